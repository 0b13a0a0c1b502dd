"""The segmented static verify on the CPU: with experts offloaded to an ExpertCache it reproduces the resident
static step (GraphedTarget) bit for bit, decodes token for token like it, and moves bytes when slots are short."""

from __future__ import annotations

import asyncio
import functools
import json
import math
import textwrap

import pytest
import torch

from backends.cpu import CPUBackend
from specter.config import EngineConfig, VerifyTuning
from specter.decode import decode_resident_graphed, prefill, run_sync
from specter.experts import ExpertCache, ExpertPool, TransferEngine
from specter.kernel import Kernel
from specter.build import LoadedModel, load_resident
from specter.model.graphed import GraphedTarget
from specter.model.kv import KVCache
from specter.model.segmented import SegmentedStep
from specter.quant.moe_triton import triton_available
from specter.verify import OffloadedExperts, VerifyRecord, verify_segmented
from specter.experts.slots import lru_victims  # the default chooser: the least recently used unprotected residents
from tests.hf_models import FAMILIES, hf_model, save_hf
from tests.interpreter import run_interpreted

PROMPT = [1, 2, 3, 4, 5, 6]
SLOTS = [2, 4, 6]  # the tiny models have 6 experts, top-2
BLOCKS = [1, 3, 16]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def load(tmp_path_factory):
    root = tmp_path_factory.mktemp("segmented")

    @functools.cache
    def loaded(family: str, dtype: str) -> LoadedModel:
        name, _, top = family.partition("-top")  # "-topA": A active experts, so the expert-id order of sums matters
        overrides = {"num_experts_per_tok": int(top)} if top else {}
        path = save_hf(hf_model(name, seed=3, **overrides), root / family)
        return load_resident(path, EngineConfig(device="cpu", dtype=dtype, max_context=64))

    return loaded


class Offloaded:
    """The engine's offloaded set-up (specter.build.load_experts), on the cpu backend unless given one, filled from resident experts."""

    def __init__(self, loaded: LoadedModel, slots: int, backend=None, tuning: VerifyTuning | None = None) -> None:
        spec = loaded.spec
        self.moe_index = {layer: i for i, layer in enumerate(spec.moe_layers)}
        self.backend = backend or CPUBackend()
        self.kernel = Kernel(self.backend)
        pool = ExpertPool(self.backend, len(spec.moe_layers), spec.num_experts, spec.expert_numel, loaded.model.dtype)
        for layer in spec.moe_layers:
            for expert in range(spec.num_experts):
                pool.write(self.moe_index[layer], expert, loaded.experts.expert(layer, expert))
        pool.check_complete()
        self.transfer = TransferEngine(self.backend, self.kernel)
        self.cache = ExpertCache(self.backend, self.kernel, self.transfer, pool, slots, lru_victims)
        self.experts = OffloadedExperts(self.cache, self.kernel, self.moe_index, tuning=tuning)

    async def verify(self, step: SegmentedStep, tokens: torch.Tensor, start: int, record: VerifyRecord,
                     predicted: dict[int, list[int]] | None = None, on_device: bool = False) -> torch.Tensor:
        logits = await verify_segmented(step, tokens, start, self.cache, self.kernel, self.moe_index, record, predicted=predicted,
                                        on_device=on_device, tuning=self.experts.tuning)
        self.cache.unprotect_all(self.backend.record_event(self.backend.compute_stream))
        return logits

    @property
    def bytes_loaded(self) -> int:
        return self.cache.stats.total().bytes_loaded

    async def close(self) -> None:
        await self.cache.aclose()
        await self.transfer.aclose()
        self.kernel.close()
        self.backend.close()


async def after_prompt(loaded: LoadedModel) -> KVCache:
    kv = loaded.model.new_kv()
    await prefill(loaded.model, kv, loaded.experts, PROMPT)
    return kv


def prefilled(loaded: LoadedModel) -> KVCache:
    return run_sync(after_prompt(loaded))


def chosen_experts(loaded: LoadedModel, kv: KVCache, block: torch.Tensor) -> dict[int, set[int]]:
    """Which experts each MoE layer's router picks for `block` (from a resident segmented run on a copy of kv)."""
    copy = loaded.model.new_kv()
    copy.k.copy_(kv.k)
    copy.v.copy_(kv.v)
    step = SegmentedStep(loaded.model, copy)
    count = step.load(block, len(PROMPT))
    chosen = {}
    for index, layer in enumerate(step.moe_layers):
        step.run_segment(index)
        chosen[layer] = set(step.ids[:count].flatten().tolist())
        for e in chosen[layer]:
            step.expert_output(e, loaded.experts.expert(layer, e))
    return chosen


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", [*FAMILIES, "qwen3_moe-top3", "qwen2_moe-top4"])
def test_offloaded_segmented_logits_are_bit_identical_to_the_resident_static_step(load, family, dtype):
    loaded = load(family, dtype)
    start = len(PROMPT)

    async def go() -> None:
        for slots in SLOTS:
            offloaded = Offloaded(loaded, slots)
            try:
                for size in BLOCKS:
                    block = torch.arange(20, 20 + size) % loaded.spec.vocab_size
                    kv_resident, kv_offloaded = await after_prompt(loaded), await after_prompt(loaded)
                    expected_used = chosen_experts(loaded, kv_resident, block)
                    expected = GraphedTarget(loaded.model, loaded.experts, kv_resident).logits(block, start)
                    record = VerifyRecord()
                    got = await offloaded.verify(SegmentedStep(loaded.model, kv_offloaded), block, start, record)
                    where = f"{slots} slots, {size} rows"
                    assert got.shape == (size, loaded.spec.vocab_size), where
                    assert torch.equal(got, expected), where
                    assert torch.equal(kv_offloaded.k, kv_resident.k) and torch.equal(kv_offloaded.v, kv_resident.v), where
                    assert {layer: set(used) for layer, used in record.used.items()} == expected_used, where
                    assert record.hits + record.misses == sum(len(used) for used in expected_used.values()), where
                if slots < loaded.spec.num_experts:
                    assert offloaded.bytes_loaded > 0 and offloaded.cache.stats.total().misses > 0, f"{slots} slots"
            finally:
                await offloaded.close()

    asyncio.run(go())


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_decoding_through_the_offloaded_segmented_step_equals_the_resident_static_decode(load, family):
    loaded = load(family, "bfloat16")
    new_tokens = 24
    expected = run_sync(decode_resident_graphed(loaded.model, loaded.experts, PROMPT, new_tokens))

    async def decode(slots: int) -> tuple[list[int], int]:
        offloaded = Offloaded(loaded, slots)
        try:
            kv = loaded.model.new_kv()
            token = (await prefill(loaded.model, kv, offloaded.experts, PROMPT)).argmax(dim=-1, keepdim=True)  # eager prefill
            step, tokens = SegmentedStep(loaded.model, kv), [token]
            for position in range(len(PROMPT), len(PROMPT) + new_tokens - 1):
                token = (await offloaded.verify(step, token, position, VerifyRecord())).argmax(dim=-1)
                tokens.append(token)
            return torch.cat(tokens).tolist(), offloaded.bytes_loaded
        finally:
            await offloaded.close()

    for slots in (2, 3):
        tokens, moved = asyncio.run(decode(slots))
        assert tokens == expected, f"{slots} slots"
        assert moved > 0


def guessed(used: dict[int, set[int]], moe_index: dict[int, int], experts: int, turn: int, guess: str) -> dict[int, list[int]]:
    """A verify's predictions per cache layer from the experts each MoE layer chose: those (right), only others, from
    `turn` on (wrong), or the two interleaved (mixed)."""
    predicted = {}
    for layer, chosen in used.items():
        others = [e for e in range(experts) if e not in chosen]
        turn_at = turn % max(1, len(others))
        right, wrong = sorted(chosen), others[turn_at:] + others[:turn_at]
        predicted[moe_index[layer]] = {"right": right, "wrong": wrong,
                                       "mixed": [x for pair in zip(wrong, right) for x in pair]}[guess]
    return predicted


def spy_leads(offloaded: "Offloaded") -> list[tuple[list[int], list[int]]]:
    """Every (computed, started) that the offloaded cache's `lead` returns from now on, in call order."""
    leads: list[tuple[list[int], list[int]]] = []
    lead = offloaded.cache.lead

    def spy(*args, **kwargs):
        leads.append(lead(*args, **kwargs))
        return leads[-1]

    offloaded.cache.lead = spy
    return leads


@pytest.mark.parametrize("many", [2, 64])
@pytest.mark.parametrize("guess", ["right", "wrong", "mixed"])
@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_predicted_misses_start_before_the_routing_is_read_and_the_logits_stay_bit_identical(load, family, guess, many):
    """VerifyTuning.lead_misses: each layer's predicted misses start early, in free slots or in the slots of predicted residents
    computed first (skipped when the routing comes), or in a slot the layer before lends (every layer back at its
    slots after the round). Right, wrong or mixed predictions: the same logits, KV and used experts as the resident
    static step, every used expert counted once, and the early path was taken."""
    loaded = load(family, "float32")
    start, experts = len(PROMPT), loaded.spec.num_experts
    leads: list[tuple[list[int], list[int]]] = []
    loans: list[tuple[int, int, bool]] = []

    async def go() -> None:
        nonlocal leads
        offloaded = Offloaded(loaded, 3, tuning=VerifyTuning(lead_misses=many))
        leads = spy_leads(offloaded)
        lend = offloaded.cache._lend

        def spy_lend(donor: int, layer: int):
            slot = lend(donor, layer)
            loans.append((donor, layer, slot is not None))
            return slot

        offloaded.cache._lend = spy_lend
        try:
            for first in range(20, 60, 8):  # later blocks meet a full cache: the slots of computed residents
                block = torch.arange(first, first + 3) % loaded.spec.vocab_size
                kv_resident, kv_offloaded = await after_prompt(loaded), await after_prompt(loaded)
                used = chosen_experts(loaded, kv_resident, block)
                expected = GraphedTarget(loaded.model, loaded.experts, kv_resident).logits(block, start)
                predicted = guessed(used, offloaded.moe_index, experts, first, guess)
                record, before = VerifyRecord(), len(leads)
                got = await offloaded.verify(SegmentedStep(loaded.model, kv_offloaded), block, start, record, predicted)
                # one lead per layer, in layer order
                needed_started = sum(len(set(loads) & used[layer]) for (_, loads), layer in zip(leads[before:], sorted(used)))
                assert record.misses >= needed_started, "a load the lead started for a chosen expert counted as a hit"
                assert torch.equal(got, expected), first
                assert torch.equal(kv_offloaded.k, kv_resident.k) and torch.equal(kv_offloaded.v, kv_resident.v), first
                assert {layer: set(e) for layer, e in record.used.items()} == used, first
                assert all(len(e) == len(set(e)) for e in record.used.values()), first
                assert record.hits + record.misses == sum(len(e) for e in used.values()), first
                offloaded.cache.unprotect_all()  # the round's end: slots lent between layers (the relay) go back
                assert offloaded.cache.slot_counts() == [3] * len(used), first
        finally:
            await offloaded.close()

    asyncio.run(go())
    if guess != "wrong":  # the layers before lent slots to the predicted misses (CacheTuning.lead_relay, on)
        assert any(done for _donor, _layer, done in loans), "no layer lent a slot to the next one's lead"
    assert all(layer == donor + 1 for donor, layer, _ in loans if layer > donor), "a lead borrowed from another layer than the one before"
    assert sum(len(started) for _, started in leads) > 0, "no predicted miss started early"
    assert sum(len(computed) for computed, _ in leads) > 0, "no resident was computed ahead of its routing"


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_the_eager_offloaded_verify_records_every_expert_its_router_chose(load, family):
    """The eager verify (OffloadedExperts.run, the CPU's): its record's `used` holds, per MoE layer, exactly the experts
    the router picked for the verified rows (the ids the forward handed it), each once, and hits + misses count them."""
    from specter.calibrate import RecordingExperts

    loaded = load(family, "float32")

    async def go() -> None:
        for slots in (2, 3, loaded.spec.num_experts):
            offloaded = Offloaded(loaded, slots)
            try:
                for size in (1, 3, 5):
                    block = torch.arange(40 + size, 40 + 2 * size) % loaded.spec.vocab_size
                    kv = await after_prompt(loaded)
                    routed = RecordingExperts(offloaded.experts)
                    record = offloaded.experts.start_record()
                    await loaded.model.forward(block, len(PROMPT), kv, routed)
                    chosen = {layer: set(routed.layer(layer)[1].flatten().tolist()) for layer in loaded.spec.moe_layers}
                    where = f"{slots} slots, {size} rows"
                    assert {layer: set(used) for layer, used in record.used.items()} == chosen, where
                    assert all(len(used) == len(set(used)) for used in record.used.values()), where
                    assert record.hits + record.misses == sum(len(used) for used in chosen.values()), where
                    offloaded.cache.unprotect_all()
            finally:
                await offloaded.close()

    asyncio.run(go())


@pytest.mark.parametrize("predict", [False, True])
def test_a_verify_longer_than_the_row_bucket_runs_in_chunks_and_counts_each_expert_once(load, predict, monkeypatch):
    """Also with a prediction: a block longer than the step's rows runs no lead (its chunks' rows differ)."""
    loaded = load("qwen2_moe", "float32")
    block = torch.arange(30, 50)  # 20 rows: a 16-row chunk, then a 4-row one
    kv_resident, kv_offloaded = prefilled(loaded), prefilled(loaded)
    expected = GraphedTarget(loaded.model, loaded.experts, kv_resident).logits(block, len(PROMPT))
    experts = loaded.spec.num_experts
    predicted = {i: list(range(experts)) for i in range(len(loaded.spec.moe_layers))} if predict else None

    async def go() -> VerifyRecord:
        offloaded = Offloaded(loaded, 3)
        monkeypatch.setattr(offloaded.cache, "lead", lambda *a, **k: pytest.fail("a lead in a chunked verify"))
        record = VerifyRecord()
        try:
            got = await offloaded.verify(SegmentedStep(loaded.model, kv_offloaded), block, len(PROMPT), record, predicted)
            assert torch.equal(got, expected)
        finally:
            await offloaded.close()
        return record

    record = asyncio.run(go())
    assert all(len(used) == len(set(used)) for used in record.used.values())
    assert record.hits + record.misses == sum(len(used) for used in record.used.values())
    assert sorted(record.used) == sorted(loaded.spec.moe_layers)


def test_segments_split_at_moe_layers_and_dense_layers_run_in_full(load):
    loaded = load("qwen2_moe", "float32")  # layer 1 is a dense MLP layer
    step = SegmentedStep(loaded.model, loaded.model.new_kv())
    assert step.moe_layers == [0, 2]
    assert step._segment_layers == [[], [1], []]
    assert step.shared is not None and not step.use_graph


def test_each_moe_segment_takes_the_familys_moe_input_and_output(load, monkeypatch):
    """The segments do not rebuild the layer: each MoE layer's norm, routing and shared expert are the model's
    static_moe_input (what the family overrides), its sum with the routed experts the model's static_moe_output."""
    loaded = load("qwen2_moe", "float32")
    model = loaded.model
    step = SegmentedStep(model, prefilled(loaded))
    inputs, outputs = [], []
    moe_input, moe_output = model.static_moe_input, model.static_moe_output
    monkeypatch.setattr(model, "static_moe_input", lambda layer, x: inputs.append(layer) or moe_input(layer, x))
    monkeypatch.setattr(model, "static_moe_output", lambda *args: outputs.append(1) or moe_output(*args))
    step.load(torch.arange(5, 8), len(PROMPT))
    for index in range(len(step.moe_layers) + 1):
        step.run_segment(index)
    assert inputs == step.moe_layers and len(outputs) == len(step.moe_layers)


FORBIDDEN = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


def test_segments_and_expert_compute_never_read_a_tensor_back_to_the_host(load, monkeypatch):
    loaded = load("qwen2_moe", "float32")
    step = SegmentedStep(loaded.model, prefilled(loaded))
    step.load(torch.arange(5, 12), len(PROMPT))
    experts = {layer: [loaded.experts.expert(layer, e) for e in range(loaded.spec.num_experts)] for layer in step.moe_layers}

    def refuse(*args, **kwargs):
        raise AssertionError("host read inside a segment or the routed-expert compute")

    for name in FORBIDDEN:
        monkeypatch.setattr(torch.Tensor, name, refuse)
    for index, layer in enumerate(step.moe_layers):
        step.run_segment(index)
        for e, packed in enumerate(experts[layer]):
            step.expert_output(e, packed)
    step.run_segment(len(step.moe_layers))
    monkeypatch.undo()
    assert step.logits.isfinite().all()


# The interpreter must be chosen before triton is imported, so this runs in a fresh process (float32 only:
# the interpreter's tl.dot mishandles bfloat16; tests/test_gpu_segmented.py covers bf16 on CUDA).
TRITON_SCRIPT = textwrap.dedent(
    """
    import asyncio, json, sys, tempfile, torch
    from pathlib import Path
    from specter.config import EngineConfig, VerifyTuning
    from specter.decode import prefill
    from specter.build import load_resident
    from specter.model.graphed import GraphedTarget
    from specter.model.segmented import SegmentedStep
    from specter.verify import VerifyRecord
    from tests.hf_models import hf_model, save_hf
    from tests.test_segmented import Offloaded
    torch.set_num_threads(1)
    results = []
    for family in ("qwen2_moe", "mixtral"):
        path = save_hf(hf_model(family, seed=3), Path(tempfile.mkdtemp()) / family)
        loaded = load_resident(path, EngineConfig(device="cpu", dtype="float32", max_context=64))

        async def go():
            kvs = []
            for _ in range(2):
                kvs.append(loaded.model.new_kv())
                await prefill(loaded.model, kvs[-1], loaded.experts, [1, 2, 3, 4, 5, 6])
            block = torch.tensor([7, 50, 3])
            expected = GraphedTarget(loaded.model, loaded.experts, kvs[0], kernel="triton").logits(block, 6)
            offloaded = Offloaded(loaded, 2)
            try:
                got = await offloaded.verify(SegmentedStep(loaded.model, kvs[1], kernel="triton"), block, 6, VerifyRecord())
            finally:
                await offloaded.close()
            return bool(torch.equal(got, expected)), (got - expected).abs().max().item()

        results.append(asyncio.run(go()))
    print(json.dumps(results))
    """
)


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_the_triton_expert_compute_matches_the_resident_triton_step_in_the_interpreter():
    for identical, gap in run_interpreted(TRITON_SCRIPT):
        assert identical, f"largest difference {gap}"


def _where_loop_sum(staged: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The per-expert masked loop set_routed used before the staged sum (the reference order and rounding)."""
    out = torch.zeros(staged.shape[1:], dtype=staged.dtype)
    for expert in sorted(set(ids.flatten().tolist())):
        chosen = (ids == expert).any(dim=-1, keepdim=True)
        out = torch.where(chosen, out + staged[expert], out)
    return out


def _routed_case(experts: int, rows: int, active: int, hidden: int, dtype: torch.dtype, seed: int):
    generator = torch.Generator().manual_seed(seed)
    staged = (torch.randn(experts, rows, hidden, generator=generator) * torch.logspace(-3, 3, hidden)).to(dtype)
    ids = torch.stack([torch.randperm(experts, generator=generator)[:active] for _ in range(rows)])
    return staged, ids


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_routed_sum_equals_the_masked_loop_bit_for_bit(dtype):
    from specter.model.segmented import routed_sum

    for seed, (experts, rows, active, hidden) in enumerate([(8, 5, 2, 64), (60, 16, 4, 96), (16, 3, 1, 40), (64, 9, 6, 33)]):
        staged, ids = _routed_case(experts, rows, active, hidden, dtype, seed)
        out = torch.full((rows, hidden), float("nan"), dtype=dtype)
        routed_sum(staged, ids, out)
        assert torch.equal(out, _where_loop_sum(staged, ids)), (dtype, experts, active)


ROUTED_SUM_SCRIPT = textwrap.dedent(
    """
    import json, torch
    from specter.model.segmented import routed_sum
    from tests.test_segmented import _routed_case
    results = []
    for seed, (experts, rows, active, hidden, dtype) in enumerate(json.loads(__import__("sys").argv[1])):
        staged, ids = _routed_case(experts, rows, active, hidden, getattr(torch, dtype), seed)
        expected = torch.empty(rows, hidden, dtype=staged.dtype)
        routed_sum(staged, ids, expected)
        out = torch.full_like(expected, float("nan"))
        routed_sum(staged, ids, out, triton=True)
        results.append(bool(torch.equal(out, expected)))
    staged, ids = _routed_case(8, 4, 3, 64, torch.bfloat16, 99)
    ids[:, 1] = ids[:, 0]  # a repeated id (zeroed buffers during a graph capture's warm-up): counted once, no stray read
    out = torch.empty(4, 64, dtype=torch.bfloat16)
    routed_sum(staged, ids, out, triton=True)
    expected = torch.empty_like(out)
    routed_sum(staged, ids[:, 1:], expected)
    results.append(bool(torch.equal(out, expected)))
    print(json.dumps(results))
    """
)


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_triton_routed_sum_in_the_interpreter_equals_the_torch_sum():
    """One launch per layer instead of four per expert: the same order and rounding, bit for bit."""
    cases = [(8, 5, 2, 64, "float32"), (60, 16, 4, 300, "bfloat16"), (16, 3, 1, 40, "float16"), (64, 9, 6, 33, "bfloat16"),
             (8, 4, 8, 256, "bfloat16")]
    assert run_interpreted(ROUTED_SUM_SCRIPT, json.dumps(cases)) == [True] * (len(cases) + 1)


def test_float16_draft_overflow_leaves_the_static_verify_exact_and_the_next_request_clean(tmp_path):
    """A float16 model whose experts' outputs overflow for some tokens: the draft writes inf K/V beyond the committed
    length, which the whole-cache static attention weighs by 0 (0 x inf is NaN: the target's logits turned NaN and it
    emitted token 0 forever, and the next request on the engine from the stale tail too). Speculating equals k = 0."""
    from specter import Engine
    from specter.config import DraftConfig

    model = hf_model("mixtral", seed=7)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "experts" in name and ("down" in name or "w2" in name):
                parameter.mul_(25000.0)  # the checkpoint's own tokens stay finite; the draft's int2 guesses overflow
    path = save_hf(model, tmp_path / "mixtral")
    prompts = [[1, 2, 3], [40, 50, 60, 70, 80]]

    async def tokens(k: int, quant: str) -> list[list[int]]:
        config = EngineConfig(device="cpu", dtype="float16", max_context=64, static_verify=True,
                              draft=DraftConfig(k=k, overlap=k, quant=quant))
        async with Engine.from_pretrained(path, config) as engine:
            return [(await engine.complete(prompt, max_new_tokens=40)).token_ids for prompt in prompts]

    plain = asyncio.run(tokens(0, "int4"))
    assert all(sequence[-4:] != [0] * 4 for sequence in plain)  # the premise: plain decoding's logits stay finite
    assert asyncio.run(tokens(8, "int2")) == plain


def test_mla_whole_cache_attention_weighs_a_non_finite_latent_it_must_not_see_as_nothing():
    """attend_latent in float16: an inf or NaN latent at a position blocked for the row (a draft's overflow left in
    the cache) leaves the row's context as if that position held zeros (0 x inf made it NaN)."""
    from specter.model.deepseek_v2 import attend_latent

    torch.manual_seed(0)
    rows, heads, rank, rope_dim, positions = 2, 2, 8, 4, 6
    q_latent, q_rope = torch.randn(rows, heads, rank).half(), torch.randn(rows, heads, rope_dim).half()
    latents, rope_keys = torch.randn(positions, rank).half(), torch.randn(positions, rope_dim).half()
    blocked = torch.zeros(rows, 1, positions, dtype=torch.bool)
    blocked[:, :, 4:] = True  # positions 4 and 5: beyond both rows
    clean = attend_latent(q_latent, q_rope, latents, rope_keys, blocked, 0.5)
    for bad in (math.inf, math.nan):
        stale = latents.clone()
        stale[4], stale[5, :2] = bad, -math.inf
        got = attend_latent(q_latent, q_rope, stale, rope_keys, blocked, 0.5)
        assert torch.isfinite(got).all() and torch.equal(got, clean)
