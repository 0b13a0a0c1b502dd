"""Load: 1,000 short requests against one engine, some cancelled at random points; nothing drifts or grows.

On the GPU: a 10,000-token generation whose reserved GPU memory stays flat after the first round.
"""

from __future__ import annotations

import asyncio
import gc
import json
import shutil
import os
import random
import threading

import pytest
import torch

from specter import Engine, EngineConfig, GenerationConfig
from specter.builtin import builtin_path
from specter.kernel import run

CONFIG = EngineConfig(device="cpu", residents=2, max_context=64)  # offloaded (2 of 16 experts per layer), k = 4
REQUESTS = 1000
CONCURRENT = 4
MAX_NEW = 6


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def soak_workload(seed: int = 2024) -> tuple[list[tuple[list[int], GenerationConfig]], list[dict]]:
    """Distinct (prompt, settings) pairs, greedy and sampled, and the seeded plan of 1,000 requests."""
    rng = random.Random(seed)
    distinct = []
    for index in range(8):
        prompt = [rng.randrange(512) for _ in range(rng.randint(1, 8))]
        sampled = index % 2 == 1
        distinct.append((prompt, GenerationConfig(max_new_tokens=MAX_NEW, temperature=0.8 if sampled else 0.0, top_p=0.95 if sampled else None,
                                                  seed=index)))
    plan = [{"which": rng.randrange(len(distinct)), "new": rng.randint(2, MAX_NEW),
             "cancel_after_s": rng.uniform(0.0, 0.04) if rng.random() < 0.2 else None} for _ in range(REQUESTS)]
    return distinct, plan


async def fresh_outputs(path, distinct) -> list[list[int]]:
    """Each distinct request's output on a freshly loaded engine (the longest; shorter ones are prefixes)."""
    outputs = []
    for prompt, generation in distinct:
        async with Engine.from_pretrained(path, CONFIG) as engine:
            outputs.append((await engine.complete(prompt, generation)).token_ids)
    return outputs


async def one_request(engine: Engine, prompt: list[int], generation: GenerationConfig, cancel_after_s: float | None) -> list[int] | None:
    """The request's tokens, or None when it was cancelled (waiting in the queue or mid-round)."""
    task = asyncio.create_task(engine.complete(prompt, generation))
    if cancel_after_s is not None:
        asyncio.get_running_loop().call_later(cancel_after_s, task.cancel)
    try:
        return (await task).token_ids
    except asyncio.CancelledError:
        return None


def footprint(engine: Engine) -> dict:
    cache = engine.runtime.cache
    layers = range(cache.num_layers)
    return {
        "protected": sum(len(cache.protected_experts(layer)) for layer in layers),
        "pinned": sum(len(cache.pinned_experts(layer)) for layer in layers),
        "overfull": sum(len(cache.lru_order(layer)) > cache.slots_per_layer for layer in layers),
        "kv": engine.runtime.kv.length,
        "threads": threading.active_count(),
        "tasks": len(asyncio.all_tasks()),
    }


@pytest.mark.slow
def test_soak_thousand_requests_with_random_cancellation():
    path = builtin_path("tiny")
    distinct, plan = soak_workload()

    async def main():
        expected = await fresh_outputs(path, distinct)
        checked = cancelled = 0
        async with Engine.from_pretrained(path, CONFIG) as engine:
            for start in range(0, REQUESTS, CONCURRENT):
                if start == 100:  # after warm-up: allocator pools, caches and thread pools have settled
                    gc.collect()
                    settled, rss_settled = footprint(engine), rss_bytes()
                batch = plan[start : start + CONCURRENT]
                requests = [(distinct[item["which"]][0], distinct[item["which"]][1].model_copy(update={"max_new_tokens": item["new"]}),
                             item["cancel_after_s"]) for item in batch]
                outputs = await asyncio.gather(*(one_request(engine, *request) for request in requests))
                for item, output in zip(batch, outputs):
                    if output is None:
                        cancelled += 1
                        continue
                    checked += 1
                    assert output == expected[item["which"]][: item["new"]], f"request {start}: {item}"
            await asyncio.sleep(0.05)  # cancelled loads land and settle
            gc.collect()
            end, rss_end = footprint(engine), rss_bytes()
        return checked, cancelled, settled, end, rss_settled, rss_end

    checked, cancelled, settled, end, rss_settled, rss_end = run(main())
    assert checked > 700 and cancelled > 20, (checked, cancelled)
    assert end == {**settled, "protected": 0, "pinned": 0, "overfull": 0, "kv": 0}, (settled, end)
    assert rss_end - rss_settled < 48 * 2**20, f"resident memory grew by {(rss_end - rss_settled) / 2**20:.1f} MiB"


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_memory_flat_over_ten_thousand_tokens(tmp_path):
    # tiny declares 4,096 positions and the engine refuses a longer context, so this copy declares 16,384
    # (its rotary embedding has no trained range to leave: the weights are random).
    path = tmp_path / "tiny-16k"
    shutil.copytree(builtin_path("tiny"), path)
    config_json = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config_json | {"max_position_embeddings": 16_384}))
    config = EngineConfig(device="cuda", residents=4, max_context=10_240)

    async def main():
        async with Engine.from_pretrained(path, config) as engine:
            readings = []
            async with engine.generate([1, 2, 3, 4], max_new_tokens=10_000) as stream:
                async for piece in stream:
                    readings.append(torch.cuda.max_memory_reserved())
            return stream.result, readings

    result, readings = run(main())
    assert len(result.token_ids) == 10_000
    assert len(readings) > 2 and max(readings[1:]) == readings[1], f"reserved grew from {readings[1]} to {max(readings)} bytes"
