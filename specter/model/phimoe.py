"""Phi-3.5-MoE (`phimoe`): LayerNorm with biases, biased attention and LM head, sparsemixer top-2 routing
and LongRoPE, on top of the standard MoE decoder in transformer.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F

from specter.errors import CheckpointError
from specter.model.registry import register_transformer
from specter.model.spec import Defaults, ModelSpec, _common, _Fields, register_family
from specter.model.transformer import FamilySpec, Tensor, Transformer
from specter.model.weights import DENSE_SHAPES, standard_dense_shapes


@dataclasses.dataclass(frozen=True)
class PhimoeSpec(ModelSpec):
    """ModelSpec plus Phi-MoE's router threshold, LM-head bias and LongRoPE settings.

    rope_kind is "default" or "longrope"; for longrope the short factors and short_mscale apply when the
    context (EngineConfig.max_context) fits in original_max_position, the long ones otherwise.
    """

    router_jitter: float = 0.01  # sparsemixer keeps experts within a relative 2 * router_jitter of the best
    lm_head_bias: bool = False
    rope_kind: str = "default"
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    short_mscale: float = 1.0
    long_mscale: float = 1.0
    original_max_position: int = 0


PHIMOE = Defaults(rms_eps=1e-5, max_position=4096 * 32, rope_theta=1e6, kv_heads=8)  # transformers' PhimoeConfig
"""rms_eps: the LayerNorm eps, despite the field's name (rms_norm_eps)."""


def read_phimoe(fields: _Fields) -> PhimoeSpec:
    """Map a Phi-3.5-MoE config.json (transformers v4 or v5 spelling) to a PhimoeSpec."""
    common = _common(fields, PHIMOE)
    _, scaling = fields.rope()
    common.update(rope_scaling=None)
    top_k = fields.need("num_experts_per_tok")
    if top_k != 2:
        raise CheckpointError(f"{fields.source}: num_experts_per_tok = {top_k}, but phimoe's sparsemixer router always picks "
                              "exactly 2 experts; set it to 2")
    bias = fields.get("attention_bias", False, bool)
    return PhimoeSpec(
        family="phimoe", **common,
        num_experts=fields.need_any(("num_local_experts", "num_experts")), top_k=2,
        expert_intermediate=fields.need("intermediate_size"), dense_intermediate=0, norm_topk_prob=False,
        qkv_bias=bias, o_bias=bias, sliding_window=fields.get("sliding_window", None),
        expert_prefix="block_sparse_moe", expert_names=("w1", "w3", "w2"),
        router_jitter=fields.get("router_jitter_noise", 0.01, float), lm_head_bias=fields.get("lm_head_bias", False, bool),
        **_longrope(fields, scaling, common["head_dim"], common["max_position"]),
    )


def _longrope(fields: _Fields, scaling: dict[str, Any] | None, head_dim: int, max_position: int) -> dict[str, Any]:
    """The rope fields of PhimoeSpec; transformers validates that longrope configs carry both mscales."""
    if scaling is None:
        return {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind != "longrope":
        raise CheckpointError(f"{fields.source}: rope scaling type {kind!r} is not supported for phimoe; supported: default, longrope")
    rope = _Fields(scaling, f"{fields.source} (rope_scaling)")
    factors = {name: tuple(rope.typed(name, f, float) for f in rope.need(name, list)) for name in ("short_factor", "long_factor")}
    for name, values in factors.items():
        if len(values) != head_dim // 2:
            raise CheckpointError(f"{fields.source}: rope {name} has {len(values)} entries, expected head_dim / 2 = {head_dim // 2}")
    # transformers gives the top-level original_max_position_embeddings priority over the one in rope_scaling
    original = fields.get("original_max_position_embeddings", rope.get("original_max_position_embeddings", max_position))
    return dict(rope_kind="longrope", **factors, short_mscale=rope.need("short_mscale", float),
                long_mscale=rope.need("long_mscale", float), original_max_position=original)


def phimoe_dense_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """The standard tensors plus the LayerNorm biases and the optional LM-head bias."""
    assert isinstance(spec, PhimoeSpec), f"phimoe shapes need a PhimoeSpec, got {type(spec).__name__}"
    D = spec.hidden_size
    shapes = standard_dense_shapes(spec)
    shapes["model.norm.bias"] = (D,)
    for layer in range(spec.num_layers):
        prefix = spec.layer_prefix(layer)
        shapes[f"{prefix}.input_layernorm.bias"] = (D,)
        shapes[f"{prefix}.post_attention_layernorm.bias"] = (D,)
    if spec.lm_head_bias:
        shapes["lm_head.bias"] = (spec.vocab_size,)
    return shapes


def sparsemixer_pick(candidates: Tensor, scores: Tensor, jitter: float) -> tuple[Tensor, Tensor]:
    """One sparsemixer pick at inference: the best candidate [T, 1] and its weight [T, 1].

    The weight is the softmax over the candidates whose score lies within a relative 2 * jitter of the
    best one (the others are masked to -inf), taken at the best; this is transformers' eval path.
    """
    best, index = candidates.max(dim=-1, keepdim=True)
    factor = scores.abs().clamp(min=best)
    too_far = ((best - scores) / factor) > (2 * jitter)
    gates = torch.softmax(candidates.masked_fill(too_far, float("-inf")), dim=-1)
    return gates.gather(dim=-1, index=index), index


class PhimoeTransformer(Transformer):
    """Phi-3.5-MoE: LayerNorm (with bias) everywhere, sparsemixer routing, LongRoPE tables."""

    spec: PhimoeSpec
    family = FamilySpec(norm="layer", routing="sparsemixer")

    def _rope_tables(self, length: int) -> tuple[Tensor, Tensor]:
        spec = self.spec
        exponents = torch.arange(0, spec.head_dim, 2, dtype=torch.int64).float() / spec.head_dim
        inv_freq, mscale = 1.0 / (spec.rope_theta**exponents), 1.0
        if spec.rope_kind == "longrope":
            # One table for the whole context keeps every position's rope independent of the sequence
            # length; transformers switches factors when a sequence crosses original_max_position.
            long = length > spec.original_max_position
            factors = torch.tensor(spec.long_factor if long else spec.short_factor, dtype=torch.float32)
            inv_freq = 1.0 / (factors * spec.rope_theta**exponents)
            mscale = spec.long_mscale if long else spec.short_mscale
        freqs = torch.arange(length, dtype=torch.float32)[:, None] * inv_freq[None, :]  # [S, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * mscale).to(self.device, self.dtype), (emb.sin() * mscale).to(self.device, self.dtype)

    def norm(self, x: Tensor, name: str) -> Tensor:
        """nn.LayerNorm with weight and bias (Phi-MoE's `rms_norm_eps` is its LayerNorm eps)."""
        return F.layer_norm(x, (x.shape[-1],), self.w[name + ".weight"], self.w[name + ".bias"], self.spec.rms_eps)

    def route(self, layer: int, h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Sparsemixer top-2 in the model dtype, as transformers computes it: ids [T, 2], weights [T, 2]."""
        scores = F.linear(h, self.w[self.spec.router_name(layer)])  # [T, E]
        first_weight, first = sparsemixer_pick(scores, scores, self.spec.router_jitter)
        rest = torch.scatter(scores, -1, first, float("-inf"))
        second_weight, second = sparsemixer_pick(rest, scores, self.spec.router_jitter)
        return h, torch.cat((first, second), dim=-1), torch.cat((first_weight, second_weight), dim=-1)


register_family("phimoe", read_phimoe)
register_transformer("phimoe", PhimoeTransformer)
DENSE_SHAPES["phimoe"] = phimoe_dense_shapes
