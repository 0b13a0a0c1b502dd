"""What a host job costs beyond its experts' bytes: the native kernel's fixed cost per call, and how much of it is the
OpenMP team waking after an idle gap (the engine's host jobs come one per MoE layer, a fraction of a millisecond to a
few milliseconds apart).

The full-depth cells measured a host expert at 0.9-1.08 ms where a layer's job holds one expert and 0.41-0.61 ms where
it holds two or more (Qwen1.5-MoE, DeepSeek-V2-Lite: 17.3 MB experts, 15 threads), which fits a fixed cost of about
0.4-0.6 ms per job; the kernel alone on one such expert took 0.53-0.57 ms cold where its bytes at Mixtral's measured
rate take 0.19. This times the kernel (`native_swiglu_many`, the experts' part of the job `HostExperts.compute_layer` runs) on the calling
thread with its own torch thread count, for jobs of 1, 2, 4 and 16 distinct experts at 1 and 16 rows each, each job
after an idle gap (0: back to back), its weights cold (twice the last-level cache read between jobs, as
host_expert.py flushes, and each job on experts the previous ones did not read) or, with --warm, the same experts
every job and no flush (warm where a job's bytes fit the cache). With --layer it times the job as the engine runs it
instead, `HostExperts.compute_layer` with the native kernel (dense outputs, as the graphed verify asks; every row
routed to each of the job's experts): the kernel plus the job's gather, weighting and pinned output, whose cost run on
two trees (PYTHONPATH=TREE) compares two host paths:

    python benchmarks/host_job_cost.py [SHAPE] [THREADS] [GAPS_MS] [REPEATS] [--warm] [--layer]
    python benchmarks/host_job_cost.py qwen1.5-moe-a2.7b 15 0,0.5,2 30

Per (threads, gap, rows) it fits job seconds = fixed + experts x per_expert by least squares over the medians of the
small jobs (1, 2 and 4 experts: the 16-expert job's time per expert differs, its blocks spread over more memory) and
prints both with each size's median; a negative `fixed` says the job sizes do not follow a line there. Run it once as is and once under `OMP_WAIT_POLICY=active` (a separate process:
libgomp reads it at start) to see how much of `fixed` is the team's wake-up. Prints one line per fit and a JSON line.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

from specter.experts import native

SIZES = (1, 2, 4, 16)
ROWS = (1, 16)


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    warm, layer = "--warm" in sys.argv, "--layer" in sys.argv
    shape = args[0] if args else "qwen1.5-moe-a2.7b"
    threads = int(args[1]) if len(args) > 1 else max(1, (torch.get_num_threads() or 2) - 1)
    gaps = [float(g) / 1e3 for g in (args[2] if len(args) > 2 else "0,0.5,2").split(",")]
    repeats = int(args[3]) if len(args) > 3 else 30
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from host_expert import default_flush_bytes, parse_shape  # the same shapes and flush as the host expert benchmark

    if native.load() is None:
        raise SystemExit(f"the native kernel is unavailable here: {native.unavailable()}")
    hidden, inter = parse_shape(shape)
    torch.set_num_threads(threads)
    count = max(SIZES) * 2  # distinct experts, so a job never reads what the previous one just read
    pinned = torch.cuda.is_available()
    experts = [(torch.randn(3 * hidden * inter) * 0.02).to(torch.bfloat16) for _ in range(count)]
    if pinned:
        experts = [e.pin_memory() for e in experts]
    run = native_job(experts, hidden, inter) if not layer else layer_job(experts, hidden, inter, threads, pinned)
    flush = None if warm else torch.ones(default_flush_bytes() // 8, dtype=torch.int64)  # read between jobs: cold weights
    inputs = {rows: (torch.randn(rows, hidden) * 0.1).to(torch.bfloat16) for rows in ROWS}
    results = []
    turn = 0
    for gap in gaps:
        for rows in ROWS:
            x = inputs[rows]
            samples: dict[int, list[float]] = {n: [] for n in SIZES}
            for repeat in range(repeats + 2):  # the first two rounds warm up
                for n in SIZES:  # interleaved, so drift falls on every size alike
                    jobs = [(x, i if warm else (turn + i) % count) for i in range(n)]
                    turn += n
                    if flush is not None:
                        flush.max()
                    if gap:
                        time.sleep(gap)
                    started = time.perf_counter()
                    run(jobs)
                    if repeat >= 2:
                        samples[n].append(time.perf_counter() - started)
            medians = {n: statistics.median(s) for n, s in samples.items()}
            small = [n for n in SIZES if n <= 4]
            per_expert, fixed = statistics.linear_regression(small, [medians[n] for n in small])  # unclamped: < 0 shows
            result = {"shape": shape, "threads": threads, "gap_ms": gap * 1e3, "rows": rows, "warm": warm, "layer": layer,
                      "median_ms": {str(n): round(m * 1e3, 4) for n, m in medians.items()},
                      "fixed_ms": round(fixed * 1e3, 4), "per_expert_ms": round(per_expert * 1e3, 4)}
            results.append(result)
            print(f"{shape} threads={threads} gap={gap * 1e3:g} ms rows={rows}{' warm' if warm else ''}"
                  f"{' compute_layer' if layer else ''}: fixed "
                  f"{fixed * 1e3:.3f} ms + {per_expert * 1e3:.3f} ms per expert; medians "
                  + ", ".join(f"{n}: {m * 1e3:.3f}" for n, m in medians.items()), flush=True)
    print(json.dumps({"results": results}))


def native_job(experts: list[torch.Tensor], hidden: int, inter: int):
    """jobs [(rows, expert index)] -> the kernel's one call on them."""
    def run(jobs):
        native.native_swiglu_many([(x, experts[index]) for x, index in jobs], hidden, inter)
    return run


def layer_job(experts: list[torch.Tensor], hidden: int, inter: int, threads: int, pinned: bool):
    """jobs [(rows, expert index)] -> `HostExperts.compute_layer` on the calling thread, the experts those of one MoE
    layer's pool (`experts` written into it), every row routed to each of them with equal weights."""
    import functools

    from specter.experts.host import HostExperts, HostInputs
    from specter.experts.pool import ExpertPool
    from specter.placement import Placement

    class Memory:
        def alloc_host(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.empty(numel, dtype=dtype, pin_memory=pinned)

    pool = ExpertPool(Memory(), 1, len(experts), experts[0].numel(), torch.bfloat16)
    for index, packed in enumerate(experts):
        pool.write(0, index, packed)
    host = HostExperts(pool, Placement.device_only(1, len(experts)), 16,
                       functools.partial(native.native_swiglu, hidden=hidden, inter=inter), threads,
                       torch.device("cuda" if pinned else "cpu"), row_invariant=True,
                       job=functools.partial(native.native_layer_job, hidden_size=hidden, inter=inter))

    def run(jobs):
        rows = list(range(jobs[0][0].shape[0]))
        routes = {index: (rows, [slot] * len(rows)) for slot, (_, index) in enumerate(jobs)}
        weights = torch.full((len(rows), len(jobs)), 1.0 / len(jobs))
        host.compute_layer(0, routes, HostInputs(jobs[0][0], weights), dense=True)
    return run


if __name__ == "__main__":
    main()
