"""`python -m fp8plug.bench`: the same as `fp8plug bench`."""

from . import main

raise SystemExit(main())
