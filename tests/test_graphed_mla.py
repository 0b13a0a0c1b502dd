"""DeepSeek-V2's multi-head latent attention in the static step on the CPU (on by default; KernelTuning.static_mla switches it off):
batch invariance, parity with the eager exact path, the static draft, and the offloaded segmented verify."""

from __future__ import annotations

import asyncio
import functools

import pytest
import torch

from specter.config import EngineConfig, KernelTuning
from specter.decode import decode_resident_graphed, greedy_decode, prefill, run_sync
from specter.errors import ConfigError
from specter.build import LoadedModel, load_resident
from specter.model.deepseek_v2 import LatentKVCache
from specter.model.graphed import (GraphedStep, GraphedTarget, ResidentMoE, StaticStep,
                                   static_step_supported)
from specter.model.segmented import SegmentedStep
from specter.sampling import SamplingParams
from specter.verify import VerifyRecord
from tests.hf_models import save_hf
from tests.test_families_extra import hf_variant
from tests.test_graphed import draft_for
from tests.test_segmented import Offloaded

PROMPT = [3, 17, 42, 5, 88, 12]
VARIANTS = ["deepseek-v2", "deepseek-lite"]  # q LoRA + yarn mscale + group-limited gate; no q LoRA + biases + 2 dense layers
DTYPES = ["float32", "bfloat16"]
FORBIDDEN = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def load(tmp_path_factory):
    root = tmp_path_factory.mktemp("graphed-mla")

    @functools.cache
    def loaded(variant: str, dtype: str) -> LoadedModel:
        path = save_hf(hf_variant(variant), root / variant)
        return load_resident(path, EngineConfig(device="cpu", dtype=dtype, max_context=64))

    return loaded


async def after_prompt(loaded: LoadedModel) -> LatentKVCache:
    kv = loaded.model.new_kv()
    await prefill(loaded.model, kv, loaded.experts, PROMPT)
    return kv


def prefilled(loaded: LoadedModel) -> LatentKVCache:
    return run_sync(after_prompt(loaded))


def dense_step(loaded: LoadedModel, kv: LatentKVCache, rows: int = 16) -> GraphedStep:
    return GraphedStep(StaticStep(loaded.model, ResidentMoE(loaded.model, loaded.experts, "dense"), rows), kv)


# ---- the switch ---------------------------------------------------------------------------------
def test_the_static_mla_is_on_unless_switched_off(load):
    loaded = load("deepseek-lite", "float32")
    model = loaded.model
    assert static_step_supported(model) and static_step_supported(type(model)) and static_step_supported(model, True)
    assert not static_step_supported(type(model), False)  # the engine asks with EngineConfig.tuning.kernels
    model = type(model)(model.spec, model.w, exact=model.exact, row_bucket=model.bucket, max_context=model.max_context,
                        kernels=KernelTuning(static_mla=False))  # the same weights, built with the switch off
    assert not static_step_supported(model)
    with pytest.raises(ConfigError, match="static_mla"):
        StaticStep(model, ResidentMoE(model, loaded.experts, "dense"), 16)


# ---- batch invariance and the KV writes -----------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_rows_of_one_call_are_bit_identical_to_one_row_calls(load, variant, dtype):
    loaded = load(variant, dtype)
    for size in (1, 9, 16):
        block = torch.arange(10, 10 + size)
        kv_block, kv_single = prefilled(loaded), prefilled(loaded)
        whole = dense_step(loaded, kv_block)
        whole.load(block, len(PROMPT))
        block_logits = whole.run()[0][:size].clone()
        single = dense_step(loaded, kv_single)
        singles = []
        for index in range(size):
            single.load(block[index : index + 1], len(PROMPT) + index)
            singles.append(single.run()[0][:1].clone())
        assert torch.equal(block_logits, torch.cat(singles)), f"{size} rows"
        assert torch.equal(kv_block.k, kv_single.k) and torch.equal(kv_block.v, kv_single.v), f"KV differs for {size} rows"
        end = len(PROMPT) + size  # padding rows repeat the last row, so nothing beyond the block is written
        assert not kv_block.k[:, :, end:].any() and not kv_block.v[:, :, end:].any()


@pytest.mark.parametrize("variant", VARIANTS)
def test_static_logits_and_latent_cache_are_close_to_the_eager_forward(load, variant):
    loaded = load(variant, "float32")
    block = torch.tensor([7, 50, 3, 91, 12])
    kv_static, kv_eager = prefilled(loaded), prefilled(loaded)
    static = GraphedTarget(loaded.model, loaded.experts, kv_static, kernel="dense").logits(block, len(PROMPT))
    eager = loaded.model.logits(run_sync(loaded.model.forward(block, len(PROMPT), kv_eager, loaded.experts)))
    assert static.shape == eager.shape == (5, loaded.spec.vocab_size)
    assert torch.allclose(static, eager, atol=1e-4, rtol=1e-4), (static - eager).abs().max()
    end = len(PROMPT) + 5
    assert kv_static.k[:, :, len(PROMPT) : end].abs().sum() > 0  # the latents were written where they belong
    assert torch.allclose(kv_static.k, kv_eager.k, atol=1e-5) and torch.allclose(kv_static.v, kv_eager.v, atol=1e-5)


# ---- decoding ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_decode_is_token_identical_to_the_eager_exact_path(load, variant, dtype):
    loaded = load(variant, dtype)
    expected = run_sync(greedy_decode(loaded.model, loaded.experts, PROMPT, 24))
    assert run_sync(decode_resident_graphed(loaded.model, loaded.experts, PROMPT, 24)) == expected


def test_a_step_never_reads_a_tensor_back_to_the_host(load, monkeypatch):
    loaded = load("deepseek-v2", "float32")
    step = dense_step(loaded, prefilled(loaded))
    step.load(torch.arange(5, 12), len(PROMPT))

    def refuse(*args, **kwargs):
        raise AssertionError("host read inside the static MLA step")

    for name in FORBIDDEN:
        monkeypatch.setattr(torch.Tensor, name, refuse)
    logits, _ = step.run(SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=3))
    monkeypatch.undo()
    assert logits.isfinite().all()


# ---- the draft ------------------------------------------------------------------------------------
@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.9, seed=4)], ids=["greedy", "sampled"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_static_draft_proposes_the_eager_drafts_tokens(load, variant, dtype, params):
    loaded = load(variant, dtype)
    eager, static = draft_for(loaded, static=False), draft_for(loaded, static=True)
    assert static.static and not eager.static
    x0, start = torch.tensor([17]), len(PROMPT)
    expected, expected_logits = run_sync(eager.propose(x0, start, 6, prefilled(loaded), params, keep_logits=True))
    got, got_logits = run_sync(static.propose(x0, start, 6, prefilled(loaded), params, keep_logits=True))
    assert torch.equal(got, expected)
    if dtype == "float32":
        assert torch.allclose(got_logits, expected_logits, atol=1e-4, rtol=1e-4)
    assert torch.equal(static.route_counts, eager.route_counts)
    assert static.route_counts.sum() == 6 * loaded.spec.top_k * len(loaded.spec.moe_layers)


# ---- the offloaded segmented verify ------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_offloaded_segmented_verify_is_bit_identical_to_the_resident_static_step(load, variant, dtype):
    loaded = load(variant, dtype)
    start = len(PROMPT)

    async def go() -> None:
        for slots in (2, loaded.spec.num_experts):
            offloaded = Offloaded(loaded, slots)
            try:
                for size in (1, 3, 16):
                    block = torch.arange(20, 20 + size) % loaded.spec.vocab_size
                    kv_resident, kv_offloaded = await after_prompt(loaded), await after_prompt(loaded)
                    expected = GraphedTarget(loaded.model, loaded.experts, kv_resident, kernel="dense").logits(block, start)
                    step = SegmentedStep(loaded.model, kv_offloaded, kernel="dense")
                    got = await offloaded.verify(step, block, start, VerifyRecord())
                    where = f"{slots} slots, {size} rows"
                    assert torch.equal(got, expected), where
                    assert torch.equal(kv_offloaded.k, kv_resident.k) and torch.equal(kv_offloaded.v, kv_resident.v), where
                if slots < loaded.spec.num_experts:
                    assert offloaded.bytes_loaded > 0, f"{slots} slots"
            finally:
                await offloaded.close()

    asyncio.run(go())
