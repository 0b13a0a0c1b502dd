"""DeepSeek-V2's latent attention in the graphed step on a real GPU: CUDA-graph replays
equal the eager paths, rows stay batch-invariant, the graphed draft and the offloaded segments match, no host syncs."""

from __future__ import annotations

import asyncio
import functools

import pytest
import torch

from specter.config import EngineConfig, KernelTuning, TuningConfig
from specter.decode import decode_resident_graphed, greedy_decode, prefill, run_sync
from specter.build import LoadedModel, load_resident
from specter.model.graphed import GraphedStep, GraphedTarget, ResidentMoE, StaticStep
from specter.model.kv import KVCache
from specter.model.segmented import SegmentedStep
from specter.quant.moe_triton import triton_available
from specter.sampling import SamplingParams
from specter.verify import VerifyRecord
from tests.hf_models import save_hf
from tests.test_families_extra import hf_variant
from tests.test_gpu_graphed import draft_for
from tests.test_segmented import Offloaded

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not triton_available(), reason="triton is not installed"),
]

PROMPT = [3, 17, 42, 5, 88, 12]
VARIANTS = ["deepseek-v2", "deepseek-lite"]
DTYPES = ["float32", "bfloat16"]
KERNELS = ["triton", "dense"]


@pytest.fixture(scope="module")
def load(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu-graphed-mla")

    @functools.cache
    def loaded(variant: str, dtype: str, rowwise: bool = False) -> LoadedModel:
        """`rowwise`: the exact forward on the row-wise fused launches (kernels.exact_rowwise: DeepSeek's norms)."""
        path = save_hf(hf_variant(variant), root / variant)
        tuning = TuningConfig(kernels=KernelTuning(exact_rowwise=rowwise))
        return load_resident(path, EngineConfig(device="cuda", dtype=dtype, max_context=64, tuning=tuning))

    return loaded


async def after_prompt(loaded: LoadedModel) -> KVCache:
    kv = loaded.model.new_kv()
    await prefill(loaded.model, kv, loaded.experts, PROMPT)
    return kv


def prefilled(loaded: LoadedModel) -> KVCache:
    return run_sync(after_prompt(loaded))


@pytest.mark.parametrize("rowwise", [False, True], ids=["torch-ops", "rowwise"])
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_graphed_greedy_decode_equals_the_eager_exact_path(load, variant, dtype, kernel, rowwise):
    loaded = load(variant, dtype, rowwise)
    expected = run_sync(greedy_decode(loaded.model, loaded.experts, PROMPT, 32))
    got = run_sync(decode_resident_graphed(loaded.model, loaded.experts, PROMPT, 32, kernel=kernel, use_graph=True))
    assert got == expected


@pytest.mark.parametrize("rowwise", [False, True], ids=["torch-ops", "rowwise"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_graphed_rows_are_bit_identical_to_one_row_replays(load, variant, dtype, rowwise):
    loaded = load(variant, dtype, rowwise)
    block = torch.arange(10, 21, device="cuda")
    kv_block, kv_rows = prefilled(loaded), prefilled(loaded)
    whole = GraphedTarget(loaded.model, loaded.experts, kv_block, use_graph=True).logits(block, len(PROMPT))
    target = GraphedTarget(loaded.model, loaded.experts, kv_rows, use_graph=True)
    rows = torch.cat([target.logits(block[i : i + 1], len(PROMPT) + i) for i in range(block.shape[0])])
    assert torch.equal(whole, rows)
    assert torch.equal(kv_block.k, kv_rows.k) and torch.equal(kv_block.v, kv_rows.v)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_a_replay_equals_the_same_step_run_eagerly(load, variant, dtype):
    loaded = load(variant, dtype)
    outputs = []
    for use_graph in (False, True):
        step = GraphedStep(StaticStep(loaded.model, ResidentMoE(loaded.model, loaded.experts), 16), prefilled(loaded), use_graph=use_graph)
        step.load(torch.arange(3, 10, device="cuda"), len(PROMPT))
        logits, tokens = step.run(SamplingParams(temperature=0.8, top_p=0.9, seed=2))
        outputs.append((logits.clone(), tokens.clone()))
    assert torch.equal(outputs[0][0], outputs[1][0]) and torch.equal(outputs[0][1], outputs[1][1])


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.9, seed=4)], ids=["greedy", "sampled"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_graphed_draft_proposes_the_eager_drafts_tokens(load, variant, dtype, params):
    loaded = load(variant, dtype)
    eager, graphed = draft_for(loaded, static=False), draft_for(loaded, static=True)
    x0 = torch.tensor([17], device="cuda")
    expected, _ = run_sync(eager.propose(x0, len(PROMPT), 8, prefilled(loaded), params))
    for _ in range(2):  # the second proposal replays the graphs captured by the first
        got, _ = run_sync(graphed.propose(x0, len(PROMPT), 8, prefilled(loaded), params))
        assert torch.equal(got, expected)
        assert torch.equal(graphed.route_counts, eager.route_counts)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_graphed_segments_with_offloaded_experts_equal_the_resident_graph(load, variant, dtype, kernel):
    from backends.cuda import CUDABackend

    loaded = load(variant, dtype)
    start = len(PROMPT)

    async def go() -> None:
        offloaded = Offloaded(loaded, 2, CUDABackend())
        try:
            for size in (1, 3, 16):
                block = torch.arange(20, 20 + size, device="cuda") % loaded.spec.vocab_size
                kv_resident, kv_offloaded = await after_prompt(loaded), await after_prompt(loaded)
                expected = GraphedTarget(loaded.model, loaded.experts, kv_resident, kernel=kernel, use_graph=True).logits(block, start)
                step = SegmentedStep(loaded.model, kv_offloaded, kernel=kernel, use_graph=True)
                got = await offloaded.verify(step, block, start, VerifyRecord())
                assert torch.equal(got, expected), f"{size} rows: largest difference {(got - expected).abs().max().item()}"
                assert torch.equal(kv_offloaded.k, kv_resident.k) and torch.equal(kv_offloaded.v, kv_resident.v), f"{size} rows"
            assert offloaded.bytes_loaded > 0
        finally:
            await offloaded.close()

    asyncio.run(go())


def test_replays_never_synchronise_with_the_host(load):
    loaded = load("deepseek-v2", "bfloat16")
    kv = prefilled(loaded)
    target = GraphedTarget(loaded.model, loaded.experts, kv, use_graph=True)
    draft = draft_for(loaded, static=True)
    params = SamplingParams(temperature=0.7, top_k=10, seed=1)
    block = torch.arange(20, 25, device="cuda")
    target.logits(block, len(PROMPT))  # captures (capture itself synchronises)
    run_sync(draft.propose(block[:1], len(PROMPT), 4, kv, params))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            drafted, _ = run_sync(draft.propose(block[:1], len(PROMPT), 4, kv, params))
            logits = target.logits(torch.cat([block[:1], drafted]), len(PROMPT))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert logits.shape == (5, loaded.spec.vocab_size) and torch.isfinite(logits).all()


def test_graphs_prepared_at_start_up_match_and_decoding_reserves_no_more_memory(load):
    loaded = load("deepseek-lite", "bfloat16")
    kv = loaded.model.new_kv()
    target = GraphedTarget(loaded.model, loaded.experts, kv, use_graph=True)
    draft = draft_for(loaded, static=True)
    target.prepare()
    draft.capture(kv)
    assert not draft.route_counts.any(), "capturing must leave the route counters as they were"
    run_sync(prefill(loaded.model, kv, loaded.experts, PROMPT))
    block = torch.arange(30, 35, device="cuda")
    drafted, _ = run_sync(draft.propose(block[:1], len(PROMPT), 4, kv, SamplingParams()))
    expected, _ = run_sync(draft_for(loaded, static=False).propose(block[:1], len(PROMPT), 4, prefilled(loaded), SamplingParams()))
    assert torch.equal(drafted, expected)
    lazy = GraphedTarget(loaded.model, loaded.experts, prefilled(loaded), use_graph=True).logits(block, len(PROMPT))
    assert torch.equal(target.logits(block, len(PROMPT)), lazy)
    torch.cuda.synchronize()
    reserved = torch.cuda.memory_reserved()
    for step in range(8):
        drafted, _ = run_sync(draft.propose(block[:1], len(PROMPT) + step, 4, kv, SamplingParams()))
        target.logits(torch.cat([block[:1], drafted]), len(PROMPT) + step)
    torch.cuda.synchronize()
    assert torch.cuda.memory_reserved() == reserved
