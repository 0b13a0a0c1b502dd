"""`python -m specter.bench` with tuning fields changed, for A/B runs of one knob on the same model.

    python benchmarks/ab_bench.py --set cache.lead_relay=false \
        --row-config '{"int8_finish": true}' -- --model /tmp/qwenref --residents 15 --systems specter

`--set SECTION.FIELD=VALUE` (repeatable) sets a field of EngineConfig.tuning (specter/config.py: cache, transfer,
verify, kernels; a nested field by its dotted path, e.g. kernels.row.block_k=1024; VALUE read as JSON: true, 3,
null) for the whole run: the bench's `--tune`. `--row-config JSON` sets fields of the one-row kernels' tiles the same
way (`kernels.row.FIELD=VALUE` for each). Everything after `--` goes to the bench.

`--alternate SECTION.FIELD=A|B` sets a field to A or B for each measured request of one bench process
(`Runtime.retune`), in the order A B B A for the repeats of each prompt of each cell, so the two sides share the
process, the machine's moment and the cache's restored state; each request's record in results.json carries
`variant` ("SECTION.FIELD=A" or "SECTION.FIELD=B"), and the end of the output compares them per cell. Repeat
`--alternate` to flip several fields together (side A takes every first value; the variant names the first field).
Each system's warm-up runs once per side (A, then B); the tuning goes back to its value after each request. Use
--repeats 4 (or another multiple of two; a multiple of four balances the order too). Runs of separate processes
differed by up to 1.4x on the H200 (host speed), more than most changes this is meant to measure.

Only the cache, transfer and verify fields can alternate: the kernels' are fixed when the runtime captures its CUDA
graphs; use `--set` (or `--row-config`) in separate processes for those.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from specter.config import TuningConfig
from specter.errors import ConfigError


def tune_args(settings: list[str]) -> list[str]:
    """The bench's `--tune` arguments for each SECTION.FIELD=VALUE, checked first (a typo exits with its message)."""
    try:
        TuningConfig().with_overrides(settings)
    except ConfigError as error:
        raise SystemExit(f"--set: {error}") from None
    return [arg for setting in settings for arg in ("--tune", setting)]


def row_config_settings(row_config: str | None) -> list[str]:
    """`--row-config JSON` as `--set` settings: kernels.row.FIELD=VALUE (EngineConfig.tuning.kernels.row) per field."""
    if not row_config:
        return []
    return [f"kernels.row.{name}={json.dumps(value)}" for name, value in json.loads(row_config).items()]


def _sides(setting: str) -> tuple[str, list[str], list[Any]]:
    """SECTION.FIELD=A|B -> (SECTION.FIELD, the two overrides, the two values), each side checked against the tuning."""
    target, _, text = setting.partition("=")
    parts = text.split("|") if text else []
    if len(parts) != 2:
        raise SystemExit(f"--alternate expects SECTION.FIELD=A|B, got {setting!r}")
    if target.strip().startswith("kernels."):
        raise SystemExit(f"--alternate {setting!r}: kernels fields are fixed when the graphs are captured; use --set")
    overrides = [f"{target}={part}" for part in parts]
    try:
        tunings = [TuningConfig().with_overrides([override]) for override in overrides]
    except ConfigError as error:
        raise SystemExit(f"--alternate: {error}") from None
    return target.strip(), overrides, [_value(tuning, target.strip()) for tuning in tunings]


def _value(tuning: TuningConfig, path: str) -> Any:
    """The tuning's field at a dotted path (cache.lead_relay)."""
    value: Any = tuning
    for name in path.split("."):
        value = getattr(value, name)
    return value


ORDER = (0, 1, 1, 0)
"""Which value each repeat of a prompt takes (A B B A ...): both sides equally often and, over four, equally often
first."""


def alternate(settings: str | list[str]) -> str:
    """Make each measured request run with side A or B of every SECTION.FIELD=A|B in `settings` (ORDER, counted per
    cell and prompt) and tag its record with the first one's value; warm-ups run once per side; the runtime's tuning
    goes back to its value after each request. Returns the first SECTION.FIELD."""
    from specter.bench import protocol

    switches = [_sides(setting) for setting in ([settings] if isinstance(settings, str) else settings)]
    measure = protocol.ModelBench._request
    turns: dict[tuple, int] = {}

    async def with_side(side: int, runtime, request):
        original = runtime.config.tuning
        runtime.retune(original.with_overrides([overrides[side] for _name, overrides, _values in switches]))
        try:
            return await request()
        finally:
            runtime.retune(original)

    async def request(self, runtime, system, prompt, start_state, cell, warm=False):
        if warm:
            for side in (0, 1):
                record = await with_side(side, runtime,
                                         lambda: measure(self, runtime, system, prompt, start_state, cell, warm=True))
            return record
        key = (*cell, system.name, prompt.kind, prompt.index)
        turn = turns[key] = turns.get(key, -1) + 1
        side = ORDER[turn % len(ORDER)]
        record = await with_side(side, runtime, lambda: measure(self, runtime, system, prompt, start_state, cell))
        name, _overrides, values = switches[0]
        return record | {"variant": f"{name}={json.dumps(values[side])}"}

    protocol.ModelBench._request = request
    return switches[0][0]


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
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    parser.add_argument("--row-config", default=None, metavar="JSON")
    parser.add_argument("--alternate", action="append", default=[], metavar="SECTION.FIELD=A|B",
                        help="repeat to flip several fields together")
    args = parser.parse_args(argv[:split])
    settings = args.set + row_config_settings(args.row_config)
    bench_args = tune_args(settings) + argv[split + 1 :]
    for line in settings:
        print(f"ab_bench: {line}", flush=True)
    if args.alternate:
        alternate(args.alternate)
    from specter.bench import cli

    out = cli.build_parser().parse_args(bench_args).out  # (exits with the bench's own message if they are wrong)
    code = cli.main(bench_args)
    if args.alternate and code in (0, 1):  # 1: some tokens differed; the comparison shows which side
        print("\n".join(["", "A/B, same process:"] + compare(out)))
    raise SystemExit(code)

if __name__ == "__main__":
    main()
