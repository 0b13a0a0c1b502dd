"""Tiny random Hugging Face MoE checkpoints, built with transformers' own classes (never downloaded)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")

_COMMON = dict(vocab_size=96, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False)


def hf_config(family: str, **overrides):
    """A tiny config of the given family with every distinguishing feature switched on."""
    import transformers as tf

    if family == "mixtral":
        cfg = tf.MixtralConfig(**_COMMON, intermediate_size=48, num_local_experts=6, num_experts_per_tok=2)
    elif family == "qwen2_moe":
        cfg = tf.Qwen2MoeConfig(**_COMMON, intermediate_size=64, moe_intermediate_size=24, shared_expert_intermediate_size=40,
                                num_experts=6, num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[1])
    elif family == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(**_COMMON, intermediate_size=64, moe_intermediate_size=24, num_experts=6, num_experts_per_tok=2,
                                norm_topk_prob=True, head_dim=16)
    elif family == "olmoe":
        cfg = tf.OlmoeConfig(**_COMMON, intermediate_size=24, num_experts=6, num_experts_per_tok=2, norm_topk_prob=False, clip_qkv=4.0,
                             eos_token_id=95, pad_token_id=0)
    else:
        raise ValueError(family)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def hf_model(family: str, seed: int = 0, **overrides):
    import transformers as tf

    classes = {"mixtral": tf.MixtralForCausalLM, "qwen2_moe": tf.Qwen2MoeForCausalLM, "qwen3_moe": tf.Qwen3MoeForCausalLM,
               "olmoe": tf.OlmoeForCausalLM}
    torch.manual_seed(seed)
    model = classes[family](hf_config(family, **overrides)).eval()
    with torch.no_grad():  # larger-than-default weights so routing and logits are far from ties
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0, 0.15)
    return model


def save_hf(model, path: Path, sharded: bool = False) -> Path:
    model.save_pretrained(path, max_shard_size="20KB" if sharded else "2GB")
    return path


def save_fused(model, path: Path) -> Path:
    """The in-memory transformers v5 layout (experts fused as 3-D tensors), written as one safetensors file."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    model.config.to_json_file(path / "config.json")
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(path / "model.safetensors"))
    return path


def rewrite_config(path: Path, **changes) -> None:
    config_path = path / "config.json"
    config = json.loads(config_path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    config_path.write_text(json.dumps(config))
