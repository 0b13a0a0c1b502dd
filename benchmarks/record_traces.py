"""Record routing traces of a bench system (`specter` unless `--system`) on a checkpoint's prompts, for `python -m specter.replay`.

One engine per cache size (`--residents 15,8`); its prompts (the checkpoint's prompts.json, as the bench takes
them) run one after another from the cache the previous one left, each round written to
`OUT/trace-r{N}.jsonl`. Each traced round (one that drafted) carries the bytes the engine moved in it
(`loaded_bytes`, which `python -m specter.replay` prints beside its own figure) and the counts each of its prefetch
plans saw (`checkpoints`: the recording prefetch policy replays its plans from those, what the draft had routed when
the engine planned; another policy takes them where it plans at the same step, else the round's totals scaled). `OUT/stats-r{N}.json` keeps each
request's stats (H2D bytes with the prompt's forward apart, acceptance, rounds): whole requests, so their bytes
include rounds that did not draft and the prompt's loads.

    python benchmarks/record_traces.py --model /tmp/qwenref --residents 15,8 --out traces
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specter.bench.protocol import checkpoint_prompts
from specter.bench.systems import get_system
from specter.config import EngineConfig, GenerationConfig
from specter.engine import Runtime
from specter.kernel import run
from specter.model.checkpoint import Checkpoint


async def record(model: Path, residents: int, out: Path, per_kind: int, max_new_tokens: int, k_max: int,
                 system: str = "specter") -> list[dict]:
    checkpoint = Checkpoint(model)
    spec = checkpoint.spec
    checkpoint.close()
    prompts = checkpoint_prompts(model, spec.vocab_size, per_kind)
    chosen = get_system(system)
    if (chosen.prefetch_options or chosen.lookahead == "fixed" or chosen.exact_prefetch or chosen.resident or chosen.scout
            or chosen.separate_draft or chosen.gate_prefetch or chosen.overlap is not None):
        raise SystemExit(f"record_traces runs systems with plain plug-ins, an adaptive depth and the engine's default "
                         f"draft-ahead; {system!r} is not one")
    config = EngineConfig.build(residents=residents, eviction=chosen.eviction, prefetch=chosen.prefetch,
                                lookahead=chosen.lookahead, draft=dict(k_max=k_max))
    runtime = await Runtime.load(model, config)
    rows = []
    try:
        await runtime.complete_ids(prompts[0].ids, GenerationConfig(max_new_tokens=16))  # warm-up, not traced
        runtime.record_trace(out / f"trace-r{residents}.jsonl")
        for prompt in prompts:
            result = await runtime.complete_ids(prompt.ids, GenerationConfig(max_new_tokens=max_new_tokens))
            stats = result.stats.as_dict()
            rows.append({"kind": prompt.kind, "index": prompt.index, **{key: stats.get(key) for key in (
                "new_tokens", "rounds", "acceptance_rate", "mean_accepted_length", "window_recall", "h2d_bytes",
                "h2d_bytes_per_token", "h2d_prefill_bytes", "h2d_decode_bytes_per_token", "tpot_s", "copy_busy_fraction")}})
            print(residents, prompt.kind, prompt.index, rows[-1]["h2d_decode_bytes_per_token"], rows[-1]["acceptance_rate"],
                  rows[-1]["tpot_s"], flush=True)
    finally:
        await runtime.aclose()
    (out / f"stats-r{residents}.json").write_text(json.dumps(rows, indent=1))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--residents", default="15,8", help="comma-separated cache slots per layer")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--per-kind", type=int, default=2, help="prompts per kind (as bench --prompts-per-kind)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--k-max", type=int, default=15)
    parser.add_argument("--system", default="specter", help="the bench system whose eviction, prefetch and lookahead "
                        "plug-ins run (its depth adapts: a fixed-k system is not supported here)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for residents in (int(n) for n in args.residents.split(",")):
        run(record(args.model, residents, args.out, args.per_kind, args.max_new_tokens, args.k_max, args.system))


if __name__ == "__main__":
    main()
