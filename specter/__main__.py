"""`python -m specter`: the command line."""

from specter.cli import main

raise SystemExit(main())
