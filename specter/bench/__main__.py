"""Entry point of `python -m specter.bench`."""

from __future__ import annotations

import sys

from specter.bench.cli import main

sys.exit(main())
