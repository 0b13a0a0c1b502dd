"""Where an offloaded decode's time goes: host profile (cProfile) and GPU activity (torch.profiler) of one request.

Builds a synthetic real shape (specter.bench.synthetic), offloads its experts to `--residents` slots per
layer, and decodes `--tokens` tokens with speculation off (k = 0) or a fixed k, eager or static verify.
Prints TPOT, the expected transfer time, the host functions with the most own time and cumulative time,
and the GPU's busiest kernels and copies.

    python benchmarks/profile_offloaded.py --shape qwen1.5-moe-a2.7b --layers 8 --residents 15 --static-verify

A trained narrow checkpoint read as its widened model, one of its prompt kinds, sampled as the bench samples (the
full-depth Qwen3-30B-A3B cell `specter` lost to llama.cpp; docs/BENCHMARKS.md, "What is not measured yet"):

    python benchmarks/profile_offloaded.py --model /tmp/narrow/qwen3-30b-a3b --widen 4 --residents 19 --k 15 \
        --prompt-kind docs --temperature 0.7 --top-p 0.9 --tokens 64 --with-stack
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import pstats
import time
from pathlib import Path


async def build(args):
    from specter.bench.synthetic import synthetic_source
    from specter.config import DraftConfig, EngineConfig
    from specter.engine import Runtime

    if args.model is not None:  # a checkpoint (the trained reference model): real routing, real acceptance
        from specter.bench.realism import weight_source

        # with --widen, the narrow checkpoint read as its widened model, widened on the device as it loads (the bench's way)
        source = weight_source(args.model, args.widen, args.device)
    else:
        source = synthetic_source(args.shape, args.layers)
    config = EngineConfig(device=args.device, dtype="bfloat16", residents=args.residents, max_context=512, lookahead="fixed",
                          draft=DraftConfig(k=args.k, k_max=args.k), static_verify=args.static_verify, progress=False,
                          cpu_experts=args.cpu_experts, cpu_threads=args.cpu_threads)
    return await Runtime.build(source, config)


PROMPT = list(range(100, 116))


async def request(runtime, tokens: int, args):
    from specter.config import GenerationConfig

    return await runtime.complete_ids(PROMPT, GenerationConfig(max_new_tokens=tokens, temperature=args.temperature,
                                                               top_p=args.top_p, seed=args.seed))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen1.5-moe-a2.7b")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--model", type=Path, default=None, help="a checkpoint directory instead of the synthetic "
                        "shape (its prompts.json's first prompt, when there, is the prompt)")
    parser.add_argument("--widen", type=int, default=None, metavar="F", help="--model is a narrow checkpoint: read it "
                        "as its F-times widened model (specter.bench.widen)")
    parser.add_argument("--prompt-kind", default=None, help="the prompts.json kind whose first prompt is the prompt "
                        "(default: the first kind)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the bench's sampled: 0.7)")
    parser.add_argument("--top-p", type=float, default=None, help="nucleus sampling (the bench's sampled: 0.9)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--residents", type=int, default=15)
    parser.add_argument("--k", type=int, default=0)
    parser.add_argument("--tokens", type=int, default=32)
    verify = parser.add_mutually_exclusive_group()
    verify.add_argument("--static-verify", dest="static_verify", action="store_const", const=True, default=None,
                        help="segmented static verify (the engine's default on CUDA)")
    verify.add_argument("--eager-verify", dest="static_verify", action="store_const", const=False)
    parser.add_argument("--cpu-experts", default="off", help="the placement plug-in (off, all, auto): all is the in-engine "
                        "`cpu-experts` baseline, whose per-layer routing read and host hand-off this profile breaks down")
    parser.add_argument("--cpu-threads", type=int, default=None, help="the host expert path's threads (default: cores - 1)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--with-stack", action="store_true", help="record python frames in trace.json (for "
                        "benchmarks/trace_gaps.py: what the host does while the GPU idles)")
    parser.add_argument("--out", type=Path, default=Path("out/profile"))
    args = parser.parse_args()
    if args.widen is not None and args.model is None:
        parser.error("--widen needs --model (a narrow checkpoint)")
    args.out.mkdir(parents=True, exist_ok=True)

    import torch

    if args.model is not None and (args.model / "prompts.json").exists():
        import json

        global PROMPT
        kinds = json.loads((args.model / "prompts.json").read_text())["kinds"]
        if args.prompt_kind is not None and args.prompt_kind not in kinds:
            parser.error(f"--prompt-kind {args.prompt_kind}: the checkpoint's prompts.json has {sorted(kinds)}")
        PROMPT = [int(t) for t in kinds[args.prompt_kind or next(iter(kinds))][0][:16]]
    elif args.prompt_kind is not None:
        parser.error("--prompt-kind needs --model with a prompts.json")

    loop = asyncio.new_event_loop()
    runtime = loop.run_until_complete(build(args))
    loop.run_until_complete(request(runtime, 8, args))  # warm-up: graphs, Triton, allocator
    started = time.perf_counter()
    plain = loop.run_until_complete(request(runtime, args.tokens, args))
    plain_s = time.perf_counter() - started
    stats = plain.stats
    expert_bytes = runtime.memory.expert_bytes
    print(f"{args.model or f'{args.shape} L={args.layers}'}{f' x{args.widen}' if args.widen else ''} residents={args.residents} "
          f"k={args.k} static_verify={args.static_verify} cpu_experts={args.cpu_experts} prompt={args.prompt_kind or 'first'} "
          f"temperature={args.temperature} top_p={args.top_p}")
    print(f"TPOT {stats.tpot_s * 1e3:.2f} ms; wall {plain_s:.2f} s for {stats.new_tokens} tokens in {stats.rounds} rounds "
          f"(accepted {stats.accepted} of {stats.drafted} drafted); misses/token "
          f"{stats.misses / max(stats.new_tokens, 1):.1f}; H2D {stats.h2d_bytes / max(stats.new_tokens, 1) / 1e6:.1f} MB/token "
          f"(= {stats.h2d_bytes / max(stats.new_tokens, 1) / 53e9 * 1e3:.2f} ms at 53 GB/s); stall/token "
          f"{stats.stall_s / max(stats.new_tokens, 1) * 1e3:.2f} ms; copy busy {stats.copy_busy_fraction}; expert {expert_bytes / 1e6:.1f} MB; "
          f"host experts/token {stats.host_computed_experts / max(stats.new_tokens, 1):.1f} in "
          f"{stats.host_compute_s / max(stats.new_tokens, 1) * 1e3:.2f} ms; waits/token: routing "
          f"{stats.routing_wait_s / max(stats.new_tokens, 1) * 1e3:.2f} ms, host {stats.host_wait_s / max(stats.new_tokens, 1) * 1e3:.2f} ms")

    profiler = cProfile.Profile()
    profiler.enable()
    loop.run_until_complete(request(runtime, args.tokens, args))
    profiler.disable()
    for key in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(args.top)
        (args.out / f"cprofile_{key}.txt").write_text(text.getvalue())
        lines = [line for line in text.getvalue().splitlines() if line.strip()]
        start = next(i for i, line in enumerate(lines) if "ncalls" in line)
        print(f"\n-- host, by {key} --")
        print("\n".join(line[:160] for line in lines[start : start + args.top + 1]))

    if args.device == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=args.with_stack) as prof:
            loop.run_until_complete(request(runtime, min(args.tokens, 16), args))
        prof.export_chrome_trace(str(args.out / "trace.json"))
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.top)
        (args.out / "gpu_table.txt").write_text(table)
        print("\n-- GPU, by device time --")
        print("\n".join(line[:200] for line in table.splitlines()[: args.top + 4]))
        torch.cuda.synchronize()
    loop.run_until_complete(runtime.aclose())
    loop.close()


if __name__ == "__main__":
    main()
