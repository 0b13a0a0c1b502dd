"""The same decodes, straight on the engine (Runtime.build + complete_ids, no bench harness), in whichever source tree
is first on PYTHONPATH: TTFT and TPOT medians, then one request under torch.profiler (kernel and CUDA-call counts).

Run it alternately on two trees to tell an engine change from a bench-harness one (issue 26's before/after):

    cd /tmp && PYTHONPATH=/path/to/old python /path/to/benchmarks/engine_ab.py old OUTDIR
    cd /tmp && PYTHONPATH=/path/to/new python /path/to/benchmarks/engine_ab.py new OUTDIR

Only the API both trees share is used (Runtime.build, complete_ids, EngineConfig, DraftConfig, GenerationConfig,
synthetic_source), so the script runs unchanged on the tree before the redesign. Writes OUTDIR/prof-TAG-CONFIG.txt.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from pathlib import Path

import torch

PROMPTS = [list(range(100 + 7 * i, 116 + 7 * i)) for i in range(4)]


def source(args):
    from specter.bench.synthetic import synthetic_source

    if args.model is None:
        return synthetic_source(args.shape, args.layers)
    try:
        from specter.build import CheckpointWeights
    except ImportError:  # the tree before the redesign
        from specter.loading import CheckpointWeights
    from specter.model.checkpoint import Checkpoint

    return CheckpointWeights(Checkpoint(args.model))


async def run(args, label: str, config) -> None:
    from specter.config import GenerationConfig
    from specter.engine import Runtime

    generation = GenerationConfig(max_new_tokens=args.new_tokens)
    runtime = await Runtime.build(source(args), config)
    try:
        for prompt in PROMPTS[:2]:  # warm-up: kernels compiled, graphs captured, the cache filled
            await runtime.complete_ids(prompt, generation)
        ttft, tpot = [], []
        for i in range(args.requests):
            stats = (await runtime.complete_ids(PROMPTS[i % len(PROMPTS)], generation)).stats
            ttft.append(stats.ttft_s * 1e3)
            tpot.append(stats.tpot_s * 1e3)
        line = (f"{args.tag} {label}: ttft {statistics.median(ttft):.2f} ms tpot {statistics.median(tpot):.3f} ms "
                f"(each: {[round(t, 2) for t in tpot]})")
        print(line, flush=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as profile:
            await runtime.complete_ids(PROMPTS[0], generation)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        events = profile.key_averages()
        with open(args.out / f"prof-{args.tag}-{label}.txt", "w") as f:
            f.write(line + "\n")
            for key in ("self_cuda_time_total", "self_cpu_time_total", "count"):
                f.write(events.table(sort_by=key, row_limit=30))
        gpu_ms = sum(e.self_device_time_total for e in events) / 1e3
        calls = {e.key: e.count for e in events if any(word in e.key for word in ("ynchronize", "Memcpy", "EventQuery", "GraphLaunch", "LaunchKernel"))}
        print(f"{args.tag} {label}: profiled request: GPU self time {gpu_ms:.1f} ms; calls {calls}", flush=True)
    finally:
        await runtime.aclose()


async def main(args) -> None:
    from specter.config import DraftConfig, EngineConfig

    base = dict(device=args.device, dtype="bfloat16", residents=args.residents, max_context=512, progress=False)
    if args.tune:  # only when asked: the tree before the redesign has no TuningConfig
        from specter.config import TuningConfig

        base["tuning"] = TuningConfig().with_overrides(args.tune)
    configs = {"default": EngineConfig(**base),
               "fixed8": EngineConfig(**base, lookahead="fixed", draft=DraftConfig(k=8, k_max=8)),
               "k0": EngineConfig(**base, draft=DraftConfig(k=0, k_max=0))}
    for label in args.configs.split(","):
        await run(args, label, configs[label])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tag", help="names this tree in the output (old, new)")
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", default=None, help="a checkpoint directory (default: a synthetic shape)")
    parser.add_argument("--shape", default="qwen1.5-moe-a2.7b")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--residents", type=int, default=15)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--configs", default="default,fixed8,k0", help="which of default, fixed8, k0, in order")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tune", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="a field of EngineConfig.tuning for every config, e.g. kernels.exact_rowwise=true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    asyncio.run(main(args))
