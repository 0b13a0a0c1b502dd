"""The memory plan: one budget split before any allocation, slots from what is left, and (on CUDA) never exceeded."""

from __future__ import annotations

import asyncio

import pytest
import torch

from specter.config import DraftConfig, EngineConfig, GenerationConfig
from specter.engine import Runtime
from specter.errors import BudgetError
from specter.build import may_speculate
from specter.memory import plan_memory
from specter.model.checkpoint import Checkpoint
from specter.trace import read_trace


def test_slots_are_what_the_budget_leaves(tiny):
    spec = Checkpoint(tiny).spec
    full = plan_memory(spec, torch.float32, EngineConfig())
    assert full.all_resident and full.slots_per_layer == spec.num_experts
    for slots in (spec.top_k, 5, spec.num_experts - 1):
        budget = full.fixed_bytes + slots * full.moe_layers * full.slot_bytes + full.slot_bytes // 2
        plan = plan_memory(spec, torch.float32, EngineConfig(budget=budget))
        assert plan.slots_per_layer == slots
        assert plan.fixed_bytes + plan.slots_per_layer * plan.moe_layers * plan.slot_bytes <= budget


def test_a_budget_between_whole_counts_gives_some_layers_one_slot_more(tiny):
    """What is left past a whole count per layer holds a slot in as many layers as it pays for, spread over the
    depth; less than one slot stays idle, and one slot more takes exactly a slot's bytes."""
    spec = Checkpoint(tiny).spec
    full = plan_memory(spec, torch.float32, EngineConfig())
    layers = full.moe_layers
    for slots, extra in ((spec.top_k, 1), (5, layers - 1), (spec.num_experts - 1, 2)):
        budget = full.fixed_bytes + (slots * layers + extra) * full.slot_bytes + full.slot_bytes // 3
        plan = plan_memory(spec, torch.float32, EngineConfig(budget=budget))
        assert (plan.slots_per_layer, plan.extra_slots, plan.total_slots) == (slots, extra, slots * layers + extra)
        assert sorted(plan.layer_slots) == [slots] * (layers - extra) + [slots + 1] * extra
        assert plan.device_bytes <= budget and plan.idle_bytes == full.slot_bytes // 3
        nxt = plan_memory(spec, torch.float32, EngineConfig(budget=plan.next_slot_budget))
        assert nxt.total_slots == plan.total_slots + 1 or nxt.all_resident
    spread = plan_memory(spec, torch.float32, EngineConfig(budget=full.fixed_bytes + (3 * layers + 2) * full.slot_bytes))
    assert spread.layer_slots == (3, 4, 3, 4)  # every other layer: one extra slot each half of the depth
    resident = plan_memory(spec, torch.float32, EngineConfig(residents=3))
    assert resident.extra_slots == 0 and resident.layer_slots == (3,) * layers  # `residents` is a count per layer


def test_an_engine_with_uneven_slots_decodes_the_resident_tokens(tiny, tmp_path):
    """The cache allocates each layer's own slots, and decoding (k = 0 and speculating) gives the tokens of every
    expert resident; a trace it records says each layer's slots, for the replay."""
    spec = Checkpoint(tiny).spec
    generation = GenerationConfig(max_new_tokens=24)
    trace = tmp_path / "uneven.jsonl"

    async def tokens(config: EngineConfig) -> tuple[list[int], tuple[int, ...]]:
        runtime = await Runtime.load(tiny, config)
        try:
            slots = runtime.cache.layer_slots if runtime.cache is not None else ()
            if runtime.cache is not None:
                assert slots == runtime.memory.layer_slots and runtime.cache.weights.shape[0] == sum(slots)
                assert runtime.cache.slot_counts() == list(slots)
                runtime.record_trace(trace)
            return (await runtime.complete_ids([3, 1, 4, 1, 5], generation)).tokens, slots
        finally:
            await runtime.aclose()

    expected, _ = asyncio.run(tokens(EngineConfig(device="cpu")))
    for k in (0, 4):
        config = EngineConfig(device="cpu", draft=DraftConfig(k=k))
        plan = plan_memory(spec, torch.float32, config, speculative=may_speculate(config))
        budget = plan.fixed_bytes + (spec.top_k * plan.moe_layers + 3) * plan.slot_bytes
        got, slots = asyncio.run(tokens(EngineConfig(device="cpu", budget=budget, draft=DraftConfig(k=k))))
        assert sorted(slots) == [spec.top_k] + [spec.top_k + 1] * 3 and got == expected
        header, _ = read_trace(trace)
        assert header.slots() == slots and header.slots_per_layer == spec.top_k


def test_minimum_is_exact(tiny):
    spec = Checkpoint(tiny).spec
    minimum = plan_memory(spec, torch.float32, EngineConfig()).minimum_budget
    assert plan_memory(spec, torch.float32, EngineConfig(budget=minimum)).slots_per_layer == spec.top_k
    with pytest.raises(BudgetError, match="short of the minimum"):
        plan_memory(spec, torch.float32, EngineConfig(budget=minimum - 1))


def test_plain_decoding_needs_no_draft_bytes(tiny):
    spec = Checkpoint(tiny).spec
    speculative = plan_memory(spec, torch.float32, EngineConfig(), speculative=True)
    plain = plan_memory(spec, torch.float32, EngineConfig(), speculative=False)
    assert plain.draft_bytes == 0 < speculative.draft_bytes
    assert plain.minimum_budget < speculative.minimum_budget


@pytest.mark.parametrize("quant, group, hidden, inter", [("int4", 128, 256, 384), ("int4", 128, 256, 96), ("int8", 64, 128, 64),
                                                        ("int3", 32, 64, 48), ("int2", 128, 64, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_plans_draft_bytes_are_the_built_drafts(quant, group, hidden, inter, dtype):
    """Per expert, the plan's draft bytes are those of the layers `quantize_layers` allocates, also where the group
    divides one projection's input and not the other's (256 and 96 at 128: both then take one group a row)."""
    from specter.draft import BITS, draft_expert_bytes, layer_group
    from specter.quant.groupwise import default_scale_dtype, empty_experts

    scale_dtype = default_scale_dtype(dtype)
    built = empty_experts(3, inter, hidden, BITS[quant], layer_group(hidden, inter, group), scale_dtype, "cpu")
    scale_bytes = torch.empty((), dtype=scale_dtype).element_size()
    assert draft_expert_bytes(hidden, inter, quant, group, scale_bytes) * 3 == built.nbytes


def test_cache_slots_match_the_plan(tiny):
    async def go():
        runtime = await Runtime.load(tiny, EngineConfig(device="cpu", residents=3))
        try:
            cache = runtime.cache
            assert cache.weights.shape == (runtime.memory.moe_layers * 3, runtime.spec.expert_numel)
        finally:
            await runtime.aclose()

    asyncio.run(go())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("k", [0, 4])
def test_peak_reserved_gpu_memory_stays_within_the_budget(tiny, k):
    spec = Checkpoint(tiny).spec
    draft = DraftConfig(k=k)
    config = EngineConfig(device="cuda", draft=draft)
    plan = plan_memory(spec, torch.float32, config, speculative=may_speculate(config))  # k = 0: no draft bytes
    budget = plan.fixed_bytes + 6 * plan.moe_layers * plan.slot_bytes  # 6 of 16 slots per layer

    async def go():
        runtime = await Runtime.load(tiny, EngineConfig(device="cuda", budget=budget, draft=draft))
        try:
            assert runtime.memory.slots_per_layer == 6
            for seed in range(3):
                await runtime.complete_ids([1, 2, 3, seed], GenerationConfig(max_new_tokens=48, temperature=0.7, seed=seed))
        finally:
            await runtime.aclose()

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    baseline = torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    asyncio.run(go())
    assert torch.cuda.max_memory_reserved() - baseline <= budget


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("k", [0, 4])
def test_uneven_slots_on_cuda_decode_the_resident_tokens_within_the_budget(tiny, k):
    """One slot more in three layers, on CUDA with its graphs (the static verify's per-slot outputs, the slot table):
    sampled tokens equal the all-resident engine's, and peak reserved memory stays within the budget."""
    spec = Checkpoint(tiny).spec
    draft = DraftConfig(k=k)
    config = EngineConfig(device="cuda", draft=draft)
    plan = plan_memory(spec, torch.float32, config, speculative=may_speculate(config))
    budget = plan.fixed_bytes + (6 * plan.moe_layers + 3) * plan.slot_bytes
    generation = GenerationConfig(max_new_tokens=48, temperature=0.7, seed=5)

    async def tokens(config: EngineConfig) -> tuple[list[int], tuple[int, ...]]:
        runtime = await Runtime.load(tiny, config)
        try:
            slots = runtime.cache.layer_slots if runtime.cache is not None else ()
            return (await runtime.complete_ids([1, 2, 3, 4], generation)).tokens, slots
        finally:
            await runtime.aclose()

    expected, _ = asyncio.run(tokens(EngineConfig(device="cuda", draft=draft)))
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    baseline = torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    got, slots = asyncio.run(tokens(EngineConfig(device="cuda", budget=budget, draft=draft)))
    assert sorted(slots) == [6] * (plan.moe_layers - 3) + [7] * 3 and got == expected
    assert torch.cuda.max_memory_reserved() - baseline <= budget


def test_static_verify_graphs_on_cuda_charge_each_slot_its_expert_output(tiny):
    """The segmented verify's expert graphs keep an [R, D] output per slot; the plan counts it (CUDA only)."""
    spec = Checkpoint(tiny).spec
    plain = plan_memory(spec, torch.bfloat16, EngineConfig(device="cuda", static_verify=False))
    static = plan_memory(spec, torch.bfloat16, EngineConfig(device="cuda", static_verify=True))
    assert plain.slot_overhead_bytes == 0 and plain.slot_bytes == plain.expert_bytes
    assert static.slot_overhead_bytes == 16 * spec.hidden_size * 2
    assert static.minimum_budget - plain.minimum_budget == static.moe_layers * static.min_slots_per_layer * static.slot_overhead_bytes
    cpu = plan_memory(spec, torch.bfloat16, EngineConfig(device="cpu", static_verify=True))
    assert cpu.slot_overhead_bytes == 0
    default = plan_memory(spec, torch.bfloat16, EngineConfig(device="cuda", cuda_graphs=True))  # static by default on CUDA
    assert default.slot_overhead_bytes == static.slot_overhead_bytes
    budget = static.fixed_bytes + static.moe_layers * 5 * static.slot_bytes
    assert plan_memory(spec, torch.bfloat16, EngineConfig(device="cuda", static_verify=True, budget=budget)).slots_per_layer == 5
    assert plan_memory(spec, torch.bfloat16, EngineConfig(device="cuda", static_verify=True, budget=budget - 1)).slots_per_layer == 4


def test_cuda_plans_reserve_room_for_library_workspaces(tiny):
    from specter.memory import CUDA_LIBRARY_BYTES

    spec = Checkpoint(tiny).spec
    cpu = plan_memory(spec, torch.float32, EngineConfig(device="cpu"))
    cuda = plan_memory(spec, torch.float32, EngineConfig(device="cuda"))
    assert cuda.workspace_bytes - cpu.workspace_bytes == CUDA_LIBRARY_BYTES


def test_the_full_residency_budget_is_all_resident_even_with_a_slot_overhead(tiny):
    """Resident experts need no expert graphs: at resident_budget every expert fits, overhead or not."""
    spec = Checkpoint(tiny).spec
    for device in ("cpu", "cuda"):
        config = EngineConfig(device=device, static_verify=True)
        plan = plan_memory(spec, torch.bfloat16, config)
        at = plan_memory(spec, torch.bfloat16, EngineConfig(device=device, static_verify=True, budget=plan.resident_budget))
        assert at.all_resident and at.slots_per_layer == spec.num_experts
        below = plan_memory(spec, torch.bfloat16, EngineConfig(device=device, static_verify=True, budget=plan.resident_budget - 1))
        assert below.slots_per_layer < spec.num_experts


def test_an_engine_decision_against_expert_graphs_removes_the_slot_overhead(tiny):
    spec = Checkpoint(tiny).spec
    config = EngineConfig(device="cuda", static_verify=True)
    assert plan_memory(spec, torch.bfloat16, config).slot_overhead_bytes > 0
    assert plan_memory(spec, torch.bfloat16, config, expert_graphs=False).slot_overhead_bytes == 0
