"""Phi-3.5-MoE (phimoe) and DeepSeek-V2 (deepseek_v2) against transformers on tiny random checkpoints:
logits and greedy tokens, exact mode, compressed MLA cache, config and bad-checkpoint errors.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from specter.config import EngineConfig
from specter.decode import greedy_decode, run_sync
from specter.errors import CheckpointError
from specter.build import load_resident
from specter.model.deepseek_v2 import LatentKVCache
from specter.model.spec import spec_from_config
from tests.hf_models import rewrite_config, save_hf
from tests.test_exact import rows_vs_steps

PROMPT = [3, 17, 42, 5, 88, 12, 7, 60]
_TINY = dict(vocab_size=96, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, max_position_embeddings=256,
             tie_word_embeddings=False)
_HEAD_PAIRS = 4  # phimoe head_dim 8 -> 4 rope frequencies

VARIANTS = {
    # Phi-3.5-MoE: biases everywhere, LongRoPE (short factors: the context stays within 128), a router
    # threshold wide enough that sparsemixer's softmax mixes several experts.
    "phimoe-longrope": ("phimoe", dict(num_key_value_heads=2, intermediate_size=24, num_local_experts=6, num_experts_per_tok=2,
                                       attention_bias=True, lm_head_bias=True, router_jitter_noise=0.3,
                                       rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                        "short_mscale": 1.1, "long_mscale": 1.3,
                                                        "short_factor": [1.0 + 0.2 * i for i in range(_HEAD_PAIRS)],
                                                        "long_factor": [2.0 + i for i in range(_HEAD_PAIRS)],
                                                        "original_max_position_embeddings": 128})),
    # The released configuration's router threshold (0.01), plain rope, no biases, a sliding window.
    "phimoe-plain": ("phimoe", dict(num_key_value_heads=2, intermediate_size=24, num_local_experts=6, num_experts_per_tok=2,
                                    router_jitter_noise=0.01, sliding_window=6)),
    # DeepSeek-V2: q LoRA, yarn rope with mscale_all_dim, group-limited gate, scaled weights, one dense layer.
    "deepseek-v2": ("deepseek_v2", dict(intermediate_size=48, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=3,
                                        n_shared_experts=2, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8,
                                        qk_rope_head_dim=4, v_head_dim=6, routed_scaling_factor=2.5, topk_method="group_limited_greedy",
                                        n_group=4, topk_group=2,
                                        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32,
                                                         "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.707,
                                                         "original_max_position_embeddings": 64})),
    # DeepSeek-V2-Lite: no q LoRA, plain rope, greedy gate, attention biases, two dense layers.
    "deepseek-lite": ("deepseek_v2", dict(intermediate_size=40, moe_intermediate_size=16, n_routed_experts=6, num_experts_per_tok=2,
                                          n_shared_experts=1, first_k_dense_replace=2, num_hidden_layers=4, kv_lora_rank=12,
                                          q_lora_rank=None, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=8, attention_bias=True)),
}


def hf_variant(variant: str, seed: int = 0):
    """A transformers model of the variant, weights normal(0, 0.15) except norms (as tests/hf_models.py)."""
    import transformers as tf

    family, overrides = VARIANTS[variant]
    config_cls, model_cls = {"phimoe": (tf.PhimoeConfig, tf.PhimoeForCausalLM),
                             "deepseek_v2": (tf.DeepseekV2Config, tf.DeepseekV2ForCausalLM)}[family]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**(_TINY | overrides))).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0, 0.15)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Each variant saved once, unsharded, for the tests that only read it."""
    root = tmp_path_factory.mktemp("families")
    return {variant: save_hf(hf_variant(variant), root / variant) for variant in VARIANTS}


def cpu(dtype: str = "float32", **fields) -> EngineConfig:
    return EngineConfig(device="cpu", dtype=dtype, max_context=fields.pop("max_context", 128), **fields)


# ---- parity with transformers -------------------------------------------------------------------
@pytest.mark.parametrize("variant,layout", [("phimoe-longrope", "sharded"), ("phimoe-plain", "single"),
                                            ("deepseek-v2", "sharded"), ("deepseek-lite", "single")])
def test_logits_and_greedy_match_transformers(variant, layout, tmp_path):
    hf = hf_variant(variant)
    path = save_hf(hf, tmp_path / variant, sharded=layout == "sharded")
    assert (path / "model.safetensors.index.json").exists() == (layout == "sharded")
    loaded = load_resident(path, cpu())
    with torch.no_grad():
        expected = hf(torch.tensor([PROMPT])).logits[0].float()
        hf_tokens = hf.generate(torch.tensor([PROMPT]), max_new_tokens=32, min_new_tokens=32, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, len(PROMPT):].tolist()
    got = loaded.model.logits(run_sync(loaded.model.forward(torch.tensor(PROMPT), 0, loaded.model.new_kv(), loaded.experts)))
    assert torch.allclose(got, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item()), (got - expected).abs().max()
    assert run_sync(greedy_decode(loaded.model, loaded.experts, PROMPT, 32)) == hf_tokens


def test_phimoe_router_matches_transformers_sparsemixer(saved):
    """Routing ids and weights per row, against transformers' router module on the same rows."""
    hf = hf_variant("phimoe-longrope")
    loaded = load_resident(saved["phimoe-longrope"], cpu())
    rows = torch.randn(40, 32)
    _, ids, weights = loaded.model.route(1, rows)
    with torch.no_grad():
        _, hf_weights, hf_ids = hf.model.layers[1].mlp.router(rows)
    assert torch.equal(ids, hf_ids) and torch.allclose(weights, hf_weights, rtol=1e-6, atol=1e-7)
    assert (weights < 0.999).any(), "the threshold should let sparsemixer mix experts in this test"


def test_phimoe_long_context_uses_long_factors(saved):
    """A context beyond original_max_position_embeddings gets transformers' long-factor frequencies and long_mscale."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = hf_variant("phimoe-longrope")
    model = load_resident(saved["phimoe-longrope"], cpu(max_context=200)).model
    long_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](hf.config, seq_len=129)
    angles = torch.arange(200, dtype=torch.float32)[:, None] * long_freq[None, :]
    assert torch.allclose(model.cos[:, :_HEAD_PAIRS], angles.cos() * 1.3, atol=1e-6)
    short = load_resident(saved["phimoe-longrope"], cpu(max_context=128)).model
    assert not torch.allclose(short.cos[:, :_HEAD_PAIRS], model.cos[:128, :_HEAD_PAIRS])


def test_deepseek_norm_topk_prob_renormalises_instead_of_scaling(saved, tmp_path):
    path = shutil.copytree(saved["deepseek-lite"], tmp_path / "m")
    rewrite_config(path, norm_topk_prob=True, routed_scaling_factor=3.0)
    _, _, weights = load_resident(path, cpu()).model.route(3, torch.randn(10, 32))
    assert torch.allclose(weights.sum(-1), torch.ones(10), atol=1e-6)


def test_deepseek_cache_holds_the_compressed_latent(saved):
    loaded = load_resident(saved["deepseek-v2"], cpu())
    spec, kv = loaded.spec, loaded.model.new_kv()
    assert isinstance(kv, LatentKVCache)
    assert kv.k.shape == (3, 1, 128, 16) and kv.v.shape == (3, 1, 128, 4)  # latent r, rope key dr per position
    assert kv.nbytes == 2 * spec.num_layers * spec.num_kv_heads * 128 * spec.head_dim * 4  # generic sizing is exact


def test_deepseek_fast_mode_stays_close_to_exact(saved):
    exact, fast = (load_resident(saved["deepseek-v2"], cpu(exact=flag)) for flag in (True, False))
    a, b = (m.model.logits(run_sync(m.model.forward(torch.tensor(PROMPT), 0, m.model.new_kv(), m.experts))) for m in (exact, fast))
    assert torch.allclose(a, b, rtol=1e-4, atol=1e-4)


# ---- exact mode -------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("variant", ["phimoe-longrope", "deepseek-v2", "deepseek-lite"])
def test_block_forward_is_bit_identical_to_single_steps(variant, dtype, saved):
    loaded = load_resident(saved[variant], cpu(dtype, max_context=96, row_bucket=8))
    for size in (2, 5, 9, 17):  # inside one bucket, exactly across buckets, and spanning three
        block_logits, step_logits, keys, values = rows_vs_steps(loaded, [1, 2, 3, 4, 5, 6], list(range(10, 10 + size)))
        assert torch.equal(block_logits, step_logits), f"logits differ for {size} rows"
        assert torch.equal(*keys) and torch.equal(*values), f"KV differs for {size} rows"


# ---- configs and bad checkpoints ----------------------------------------------------------------
def edit_tensors(path, fn) -> None:
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    fn(tensors)
    save_file(tensors, str(file))


def expect_error(path, *fragments) -> None:
    with pytest.raises(CheckpointError) as info:
        load_resident(path, cpu())
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


@pytest.mark.parametrize("variant,name", [("phimoe-longrope", "model.layers.1.input_layernorm.bias"),
                                          ("phimoe-longrope", "model.layers.2.block_sparse_moe.experts.3.w2.weight"),
                                          ("deepseek-v2", "model.layers.1.self_attn.kv_b_proj.weight"),
                                          ("deepseek-v2", "model.layers.2.mlp.shared_experts.up_proj.weight"),
                                          ("deepseek-lite", "model.layers.3.mlp.experts.5.down_proj.weight")])
def test_missing_tensor(variant, name, tmp_path):
    path = save_hf(hf_variant(variant), tmp_path / "m")
    edit_tensors(path, lambda t: t.pop(name))
    expect_error(path, name, "missing")


@pytest.mark.parametrize("variant,name,expected", [("phimoe-longrope", "lm_head.bias", "[96]"),
                                                   ("deepseek-v2", "model.layers.0.self_attn.kv_a_proj_with_mqa.weight", "[20, 32]"),
                                                   ("deepseek-lite", "model.layers.1.self_attn.q_proj.weight", "[40, 32]")])
def test_wrong_shape(variant, name, expected, tmp_path):
    path = save_hf(hf_variant(variant), tmp_path / "m")
    edit_tensors(path, lambda t: t.__setitem__(name, t[name][:-1]))
    expect_error(path, "model.safetensors", name, f"expected {expected}")


@pytest.mark.parametrize("variant,changes,fragments", [
    ("phimoe-plain", {"num_experts_per_tok": 3}, ("num_experts_per_tok = 3", "exactly 2")),
    ("phimoe-plain", {"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, ("'yarn'", "phimoe", "longrope")),
    ("phimoe-longrope", {"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0] * 4,
                                             "short_mscale": 1.0, "long_mscale": 1.0}}, ("short_factor has 1 entries", "4")),
    ("deepseek-lite", {"topk_method": "noaux_tc"}, ("'noaux_tc'", "group_limited_greedy")),
    ("deepseek-lite", {"rope_parameters": {"rope_type": "longrope"}}, ("'longrope'", "deepseek_v2", "yarn")),
    ("deepseek-lite", {"kv_lora_rank": None}, ("'kv_lora_rank'", "missing")),
])
def test_unsupported_or_missing_config(variant, changes, fragments, saved, tmp_path):
    path = shutil.copytree(saved[variant], tmp_path / "m")
    rewrite_config(path, **changes)
    expect_error(path, "config.json", *fragments)


PHI_35_MOE = {  # microsoft/Phi-3.5-MoE-instruct config.json, rope factor lists shortened to ones
    "model_type": "phimoe", "vocab_size": 32064, "hidden_size": 4096, "intermediate_size": 6400, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 16, "num_experts_per_tok": 2,
    "max_position_embeddings": 131072, "original_max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "sliding_window": 131072, "attention_bias": True, "lm_head_bias": True, "router_jitter_noise": 0.01, "input_jitter_noise": 0.01,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 32000,
    "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 64, "long_factor": [1.0] * 64, "short_mscale": 1.243163121016122,
                     "long_mscale": 1.243163121016122, "original_max_position_embeddings": 4096},
}
DEEPSEEK_V2_LITE = {  # deepseek-ai/DeepSeek-V2-Lite config.json
    "model_type": "deepseek_v2", "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408,
    "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16, "n_routed_experts": 64, "n_shared_experts": 2,
    "num_experts_per_tok": 6, "first_k_dense_replace": 1, "moe_layer_freq": 1, "kv_lora_rank": 512, "q_lora_rank": None,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
    "scoring_func": "softmax", "norm_topk_prob": False, "routed_scaling_factor": 1.0, "rms_norm_eps": 1e-6, "rope_theta": 10000,
    "max_position_embeddings": 163840, "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "bos_token_id": 100000, "eos_token_id": 100001,
    "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096},
}


def test_real_configs_read():
    phi = spec_from_config(PHI_35_MOE)
    assert (phi.num_experts, phi.top_k, phi.expert_intermediate, phi.head_dim, phi.rope_kind) == (16, 2, 6400, 128, "longrope")
    assert phi.expert_prefix == "block_sparse_moe" and phi.lm_head_bias and phi.qkv_bias and phi.o_bias
    lite = spec_from_config(DEEPSEEK_V2_LITE)
    assert (lite.num_experts, lite.top_k, lite.shared_intermediate, lite.moe_layers[0], lite.yarn["factor"]) == (64, 6, 2816, 1, 40.0)
    assert 2 * lite.num_kv_heads * lite.head_dim == 512 + 64  # the compressed cache per layer and position
