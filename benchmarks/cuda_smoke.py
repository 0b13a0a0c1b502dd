"""Speculative offloaded decoding on CUDA equals the baseline on the built-in model (a quick end-to-end check)."""

from __future__ import annotations

import asyncio
import sys
import time

from specter.builtin import builtin_path
from specter.config import DraftConfig, EngineConfig, GenerationConfig
from specter.engine import Runtime


async def run(config: EngineConfig, prompt: list[int], generation: GenerationConfig):
    runtime = await Runtime.load(builtin_path("tiny"), config)
    try:
        return await runtime.complete_ids(prompt, generation)
    finally:
        await runtime.aclose()


def main() -> int:
    device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
    prompt = [5, 17, 99, 3, 250, 7]
    failures = 0
    for temperature in (0.0, 0.9):
        generation = GenerationConfig(max_new_tokens=48, temperature=temperature, seed=11)
        base = asyncio.run(run(EngineConfig(device=device, draft=DraftConfig(k=0)), prompt, generation))
        for residents, k, link in ((None, 4, None), (4, 0, None), (4, 4, None), (2, 8, "gen4"), (6, 4, "2")):
            started = time.perf_counter()
            config = EngineConfig(device=device, residents=residents, link=link, draft=DraftConfig(k=k))
            result = asyncio.run(run(config, prompt, generation))
            same = result.tokens == base.tokens
            failures += not same
            s = result.stats
            print(f"T={temperature} residents={residents} k={k} link={link}: equal={same} tpot={s.tpot_s * 1e3:.2f}ms "
                  f"accept={s.acceptance_rate:.2f} recall={s.window_recall:.2f} hit={s.hit_rate:.2f} "
                  f"h2d={s.h2d_bytes} ({time.perf_counter() - started:.1f}s)")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
