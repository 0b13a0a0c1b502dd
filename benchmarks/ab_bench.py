"""`python -m specter.bench` with module switches changed first, for A/B runs of one switch on the same model.

    python benchmarks/ab_bench.py --set specter.experts.cache.ROLL_INTO_HOT=false \
        --row-config '{"int8_finish": true}' -- --model /tmp/qwenref --residents 15 --systems specter

`--set MODULE.NAME=VALUE` (repeatable) sets a module-level constant (VALUE read as JSON: true, 3, "x");
`--row-config JSON` replaces fields of `rowfused.DEFAULT_CONFIG`. Everything after `--` goes to the bench.

`--alternate MODULE.NAME=A|B` flips a constant between A and B before each measured request of one bench process
(warm-ups excluded), so the two sides share the process, the machine's moment and the cache's restored state; each
request's record in results.json carries `variant` ("NAME=A" or "NAME=B"), and the end of the output compares them.
Use an even --repeats so each prompt gets both sides equally often. Runs of separate processes differed by up to
1.4x on the H200 (host speed), more than most changes this is meant to measure.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
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


def alternate(setting: str) -> str:
    """Make each measured request flip MODULE.NAME between the two values and tag its record; returns a label."""
    from specter.bench import protocol

    target, _, text = setting.partition("=")
    module_name, _, name = target.rpartition(".")
    values = [json.loads(part) for part in text.split("|")]
    if not module_name or len(values) != 2:
        raise SystemExit(f"--alternate expects MODULE.NAME=A|B, got {setting!r}")
    module = importlib.import_module(module_name)
    if not hasattr(module, name):
        raise SystemExit(f"--alternate: {module_name} has no {name}")
    measure = protocol.ModelBench._request
    turn = {"next": 0}

    async def request(self, runtime, system, prompt, start_state, cell, warm=False):
        if warm:
            return await measure(self, runtime, system, prompt, start_state, cell, warm=True)
        value = values[turn["next"] % 2]
        turn["next"] += 1
        setattr(module, name, value)
        record = await measure(self, runtime, system, prompt, start_state, cell)
        return record | {"variant": f"{name}={json.dumps(value)}"}

    protocol.ModelBench._request = request
    return name


def compare(out: str) -> list[str]:
    """Per cell and variant: median TPOT, copy busy and idle shares, acceptance, from results.json."""
    import statistics
    from pathlib import Path

    runs = json.loads((Path(out) / "results.json").read_text())["runs"]
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        if "variant" in run:
            groups.setdefault((run["setting"], run["link"], run["system"], run["variant"]), []).append(run)
    lines = []
    for key, group in sorted(groups.items()):
        window = sum(r["copy_window_s"] for r in group)
        idle = {}
        for r in group:
            for cause, seconds in (r.get("copy_idle_s") or {}).items():
                idle[cause] = idle.get(cause, 0.0) + seconds
        drafted = sum(r.get("drafted", 0) for r in group)
        lines.append(" ".join(key) + f": {len(group)} requests, TPOT median {1e3 * statistics.median(r['tpot_s'] for r in group):.3f} ms"
                     f", copy busy {sum(r['copy_busy_s'] for r in group) / window if window else float('nan'):.3f}"
                     f", idle {({c: round(s / window, 3) for c, s in idle.items()} if window else {})}"
                     f", acceptance {sum(r.get('accepted', 0) for r in group) / drafted if drafted else float('nan'):.3f}"
                     f", equal {all(r['tokens_equal'] for r in group)}")
    return lines


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE")
    parser.add_argument("--row-config", default=None, metavar="JSON")
    parser.add_argument("--alternate", default=None, metavar="MODULE.NAME=A|B")
    args = parser.parse_args(argv[:split])
    for line in apply(args.set, args.row_config):
        print(f"ab_bench: {line}", flush=True)
    if args.alternate:
        alternate(args.alternate)
    bench_args = argv[split + 1 :]
    try:
        from specter.bench import cli

        code = cli.main(bench_args)
    finally:
        if args.alternate:
            out = bench_args[bench_args.index("--out") + 1] if "--out" in bench_args else "bench-out"
            print("\n".join(["", "A/B, same process:"] + compare(out)))
    raise SystemExit(code)


if __name__ == "__main__":
    main()
