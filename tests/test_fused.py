"""The fused RMSNorm and RoPE kernels of the non-exact forward (the draft), run in Triton's interpreter on the CPU
against torch's op sequence; and the exact forward never takes them."""

from __future__ import annotations

import pytest
import torch

from specter.model import fused
from specter.quant.moe_triton import triton_available
from tests.interpreter import run_interpreted

SCRIPT = r"""
import json
import torch
from specter.model import fused
from specter.model.transformer import rms_norm, rotate_half

ULP = {torch.float32: 2.0**-20, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}
results = []
generator = torch.Generator().manual_seed(0)
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    for shape in ((1, 2048), (5, 64), (3, 4, 128), (2, 3, 40)):
        x = (torch.randn(*shape, generator=generator) * 3).to(dtype)
        weight = (1 + torch.randn(shape[-1], generator=generator) / 4).to(dtype)
        reference = rms_norm(x, weight, 1e-6).float()
        got = fused.rms_norm(x, weight, 1e-6)
        gap = ((got.float() - reference).abs() / (reference.abs() + 1e-3)).max().item()
        results.append(["norm", str(dtype), list(shape), got.dtype == x.dtype and got.shape == x.shape, gap, 2 * ULP[dtype]])
    view = (torch.randn(4, 96, generator=generator)).to(dtype)[:, :64]  # a strided view
    gap = (fused.rms_norm(view, torch.ones(64, dtype=dtype), 1e-5).float() - rms_norm(view, torch.ones(64, dtype=dtype), 1e-5).float()).abs().max().item()
    results.append(["norm-view", str(dtype), [4, 64], True, gap, 4 * ULP[dtype]])
    for rows, heads, kv_heads, head_dim in ((1, 8, 2, 64), (5, 4, 4, 32), (3, 6, 2, 40)):
        q = torch.randn(rows, heads, head_dim, generator=generator).to(dtype)
        k = torch.randn(rows, kv_heads, head_dim, generator=generator).to(dtype)
        angles = torch.rand(100, head_dim // 2, generator=generator) * 6.3
        cos, sin = torch.cat((angles, angles), -1).cos().to(dtype), torch.cat((angles, angles), -1).sin().to(dtype)
        positions = torch.randperm(100, generator=generator)[:rows]
        c, s = cos[positions][:, None, :], sin[positions][:, None, :]
        ref_q, ref_k = q * c + rotate_half(q) * s, k * c + rotate_half(k) * s
        got_q, got_k = fused.rope(q, k, cos, sin, positions)
        gap = max((got_q.float() - ref_q.float()).abs().max().item(), (got_k.float() - ref_k.float()).abs().max().item())
        results.append(["rope", str(dtype), [rows, heads, kv_heads, head_dim], got_q.shape == q.shape and got_k.shape == k.shape,
                        gap, 4 * ULP[dtype] * 4])
print(json.dumps(results))
"""

ROUTER_SCRIPT = r"""
import json
import torch
import torch.nn.functional as F
from specter.model import fused

results = []
generator = torch.Generator().manual_seed(3)
for dtype in (torch.float32, torch.bfloat16):
    for rows, experts, top_k, renormalize in ((1, 60, 4, False), (5, 64, 6, True), (3, 8, 2, True), (2, 128, 8, False)):
        logits = (torch.randn(rows, experts, generator=generator) * 2).to(dtype)
        probs = torch.softmax(logits.float(), dim=-1)
        ref_weights, ref_ids = torch.topk(probs, top_k, dim=-1)
        if renormalize:
            ref_weights = ref_weights / ref_weights.sum(dim=-1, keepdim=True)
        ids, weights = fused.topk_softmax(logits, top_k, renormalize, dtype)
        # the same probabilities in the same order (bf16 logits tie: then torch's id order is unspecified)
        same = torch.equal(probs.gather(-1, ids), torch.topk(probs, top_k, dim=-1).values)
        results.append(["router", str(dtype), [rows, experts, top_k, renormalize], same,
                        ids.dtype == torch.int64 and weights.dtype == dtype,
                        (weights.float() - ref_weights.to(dtype).float()).abs().max().item()])
    tied = torch.tensor([[1.0, 3.0, 3.0, 0.5, 3.0, -1.0]], dtype=dtype)  # equal probabilities: lower expert id first
    ids, _ = fused.topk_softmax(tied, 3, False, dtype)
    results.append(["router-ties", str(dtype), [1, 6, 3, False], ids.tolist() == [[1, 2, 4]], True, 0.0])
    # not a number: a NaN or infinite logit makes torch's whole row NaN; the ids must still be real, distinct experts
    broken = torch.tensor([[0.5, float("nan"), 1.0, 2.0, -1.0, 0.0], [0.0, float("inf"), 1.0, 0.0, 0.0, 0.0]], dtype=dtype)
    ids, weights = fused.topk_softmax(broken, 2, True, dtype)
    valid = all(0 <= i < 6 for row in ids.tolist() for i in row) and all(len(set(row)) == 2 for row in ids.tolist())
    results.append(["router-nan", str(dtype), [2, 6, 2, True], valid, bool(weights.float().isnan().all()), 0.0])
    for rows, width in ((1, 2048), (4, 96), (3, 5000)):  # 5000: more than one 4096-wide block
        h = torch.randn(rows, width, generator=generator).to(dtype)
        gate = (torch.randn(1, width, generator=generator) / width**0.5).to(dtype)
        out = torch.randn(rows, width, generator=generator).to(dtype)
        reference = torch.sigmoid(F.linear(h, gate)) * out
        got = fused.sigmoid_gate(h, gate, out)
        results.append(["gate", str(dtype), [rows, width], got.shape == out.shape and got.dtype == dtype, True,
                        ((got.float() - reference.float()).abs() / (reference.float().abs() + 1e-2)).max().item()])
    for rows, inter, gated in ((1, 1408, True), (3, 40, True), (2, 1500, False)):  # 1500: two column blocks
        product = torch.randn(rows, 2 * inter + 7 + int(gated), generator=generator).to(dtype)  # a packed product
        gate_logit = product[:, 2 * inter + 5 :][:, :1] if gated else None  # strided views, as packed_finish takes them
        reference = F.silu(product[:, :inter].float()) * product[:, inter : 2 * inter].float()
        if gated:
            reference = reference * torch.sigmoid(gate_logit.float())
        got = fused.gated_silu(product, inter, gate_logit)
        results.append(["gated-silu", str(dtype), [rows, inter, gated], got.shape == (rows, inter) and got.dtype == dtype,
                        True, ((got.float() - reference).abs() / (reference.abs() + 1e-2)).max().item()])
print(json.dumps(results))
"""


ATTENTION_SCRIPT = r"""
import json, math
import torch
from specter.model import fused

results = []
generator = torch.Generator().manual_seed(5)
cases = [  # rows, heads, kv heads, head dim, capacity, positions, window, splits of the positions
    (1, 4, 4, 64, 40, [17], None, None),
    (3, 8, 2, 32, 70, [0, 33, 69], None, None),  # grouped queries; the first and the last position
    (2, 6, 2, 40, 50, [45, 12], 8, None),  # a sliding window, a head dim that is not a power of two
    (1, 32, 4, 16, 130, [129], None, None),  # 8 query heads per cache head (smaller key blocks)
    (3, 8, 2, 32, 70, [0, 33, 69], None, 4),  # runs merged; position 0: every run but the first is empty
    (2, 6, 2, 40, 50, [45, 12], 8, 3),  # runs of a sliding window
    (1, 2, 1, 16, 1100, [1099], None, None),  # a long cache: nine runs by default (merged)
    # merged in the launch (counters): rows whose positions fit in the first run (written by it alone) beside rows
    # that need several runs, grouped queries, a sliding window, the long cache
    (3, 8, 2, 32, 300, [0, 150, 299], None, "merged"),
    (2, 6, 2, 40, 300, [280, 12], 100, "merged"),
    (1, 2, 1, 16, 1100, [1099], None, "merged"),
]
for dtype in (torch.float32, torch.float16):
    for rows, heads, kv_heads, head_dim, capacity, positions, window, splits in cases:
        q = torch.randn(rows, heads, head_dim, generator=generator).to(dtype)
        keys = torch.randn(kv_heads, capacity, head_dim, generator=generator).to(dtype)
        values = torch.randn(kv_heads, capacity, head_dim, generator=generator).to(dtype)
        pos = torch.tensor(positions)
        merged = splits == "merged"  # the runs merged in the same launch (counters), the default runs
        counters = torch.zeros(rows * kv_heads, dtype=torch.int32) if merged else None
        got = fused.decode_attention(q, keys, values, pos, window, None if merged else splits, counters)
        if merged:
            assert counters.eq(0).all().item(), "the counters are back at zero"
        group = heads // kv_heads
        reference = torch.empty(rows, heads, head_dim, dtype=torch.float64)
        for r, p in enumerate(positions):
            first = 0 if window is None else max(0, p - window + 1)
            for h in range(heads):
                k, v = keys[h // group, first : p + 1].double(), values[h // group, first : p + 1].double()
                weights = torch.softmax(k @ q[r, h].double() / math.sqrt(head_dim), dim=0)
                reference[r, h] = weights @ v
        gap = (got.double().view(rows, heads, head_dim) - reference).abs().max().item()
        results.append([str(dtype), [rows, heads, kv_heads, head_dim, capacity, positions, window, splits],
                        got.shape == (rows, heads * head_dim) and got.dtype == dtype, gap])
# positions past the visible ones never count: garbage there changes nothing
q = torch.randn(1, 4, 32, generator=generator)
keys, values = torch.randn(4, 20, 32, generator=generator), torch.randn(4, 20, 32, generator=generator)
clean = fused.decode_attention(q, keys, values, torch.tensor([9]), None)
keys[:, 10:], values[:, 10:] = float("nan"), 1e6
results.append(["garbage", [1, 4, 4, 32, 20, [9], None], True,
                (fused.decode_attention(q, keys, values, torch.tensor([9]), None) - clean).abs().max().item()])
results.append(["garbage", [1, 4, 4, 32, 20, [9], None, 3], True,
                (fused.decode_attention(q, keys, values, torch.tensor([9]), None, 3) - clean).abs().max().item()])
print(json.dumps(results))
"""


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_fused_decode_attention_matches_a_float64_reference_in_the_interpreter():
    results = run_interpreted(ATTENTION_SCRIPT)
    assert len(results) == 2 * 10 + 2
    for dtype, case, shape_ok, gap in results:
        assert shape_ok, (dtype, case)
        assert gap <= (2e-3 if dtype == "torch.float16" else 1e-5), (dtype, case, gap)


STATIC_STEP_PRELUDE = r"""
import json, sys
import torch
from specter.config import EngineConfig
from specter.build import load_resident
from specter.model import fused
from specter.model.graphed import ResidentMoE, StaticStep


def counted(name):
    # fused.<name> wrapped to record each call in the returned list
    calls, original = [], getattr(fused, name)
    setattr(fused, name, lambda *args: calls.append(1) or original(*args))
    return calls


def tuned(model, **fields):
    # the model over the same weights with these KernelTuning (EngineConfig.tuning.kernels) fields changed: a new
    # Transformer, whose kernel tiers are chosen anew
    return type(model)(model.spec, model.w, exact=model.exact, row_bucket=model.bucket, max_context=model.max_context,
                       kernels=model.kernels.model_copy(update=fields))


def load(path, exact):
    return load_resident(path, EngineConfig(device="cpu", dtype="float32", max_context=32, exact=exact))


def static_step(loaded, model):
    return StaticStep(model, ResidentMoE(model, loaded.experts, "dense"), 4)
"""


def run_on_a_small_qwen(script: str, tmp_path) -> tuple[dict, int]:
    """`script` interpreted on a small saved qwen2_moe checkpoint (its path is argv[1]); its result and layer count."""
    import json

    from tests.hf_models import hf_model, save_hf

    path = save_hf(hf_model("qwen2_moe"), tmp_path / "m")
    return run_interpreted(script, str(path)), json.loads((path / "config.json").read_text())["num_hidden_layers"]


STATIC_ATTENTION_SCRIPT = STATIC_STEP_PRELUDE + r"""
path = sys.argv[1]
calls = counted("decode_attention")
result = {}
for exact in (True, False):
    loaded = load(path, exact)
    tokens, positions = torch.tensor([3, 1, 4, 1]), torch.arange(4)
    outputs = []
    for flag in (False, True):
        model = tuned(loaded.model, decode_attention=flag)
        outputs.append(static_step(loaded, model).hidden(tokens, positions, model.new_kv()))
    result["exact" if exact else "fast"] = {"calls": len(calls),
        "gap": ((outputs[1] - outputs[0]).abs().max() / outputs[0].abs().max()).item()}
    calls.clear()
    # the eager model's one-row step (the eager draft) takes the same kernel, and only with one row
    model, kv = loaded.model, loaded.model.new_kv()
    spec = model.spec
    kv.k.normal_(generator=torch.Generator().manual_seed(1))
    kv.v.normal_(generator=torch.Generator().manual_seed(2))
    q = torch.randn(2, spec.num_heads, spec.head_dim, generator=torch.Generator().manual_seed(3))
    eager = []
    for flag in (False, True):
        flagged = tuned(model, decode_attention=flag)
        eager.append([flagged._attend(0, q[:1], 7, kv), flagged._attend(0, q, 7, kv)])
    result["eager-exact" if exact else "eager-fast"] = {"calls": len(calls),
        "gap": max(((b - a).abs().max() / a.abs().max()).item() for a, b in zip(*eager))}
    calls.clear()
print(json.dumps(result))
"""


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_only_non_exact_one_row_steps_take_the_fused_attention_when_switched_on(tmp_path):
    result, layers = run_on_a_small_qwen(STATIC_ATTENTION_SCRIPT, tmp_path)
    assert result["exact"] == {"calls": 0, "gap": 0.0}  # exact mode keeps torch's ops even with the switch on
    assert result["fast"]["calls"] == layers, result  # once per layer with the switch on, never with it off
    assert result["fast"]["gap"] < 1e-4, result
    assert result["eager-exact"] == {"calls": 0, "gap": 0.0}
    assert result["eager-fast"]["calls"] == 1, result  # the one-row call; the two-row block keeps its masked path
    assert result["eager-fast"]["gap"] < 1e-4, result


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_fused_router_and_shared_gate_match_torch_in_the_interpreter():
    results = run_interpreted(ROUTER_SCRIPT)
    assert len(results) == 2 * (4 + 2 + 3 + 3)
    tolerance = {"torch.float32": 1e-5, "torch.bfloat16": 2.0**-7}
    for kind, dtype, shape, same, types_ok, gap in results:
        assert same and types_ok, (kind, dtype, shape)  # the same choice in the same order (or shapes and types)
        # the gate's dot is rounded to the dtype before its sigmoid: a one-ulp difference there moves the product
        assert gap <= (4 if kind == "gate" else 1) * tolerance[dtype], (kind, dtype, shape, gap)


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_fused_norm_and_rope_match_torch_in_the_interpreter():
    results = run_interpreted(SCRIPT)
    assert len(results) == 3 * (4 + 1 + 3)
    for kind, dtype, shape, shapes_ok, gap, tolerance in results:
        assert shapes_ok, (kind, dtype, shape)
        assert gap <= tolerance, (kind, dtype, shape, gap, tolerance)


DRAFT_SCRIPT = r"""
import asyncio, json, sys
import torch
from specter.config import EngineConfig
from specter.build import load_resident
from specter.model import fused

path = sys.argv[1]
exact = load_resident(path, EngineConfig(device="cpu", dtype="float32", max_context=32))
fast = load_resident(path, EngineConfig(device="cpu", dtype="float32", max_context=32, exact=False))
calls = {"norm": 0, "rope": 0, "router": 0, "gate": 0, "gated": 0}
functions = {"norm": "rms_norm", "rope": "rope", "router": "topk_softmax", "gate": "sigmoid_gate", "gated": "gated_silu"}
for name in calls:
    original = getattr(fused, functions[name])
    def counted(*args, _original=original, _name=name):
        calls[_name] += 1
        return _original(*args)
    setattr(fused, functions[name], counted)

async def hidden(loaded):
    kv = loaded.model.new_kv()
    return await loaded.model.forward(torch.tensor([3, 1, 4, 1, 5]), 0, kv, loaded.experts)

got_exact = asyncio.run(hidden(exact))
exact_calls = dict(calls)
got_fast = asyncio.run(hidden(fast))
print(json.dumps({"exact_calls": exact_calls, "fast_calls": calls,
                  "gap": ((got_fast - got_exact).abs().max() / got_exact.abs().max()).item()}))
"""


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_only_the_non_exact_forward_takes_the_fused_kernels(tmp_path, family):
    import json

    from tests.hf_models import hf_model, save_hf

    # qwen3_moe: qk-norm (every norm site of the standard attention), renormalised top-k; qwen2_moe: a gated shared expert
    path = save_hf(hf_model(family), tmp_path / "m")
    result = run_interpreted(DRAFT_SCRIPT, str(path))
    assert result["exact_calls"] == {"norm": 0, "rope": 0, "router": 0, "gate": 0, "gated": 0}  # exact: torch's ops
    config = json.loads((path / "config.json").read_text())
    layers = config["num_hidden_layers"]
    qk_norms = 2 if family == "qwen3_moe" else 0
    moe_layers = sum(1 for layer in range(layers) if layer not in config.get("mlp_only_layers", []))
    # per layer: input, (q, k) and post-attention norms, one rope, one router, a gated shared activation where there
    # is a gated shared expert (its gate is then a row of the packed product: no sigmoid_gate); the final norm is
    # the head's (not in forward)
    assert result["fast_calls"] == {"norm": (2 + qk_norms) * layers, "rope": layers, "router": moe_layers, "gate": 0,
                                    "gated": moe_layers if family == "qwen2_moe" else 0}, result
    assert result["gap"] < 1e-4, result


def test_the_fused_path_is_off_for_cpu_tensors_outside_the_interpreter():
    assert not fused.usable(torch.zeros(2)) or fused.moe_triton.interpreting()


ROPE_CACHE_SCRIPT = STATIC_STEP_PRELUDE + r"""
path = sys.argv[1]
calls = counted("rope_and_cache")
result = {}
for exact in (True, False):
    loaded = load(path, exact)
    tokens, positions = torch.tensor([3, 1, 4, 1]), torch.tensor([5, 6, 7, 9])  # a gap: position 8 stays unwritten
    outputs, caches = [], []
    for flag in (False, True):
        model = tuned(loaded.model, rope_writes_cache=flag)
        step = static_step(loaded, model)
        kv = model.new_kv()
        kv.k.fill_(7.0)
        kv.v.fill_(7.0)
        outputs.append(step.hidden(tokens, positions, kv))
        caches.append((kv.k.clone(), kv.v.clone()))
    result["exact" if exact else "fast"] = {
        "calls": len(calls),
        "same_output": bool(torch.equal(outputs[0], outputs[1])),
        "same_cache": bool(torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])),
        "untouched_kept": bool((caches[1][0][:, :, 8] == 7.0).all() and (caches[1][1][:, :, :5] == 7.0).all()),
    }
    calls.clear()
print(json.dumps(result))
"""


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_rope_and_cache_writes_the_same_kv_and_output_as_rope_plus_index_copy(tmp_path):
    result, layers = run_on_a_small_qwen(ROPE_CACHE_SCRIPT, tmp_path)
    assert result["exact"] == {"calls": 0, "same_output": True, "same_cache": True, "untouched_kept": True}
    assert result["fast"] == {"calls": layers, "same_output": True, "same_cache": True, "untouched_kept": True}, result
