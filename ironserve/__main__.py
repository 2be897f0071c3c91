"""`python -m ironserve` is the `ironserve` command."""

from ironserve.cli import main

raise SystemExit(main())
