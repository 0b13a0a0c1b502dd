"""`python -m specter.bench` with module switches changed first, for A/B runs of one switch on the same model.

    python benchmarks/ab_bench.py --set specter.experts.cache.ROLL_INTO_HOT=false \
        --row-config '{"int8_finish": true}' -- --model /tmp/qwenref --residents 15 --systems specter

`--set MODULE.NAME=VALUE` (repeatable) sets a module-level constant (VALUE read as JSON: true, 3, "x");
`--row-config JSON` replaces fields of `rowfused.DEFAULT_CONFIG`. Everything after `--` goes to the bench.

`--alternate MODULE.NAME=A|B` sets a constant to A or B for each measured request of one bench process, in the
order A B B A for the repeats of each prompt of each cell, so the two sides share the process, the machine's moment
and the cache's restored state; each request's record in results.json carries `variant` ("NAME=A" or "NAME=B"),
and the end of the output compares them per cell. Repeat `--alternate` to flip several constants together (side A
takes every first value; the variant names the first constant). Each system's warm-up runs once per side (A, then
B; the constants go back to their values after each), so what a side builds on first use is built for what the
warm-up touches; a switch whose other side captures graphs lazily has a start-up switch of its own to capture both
(`--set specter.model.segmented.PREPARE_BOTH=true` for STAGE_IN_GRAPH). Use --repeats 4 (or another multiple of two; a multiple of four
balances the order too). Runs of separate processes differed by up to 1.4x on the H200 (host speed), more than
most changes this is meant to measure.

Only a constant read at run time can be switched this way: one read when a graph is captured or a runtime is
built (a `RowConfig` field of the draft step's CUDA graph, say), or copied elsewhere by `from X import NAME`, keeps
its first value; use `--set` / `--row-config` in separate processes for those.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys
from typing import Any


def apply(settings: list[str], row_config: str | None) -> list[str]:
    """Set each MODULE.NAME=VALUE; returns what was set, for the log."""
    done = []
    for setting in settings:
        module, name, (value,) = _switch("--set", setting, count=1)
        setattr(module, name, value)
        done.append(f"{module.__name__}.{name}={value!r}")
    if row_config:
        from specter.model import rowfused

        rowfused.DEFAULT_CONFIG = dataclasses.replace(rowfused.DEFAULT_CONFIG, **json.loads(row_config))
        done.append(f"rowfused.DEFAULT_CONFIG={rowfused.DEFAULT_CONFIG}")
    return done


def _switch(option: str, setting: str, count: int) -> tuple[Any, str, list[Any]]:
    """MODULE.NAME=V1|V2.. -> (module, NAME, values as JSON), with a clear error for each way it can be wrong."""
    target, _, text = setting.partition("=")
    module_name, _, name = target.rpartition(".")
    shape = "MODULE.NAME=VALUE" if count == 1 else "MODULE.NAME=A|B"
    parts = text.split("|") if text else []
    if not module_name or len(parts) != count:
        raise SystemExit(f"{option} expects {shape}, got {setting!r}")
    try:
        values = [json.loads(part) for part in parts]
    except json.JSONDecodeError:
        raise SystemExit(f"{option}: values are JSON (true, 3, \"text\"), got {text!r}") from None
    module = importlib.import_module(module_name)
    if not hasattr(module, name):
        raise SystemExit(f"{option}: {module_name} has no {name}")
    return module, name, values


ORDER = (0, 1, 1, 0)
"""Which value each repeat of a prompt takes (A B B A ...): both sides equally often and, over four, equally often
first."""


def alternate(settings: str | list[str]) -> str:
    """Make each measured request run with side A or B of every MODULE.NAME=A|B in `settings` (ORDER, counted per
    cell and prompt) and tag its record with the first one's value; warm-ups run once per side; the constants go
    back to their values after each request. Returns the first NAME."""
    from specter.bench import protocol

    switches = [_switch("--alternate", setting, count=2) for setting in ([settings] if isinstance(settings, str) else settings)]
    measure = protocol.ModelBench._request
    turns: dict[tuple, int] = {}

    async def with_side(side: int, request):
        originals = [getattr(module, name) for module, name, _values in switches]
        for module, name, values in switches:
            setattr(module, name, values[side])
        try:
            return await request()
        finally:
            for (module, name, _values), original in zip(switches, originals):
                setattr(module, name, original)

    async def request(self, runtime, system, prompt, start_state, cell, warm=False):
        if warm:
            for side in (0, 1):
                record = await with_side(side, lambda: measure(self, runtime, system, prompt, start_state, cell, warm=True))
            return record
        key = (*cell, system.name, prompt.kind, prompt.index)
        turn = turns[key] = turns.get(key, -1) + 1
        side = ORDER[turn % len(ORDER)]
        record = await with_side(side, lambda: measure(self, runtime, system, prompt, start_state, cell))
        _module, name, values = switches[0]
        return record | {"variant": f"{name}={json.dumps(values[side])}"}

    protocol.ModelBench._request = request
    return switches[0][1]


def compare(out: str) -> list[str]:
    """Per cell and variant: median TPOT, copy busy and idle shares, acceptance, decode bytes, from results.json."""
    import statistics

    from specter.bench.report import decode_mb_per_token
    from pathlib import Path

    runs = json.loads((Path(out) / "results.json").read_text())["runs"]
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        if "variant" in run:
            groups.setdefault((run["model"], run["setting"], run["link"], run["system"], run["variant"]), []).append(run)
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
                     f", decode MB/tok {decode_mb_per_token(group)}"
                     f", equal {all(r['tokens_equal'] for r in group)}")
    lines += paired(runs)
    return lines


def paired(runs: list[dict]) -> list[str]:
    """Per cell: the geometric mean over prompts of (mean TPOT of side A) / (mean TPOT of side B), each prompt's
    two sides from the same process and cache state. A median over all of a side's requests mixes prompts whose
    TPOTs differ by 2x; this ratio compares each prompt with itself. Below 1: side A faster."""
    import math

    cells: dict[tuple, dict[tuple, dict[str, list[float]]]] = {}
    for run in runs:
        if "variant" in run:
            cell = (run["model"], run["setting"], run["link"], run["system"])
            prompt = (run["prompt_kind"], run["prompt_index"])
            cells.setdefault(cell, {}).setdefault(prompt, {}).setdefault(run["variant"], []).append(run["tpot_s"])
    lines = []
    for cell, prompts in sorted(cells.items()):
        variants = sorted({variant for sides in prompts.values() for variant in sides})
        if len(variants) != 2:
            continue
        first = _first_side(runs, variants)
        second = next(v for v in variants if v != first)
        ratios = [(sum(sides[first]) / len(sides[first])) / (sum(sides[second]) / len(sides[second]))
                  for sides in prompts.values() if sides.get(first) and sides.get(second) and sum(sides[second]) > 0
                  and sum(sides[first]) > 0]  # (a request with no new tokens has no TPOT)
        if ratios:
            mean = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
            lines.append(" ".join(cell) + f": TPOT {first} / {second}, geometric mean over {len(ratios)} prompts "
                         f"{mean:.3f} (per prompt {', '.join(f'{r:.3f}' for r in ratios)})")
    return lines


def _first_side(runs: list[dict], variants: list[str]) -> str:
    """Side A: the variant of the first measured request (ORDER starts with A)."""
    return next(run["variant"] for run in runs if run.get("variant") in variants)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE")
    parser.add_argument("--row-config", default=None, metavar="JSON")
    parser.add_argument("--alternate", action="append", default=[], metavar="MODULE.NAME=A|B",
                        help="repeat to flip several constants together")
    args = parser.parse_args(argv[:split])
    for line in apply(args.set, args.row_config):
        print(f"ab_bench: {line}", flush=True)
    if args.alternate:
        alternate(args.alternate)
    bench_args = argv[split + 1 :]
    from specter.bench import cli

    out = cli.build_parser().parse_args(bench_args).out  # (exits with the bench's own message if they are wrong)
    code = cli.main(bench_args)
    if args.alternate and code in (0, 1):  # 1: some tokens differed; the comparison shows which side
        print("\n".join(["", "A/B, same process:"] + compare(out)))
    raise SystemExit(code)


if __name__ == "__main__":
    main()
