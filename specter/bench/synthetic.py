"""Synthetic checkpoints at real shapes: random weights made straight in memory, served as a `WeightSource`.

Random weights give random routing (no locality), so these measure transfer and compute costs at the
real expert sizes, not acceptance. `layers` truncates the depth; every output carries the label.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import torch
from tqdm.auto import tqdm

import specter.model  # noqa: F401  (registers the extra families: phimoe, deepseek_v2)
from specter.errors import CheckpointError, ConfigError
from specter.model.spec import FAMILIES, ModelSpec, spec_from_config
from specter.model.weights import dense_numel, dense_shapes

Tensor = torch.Tensor

# config.json fields as Hugging Face publishes them (rope scaling left out: it changes no timing).
SHAPES: dict[str, dict[str, Any]] = {
    "qwen1.5-moe-a2.7b": dict(
        model_type="qwen2_moe", hidden_size=2048, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16,
        vocab_size=151936, num_experts=60, num_experts_per_tok=4, moe_intermediate_size=1408,
        shared_expert_intermediate_size=5632, intermediate_size=5632, norm_topk_prob=False, qkv_bias=True,
        decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=8192, tie_word_embeddings=False, torch_dtype="bfloat16",
    ),
    "mixtral-8x7b": dict(
        model_type="mixtral", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        vocab_size=32000, num_local_experts=8, num_experts_per_tok=2, intermediate_size=14336, rms_norm_eps=1e-5,
        rope_theta=1000000.0, max_position_embeddings=32768, tie_word_embeddings=False, torch_dtype="bfloat16",
    ),
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, vocab_size=151936, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
        intermediate_size=6144, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6,
        rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=False, torch_dtype="bfloat16",
    ),
    "olmoe-1b-7b": dict(
        model_type="olmoe", hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16,
        vocab_size=50304, num_experts=64, num_experts_per_tok=8, intermediate_size=1024, norm_topk_prob=False,
        rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=4096, tie_word_embeddings=False,
        torch_dtype="bfloat16",
    ),
    "phi-3.5-moe": dict(
        model_type="phimoe", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        vocab_size=32064, num_local_experts=16, num_experts_per_tok=2, intermediate_size=6400, rms_norm_eps=1e-5,
        rope_theta=10000.0, max_position_embeddings=131072, attention_bias=True, lm_head_bias=True,
        tie_word_embeddings=False, torch_dtype="bfloat16",
    ),
    "deepseek-v2-lite": dict(
        model_type="deepseek_v2", hidden_size=2048, num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16,
        vocab_size=102400, n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2, moe_intermediate_size=1408,
        first_k_dense_replace=1, moe_layer_freq=1, intermediate_size=10944, kv_lora_rank=512, q_lora_rank=None,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, topk_method="greedy", norm_topk_prob=False,
        routed_scaling_factor=1.0, scoring_func="softmax", rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=163840, tie_word_embeddings=False, torch_dtype="bfloat16",
    ),
}

DISTINCT_EXPERTS = 8
"""Random experts made per source; the rest repeat them (routing, sizes and copies are what timing needs)."""


def shape_config(name: str, layers: int | None = None) -> dict[str, Any]:
    """The config.json of a named real shape, truncated to `layers` decoder layers when given."""
    if name not in SHAPES:
        raise ConfigError(f"no synthetic shape named {name!r}; known shapes: {', '.join(SHAPES)}")
    config = copy.deepcopy(SHAPES[name])
    if layers is not None:
        if not 1 <= layers <= config["num_hidden_layers"]:
            raise ConfigError(f"--layers {layers} is outside 1..{config['num_hidden_layers']} for {name}")
        config["num_hidden_layers"] = layers
    return config


def family_available(name: str) -> bool:
    """Whether this engine has the model family of shape `name` (phimoe, deepseek_v2 arrive separately)."""
    return SHAPES[name]["model_type"] in FAMILIES


def shape_label(name: str, layers: int | None) -> str:
    """`name` or `name[L=4/32]`: the depth truncation shows in every table, file and plot."""
    full = SHAPES[name]["num_hidden_layers"]
    return name if layers is None or layers == full else f"{name}[L={layers}/{full}]"


class SyntheticWeights:
    """A WeightSource of random weights for a real shape: dense tensors made on the device, experts cycled.

    Dense weights are N(0, 1/fan_in) (norm weights 1, biases 0), so activations stay in range; routers are
    scaled up so routing is decisive. Experts come from a bank of `distinct` random experts made once.
    """

    def __init__(self, config: dict[str, Any], *, seed: int = 0, distinct: int = DISTINCT_EXPERTS, source: str = "synthetic") -> None:
        self.config = dict(config)
        self.spec: ModelSpec = spec_from_config(self.config, source)
        self.seed, self.distinct = seed, distinct
        self._bank: list[Tensor] = []

    def validate(self) -> None:
        if self.distinct < 1:
            raise CheckpointError(f"synthetic weights need at least one distinct expert, got {self.distinct}")

    def dense(self, dtype: torch.dtype, device: torch.device, progress: bool) -> dict[str, Tensor]:
        generator = torch.Generator(device=device).manual_seed(self.seed)
        shapes = dense_shapes(self.spec)
        dense = {}
        for name, shape in tqdm(shapes.items(), desc="synthetic dense", disable=not progress, unit="tensor"):
            dense[name] = self._dense_tensor(name, shape, dtype, device, generator)
        if self.spec.tie_word_embeddings and "lm_head.weight" not in dense:
            dense["lm_head.weight"] = dense["model.embed_tokens.weight"]
        return dense

    def _dense_tensor(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                      generator: torch.Generator) -> Tensor:
        if name.endswith(".bias"):
            return torch.zeros(shape, dtype=dtype, device=device)
        if len(shape) == 1:  # norm weights
            return torch.ones(shape, dtype=dtype, device=device)
        scale = 1.0 if name.endswith("embed_tokens.weight") else shape[-1] ** -0.5
        if name.endswith(".gate.weight"):
            scale *= 4.0  # decisive routers, as trained ones are
        tensor = torch.empty(shape, dtype=dtype, device=device)
        return tensor.normal_(0.0, scale, generator=generator)

    def experts(self, dtype: torch.dtype, progress: bool) -> Iterator[tuple[int, int, Tensor]]:
        spec = self.spec
        bank = self._expert_bank(dtype)
        total = len(spec.moe_layers) * spec.num_experts
        with tqdm(total=total, desc="synthetic experts", disable=not progress, unit="expert") as bar:
            for index, (layer, expert) in enumerate((l, e) for l in spec.moe_layers for e in range(spec.num_experts)):
                yield layer, expert, bank[index % len(bank)]
                bar.update(1)

    def _expert_bank(self, dtype: torch.dtype) -> list[Tensor]:
        """`distinct` packed experts [gate; up; down], made on the GPU when there is one (fast), kept on the host."""
        if not self._bank:
            spec = self.spec
            device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
            generator = torch.Generator(device=device).manual_seed(self.seed + 1)
            gate_up_numel = 2 * spec.expert_intermediate * spec.hidden_size
            for _ in range(self.distinct):
                flat = torch.empty(spec.expert_numel, dtype=dtype, device=device)
                flat[:gate_up_numel].normal_(0.0, spec.hidden_size**-0.5, generator=generator)
                flat[gate_up_numel:].normal_(0.0, spec.expert_intermediate**-0.5, generator=generator)
                self._bank.append(flat.cpu())
        return self._bank

    def close(self) -> None:
        self._bank = []


def synthetic_source(name: str, layers: int | None = None, seed: int = 0) -> SyntheticWeights:
    """The WeightSource of shape `name`; raises CheckpointError when its family is not in this engine yet."""
    config = shape_config(name, layers)
    if not family_available(name):
        raise CheckpointError(f"synthetic {name}: model family {config['model_type']!r} is not registered in this engine yet; skipped")
    return SyntheticWeights(config, seed=seed, source=f"synthetic {shape_label(name, layers)}")


def shape_bytes(spec: ModelSpec, element_size: int = 2) -> dict[str, int]:
    """Sizes of a shape without allocating it: one expert, all routed experts, and the dense weights."""
    dense = dense_numel(spec) * element_size
    expert = spec.expert_bytes(element_size)
    return {"expert_bytes": expert, "experts_bytes": expert * spec.num_experts * len(spec.moe_layers), "dense_bytes": dense}
