"""The segmented static verify on a real GPU: with experts offloaded to an ExpertCache on the cuda backend, its
CUDA-graph segments reproduce the resident GraphedTarget's logits bit for bit and decode token for token like it."""

from __future__ import annotations

import asyncio
import functools

import pytest
import torch

from specter.config import EngineConfig
from specter.decode import decode_resident_graphed, prefill, run_sync
from specter.build import LoadedModel, load_resident
from specter.model.graphed import GraphedTarget
from specter.model.kv import KVCache
from specter.model.segmented import SegmentedStep
from specter.quant.moe_triton import triton_available
from specter.verify import VerifyRecord
from tests.hf_models import FAMILIES, hf_model, save_hf
from tests.test_segmented import Offloaded

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not triton_available(), reason="triton is not installed"),
]

PROMPT = [1, 2, 3, 4, 5, 6]
DTYPES = ["float32", "bfloat16"]
KERNELS = ["triton", "dense"]


@pytest.fixture(scope="module")
def load(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu-segmented")

    @functools.cache
    def loaded(family: str, dtype: str) -> LoadedModel:
        path = save_hf(hf_model(family, seed=3), root / family)
        return load_resident(path, EngineConfig(device="cuda", dtype=dtype, max_context=64))

    return loaded


def cuda_offloaded(loaded: LoadedModel, slots: int) -> Offloaded:
    from backends.cuda import CUDABackend

    return Offloaded(loaded, slots, CUDABackend())


async def after_prompt(loaded: LoadedModel) -> KVCache:
    kv = loaded.model.new_kv()
    await prefill(loaded.model, kv, loaded.experts, PROMPT)
    return kv


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_graphed_segments_with_offloaded_experts_equal_the_resident_graph(load, family, dtype, kernel):
    loaded = load(family, dtype)
    start = len(PROMPT)

    async def go() -> None:
        for slots in (2, 4):
            offloaded = cuda_offloaded(loaded, slots)
            try:
                for size in (1, 3, 16):
                    block = torch.arange(20, 20 + size, device="cuda") % loaded.spec.vocab_size
                    kv_resident, kv_offloaded = await after_prompt(loaded), await after_prompt(loaded)
                    expected = GraphedTarget(loaded.model, loaded.experts, kv_resident, kernel=kernel, use_graph=True).logits(block, start)
                    step = SegmentedStep(loaded.model, kv_offloaded, kernel=kernel, use_graph=True)
                    got = await offloaded.verify(step, block, start, VerifyRecord())
                    where = f"{slots} slots, {size} rows"
                    assert torch.equal(got, expected), f"{where}: largest difference {(got - expected).abs().max().item()}"
                    assert torch.equal(kv_offloaded.k, kv_resident.k) and torch.equal(kv_offloaded.v, kv_resident.v), where
                assert offloaded.bytes_loaded > 0
            finally:
                await offloaded.close()

    asyncio.run(go())


@pytest.mark.parametrize("guess", ["right", "wrong", "mixed"])
@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_the_lead_over_the_routing_keeps_graphed_segments_bit_identical_on_the_device(load, family, guess):
    """VerifyTuning.lead_misses on CUDA, misses ordered on the device (on_device): predicted residents computed through
    their slots' expert graphs before the routing is read, predicted misses copied into slots behind those computes
    (the residents whose slots they take computed first); right, wrong and mixed predictions."""
    from tests.test_segmented import chosen_experts, guessed, spy_leads

    loaded = load(family, "bfloat16")
    start, experts = len(PROMPT), loaded.spec.num_experts
    leads = []

    async def go() -> None:
        nonlocal leads
        offloaded = cuda_offloaded(loaded, 3)
        leads = spy_leads(offloaded)
        try:
            for first in range(20, 60, 8):
                block = torch.arange(first, first + 3, device="cuda") % loaded.spec.vocab_size
                kv_resident, kv_offloaded = await after_prompt(loaded), await after_prompt(loaded)
                used = chosen_experts(loaded, kv_resident, block)
                expected = GraphedTarget(loaded.model, loaded.experts, kv_resident, use_graph=True).logits(block, start)
                predicted = guessed(used, offloaded.moe_index, experts, first, guess)
                step = SegmentedStep(loaded.model, kv_offloaded, use_graph=True)
                record = VerifyRecord()
                got = await offloaded.verify(step, block, start, record, predicted, on_device=True)
                assert torch.equal(got, expected), f"block at {first}: largest difference {(got - expected).abs().max().item()}"
                assert torch.equal(kv_offloaded.k, kv_resident.k) and torch.equal(kv_offloaded.v, kv_resident.v), first
                assert {layer: set(e) for layer, e in record.used.items()} == used, first
        finally:
            await offloaded.close()

    asyncio.run(go())
    assert sum(len(started) for _, started in leads) > 0 and sum(len(computed) for computed, _ in leads) > 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_offloaded_graphed_greedy_decode_equals_the_resident_graphed_decode(load, family, dtype):
    loaded = load(family, dtype)
    new_tokens = 24
    expected = run_sync(decode_resident_graphed(loaded.model, loaded.experts, PROMPT, new_tokens, use_graph=True))

    async def decode() -> list[int]:
        offloaded = cuda_offloaded(loaded, 2)
        try:
            kv = loaded.model.new_kv()
            token = (await prefill(loaded.model, kv, offloaded.experts, PROMPT)).argmax(dim=-1, keepdim=True)
            step, tokens = SegmentedStep(loaded.model, kv, use_graph=True), [token]
            step.prepare()
            for position in range(len(PROMPT), len(PROMPT) + new_tokens - 1):
                token = (await offloaded.verify(step, token, position, VerifyRecord())).argmax(dim=-1)
                tokens.append(token)
            return torch.cat(tokens).tolist()
        finally:
            await offloaded.close()

    assert asyncio.run(decode()) == expected


@pytest.mark.parametrize("dtype", DTYPES)
def test_segment_replays_equal_the_same_segments_run_eagerly(load, dtype):
    loaded = load("qwen2_moe", dtype)
    results = []
    for use_graph in (False, True):
        step = SegmentedStep(loaded.model, run_sync(after_prompt(loaded)), use_graph=use_graph)
        step.load(torch.arange(3, 10, device="cuda"), len(PROMPT))
        for index, layer in enumerate(step.moe_layers):
            step.run_segment(index)
            for e in range(loaded.spec.num_experts):
                step.expert_output(e, loaded.experts.expert(layer, e))
        step.run_segment(len(step.moe_layers))
        results.append(step.logits.clone())
    assert torch.equal(results[0], results[1])
