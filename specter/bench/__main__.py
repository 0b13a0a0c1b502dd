"""Entry point of `python -m specter.bench`."""

from __future__ import annotations

from specter.bench.cli import main
from specter.bench.stopping import exit_bounded

exit_bounded(main())
