"""Exact widening (specter.bench.widen): a widened tiny checkpoint of every family computes the narrow one's function.

Both models load through specter's own loader (load_resident: Checkpoint, load_dense, iter_experts, the family's
Transformer). The bounds:
- float32: logits within 1e-5 of the largest logit (measured: at most 1.1e-6);
- bfloat16 (8 significant bits, so each rounding errs by up to 2^-9 relative and a tiny random model in bf16 is
  about 1 % off in its logits): the widened model in bf16 is no farther from the exact function (the narrow model in
  float32) than the narrow model in bf16 is, within a factor of 2, in RMS over all logits and in the median over
  positions of the largest error (measured: F = 2 bit-identical to the narrow bf16 logits; F = 3 at most 1.6x);
  where the two bf16 models' argmax differ, the exact top two logits are closer than the narrow bf16 model's own error;
- greedy tokens (float32, 16 steps) identical.
Meta-tests: widenings without the 1/F scale, or with the KV heads interleaved rather than tiled, fail the same check.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specter.bench import widen
from specter.bench.synthetic import SHAPES
from specter.config import EngineConfig
from specter.decode import greedy_decode, run_sync
from specter.errors import CheckpointError, ConfigError
from specter.build import load_resident
from specter.build import CheckpointWeights
from specter.model.checkpoint import Checkpoint
from specter.model.spec import spec_from_config
from tests.hf_models import hf_model, rewrite_config, save_fused, save_hf
from tests.test_families_extra import hf_variant

PROMPT = [3, 17, 42, 5, 88, 12, 7, 60]
STEPS = 16
FP32_TOLERANCE = 1e-5  # of the largest logit
BF16_FACTOR = 2.0  # widened bf16 error / narrow bf16 error, both against the narrow float32 logits

BUILDERS = {
    "mixtral": lambda path: save_fused(hf_model("mixtral"), path),  # transformers v5's fused 3-D experts
    "qwen2_moe": lambda path: save_hf(hf_model("qwen2_moe"), path),  # shared expert and its gate, a dense layer, q/k/v biases
    "qwen3_moe": lambda path: save_hf(hf_model("qwen3_moe", tie_word_embeddings=True), path),  # per-head q/k norms, tied
    "olmoe": lambda path: save_hf(hf_model("olmoe"), path),  # q/k norms over the whole projection, clip_qkv
    "phimoe": lambda path: save_hf(hf_variant("phimoe-longrope"), path),  # LayerNorm with biases, biased LM head, sparsemixer
    "deepseek_v2": lambda path: save_hf(hf_variant("deepseek-v2"), path),  # MLA with q LoRA, yarn, group-limited gate
    "deepseek_v2-lite": lambda path: save_hf(hf_variant("deepseek-lite"), path),  # MLA without q LoRA, attention biases
}


@pytest.fixture(scope="module")
def narrow(tmp_path_factory, one_thread):
    root = tmp_path_factory.mktemp("narrow")
    return {name: build(root / name) for name, build in BUILDERS.items()}


def run(path: Path, dtype: str, tokens: list[int]) -> tuple[torch.Tensor, list[int]]:
    """Logits [T, V] of `tokens` in one forward, and the greedy continuation of PROMPT (float32 only)."""
    loaded = load_resident(path, EngineConfig(device="cpu", dtype=dtype, max_context=64))
    model, experts = loaded.model, loaded.experts
    logits = model.logits(run_sync(model.forward(torch.tensor(tokens), 0, model.new_kv(), experts)))
    greedy = run_sync(greedy_decode(model, experts, PROMPT, STEPS)) if dtype == "float32" else []
    return logits, greedy


def fp32_gap(reference: torch.Tensor, other: torch.Tensor) -> float:
    return ((other - reference).abs().max() / reference.abs().max()).item()


def rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).pow(2).mean().sqrt().item()


def median_row_max(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().amax(-1).median().item()


@pytest.fixture(scope="module")
def reference(narrow):
    """Per family: the narrow greedy tokens, the sequence they make and its float32 and bf16 logits."""
    out = {}
    for name, path in narrow.items():
        _, tokens = run(path, "float32", PROMPT)
        sequence = PROMPT + tokens
        out[name] = (tokens, sequence, run(path, "float32", sequence)[0], run(path, "bfloat16", sequence)[0])
    return out


@pytest.mark.parametrize("factor", [2, 3])
@pytest.mark.parametrize("family", list(BUILDERS))
def test_widened_model_computes_the_narrow_function(family, factor, narrow, reference, tmp_path):
    tokens, sequence, exact, narrow_bf16 = reference[family]
    wide_path = widen.widen_checkpoint(narrow[family], tmp_path / "wide", factor)
    wide_spec = Checkpoint(wide_path).spec
    assert wide_spec.hidden_size == factor * Checkpoint(narrow[family]).spec.hidden_size
    wide32, wide_tokens = run(wide_path, "float32", sequence)
    wide_bf16, _ = run(wide_path, "bfloat16", sequence)
    print(f"{family} F={factor}: float32 max |d|/max|logit| {fp32_gap(exact, wide32):.2e}; bf16 RMS error wide "
          f"{rms(wide_bf16, exact):.4f} narrow {rms(narrow_bf16, exact):.4f}, wide vs narrow bf16 max "
          f"{(wide_bf16 - narrow_bf16).abs().max().item():.4f}")
    assert fp32_gap(exact, wide32) < FP32_TOLERANCE
    assert wide_tokens == tokens
    assert rms(wide_bf16, exact) <= BF16_FACTOR * rms(narrow_bf16, exact)
    assert median_row_max(wide_bf16, exact) <= BF16_FACTOR * median_row_max(narrow_bf16, exact)
    split = wide_bf16.argmax(-1) != narrow_bf16.argmax(-1)
    top2 = exact.topk(2, dim=-1).values
    assert ((top2[:, 0] - top2[:, 1])[split] <= (narrow_bf16 - exact).abs().max()).all(), "a bf16 argmax split away from a near tie"


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v2-lite"])
def test_widening_without_the_scale_is_caught(family, narrow, reference, tmp_path, monkeypatch):
    """The meta-test: the check above fails for a widening that forgets the 1/F of the linear maps."""
    monkeypatch.setattr(widen, "_scaled", lambda tensor, factor: tensor)
    wide, _ = run(widen.widen_checkpoint(narrow[family], tmp_path / "wrong", 2), "float32", reference[family][1])
    assert fp32_gap(reference[family][2], wide) > 100 * FP32_TOLERANCE


def test_interleaved_kv_heads_are_caught(narrow, reference, tmp_path, monkeypatch):
    """KV heads repeated in place (g0 g0 g1 g1) instead of tiled as a block (g0 g1 g0 g1) break the GQA mapping."""
    spec = Checkpoint(narrow["mixtral"]).spec
    tiled = widen.tensor_rule

    def interleaved(name, rule_spec):
        if not name.endswith(("k_proj.weight", "v_proj.weight")):
            return tiled(name, rule_spec)
        return lambda t, factor: widen.reader(t, factor).unflatten(0, (spec.num_kv_heads, spec.head_dim)) \
            .repeat_interleave(factor, dim=0).flatten(0, 1)

    monkeypatch.setattr(widen, "tensor_rule", interleaved)
    wide, _ = run(widen.widen_checkpoint(narrow["mixtral"], tmp_path / "wrong", 2), "float32", reference["mixtral"][1])
    assert fp32_gap(reference["mixtral"][2], wide) > 100 * FP32_TOLERANCE


# ---- real shapes ---------------------------------------------------------------------------------
NARROW_DIMS = {  # shape: (F, hidden, heads, kv heads, expert width, shared width, dense width, kv_lora_rank)
    "mixtral-8x7b": (8, 512, 4, 1, 1792, None, None, None),
    "phi-3.5-moe": (8, 512, 4, 1, 800, None, None, None),
    "qwen1.5-moe-a2.7b": (4, 512, 4, 4, 352, 1408, 1408, None),
    "deepseek-v2-lite": (4, 512, 4, 4, 352, None, 2736, 128),
    "qwen3-30b-a3b": (4, 512, 8, 1, 192, None, 1536, None),
    "olmoe-1b-7b": (4, 512, 4, 4, 256, None, None, None),
}
REAL_EXPERT_BYTES = {"mixtral-8x7b": 352_321_536, "phi-3.5-moe": 157_286_400, "qwen1.5-moe-a2.7b": 17_301_504,
                     "deepseek-v2-lite": 17_301_504, "qwen3-30b-a3b": 9_437_184, "olmoe-1b-7b": 12_582_912}  # bf16, 3 * I * D * 2


@pytest.mark.parametrize("shape", list(NARROW_DIMS))
def test_narrow_config_of_each_real_shape(shape):
    factor, hidden, heads, kv_heads, expert, shared, dense, latent = NARROW_DIMS[shape]
    real = SHAPES[shape]
    config = widen.shape_narrow_config(shape, vocab_size=256)
    assert factor == widen.DEFAULT_FACTORS[shape]
    assert (config["hidden_size"], config["num_attention_heads"], config.get("num_key_value_heads")) == (hidden, heads, kv_heads)
    width = config.get("moe_intermediate_size", config.get("intermediate_size"))
    assert (width, config.get("shared_expert_intermediate_size"), config.get("kv_lora_rank")) == (expert, shared, latent)
    assert "moe_intermediate_size" not in config or config["intermediate_size"] == dense
    kept = {key: value for key, value in real.items() if key not in widen.WIDTH_FIELDS + ("vocab_size",)}
    assert {key: config[key] for key in kept} == kept  # depth, experts, top-k, routing, head dims, norms, rope
    narrow_spec, real_spec = spec_from_config(config), spec_from_config(real)
    assert narrow_spec.head_dim == real_spec.head_dim or shape == "deepseek-v2-lite"
    assert widen.widen_config(config, factor) == {**real, "vocab_size": 256, "tie_word_embeddings": False}


@pytest.mark.parametrize("shape", ["mixtral-8x7b", "phi-3.5-moe", "qwen1.5-moe-a2.7b", "deepseek-v2-lite", "qwen3-30b-a3b"])
def test_widening_a_narrow_real_shape_gives_the_real_bytes(shape):
    """Shapes only (meta tensors): every widened tensor has the real shape, so bytes per expert and per layer are real."""
    factor = widen.DEFAULT_FACTORS[shape]
    config = widen.shape_narrow_config(shape, vocab_size=256)
    config["num_hidden_layers"] = 2  # the layers are alike past the first dense ones; two keep it fast
    narrow_sd = {name: torch.empty(dims, dtype=torch.bfloat16, device="meta")
                 for name, dims in widen.expected_shapes(spec_from_config(config)).items()}
    wide_sd, wide_config = widen.widen_state_dict(narrow_sd, config, factor)
    real = spec_from_config({**SHAPES[shape], "num_hidden_layers": 2, "vocab_size": 256})
    assert {name: tuple(t.shape) for name, t in wide_sd.items()} == widen.expected_shapes(real)
    per_layer = [sum(t.nbytes for name, t in wide_sd.items() if name.startswith(f"model.layers.{layer}.")) for layer in range(2)]
    assert per_layer == widen.layer_bytes(real)
    assert spec_from_config(wide_config).expert_bytes(2) == REAL_EXPERT_BYTES[shape]
    full = spec_from_config(SHAPES[shape])
    assert widen.layer_bytes(spec_from_config(widen.widen_config(widen.shape_narrow_config(shape), factor))) == widen.layer_bytes(full)


def test_bad_factors_are_refused_with_the_field_named():
    with pytest.raises(ConfigError, match="'num_key_value_heads' = 4 is not divisible by the factor 8"):
        widen.narrow_config(SHAPES["qwen3-30b-a3b"], 8)
    with pytest.raises(ConfigError, match="'hidden_size' = 4096 is not divisible by the factor 3"):
        widen.narrow_config(SHAPES["mixtral-8x7b"], 3)
    with pytest.raises(ConfigError, match="'kv_lora_rank' = 510 is not divisible by the factor 4"):
        widen.narrow_config({**SHAPES["deepseek-v2-lite"], "kv_lora_rank": 510}, 4)
    for factor in (0, -2, 2.0, True):
        with pytest.raises(ConfigError, match="whole number >= 1"):
            widen.narrow_config(SHAPES["mixtral-8x7b"], factor)
        with pytest.raises(ConfigError, match="whole number >= 1"):
            widen.widen_config(SHAPES["mixtral-8x7b"], factor)


def test_a_widened_checkpoint_without_a_declared_dtype_computes_in_its_stored_one(tmp_path):
    """As the engine reads the narrow checkpoint (its stored dtype when config.json declares none), so the widened
    one; an explicit dtype still wins."""
    src = tmp_path / "src"
    save_hf(hf_model("mixtral").to(torch.bfloat16), src)
    rewrite_config(src, torch_dtype=None, dtype=None)
    assert Checkpoint(src).spec.dtype == "bfloat16"
    assert widen.WidenedCheckpoint(src, 2).spec.dtype == "bfloat16"
    assert widen.WidenedCheckpoint(src, 2, torch.float32).spec.dtype == "float32"


# ---- the CLI and the on-disk layout --------------------------------------------------------------
def test_cli_widens_into_shards_and_copies_the_tokenizer(tmp_path, capsys):
    src = tmp_path / "src"
    save_hf(hf_model("mixtral"), src)  # per-expert tensors under block_sparse_moe, as released Mixtral checkpoints
    (src / "tokenizer.json").write_text("{}")
    dst = tmp_path / "dst"
    assert widen.main(["--factor", "2", "--src", str(src), "--dst", str(dst), "--shard-gb", str(40_000 / 2**30), "--dtype", "source"]) == 0
    assert (dst / "model.safetensors.index.json").is_file() and len(list(dst.glob("model-*-of-*.safetensors"))) > 1
    assert (dst / "tokenizer.json").read_text() == "{}"
    written, in_memory = Checkpoint(dst), widen.WidenedCheckpoint(src, 2)
    assert written.config == in_memory.config and set(written.index) == set(in_memory.index)
    assert all(torch.equal(written.tensor(name), in_memory.tensor(name)) for name in written.index)
    exact, _ = run(src, "float32", PROMPT)
    assert fp32_gap(exact, run(dst, "float32", PROMPT)[0]) < FP32_TOLERANCE
    source = CheckpointWeights(widen.WidenedCheckpoint(src, 2))  # the engine's loaders reading the widening directly
    assert all(torch.equal(t, written.tensor(name)) for name, t in source.dense(torch.float32, torch.device("cpu"), False).items())
    on_disk = list(CheckpointWeights(written).experts(torch.float32, False))
    assert all(torch.equal(a[2], b[2]) and a[:2] == b[:2] for a, b in zip(source.experts(torch.float32, False), on_disk, strict=True))

    assert widen.main(["--factor", "3", "--src", str(src), "--dst", str(tmp_path / "bf16")]) == 0  # bfloat16 by default
    assert Checkpoint(tmp_path / "bf16").spec.dtype == "bfloat16"
    assert Checkpoint(tmp_path / "bf16").tensor("lm_head.weight").dtype == torch.bfloat16

    assert widen.main(["--shape", "mixtral-8x7b", "--src", str(src), "--dst", str(tmp_path / "no")]) == 2
    assert "not mixtral-8x7b at 1/8 width: hidden_size = 32 (expected 512)" in capsys.readouterr().err
    assert widen.main(["--shape", "deepseek-v2-lite", "--factor", "8", "--narrow-config", "--vocab-size", "256"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert (printed["hidden_size"], printed["kv_lora_rank"], printed["vocab_size"]) == (256, 64, 256)


def test_a_tensor_without_a_rule_is_refused_not_copied():
    config = widen.shape_narrow_config("deepseek-v2-lite", vocab_size=256)
    config["num_hidden_layers"] = 2
    narrow_sd = {name: torch.empty(dims, device="meta") for name, dims in widen.expected_shapes(spec_from_config(config)).items()}
    narrow_sd["model.layers.1.mlp.gate.e_score_correction_bias"] = torch.empty(64, device="meta")  # DeepSeek-V3's, say
    with pytest.raises(CheckpointError, match="'model.layers.1.mlp.gate.e_score_correction_bias': no widening rule"):
        widen.widen_state_dict(narrow_sd, config, 4)


# ---- where widening runs: the same bits on every device -----------------------------------------
def _repeat(t: torch.Tensor, dim: int, factor: int) -> torch.Tensor:
    reps = [1] * t.dim()
    reps[dim] = factor
    return t.repeat(*reps)


def _first_scaled(t: torch.Tensor, factor: int) -> torch.Tensor:
    return t if factor == 1 else (t.double() / factor).to(t.dtype)


FIRST_RULES = {  # the rules as first written (one Tensor.repeat per dim, float64 division by a Python scalar, on the CPU)
    "embedding": lambda t, f: _repeat(t, 1, f),
    "linear": lambda t, f: _repeat(_repeat(_first_scaled(t, f), 0, f), 1, f),
    "reader": lambda t, f: _repeat(_first_scaled(t, f), 1, f),
    "tiled_vector": lambda t, f: _repeat(t, 0, f),
    "kept": lambda t, f: t,
    "fused_linear": lambda t, f: _repeat(_repeat(_first_scaled(t, f), 1, f), 2, f),
    "fused_gate_up": lambda t, f: torch.cat([FIRST_RULES["fused_linear"](half, f) for half in t.chunk(2, dim=1)], dim=1),
}


def first_widening(name: str, t: torch.Tensor, spec, factor: int) -> torch.Tensor:
    """The widening of the narrow `name` as the first implementation computed it (the reference: CPU, bit for bit)."""
    rule = widen.tensor_rule(name, spec)  # which rule a tensor takes is not under test here, only its arithmetic
    if rule.__qualname__.startswith("latent_then_rope"):
        latent = spec.kv_lora_rank
        rows = torch.cat([_repeat(t[:latent], 0, factor), t[latent:]], dim=0)
        return _repeat(_first_scaled(rows, factor), 1, factor) if t.dim() == 2 else rows
    return FIRST_RULES[rule.__name__](t, factor)


def check_widened_on(device: str, path: Path, factor: int, dtype: torch.dtype | None) -> int:
    """Every tensor of WidenedCheckpoint(path, F, dtype, device) is on `device`, contiguous, and equal bit for bit to
    the first implementation's widening on the CPU; returns how many tensors were compared."""
    narrow = Checkpoint(path)
    wide = widen.WidenedCheckpoint(path, factor, dtype, device)
    assert wide.device.type == torch.device(device).type
    for name in wide.names():
        source = "model.embed_tokens.weight" if wide.tied and name == "lm_head.weight" else name
        t = narrow.tensor(source)
        expected = first_widening(name, t if dtype is None else t.to(dtype), narrow.spec, factor)
        got = wide.tensor(name)
        assert got.device.type == torch.device(device).type and got.is_contiguous(), name
        assert (got.dtype, got.shape) == (expected.dtype, expected.shape), name
        assert torch.equal(got.cpu(), expected), f"'{name}' widened x{factor} on {device} differs from the first CPU widening"
    wide.close()
    return len(wide.names())


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("factor", [2, 3])
@pytest.mark.parametrize("family", list(BUILDERS))
def test_widening_on_the_cpu_is_the_first_implementations_bit_for_bit(family, factor, dtype, narrow):
    """The one-copy tiling and the device-tensor divisor change no bit: every tensor of every family, F = 2 (exact) and
    F = 3 (W/F rounded), in the checkpoint's float32 and cast to bfloat16."""
    assert check_widened_on("cpu", narrow[family], factor, dtype) > 0


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v2"])  # fused 3-D experts; MLA's latent-then-rope rows
def test_the_bit_check_catches_a_widening_without_the_scale(family, narrow, monkeypatch):
    monkeypatch.setattr(widen, "_scaled", lambda tensor, factor: tensor)
    with pytest.raises(AssertionError, match="differs from the first CPU widening"):
        check_widened_on("cpu", narrow[family], 2, torch.bfloat16)


def test_the_bit_check_catches_interleaved_tiles(narrow, monkeypatch):
    """Tiles as [a a b b] rather than [a b a b] (repeat_interleave): the same values, the wrong places."""
    def interleaved(t, dims, factor):
        for dim in [dims] if isinstance(dims, int) else dims:
            t = t.repeat_interleave(factor, dim=dim)
        return t

    monkeypatch.setattr(widen, "_tile", interleaved)
    with pytest.raises(AssertionError, match="differs from the first CPU widening"):
        check_widened_on("cpu", narrow["qwen2_moe"], 2, None)


@pytest.mark.parametrize("factor", [3, 5, 6, 7, 12])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_scaled_divides_as_first_written(factor, dtype):
    """`_scaled`'s divisor is a tensor on the operand's device (on CUDA a Python scalar divisor is a multiplication by its
    rounded reciprocal); on the CPU that is the same IEEE division, even where float64 keeps every bit of the quotient."""
    values = torch.randn(4096, generator=torch.Generator().manual_seed(factor), dtype=torch.float64).mul(100).to(dtype)
    assert torch.equal(widen._scaled(values, factor), _first_scaled(values, factor))


def test_the_widening_device(monkeypatch):
    assert widen.widen_device("cpu") == torch.device("cpu")
    assert widen.widen_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert widen.widen_device("auto") == torch.device("cpu")
    with pytest.raises(ConfigError, match="widening device 'cuda:0': CUDA is not available"):
        widen.widen_device("cuda:0")
