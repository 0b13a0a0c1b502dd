"""`python -m specter.bench` with module switches changed first, for A/B runs of one switch on the same model.

    python benchmarks/ab_bench.py --set specter.experts.cache.ROLL_INTO_HOT=false \
        --row-config '{"int8_finish": true}' -- --model /tmp/qwenref --residents 15 --systems specter

`--set MODULE.NAME=VALUE` (repeatable) sets a module-level constant (VALUE read as JSON: true, 3, "x");
`--row-config JSON` replaces fields of `rowfused.DEFAULT_CONFIG`. Everything after `--` goes to the bench.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import runpy
import sys


def apply(settings: list[str], row_config: str | None) -> list[str]:
    """Set each MODULE.NAME=VALUE; returns what was set, for the log."""
    done = []
    for setting in settings:
        target, _, text = setting.partition("=")
        module_name, _, name = target.rpartition(".")
        if not module_name or not text:
            raise SystemExit(f"--set expects MODULE.NAME=VALUE, got {setting!r}")
        module = importlib.import_module(module_name)
        if not hasattr(module, name):
            raise SystemExit(f"--set: {module_name} has no {name}")
        setattr(module, name, json.loads(text))
        done.append(f"{target}={getattr(module, name)!r}")
    if row_config:
        from specter.model import rowfused

        rowfused.DEFAULT_CONFIG = dataclasses.replace(rowfused.DEFAULT_CONFIG, **json.loads(row_config))
        done.append(f"rowfused.DEFAULT_CONFIG={rowfused.DEFAULT_CONFIG}")
    return done


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE")
    parser.add_argument("--row-config", default=None, metavar="JSON")
    args = parser.parse_args(argv[:split])
    for line in apply(args.set, args.row_config):
        print(f"ab_bench: {line}", flush=True)
    sys.argv = ["specter.bench", *argv[split + 1 :]]
    runpy.run_module("specter.bench", run_name="__main__")


if __name__ == "__main__":
    main()
