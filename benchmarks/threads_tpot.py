"""TPOT of `tiny` on the CPU (all experts resident, k=4) at several torch thread counts, interleaved in one process
and rotated each round, so that a shared machine's load falls on every count alike (EngineConfig.threads).

    python benchmarks/threads_tpot.py ROUNDS NEW_TOKENS 1,2,4
"""

from __future__ import annotations

import statistics
import sys

import torch

from specter import Engine, EngineConfig
from specter.kernel import run

async def main(rounds: int, new: int, counts: list[int]) -> None:
    times = {n: [] for n in counts}
    async with Engine.from_pretrained("tiny", EngineConfig(device="cpu")) as engine:
        await engine.complete("hello", max_new_tokens=8)  # warm-up
        for r in range(rounds):
            order = counts[r % len(counts):] + counts[:r % len(counts)]
            for threads in order:
                torch.set_num_threads(threads)
                result = await engine.complete("hello world", max_new_tokens=new)
                times[threads].append(result.stats.tpot_s * 1e3)
    for threads, values in times.items():
        print(f"threads={threads}: TPOT median {statistics.median(values):.1f} ms, runs {[round(v, 1) for v in values]}", flush=True)

if __name__ == "__main__":
    run(main(int(sys.argv[1]), int(sys.argv[2]), [int(n) for n in sys.argv[3].split(",")]))
