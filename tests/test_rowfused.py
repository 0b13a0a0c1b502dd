"""The draft step's one-row kernels (specter.model.rowfused) in Triton's interpreter on the CPU: each against a float
reference, the MoE's picks and route counts against torch's router, the sum order fixed by expert id; and the draft's
one-row layer through them against the same layer through the packed torch/fused path."""

from __future__ import annotations

import json

import pytest
import torch

from specter.model import rowfused
from specter.quant import quantize_experts
from specter.quant.moe_triton import triton_available
from tests.interpreter import run_interpreted

KERNEL_SCRIPT = r"""
import json, sys
import torch
import torch.nn.functional as F
from specter.config import RowTiles
from specter.model import rowfused
from specter.model.transformer import rms_norm
from specter.quant import quantize_experts

def gap(got, expected):
    got, expected = got.double(), expected.double()
    return ((got - expected).norm() / expected.norm()).item()

results = []
for case in json.loads(sys.argv[1]):
    dtype = getattr(torch, case["dtype"])
    d, i, e, a, s, group = case["hidden"], case["inter"], case["experts"], case["top_k"], case["shared"], case["group"]
    gen = torch.Generator().manual_seed(case["seed"])
    rand = lambda *shape: torch.randn(*shape, generator=gen)
    config = RowTiles(block_n=case.get("block_n", 8), block_k=case.get("block_k", 512),
                      block_n_residual=case.get("block_n", 2), block_k_residual=case.get("block_k", 1024),
                      block_n_input=case.get("block_n", 4),
                      block_n_moe=case.get("block_n_moe", 16), block_k_moe=case.get("block_k_moe", 512),
                      block_k_gate_up=case.get("block_k_moe", 512),
                      block_n_finish=case.get("block_n_finish", 4), words_gate_up=case.get("words", False),
                      words_finish=case.get("words", True), block_k_shared=case.get("block_k_shared", 512),
                      evict_first=case.get("evict", False), int8_gate_up=case.get("int8", False),
                      int8_finish=case.get("int8_finish", False))
    row = {}
    x = (rand(1, d) * 2).to(dtype)
    norm = (1 + rand(d) / 4).to(dtype)
    weight, bias = (rand(d + 5, d) / d**0.5).to(dtype), rand(d + 5).to(dtype)
    normed = rms_norm(x.float(), norm.float(), 1e-6)
    row["norm_linear"] = gap(rowfused.norm_linear(x, norm, 1e-6, weight, bias, d + 3, config), F.linear(normed, weight.float()[: d + 3], bias.float()[: d + 3]))
    row["norm_linear_no_bias"] = gap(rowfused.norm_linear(x, norm, 1e-6, weight, None, d + 5, config), F.linear(normed, weight.float()))
    residual = rand(1, d + 5).to(dtype)
    row["linear_residual"] = gap(rowfused.linear_residual(x, weight, residual, config), residual.float() + F.linear(x.float(), weight.float()))
    packed = (rand(2 * s + e + 1 + 7, d) / d**0.5).to(dtype)  # gate, up, router, shared gate, padding rows
    h, act, tail = rowfused.norm_ffn_input(x, norm, 1e-6, packed, s, e + 1, config)
    product = F.linear(normed, packed.float())
    row["h"] = gap(h, normed)
    # rounded as rms_norm rounds it, up to its last bits: the sum of squares is added in another order, so the inverse
    # norm may differ in its last bit (float32: every value moves by up to ~2.4 ulps; float16: a value next to a rounding
    # boundary lands on its other side, 1 ulp), and not merely close
    torch_h = rms_norm(x, norm, 1e-6)
    steps = 4 if dtype == torch.float32 else 1
    row["h_rounded_as_rms_norm"] = torch.allclose(h, torch_h, rtol=steps * torch.finfo(dtype).eps, atol=0.0)
    row["shared_act"] = gap(act, F.silu(product[:, :s]) * product[:, s : 2 * s])
    row["tail"] = gap(tail, product[:, 2 * s : 2 * s + e + 1])
    router = (rand(e, d) / d**0.5).to(dtype)  # a layer without a shared expert: the norm and the router alone
    h_alone, logits_alone = rowfused.norm_router(x, norm, 1e-6, router, config)
    row["router_h"] = gap(h_alone, normed)
    row["router_logits"] = gap(logits_alone, F.linear(normed, router.float()))
    gate, up, down = rand(e, i, d) / d**0.5, rand(e, i, d) / d**0.5, rand(e, d, i) / i**0.5
    quantized = quantize_experts(gate, up, down, bits=4, group=group)
    w13, w2 = quantized.dequantize_w13(), quantized.dequantize_w2()
    logits = (rand(1, e) * 2).to(dtype)
    counts = torch.full((e,), 3.0)
    routed, ids, weights = rowfused.moe_gate_up(h, logits, quantized, a, case["renormalize"], counts, config)
    probs = torch.softmax(logits.float(), dim=-1)
    top_weights, top_ids = torch.topk(probs, a)
    if case["renormalize"]:
        top_weights = top_weights / top_weights.sum(-1, keepdim=True)
    row["same_picks"] = ids.tolist() == top_ids[0].tolist()
    row["weights"] = gap(weights, top_weights[0].to(dtype).float())
    row["counted"] = torch.equal(counts, 3.0 + torch.bincount(top_ids[0], minlength=e).float())
    hf = h.float()[0]
    expected = torch.stack([F.silu(w13[x_, :i] @ hf) * (w13[x_, i:] @ hf) for x_ in ids.tolist()])
    row["routed_act"] = gap(routed, expected)
    shared_act = rand(1, s).to(dtype)
    shared_down = (rand(d, s) / s**0.5).to(dtype)
    logit = rand(1, 1).to(dtype)
    for gated in (True, False):
        out = rowfused.moe_finish(x, routed, ids, weights, quantized, shared_act, shared_down, logit if gated else None, config)
        flipped = rowfused.moe_finish(x, routed.flip(0).contiguous(), ids.flip(0).contiguous(), weights.flip(0).contiguous(),
                                      quantized, shared_act, shared_down, logit if gated else None, config)
        routed_sum = sum(weights[j] * (w2[x_] @ routed[j].float()) for j, x_ in enumerate(ids.tolist()))
        shared = F.linear(shared_act.float(), shared_down.float())[0] * (torch.sigmoid(logit.float())[0, 0] if gated else 1.0)
        row["finish_gated" if gated else "finish"] = gap(out[0], x.float()[0] + routed_sum + shared)
        row["order_free_gated" if gated else "order_free"] = torch.equal(out, flipped)
    if case.get("int8_finish"):  # gate/up's output in int8 too, the routed rows summed against it by dp4a's emulation
        assert rowfused.int8_finish_fits(quantized, config)
        routed8, ids8, weights8, q8 = rowfused.moe_gate_up(h, logits, quantized, a, case["renormalize"], None, config,
                                                           int8_act=True)
        row["same_act_with_int8"] = torch.equal(routed8, routed) and torch.equal(ids8, ids)
        routed_sum = sum(weights[j] * (w2[x_] @ routed[j].float()) for j, x_ in enumerate(ids.tolist()))
        shared = F.linear(shared_act.float(), shared_down.float())[0] * torch.sigmoid(logit.float())[0, 0]
        out8 = rowfused.moe_finish(x, routed8, ids8, weights8, quantized, shared_act, shared_down, logit, config, act_int8=q8)
        row["finish_int8"] = gap(out8[0], x.float()[0] + routed_sum + shared)
        flip = lambda t: t.flip(0).contiguous()
        flipped = rowfused.Int8Act(flip(q8.even), flip(q8.odd), flip(q8.scale), flip(q8.bias), q8.group)
        out8_flipped = rowfused.moe_finish(x, flip(routed8), flip(ids8), flip(weights8), quantized, shared_act, shared_down,
                                           logit, config, act_int8=flipped)
        row["order_free_int8"] = torch.equal(out8, out8_flipped)
        routed_only = rowfused.moe_finish(x, routed8, ids8, weights8, quantized, None, None, None, config, act_int8=q8)
        row["finish_int8_alone"] = gap(routed_only[0] - x.float()[0], routed_sum)  # the routed sum by itself
    alone = rowfused.moe_finish(x, routed, ids, weights, quantized, None, None, None, config)  # no shared expert
    row["finish_alone"] = gap(alone[0], x.float()[0] + routed_sum)
    # the top-k taken by the router's last program (Select), with the shared expert's rows and without them
    for name, run in (("ffn", lambda sel: rowfused.norm_ffn_input(x, norm, 1e-6, packed, s, e + 1, config, select=sel)[::2]),
                      ("router", lambda sel: rowfused.norm_router(x, norm, 1e-6, router, config, select=sel))):
        sync, counted = torch.zeros(1, dtype=torch.int32), torch.full((e,), 1.0)
        select = rowfused.Select.new(e, a, case["renormalize"], sync, counted)
        h_sel, tail_sel = run(select)
        logits_sel = tail_sel[:, :e]
        plain_act, plain_ids, plain_weights = rowfused.moe_gate_up(h_sel, logits_sel, quantized, a, case["renormalize"], None, config)
        picked_act, picked_ids, picked_weights = rowfused.moe_gate_up(h_sel, None, quantized, a, case["renormalize"], None, config, picks=select)
        row[f"select_{name}_same"] = (torch.equal(picked_ids, plain_ids) and torch.equal(picked_weights, plain_weights)
                                      and torch.equal(picked_act, plain_act))
        row[f"select_{name}_counted"] = torch.equal(counted, 1.0 + torch.bincount(plain_ids.long(), minlength=e).float())
        uncounted = rowfused.Select.new(e, a, case["renormalize"], sync)  # no route counter: the picks alone
        run(uncounted)
        row[f"select_{name}_reset"] = sync.item() == 0 and torch.equal(uncounted.ids, plain_ids)
    results.append(row)
print(json.dumps(results))
"""

CASES = [
    # the Qwen layout in miniature (group 32, 4 of 10 experts, two K steps of several groups), fp32 and fp16; codes
    # read as the defaults read them (gate/up bytes, finish words), all as words, all as bytes
    dict(hidden=256, inter=96, experts=10, top_k=4, shared=192, group=32, dtype="float32", renormalize=False, block_k=128,
         block_k_moe=128),
    dict(hidden=256, inter=96, experts=10, top_k=4, shared=192, group=32, dtype="float16", renormalize=True),
    dict(hidden=256, inter=96, experts=10, top_k=4, shared=192, group=32, dtype="float32", renormalize=False, words=True),
    # one group per row (a K step inside a group: GROUPS 1), hidden not a power of two, 2 picks
    dict(hidden=160, inter=48, experts=6, top_k=2, shared=72, group=-1, dtype="float32", renormalize=True),
    dict(hidden=160, inter=48, experts=6, top_k=2, shared=72, group=-1, dtype="float32", renormalize=True, words=False),
    # a group larger than the K step, 5 picks (padding lanes of the 8-lane pick vector), odd row blocks
    dict(hidden=128, inter=64, experts=8, top_k=5, shared=40, group=64, dtype="float32", renormalize=False, block_k_moe=32,
         block_n=4, block_n_moe=8, block_n_finish=2),
    dict(hidden=96, inter=32, experts=5, top_k=5, shared=40, group=32, dtype="float32", renormalize=False, block_n_finish=8,
         block_k_shared=16, evict=True),
]
INT8_CASES = [
    # gate/up with h quantised to int8 and integer sums (RowTiles.int8_gate_up, the dp4a path's emulation here):
    # several groups per K step, a partial last step (224 = 3.5 steps of 64), a K step inside a group
    dict(hidden=256, inter=96, experts=10, top_k=4, shared=192, group=32, dtype="float32", renormalize=False, int8=True,
         block_k_moe=128),
    dict(hidden=224, inter=96, experts=10, top_k=4, shared=192, group=32, dtype="float16", renormalize=True, int8=True,
         block_k_moe=64),
    dict(hidden=128, inter=64, experts=8, top_k=5, shared=40, group=64, dtype="float32", renormalize=False, int8=True,
         block_k_moe=32),
    # gate/up's output in int8 and the finish's routed rows by dp4a's emulation (RowTiles.int8_finish): blocks of 16
    # columns in a partial K step (96 of 128), blocks of 8 in steps inside a group, with the float and int8 gate/up
    dict(hidden=256, inter=96, experts=10, top_k=4, shared=192, group=32, dtype="float32", renormalize=False,
         int8_finish=True),
    dict(hidden=128, inter=64, experts=8, top_k=5, shared=40, group=64, dtype="float32", renormalize=True, int8=True,
         int8_finish=True, block_n_moe=8, block_k_moe=32),
    dict(hidden=256, inter=96, experts=10, top_k=4, shared=192, group=32, dtype="float16", renormalize=False, int8=True,
         int8_finish=True),
]


def check_row_kernels(cases: list[dict], first_seed: int) -> None:
    cases = [dict(case, seed=first_seed + index) for index, case in enumerate(cases)]
    results = run_interpreted(KERNEL_SCRIPT, json.dumps(cases), timeout=400)
    for case, row in zip(cases, results, strict=True):
        tolerance = 3e-3 if case["dtype"] == "float16" else 2e-6
        if case.get("int8"):  # h in int8: about 1/254 of each group's largest value per element (rows of 128-256 values
            # here: a dot product near zero keeps the absolute error, so the norm-wise gap reaches ~1 %)
            assert 1e-5 < row.pop("routed_act") < 2e-2, (case, "routed_act")  # not the float path's result, but close
        if case.get("int8_finish"):  # the routed rows against int8 activations
            assert row.pop("same_act_with_int8") is True and row.pop("order_free_int8") is True, case
            assert 1e-6 < row.pop("finish_int8") < 1e-2, case
            assert 1e-5 < row.pop("finish_int8_alone") < 2e-2, case
        for key in ("same_picks", "counted", "order_free", "order_free_gated", "h_rounded_as_rms_norm", "select_ffn_same",
                    "select_ffn_counted",
                    "select_ffn_reset", "select_router_same", "select_router_counted", "select_router_reset"):
            assert row.pop(key) is True, (case, key)  # the router's picks in its order; one count per pick; id order
        for key, value in row.items():
            assert value < tolerance, (case, key, value)


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_row_kernels_match_float_references_in_the_interpreter():
    check_row_kernels(CASES, 0)


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_int8_row_kernels_match_float_references_within_the_int8_error_in_the_interpreter():
    """RowTiles.int8_gate_up and int8_finish, through dp4a's plain-integer emulation (the GPU test holds the
    instruction to the same bits)."""
    check_row_kernels(INT8_CASES, 100)


def test_int4_block_k_is_a_whole_number_of_groups_or_inside_one():
    assert rowfused.int4_block_k(2048, 128, 512) == 512  # four groups per step (the Qwen shape)
    assert rowfused.int4_block_k(1408, 128, 512) == 512  # the K tail is masked
    assert rowfused.int4_block_k(24, 24, 512) == 8  # one group per row of 24: steps of 8 inside it
    assert rowfused.int4_block_k(96, 96, 512) == 32
    assert rowfused.int4_block_k(64, 12, 512) is None  # 12 neither divides nor is divided by a power of two >= 8


def test_only_int4_experts_in_whole_words_take_the_row_kernels():
    gen = torch.Generator().manual_seed(0)
    gate, up, down = torch.randn(3, 24, 32, generator=gen), torch.randn(3, 24, 32, generator=gen), torch.randn(3, 32, 24, generator=gen)
    assert rowfused.supports(quantize_experts(gate, up, down, bits=4, group=-1))
    assert not rowfused.supports(quantize_experts(gate, up, down, bits=8, group=-1))
    assert not rowfused.supports(quantize_experts(gate[:, :20], up[:, :20], down[:, :, :20], bits=4, group=-1))  # 20 codes: not whole words


DRAFT_SCRIPT = r"""
import asyncio, inspect, json, sys
import torch
from specter.config import DraftConfig, EngineConfig, TuningConfig
from specter.draft import Draft
from specter.engine import Runtime
from specter.model import fused, rowfused, rowkernels
from specter.model.graphed import StaticStep

names = ("norm_linear", "linear_residual", "norm_ffn_input", "norm_router", "moe_gate_up", "moe_finish")
calls = {name: 0 for name in names}
int8_finishes = [0]  # moe_finish calls given gate/up's int8 output
tiles_given = []  # the tiles each call was given
for name in names:
    original = getattr(rowfused, name)
    def counted(*args, _original=original, _name=name, **kwargs):
        calls[_name] += 1
        int8_finishes[0] += kwargs.get("act_int8") is not None
        tiles_given.append(inspect.signature(_original).bind(*args, **kwargs).arguments.get("tiles"))
        return _original(*args, **kwargs)
    setattr(rowfused, name, counted)

class Launches:  # a jitted kernel whose launches record their column block and warps
    def __init__(self, kernel):
        self.kernel, self.seen = kernel, set()
    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.seen.add((kwargs["BLOCK_N"], kwargs["num_warps"]))
            return self.kernel[grid](*args, **kwargs)
        return launch
gate_up = rowkernels.jitted().moe_gate_up = Launches(rowkernels.jitted().moe_gate_up)

merged_attention = []  # per decode_attention call: whether it merged its runs in its launch (was given counters)
plain_attention = fused.decode_attention
def recorded_attention(*args, **kwargs):
    merged_attention.append((args[6] if len(args) > 6 else kwargs.get("counters")) is not None)
    return plain_attention(*args, **kwargs)
fused.decode_attention = recorded_attention

# the one-row kernels' tiles by name (EngineConfig.tuning.kernels.row), block_n_moe and warps_moe off their defaults
row = dict(topk_in_router=sys.argv[2] == "router", int8_gate_up=sys.argv[4] != "float",
           int8_finish=sys.argv[4] == "int8+finish", block_n_moe=8, warps_moe=2)
tuning = TuningConfig().with_overrides([f"kernels.row.{name}={json.dumps(value)}" for name, value in row.items()])
quant = sys.argv[3]

async def main():
    runtime = await Runtime.load(sys.argv[1], EngineConfig(device="cpu", dtype="float32", max_context=32, residents=3,
                                                           draft=DraftConfig(k=2, quant=quant), tuning=tuning))
    try:
        target, experts = runtime.model, runtime.draft.experts
        result = {"moe_layers": len(target.spec.moe_layers), "layers": target.spec.num_layers, "top_k": target.spec.top_k,
                  "tiles": runtime.draft.model.kernels.row == tuning.kernels.row}
        for flag in (False, True):  # a draft built with the row kernels off, then on (EngineConfig.tuning.kernels)
            model = Draft(target, experts, kernels=tuning.with_overrides([f"kernels.row_kernels={json.dumps(flag)}"]).kernels).model
            kv = model.new_kv()
            experts.route_counts.zero_()
            await model.forward(torch.tensor([3, 1, 4]), 0, kv, experts)  # three rows: never the row kernels
            before = dict(calls)
            experts.route_counts.zero_()
            eager = await model.forward(torch.tensor([1]), 3, kv, experts)
            eager_counts = experts.route_counts.clone()
            static_kv = model.new_kv()
            static_kv.k.copy_(kv.k)
            static_kv.v.copy_(kv.v)
            static = StaticStep(model, experts, rows=1).hidden(torch.tensor([1]), torch.tensor([3]), static_kv)
            exact = await target.forward(torch.tensor([1]), 3, kv, runtime.experts)  # the exact target: never
            result[str(flag)] = {"eager": eager[0].tolist(), "static": static[0].tolist(), "counts": eager_counts.tolist(),
                                 "static_counts": (experts.route_counts - eager_counts).tolist(),
                                 "three_rows": before, "one_row": dict(calls), "kv": static_kv.k[:, :, 3].flatten().tolist(),
                                 "int8_finishes": int8_finishes[0], "merged_attention": list(merged_attention),
                                 "tiles_given": all(given == tuning.kernels.row for given in tiles_given),
                                 "gate_up_launches": sorted(gate_up.seen)}
            int8_finishes[0] = 0
            merged_attention.clear()
            tiles_given.clear()
            gate_up.seen.clear()
            for name in names:
                calls[name] = 0
        print(json.dumps(result))
    finally:
        await runtime.aclose()

asyncio.run(main())
"""


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
@pytest.mark.parametrize("family, top_k_in, quant, activations", [
    ("qwen2_moe", "gate_up", "int4", "float"), ("qwen3_moe", "gate_up", "int4", "float"), ("mixtral", "gate_up", "int4", "float"),
    ("olmoe", "gate_up", "int4", "float"), ("qwen2_moe", "router", "int4", "float"), ("mixtral", "router", "int4", "float"),
    ("qwen2_moe", "router", "int8", "float"), ("qwen2_moe", "router", "int4", "int8"), ("qwen3_moe", "router", "int4", "int8"),
    ("qwen2_moe", "router", "int4", "int8+finish"), ("mixtral", "gate_up", "int4", "int8+finish")])
def test_the_drafts_one_row_layer_takes_the_row_kernels_and_matches_the_packed_path(tmp_path, family, top_k_in, quant,
                                                                                     activations):
    """qwen2_moe: a gated shared expert and a dense layer; qwen3_moe: q/k norms per head, renormalised top-k; mixtral:
    no q/k/v biases; olmoe: clipped q/k/v and full q/k norms. The norms, clips and biases stay where the family puts
    them; only the products, the routing and the sums move into the row kernels. top_k_in: where the router's top-k
    runs (RowTiles.topk_in_router: the input product's last router program, or every gate/up program). An int8
    draft keeps the packed MoE path (the row MoE kernels are int4's) and still takes the attention's row kernels.
    activations "int8": the gate/up kernel quantises h to int8 (RowTiles.int8_gate_up): the same picks, the
    output within 2 % of the packed path's instead of a sum reordering's 1e-5; "int8+finish": gate/up's output goes to
    the finish in int8 too (RowTiles.int8_finish), in every MoE layer's one-row call."""
    from tests.hf_models import hf_model, save_hf

    path = save_hf(hf_model(family, seed=3), tmp_path / "m")
    result = run_interpreted(DRAFT_SCRIPT, str(path), top_k_in, quant, activations, timeout=300)
    layers, moe_layers = result["layers"], result["moe_layers"]
    off, on = result["False"], result["True"]
    nothing = dict.fromkeys(("norm_linear", "linear_residual", "norm_ffn_input", "norm_router", "moe_gate_up", "moe_finish"), 0)
    shared = family == "qwen2_moe"  # the only family here with a shared expert
    moe = moe_layers if quant == "int4" else 0  # layers whose MoE runs through the row kernels
    assert off["three_rows"] == off["one_row"] == nothing  # switched off: never
    assert on["three_rows"] == nothing  # more than one row: never (nor the exact target's one row, counted after)
    # one row (eager, then static): per layer the norm + q/k/v product and o_proj + residual, per MoE layer the three
    # MoE launches (the dense layer keeps its own MLP)
    # (the packed MoE path adds its shared down product through plus_linear: linear_residual's kernel too)
    packed_shared = 2 * moe_layers if shared and quant != "int4" else 0
    assert on["one_row"] == {"norm_linear": 2 * layers, "linear_residual": 2 * layers + packed_shared,
                             "norm_ffn_input": 2 * moe if shared else 0, "norm_router": 0 if shared else 2 * moe,
                             "moe_gate_up": 2 * moe, "moe_finish": 2 * moe}, result
    eager_off, eager_on, static_on = (torch.tensor(v) for v in (off["eager"], on["eager"], on["static"]))
    gap = ((eager_on - eager_off).abs().max() / eager_off.abs().max()).item()
    assert gap < (1e-5 if activations == "float" else 2e-2)  # fp32: sums reordered only, unless h is in int8
    assert activations == "float" or gap > 1e-7  # ... and then the int8 path did run
    assert on["int8_finishes"] == (2 * moe if activations == "int8+finish" else 0) and off["int8_finishes"] == 0
    # the tiles of EngineConfig.tuning.kernels.row reach every one-row call, and gate/up launches with its column block
    # and warps (8 and 2, not the defaults 16 and 8)
    assert result["tiles"] and on["tiles_given"] and off["tiles_given"]
    assert on["gate_up_launches"] == ([[8, 2]] if moe else []) and off["gate_up_launches"] == []
    # the one-row attention (eager and static, with and without the row kernels) merges its runs in its own launch,
    # with counters (KernelTuning.merge_in_launch): the same kernel path in both, so the two steps propose alike
    assert on["merged_attention"] == off["merged_attention"] == [True] * (2 * layers)
    torch.testing.assert_close(static_on, eager_on, rtol=1e-5, atol=1e-5)  # the graphed step proposes as the eager one
    assert on["counts"] == off["counts"] == on["static_counts"]  # the same picks, counted once each
    assert sum(on["counts"][layer][e] for layer in range(layers) for e in range(len(on["counts"][0]))) == result["top_k"] * moe_layers
    kv_on, kv_off = torch.tensor(on["kv"]), torch.tensor(off["kv"])
    if activations != "float":  # the later layers' keys carry the earlier layers' int8 gate/up
        assert ((kv_on - kv_off).abs().max() / kv_off.abs().max()).item() < 2e-2
    else:
        torch.testing.assert_close(kv_on, kv_off, rtol=1e-5, atol=1e-5)
