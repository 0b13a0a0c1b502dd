"""The benchmark: every compared system on the same engine, prompts, budget and initial cache (benchmarks/README.md).

Run `python -m specter.bench --help`; `specter.bench.cli.main(argv)` is the same from Python.
"""

from __future__ import annotations
