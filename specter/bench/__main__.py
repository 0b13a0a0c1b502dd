"""Entry point of `python -m specter.bench`."""

from __future__ import annotations

import importlib

from specter.exits import load_tool, quiet_late_interrupt

main = load_tool(lambda: importlib.import_module("specter.bench.cli").main)  # torch among its imports
from specter.bench.stopping import exit_bounded  # noqa: E402  (after the held imports, as light as they leave it)

status = main()
quiet_late_interrupt()
exit_bounded(status)
