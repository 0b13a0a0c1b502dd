"""The draft step's one-row kernels (specter.model.rowfused) on a real GPU at the Qwen1.5-MoE shape, bf16: each
against a float reference (relative error at most 1e-2), the MoE's picks against torch's router, a fixed sum order,
no host sync, and CUDA-graph replay with new inputs."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import pytest
import torch
import torch.nn.functional as F

from specter.config import KernelTuning, RowTiles
from specter.model import rowfused
from specter.model.transformer import rms_norm
from specter.quant import QuantizedExperts, quantize_experts
from specter.quant.moe_triton import triton_available

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not triton_available(), reason="triton is not installed"),
]

T = TypeVar("T")
D, I, E, A, S = 2048, 1408, 60, 4, 5632  # hidden, expert intermediate, experts, picks, shared intermediate


def gap(got: torch.Tensor, expected: torch.Tensor) -> float:
    got, expected = got.double().cpu(), expected.double().cpu()
    return ((got - expected).norm() / expected.norm()).item()


def randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, generator=gen, device="cuda") * scale).bfloat16()


def captured(run: Callable[[], T]) -> tuple[torch.cuda.CUDAGraph, T]:
    """A CUDA graph of run() (warmed up once on a side stream first, as capture wants) and its static outputs."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = run()
    return graph, outputs


@pytest.fixture(scope="module")
def layer() -> QuantizedExperts:
    gate, up = randn(E, I, D, seed=1, scale=D**-0.5), randn(E, I, D, seed=2, scale=D**-0.5)
    return quantize_experts(gate, up, randn(E, D, I, seed=3, scale=I**-0.5), bits=4, group=128)


def test_bf16_products_match_float_references() -> None:
    x, norm = randn(1, D, seed=4, scale=3.0), 1 + randn(D, seed=5, scale=0.25)
    qkv, bias = randn(6144, D, seed=6, scale=D**-0.5), randn(6144, seed=7)
    normed = rms_norm(x.float(), norm.float(), 1e-6)
    assert gap(rowfused.norm_linear(x, norm, 1e-6, qkv, bias, 6144), F.linear(normed, qkv.float(), bias.float())) < 1e-2
    o_proj, residual = randn(D, D, seed=8, scale=D**-0.5), randn(1, D, seed=9)
    assert gap(rowfused.linear_residual(x, o_proj, residual), residual.float() + F.linear(x.float(), o_proj.float())) < 1e-2
    packed = randn(2 * S + E + 1 + 3, D, seed=10, scale=D**-0.5)  # padded to 11,328 rows as at load
    h, act, tail = rowfused.norm_ffn_input(x, norm, 1e-6, packed, S, E + 1)
    product = F.linear(normed, packed.float())
    assert gap(h, normed) < 1e-2
    assert gap(act, F.silu(product[:, :S]) * product[:, S : 2 * S]) < 1e-2
    assert gap(tail, product[:, 2 * S : 2 * S + E + 1]) < 1e-2


def test_moe_kernels_match_float_references_pick_as_the_router_and_sum_in_id_order(layer: QuantizedExperts) -> None:
    h, logits = randn(1, D, seed=11), randn(1, E, seed=12, scale=2.0)
    counts = torch.zeros(E, device="cuda")
    act, ids, weights = rowfused.moe_gate_up(h, logits, layer, A, False, counts)
    top_weights, top_ids = torch.softmax(logits.float(), dim=-1).topk(A)
    assert ids.tolist() == top_ids[0].tolist()
    assert gap(weights, top_weights[0]) < 1e-2
    assert torch.equal(counts.cpu(), torch.bincount(top_ids[0].cpu(), minlength=E).float())
    w13, w2 = layer.dequantize_w13(), layer.dequantize_w2()
    hf = h.float()[0]
    assert gap(act, torch.stack([F.silu(w13[e, :I] @ hf) * (w13[e, I:] @ hf) for e in ids.tolist()])) < 1e-2
    x, shared_act, shared_down, logit = randn(1, D, seed=13), randn(1, S, seed=14), randn(D, S, seed=15, scale=S**-0.5), randn(1, 1, seed=16)
    out = rowfused.moe_finish(x, act, ids, weights, layer, shared_act, shared_down, logit)
    routed = sum(weights[j] * (w2[e] @ act[j].float()) for j, e in enumerate(ids.tolist()))
    shared = F.linear(shared_act.float(), shared_down.float())[0] * torch.sigmoid(logit.float())[0, 0]
    assert gap(out[0], x.float()[0] + routed + shared) < 1e-2
    flipped = rowfused.moe_finish(x, act.flip(0).contiguous(), ids.flip(0).contiguous(), weights.flip(0).contiguous(), layer,
                                  shared_act, shared_down, logit)
    assert torch.equal(out, flipped)  # the picks' order does not change a bit


def test_the_layer_never_syncs_and_replays_in_a_cuda_graph_with_new_inputs(layer: QuantizedExperts) -> None:
    x, norm = randn(1, D, seed=20), 1 + randn(D, seed=21, scale=0.25)
    packed, shared_down = randn(2 * S + E + 1 + 3, D, seed=22, scale=D**-0.5), randn(D, S, seed=23, scale=S**-0.5)
    counts = torch.zeros(E, device="cuda")

    def run() -> torch.Tensor:
        h, act, tail = rowfused.norm_ffn_input(x, norm, 1e-6, packed, S, E + 1)
        routed, ids, weights = rowfused.moe_gate_up(h, tail[:, :E], layer, A, False, counts)
        return rowfused.moe_finish(x, routed, ids, weights, layer, act, shared_down, tail[:, E : E + 1])

    run()  # compile outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph, static_out = captured(run)
    x.copy_(randn(1, D, seed=24))
    counts.zero_()
    graph.replay()
    torch.cuda.synchronize()
    replayed, replay_counts = static_out.clone(), counts.clone()
    counts.zero_()
    assert torch.equal(replayed, run())
    assert torch.equal(replay_counts, counts) and counts.sum().item() == A


@pytest.mark.parametrize("experts, picks", [(E, A), (128, 8)])  # 4 router programs; 8 (Qwen3-MoE's 128 experts, top-8)
def test_the_top_k_in_the_routers_launch_is_the_routers_every_time(layer: QuantizedExperts, experts: int, picks: int) -> None:
    """rowfused.Select: the router's last program (counted on a device counter) takes the top-k of what the other
    programs stored. Run 200 times with new inputs, eagerly and as graph replays: each time the picks are the router's
    top-k of the stored logits, each pick is counted once at its expert, and the counter is back at zero (a race would
    show here). With a shared expert (the Qwen layout: norm_ffn_input), and without one (norm_router)."""
    norm = 1 + randn(D, seed=30, scale=0.25)
    sync, counts = torch.zeros(1, dtype=torch.int32, device="cuda"), torch.zeros(experts, device="cuda")
    x = randn(1, D, seed=32)
    if experts == E:
        packed = randn(2 * S + E + 1 + 3, D, seed=31, scale=D**-0.5)
        quantized = layer
    else:
        router = randn(experts, D, seed=33, scale=D**-0.5)
        small = (experts, 64, D)  # the gate/up kernel only reads the picks here: narrow experts keep the test light
        quantized = quantize_experts(randn(*small, seed=34, scale=D**-0.5), randn(*small, seed=35, scale=D**-0.5),
                                     randn(experts, D, 64, seed=36, scale=0.125), bits=4, group=64)  # fmt: skip

    def run() -> tuple[torch.Tensor, rowfused.Select, torch.Tensor]:
        select = rowfused.Select.new(experts, picks, False, sync, counts)
        if experts == E:
            h, _act, tail = rowfused.norm_ffn_input(x, norm, 1e-6, packed, S, E + 1, select=select)
        else:
            h, tail = rowfused.norm_router(x, norm, 1e-6, router, select=select)
        rowfused.moe_gate_up(h, None, quantized, picks, False, picks=select)
        return tail, select, h

    def check(tail: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> None:
        # the router's order: larger logit first, the lower id among equals (bf16 logits tie often, and torch.topk
        # orders ties as it likes: H200, row10g, [40, 24, 52, 44] against torch's [40, 52, 24, 44])
        logits = tail[0, :experts].float().cpu()
        order = sorted(range(experts), key=lambda e: (-logits[e].item(), e))[:picks]
        assert ids.tolist() == order
        expected = torch.softmax(logits, dim=-1)[order].bfloat16().float()
        torch.testing.assert_close(weights.cpu(), expected, rtol=1e-2, atol=0.0)
        assert torch.equal(counts.cpu(), torch.bincount(torch.tensor(order), minlength=experts).float())
        assert sync.item() == 0

    for seed in range(100):
        x.copy_(randn(1, D, seed=100 + seed))
        counts.zero_()
        tail, select, _ = run()
        check(tail, select.ids, select.weights)
    graph, (static_tail, static_select, _) = captured(run)
    for seed in range(100):
        x.copy_(randn(1, D, seed=300 + seed))
        counts.zero_()
        graph.replay()
        torch.cuda.synchronize()
        check(static_tail, static_select.ids, static_select.weights)


def test_int8_gate_up_by_dp4a_equals_its_integer_emulation_and_the_float_path_within_1_percent(layer: QuantizedExperts) -> None:
    """RowTiles.int8_gate_up: h in int8 per group and the codes x activations summed in int32 by dp4a. The sums are
    integers, so the instruction and its plain-integer emulation (what the CPU's interpreter tests run) give the same
    bits; against the float path (bf16 h, float32 sums) the activations differ by at most 1e-2 relative."""
    counts = torch.zeros(E, device="cuda")
    for seed in range(5):
        h, logits = randn(1, D, seed=60 + seed, scale=2.0), randn(1, E, seed=70 + seed, scale=2.0)
        runs = {}
        for name, changes in (("dp4a", {}), ("emulated", {"dp4a": False}), ("float", {"int8_gate_up": False})):
            config = RowTiles(**changes)
            runs[name] = rowfused.moe_gate_up(h, logits, layer, A, False, counts, config)
        assert KernelTuning().row.int8_gate_up and KernelTuning().row.dp4a  # what the draft step runs
        assert torch.equal(runs["dp4a"][0], runs["emulated"][0])
        assert torch.equal(runs["dp4a"][1], runs["float"][1])  # the same picks
        assert 1e-5 < gap(runs["dp4a"][0], runs["float"][0]) < 1e-2


def test_int8_finish_by_dp4a_equals_its_integer_emulation_and_the_float_finish_within_1_percent(layer: QuantizedExperts) -> None:
    """RowTiles.int8_finish: gate/up's output leaves in int8 too (a scale per 16 columns) and the finish sums the
    routed int4 down rows against it by dp4a. The instruction and its emulation give the same bits; against the float
    finish the layer's output differs by at most 1e-2 relative, and the picks' order changes no bit."""
    assert rowfused.int8_finish_fits(layer)
    x, shared_act = randn(1, D, seed=80), randn(1, S, seed=81)
    shared_down, logit = randn(D, S, seed=82, scale=S**-0.5), randn(1, 1, seed=83)
    for seed in range(5):
        h, logits = randn(1, D, seed=90 + seed, scale=2.0), randn(1, E, seed=95 + seed, scale=2.0)
        act, ids, weights, q8 = rowfused.moe_gate_up(h, logits, layer, A, False, None, int8_act=True)
        outs = {name: rowfused.moe_finish(x, act, ids, weights, layer, shared_act, shared_down, logit,
                                          RowTiles(dp4a=dp4a), act_int8=q8)
                for name, dp4a in (("dp4a", True), ("emulated", False))}  # fmt: skip
        assert torch.equal(outs["dp4a"], outs["emulated"])
        float_out = rowfused.moe_finish(x, act, ids, weights, layer, shared_act, shared_down, logit)
        routed_int8, routed_float = outs["dp4a"].float() - x.float(), float_out.float() - x.float()
        assert 1e-6 < gap(routed_int8, routed_float) < 1e-2
        flip = lambda t: t.flip(0).contiguous()  # noqa: E731
        flipped = rowfused.Int8Act(flip(q8.even), flip(q8.odd), flip(q8.scale), flip(q8.bias), q8.group)
        again = rowfused.moe_finish(x, flip(act), flip(ids), flip(weights), layer, shared_act, shared_down, logit,
                                    act_int8=flipped)  # fmt: skip
        assert torch.equal(again, outs["dp4a"])
