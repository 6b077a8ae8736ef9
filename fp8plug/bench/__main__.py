"""`python -m fp8plug.bench`: the same as `fp8plug bench`."""

from fp8plug.bench import main

raise SystemExit(main())
