"""`python -m fp8plug env|bench`: the same as the `fp8plug` console script."""

from fp8plug.cli import main

raise SystemExit(main())
