"""`python -m specter`: the command line."""

import importlib

from specter.exits import load_tool, quiet_late_interrupt

main = load_tool(lambda: importlib.import_module("specter.cli").main)
status = main()
quiet_late_interrupt()
raise SystemExit(status)
