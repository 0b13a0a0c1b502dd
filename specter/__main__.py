"""`python -m specter`: the command line, as the `specter` console script runs it (`specter.entry`)."""

from specter.entry import specter

raise SystemExit(specter())
