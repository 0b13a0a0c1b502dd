"""EngineConfig.tuning.kernels.exact_rowwise: the exact forward (the target) takes the fused launches that compute each
row on its own (RMSNorm, RoPE, the router's softmax + top-k, the shared expert's gate, each row's attention over its
visible positions), its eager and static paths alike, and the exactness contract still holds: speculative output
equals plain decoding, greedy and seeded sampling, through the eager and the static verify. Run under Triton's interpreter (tests/interpreter.py), where the fused
launches run on the CPU; the GPU's own rounding is checked by the GPU tests with the switch on."""

from __future__ import annotations

import json

import pytest
import torch

from specter.quant.moe_triton import triton_available
from tests.interpreter import run_interpreted

SCRIPT = r"""
import asyncio, json, sys
import torch
from specter.config import DraftConfig, EngineConfig, GenerationConfig, KernelTuning, TuningConfig
from specter.build import load_resident
from specter.engine import Runtime
from specter.model import fused
from specter.model.graphed import ResidentMoE, StaticStep

path = sys.argv[1]
calls = {"rms_norm": 0, "rope": 0, "topk_softmax": 0, "sigmoid_gate": 0, "decode_attention": 0}
for name in calls:
    original = getattr(fused, name)
    def counted(*args, _original=original, _name=name):
        calls[_name] += 1
        return _original(*args)
    setattr(fused, name, counted)

def config(rowwise, k, static):
    return EngineConfig(device="cpu", dtype="float32", max_context=64, residents=2, static_verify=static,
                        tuning=TuningConfig(kernels=KernelTuning(exact_rowwise=rowwise)),
                        draft=DraftConfig(k=k, k_max=max(k, 1)))

async def decode(rowwise, k, static, sampled):
    generation = GenerationConfig(max_new_tokens=10, temperature=0.8 if sampled else 0.0, seed=5)
    async with await Runtime.load(path, config(rowwise, k, static)) as runtime:
        tiers = runtime.model.tiers
        result = await runtime.complete_ids([3, 1, 4, 1, 5, 9, 2, 6], generation)
        return result.tokens, {"norm": tiers.norm, "rope": tiers.rope, "router": tiers.router,
                                  "rope_writes_cache": tiers.rope_writes_cache, "packed_qkv": tiers.packed_qkv}

async def row_invariance(rowwise):
    # Each row of a forward over several rows, bit for bit the same row computed alone after the ones before it: the
    # eager exact forward (row blocks) and the static step (R rows, padding repeating the row), as verify and decode.
    # runs of 16 positions: a 64-position cache is cut into 4, so the merge launch runs too
    tuning = TuningConfig(kernels=KernelTuning(exact_rowwise=rowwise, positions_per_split=16))
    loaded = load_resident(path, EngineConfig(device="cpu", dtype="float32", max_context=64, tuning=tuning))
    model, tokens = loaded.model, torch.tensor([3, 1, 4, 1, 5])
    together = await model.forward(tokens, 0, model.new_kv(), loaded.experts)
    kv = model.new_kv()
    alone = [(await model.forward(tokens[i : i + 1], i, kv, loaded.experts))[0] for i in range(5)]
    step = StaticStep(model, ResidentMoE(model, loaded.experts, "dense"), 4)
    static_together = step.hidden(tokens[:4], torch.arange(4), model.new_kv())
    kv = model.new_kv()
    static_alone = [step.hidden(tokens[i : i + 1].repeat(4), torch.full((4,), i), kv)[0] for i in range(4)]
    long = None
    if sys.argv[2] == "all":  # a prompt longer than a row block (its attention in launches of row_bucket rows), in one call or two
        prompt = torch.arange(24) % 7 + 1
        whole = await model.forward(prompt, 0, model.new_kv(), loaded.experts)
        kv = model.new_kv()
        halves = torch.cat([await model.forward(prompt[:13], 0, kv, loaded.experts),
                            await model.forward(prompt[13:], 13, kv, loaded.experts)])
        long = bool(torch.equal(whole, halves))
    return {"long": long,
            "eager": [bool(torch.equal(together[i], alone[i])) for i in range(5)],
            "static": [bool(torch.equal(static_together[i], static_alone[i])) for i in range(4)],
            "fused_norm": model.tiers.norm, "calls": dict(calls)}

if sys.argv[2] == "rows":
    print(json.dumps({"rows": asyncio.run(row_invariance(True))}))
    sys.exit(0)
out = {"rows": asyncio.run(row_invariance(True))}
for static in (False, True):
    for sampled in (False, True):
        key = f"{'static' if static else 'eager'}-{'sampled' if sampled else 'greedy'}"
        plain, tiers = asyncio.run(decode(True, 0, static, sampled))
        speculative, _ = asyncio.run(decode(True, 3, static, sampled))
        out[key] = {"plain": plain, "speculative": speculative, "tiers": tiers}

# the target's own launches: a plain (k = 0) engine has no draft, so every fused call below is the target's
for name in calls:
    calls[name] = 0
asyncio.run(decode(True, 0, False, False))
out["target_calls_on"] = dict(calls)
for name in calls:
    calls[name] = 0
tokens_off, tiers_off = asyncio.run(decode(False, 0, False, False))
out["target_calls_off"] = dict(calls)
out["tiers_off"] = tiers_off
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    """The script's result on a small saved qwen2_moe checkpoint (one interpreter run), and its layer count."""
    from tests.hf_models import hf_model, save_hf

    path = save_hf(hf_model("qwen2_moe"), tmp_path_factory.mktemp("rowwise") / "m")
    return (run_interpreted(SCRIPT, str(path), "all", timeout=600),
            json.loads((path / "config.json").read_text())["num_hidden_layers"])


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_each_row_of_the_exact_forward_equals_that_row_alone_with_the_rowwise_launches(interpreted):
    rows = interpreted[0]["rows"]
    assert rows["fused_norm"] is True
    assert all(rows["eager"]) and all(rows["static"]) and rows["long"] is True, rows


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
@pytest.mark.parametrize("family, fused", [
    ("qwen3_moe", {"rms_norm", "rope", "topk_softmax", "decode_attention"}),  # a per-head q/k norm
    ("mixtral", {"rms_norm", "rope", "topk_softmax", "decode_attention"}),  # no shared expert
    ("phimoe-longrope", {"rope", "decode_attention"}),  # LayerNorm and sparsemixer routing: its own
    ("deepseek-v2", {"rms_norm"}),  # latent attention, its own RoPE and group-limited routing
])
def test_other_families_rows_equal_each_row_alone_with_the_rowwise_launches(tmp_path, family, fused):
    from tests.hf_models import hf_model, save_hf
    from tests.test_families_extra import hf_variant

    model = hf_variant(family) if family in ("phimoe-longrope", "deepseek-v2") else hf_model(family)
    rows = run_interpreted(SCRIPT, str(save_hf(model, tmp_path / "m")), "rows", timeout=300)["rows"]
    assert {name for name, count in rows["calls"].items() if count} == fused, rows["calls"]
    assert all(rows["eager"]) and all(rows["static"]), rows


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_the_exact_forward_on_rowwise_launches_keeps_speculation_exact(interpreted):
    out, layers = interpreted
    for key in ("eager-greedy", "eager-sampled", "static-greedy", "static-sampled"):
        run = out[key]
        assert len(run["plain"]) == 10 and run["speculative"] == run["plain"], (key, run)
        # the row-wise tiers only: the draft's one-launch rope-and-cache and packed products stay the draft's
        assert run["tiers"] == {"norm": True, "rope": True, "router": True, "rope_writes_cache": False,
                                "packed_qkv": False}, (key, run["tiers"])
    on, off = out["target_calls_on"], out["target_calls_off"]
    assert not any(off.values()), off  # the switch off: torch's ops
    assert on["rms_norm"] >= 2 * layers and on["rope"] >= layers and on["topk_softmax"] >= layers, on
    assert on["sigmoid_gate"] >= layers and on["decode_attention"] >= layers, on  # qwen2_moe's shared expert is gated
    assert out["tiers_off"]["norm"] is False and out["tiers_off"]["router"] is False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek-v2", "phimoe-longrope"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_speculation_stays_exact_on_cuda_with_the_rowwise_launches(tmp_path_factory, family, temperature):
    """On CUDA, offloaded, bf16: speculative output (the default draft-ahead and segmented static verify) equals k = 0
    with the exact forward on the row-wise launches, every family, greedy and seeded sampling. (The eager verify's
    exactness with them: the interpreter test above.)"""
    import asyncio

    from specter.config import DraftConfig, EngineConfig, GenerationConfig, KernelTuning, TuningConfig
    from specter.engine import Runtime
    from tests.test_speculative import checkpoint

    path = checkpoint(family, str(tmp_path_factory.mktemp("rowwise-gpu")))
    generation = GenerationConfig(max_new_tokens=16, temperature=temperature, seed=11)
    common = dict(device="cuda", dtype="bfloat16", max_context=96, residents=3,
                  tuning=TuningConfig(kernels=KernelTuning(exact_rowwise=True)))

    async def tokens(k: int) -> list[int]:
        draft = DraftConfig(k=k, quant="int8") if k else DraftConfig(k=0)
        async with await Runtime.load(path, EngineConfig(**common, draft=draft)) as runtime:
            assert runtime.model.tiers.exact_attention  # the switch reached the target
            return (await runtime.complete_ids([3, 1, 4, 1], generation)).tokens

    plain = asyncio.run(tokens(0))
    assert len(plain) == 16 and asyncio.run(tokens(4)) == plain
