"""The graphed decode step on a real GPU: CUDA-graph replays equal the eager paths, rows stay batch-invariant,
the Triton resident MoE is accurate on real shapes, and replays never synchronise with the host."""

from __future__ import annotations

import functools

import pytest
import torch

from specter.config import DraftConfig, EngineConfig, KernelTuning, TuningConfig
from specter.decode import decode_resident_graphed, greedy_decode, prefill, run_sync
from specter.draft import Draft, DraftExperts, quantize_layers
from specter.build import LoadedModel, load_resident
from specter.model.graphed import GraphedStep, GraphedTarget, ResidentMoE, StaticStep, resident_moe_triton
from specter.model.weights import pack_expert
from specter.quant.moe_triton import triton_available
from specter.sampling import SamplingParams
from tests.hf_models import FAMILIES, hf_model, save_hf

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
    root = tmp_path_factory.mktemp("gpu-graphed")

    @functools.cache
    def loaded(family: str, dtype: str, rowwise: bool = False) -> LoadedModel:
        """`rowwise`: the exact forward on the row-wise fused launches (kernels.exact_rowwise)."""
        path = save_hf(hf_model(family), root / family)
        tuning = TuningConfig(kernels=KernelTuning(exact_rowwise=rowwise))
        return load_resident(path, EngineConfig(device="cuda", dtype=dtype, max_context=64, tuning=tuning))

    return loaded


def prefilled(loaded: LoadedModel):
    kv = loaded.model.new_kv()
    run_sync(prefill(loaded.model, kv, loaded.experts, PROMPT))
    return kv


@pytest.mark.parametrize("rowwise", [False, True], ids=["torch-ops", "rowwise"])
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_graphed_greedy_decode_equals_the_eager_exact_path(load, family, dtype, kernel, rowwise):
    loaded = load(family, dtype, rowwise)
    expected = run_sync(greedy_decode(loaded.model, loaded.experts, PROMPT, 32))
    got = run_sync(decode_resident_graphed(loaded.model, loaded.experts, PROMPT, 32, kernel=kernel, use_graph=True))
    assert got == expected


@pytest.mark.parametrize("rowwise", [False, True], ids=["torch-ops", "rowwise"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_graphed_rows_are_bit_identical_to_one_row_replays(load, family, dtype, rowwise):
    loaded = load(family, dtype, rowwise)
    block = torch.arange(10, 21, device="cuda")
    kv_block, kv_rows = prefilled(loaded), prefilled(loaded)
    whole = GraphedTarget(loaded.model, loaded.experts, kv_block, use_graph=True).logits(block, len(PROMPT))
    target = GraphedTarget(loaded.model, loaded.experts, kv_rows, use_graph=True)
    rows = torch.cat([target.logits(block[i : i + 1], len(PROMPT) + i) for i in range(block.shape[0])])
    assert torch.equal(whole, rows)
    assert torch.equal(kv_block.k, kv_rows.k) and torch.equal(kv_block.v, kv_rows.v)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_replay_equals_the_same_step_run_eagerly(load, dtype):
    loaded = load("qwen2_moe", dtype)
    outputs = []
    for use_graph in (False, True):
        step = GraphedStep(StaticStep(loaded.model, ResidentMoE(loaded.model, loaded.experts), 16), prefilled(loaded), use_graph=use_graph)
        step.load(torch.arange(3, 10, device="cuda"), len(PROMPT))
        logits, tokens = step.run(SamplingParams(temperature=0.8, top_p=0.9, seed=2))
        outputs.append((logits.clone(), tokens.clone()))
    assert torch.equal(outputs[0][0], outputs[1][0]) and torch.equal(outputs[0][1], outputs[1][1])


def draft_for(loaded: LoadedModel, static: bool) -> Draft:
    spec = loaded.spec
    stream = ((layer, e, loaded.experts.expert(layer, e)) for layer in spec.moe_layers for e in range(spec.num_experts))
    layers = quantize_layers(stream, spec.hidden_size, spec.expert_intermediate, spec.num_experts, DraftConfig(), loaded.model.device,
                             layers=spec.moe_layers, dtype=loaded.model.dtype)
    return Draft(loaded.model, DraftExperts(layers, spec.num_layers, spec.num_experts, loaded.model.device), static=static)


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.9, seed=4)], ids=["greedy", "sampled"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_graphed_draft_proposes_the_eager_drafts_tokens(load, family, dtype, params):
    loaded = load(family, dtype)
    eager, graphed = draft_for(loaded, static=False), draft_for(loaded, static=True)
    x0 = torch.tensor([17], device="cuda")
    expected, _ = run_sync(eager.propose(x0, len(PROMPT), 8, prefilled(loaded), params))
    for _ in range(2):  # the second proposal replays the graphs captured by the first
        got, _ = run_sync(graphed.propose(x0, len(PROMPT), 8, prefilled(loaded), params))
        assert torch.equal(got, expected)
        assert torch.equal(graphed.route_counts, eager.route_counts)


def test_replays_never_synchronise_with_the_host(load):
    loaded = load("qwen2_moe", "bfloat16")
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
    loaded = load("olmoe", "bfloat16")
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


QWEN = dict(experts=60, hidden=2048, intermediate=1408, active=4)


@pytest.fixture(scope="module")
def qwen_packed() -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(0)
    e, d, i = QWEN["experts"], QWEN["hidden"], QWEN["intermediate"]
    experts = [pack_expert(torch.randn(i, d, generator=gen, device="cuda") / d**0.5, torch.randn(i, d, generator=gen, device="cuda") / d**0.5,
                           torch.randn(d, i, generator=gen, device="cuda") / i**0.5) for _ in range(e)]
    return torch.stack(experts).bfloat16()


@pytest.mark.parametrize("tokens", [1, 16])
def test_triton_resident_moe_on_qwen_shapes_is_accurate_and_batch_invariant(qwen_packed, tokens):
    e, d, i, a = QWEN["experts"], QWEN["hidden"], QWEN["intermediate"], QWEN["active"]
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    weights, ids = torch.softmax(torch.randn(tokens, e, generator=gen, device="cuda"), dim=-1).topk(a, dim=-1)
    weights = weights.bfloat16()
    x = torch.randn(tokens, d, generator=gen, device="cuda").bfloat16()
    out = resident_moe_triton(x, ids, weights, qwen_packed, d, i)
    reference = torch.zeros(tokens, d, device="cuda", dtype=torch.float64)
    for row in range(tokens):
        for slot in range(a):
            flat = qwen_packed[ids[row, slot]].double()
            gate_up = flat[: 2 * i * d].view(2 * i, d) @ x[row].double()
            act = torch.nn.functional.silu(gate_up[:i]) * gate_up[i:]
            reference[row] += weights[row, slot].double() * (flat[2 * i * d :].view(d, i) @ act)
    assert ((out.double() - reference).norm() / reference.norm()).item() < 1e-2
    singles = torch.cat([resident_moe_triton(x[r : r + 1], ids[r : r + 1], weights[r : r + 1], qwen_packed, d, i) for r in range(tokens)])
    assert torch.equal(out, singles)


def test_a_capture_survives_garbage_that_holds_a_dead_graph():
    """An unreachable CUDA graph in a reference cycle (an earlier engine's, say) is not collected mid-capture:
    destroying a graph while this thread captures would invalidate the capture (seen in the property tests)."""
    import gc

    from specter.model.graphed import capture_graph

    side = torch.cuda.Stream()
    x = torch.arange(8, device="cuda", dtype=torch.float32)

    class Holder:
        pass

    dead = Holder()
    dead.cycle = dead
    dead.graph, _ = capture_graph(lambda: x * 2, None, side)
    del dead  # unreachable; only the cyclic collector can free it

    def body() -> torch.Tensor:
        # enough container allocations to trigger several automatic collections of the young generation
        junk = [[index] for index in range(5 * gc.get_threshold()[0])]
        assert len(junk) > 0
        return x + 1

    graph, out = capture_graph(body, None, side)
    x.fill_(3.0)
    graph.replay()
    torch.cuda.synchronize()
    assert out.tolist() == [4.0] * 8
    gc.collect()  # the dead graph goes now, outside any capture
