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

def parse(argv: list[str]) -> tuple[int, int, list[int]]:
    """ROUNDS NEW_TOKENS COUNTS, each a positive integer (COUNTS comma-separated); SystemExit(2) with the usage else."""
    try:
        rounds, new, counts = int(argv[0]), int(argv[1]), [int(n) for n in argv[2].split(",")]
        if len(argv) != 3 or min(rounds, new, *counts) < 1:
            raise ValueError
    except (IndexError, ValueError):
        print("usage: python benchmarks/threads_tpot.py ROUNDS NEW_TOKENS COUNTS (positive integers; COUNTS comma-"
              "separated thread counts, e.g. 8 48 1,2,4)", file=sys.stderr)
        raise SystemExit(2) from None
    return rounds, new, counts


if __name__ == "__main__":
    run(main(*parse(sys.argv[1:])))
