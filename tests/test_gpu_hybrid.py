"""Host experts on a real GPU (issue 29): the segmented CUDA-graph verify and the eager verify with a placement, the
host's rows going down behind the routing's copy and its outputs coming back on the compute stream. The CPU-side
logic is tests/test_hybrid.py and tests/test_host_experts.py (also run here with SPECTER_TEST_DEVICE=cuda)."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from specter.config import DraftConfig, EngineConfig, GenerationConfig
from specter.engine import Runtime
from tests.test_hybrid import RandomPlacement, placed_by
from tests.test_speculative import checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("gpu-hybrid"))


def run(path: str, config: EngineConfig, prompt: list[int], generation: GenerationConfig):
    async def go():
        async with await Runtime.load(path, config) as runtime:
            result = await runtime.complete_ids(prompt, generation)
            return result, torch.get_num_threads(), runtime.segmented is not None

    return asyncio.run(go())


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "deepseek-v2", "phimoe-longrope"])
@pytest.mark.parametrize("static", [None, False])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_all_on_cuda(root, family, static, temperature):
    """`all` in bf16 on CUDA: speculative (with the default draft-ahead) equals k = 0, no expert byte crosses the link
    after load, host experts are computed, the loop thread keeps one torch thread."""
    path = checkpoint(family, root)
    generation = GenerationConfig(max_new_tokens=16, temperature=temperature, seed=11)
    common = dict(device="cuda", dtype="bfloat16", max_context=96, residents=3, static_verify=static, cpu_experts="all",
                  cpu_threads=4)
    plain, threads, segmented = run(path, EngineConfig(**common, draft=DraftConfig(k=0)), [3, 1, 4, 1], generation)
    assert segmented == (static is None)
    assert threads == 1  # EngineConfig.threads on CUDA; the host thread has its own count
    speculative, _, _ = run(path, EngineConfig(**common, draft=DraftConfig(k=4, quant="int8")), [3, 1, 4, 1], generation)
    assert speculative.tokens == plain.tokens
    for stats in (plain.stats, speculative.stats):
        assert stats.h2d_bytes == 0 and stats.misses == 0 and stats.host_computed_experts > 0, stats.as_dict()


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("static", [None, False])
def test_random_placement_on_cuda(root, seed, static):
    """A random placement (host and device experts in one layer, misses copied on demand beside host compute):
    speculative equals k = 0 with the same placement, greedy and sampled, and both computed experts on the host (the
    placement was taken: seeds 1..3 put about half of each layer's experts there)."""
    path = checkpoint("mixtral", root)
    for temperature in (0.0, 0.8):
        generation = GenerationConfig(max_new_tokens=16, temperature=temperature, seed=seed)
        common = dict(device="cuda", dtype="bfloat16", max_context=96, residents=2, static_verify=static, cpu_threads=4)
        with placed_by(RandomPlacement(seed)):
            plain, _, _ = run(path, EngineConfig(**common, draft=DraftConfig(k=0)), [2, 7, 1], generation)
            speculative, _, _ = run(path, EngineConfig(**common, draft=DraftConfig(k=5, quant="int8")), [2, 7, 1], generation)
        assert speculative.tokens == plain.tokens
        for stats in (plain.stats, speculative.stats):
            assert stats.host_computed_experts > 0, stats.as_dict()


def test_the_host_thread_holds_its_own_count_on_cuda(root):
    """The host thread runs with cpu_threads torch threads while the loop thread keeps 1, and stops with the runtime."""
    path = checkpoint("mixtral", root)
    seen = {}

    async def go():
        config = EngineConfig(device="cuda", dtype="bfloat16", max_context=96, residents=2, cpu_experts="all", cpu_threads=3,
                              draft=DraftConfig(k=0))
        async with await Runtime.load(path, config) as runtime:
            host = runtime.experts.host
            job = runtime.kernel.submit_host(host.thread, lambda: (threading.current_thread().name, torch.get_num_threads()))
            seen["host"] = await runtime.kernel.wait_host(job)
            seen["loop"] = torch.get_num_threads()
            await runtime.complete_ids([1, 2, 3], GenerationConfig(max_new_tokens=4))
            seen["thread"] = host.thread.thread
        return seen

    asyncio.run(go())
    assert seen["host"] == ("specter-host-experts", 3) and seen["loop"] == 1
    assert not seen["thread"].is_alive()
