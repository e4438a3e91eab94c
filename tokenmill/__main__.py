"""`python -m tokenmill ...` = the `tokenmill` command."""

from tokenmill.entrypoints.cli import main

raise SystemExit(main())
