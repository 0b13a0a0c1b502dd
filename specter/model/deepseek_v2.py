"""DeepSeek-V2 / V2-Lite (`deepseek_v2`): multi-head latent attention over a compressed KV cache, dense
first layers, shared experts and the (group-limited) softmax top-k gate, as transformers implements them.

Shape legend as in transformer.py, plus r kv latent (kv_lora_rank), dr rope part of a query/key head
(qk_rope_head_dim), dn its no-rope part (qk_nope_head_dim), dv value head (v_head_dim).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.nn.functional as F

from specter.config import KernelTuning
from specter.errors import CheckpointError
from specter.model.kv import KVCache
from specter.model.registry import register_transformer
from specter.model.spec import Defaults, ModelSpec, _common, _Fields, register_family
from specter.model.transformer import FamilySpec, Tensor, Transformer, finite_values, rms_norm
from specter.model.weights import DENSE_SHAPES, standard_dense_shapes

LORA_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm use the RMSNorm default, not rms_norm_eps


@dataclasses.dataclass(frozen=True)
class DeepseekSpec(ModelSpec):
    """ModelSpec plus multi-head latent attention and DeepSeek's gate.

    The cache holds r + dr numbers per layer and position (the compressed form), so num_kv_heads is 1
    and head_dim is (r + dr) / 2 rounded up to even: generic KV sizing, 2 * L * Hkv * S * hd, is then
    the compressed cache's size. Attention itself reads the MLA fields below, never head_dim.
    yarn holds transformers' yarn rope parameters, or None for plain rope.
    """

    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    attention_bias: bool = False
    routed_scaling_factor: float = 1.0
    topk_method: str = "greedy"  # "greedy" | "group_limited_greedy"
    n_group: int = 1
    topk_group: int = 1
    yarn: dict[str, Any] | None = None

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


# ---- reading config.json ------------------------------------------------------------------------
DEEPSEEK_V2 = Defaults(rms_eps=1e-6, max_position=2048)  # transformers' DeepseekV2Config


def read_deepseek_v2(fields: _Fields) -> DeepseekSpec:
    """Map a DeepSeek-V2 / V2-Lite config.json (transformers v4 or v5 spelling) to a DeepseekSpec. Where a field is
    left out, transformers' default (DeepseekV2Config): q_lora_rank 1536 and two shared experts; an explicit null
    q_lora_rank is no q LoRA (V2-Lite), a null n_shared_experts none."""
    common = _common(fields, DEEPSEEK_V2)
    _, scaling = fields.rope()
    latent, rope_dim = fields.need("kv_lora_rank"), fields.need("qk_rope_head_dim")
    common.update(rope_scaling=None, num_kv_heads=1, head_dim=-(-(latent + rope_dim) // 4) * 2)
    _refuse_unsupported(fields)
    moe_width = fields.need("moe_intermediate_size")
    return DeepseekSpec(
        family="deepseek_v2", **common,
        num_experts=fields.need_any(("n_routed_experts", "num_experts")), top_k=fields.need("num_experts_per_tok"),
        expert_intermediate=moe_width, dense_intermediate=fields.need("intermediate_size"),
        norm_topk_prob=fields.get("norm_topk_prob", False, bool),
        shared_intermediate=moe_width * fields.get_or_null("n_shared_experts", 2, 0),
        dense_layers=_dense_layers(fields, common["num_layers"]),
        q_lora_rank=fields.get_or_null("q_lora_rank", 1536, None), kv_lora_rank=latent, qk_nope_head_dim=fields.need("qk_nope_head_dim"),
        qk_rope_head_dim=rope_dim, v_head_dim=fields.need("v_head_dim"), attention_bias=fields.get("attention_bias", False, bool),
        routed_scaling_factor=fields.get("routed_scaling_factor", 1.0, float), **_gate_groups(fields),
        yarn=_yarn(fields, scaling, common["max_position"]),
    )


def _refuse_unsupported(fields: _Fields) -> None:
    if fields.get("mlp_bias", False, bool):
        raise CheckpointError(f"{fields.source}: mlp_bias = true is not supported for deepseek_v2 (released checkpoints have none)")
    scoring = fields.get("scoring_func", "softmax", str)
    if scoring != "softmax":
        raise CheckpointError(f"{fields.source}: scoring_func {scoring!r} is not supported for deepseek_v2; supported: softmax")


def _dense_layers(fields: _Fields, num_layers: int) -> frozenset[int]:
    """The first `first_k_dense_replace` layers, and layers off the `moe_layer_freq` stride, have a dense MLP."""
    first_moe, every = fields.get("first_k_dense_replace", 0), max(1, fields.get("moe_layer_freq", 1))
    return frozenset(layer for layer in range(num_layers) if layer < first_moe or layer % every != 0)


def _gate_groups(fields: _Fields) -> dict[str, Any]:
    method = fields.get("topk_method", "greedy", str)
    if method not in ("greedy", "group_limited_greedy"):
        raise CheckpointError(f"{fields.source}: topk_method {method!r} is not supported for deepseek_v2; "
                              "supported: greedy, group_limited_greedy")
    if method == "greedy":
        return dict(topk_method=method)
    experts, groups, chosen = fields.need_any(("n_routed_experts", "num_experts")), fields.need("n_group"), fields.need("topk_group")
    if experts % groups or not 1 <= chosen <= groups:
        raise CheckpointError(f"{fields.source}: group-limited routing needs n_group ({groups}) to divide the experts ({experts}) "
                              f"and 1 <= topk_group ({chosen}) <= n_group")
    return dict(topk_method=method, n_group=groups, topk_group=chosen)


def _yarn(fields: _Fields, scaling: dict[str, Any] | None, max_position: int) -> dict[str, Any] | None:
    if scaling is None:
        return None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind != "yarn":
        raise CheckpointError(f"{fields.source}: rope scaling type {kind!r} is not supported for deepseek_v2; supported: default, yarn")
    rope = _Fields(scaling, f"{fields.source} (rope_scaling)")
    # transformers gives the top-level original_max_position_embeddings priority over the one in rope_scaling
    original = fields.get("original_max_position_embeddings", rope.get("original_max_position_embeddings", max_position))
    return dict(
        factor=rope.get("factor", max_position / original, float), original_max_position=original,
        beta_fast=rope.get("beta_fast", 32.0, float) or 32.0, beta_slow=rope.get("beta_slow", 1.0, float) or 1.0,
        mscale=rope.get("mscale", 0.0, float), mscale_all_dim=rope.get("mscale_all_dim", 0.0, float),
        attention_factor=rope.get("attention_factor", None, float), truncate=rope.get("truncate", True, bool),
    )


def deepseek_dense_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every non-routed-expert tensor of DeepSeek-V2 and its shape, by on-disk name."""
    assert isinstance(spec, DeepseekSpec), f"deepseek_v2 shapes need a DeepseekSpec, got {type(spec).__name__}"
    return standard_dense_shapes(spec, attention=mla_shapes, shared_name="shared_experts")


def mla_shapes(spec: DeepseekSpec, prefix: str) -> dict[str, tuple[int, ...]]:
    D, H, r, dr = spec.hidden_size, spec.num_heads, spec.kv_lora_rank, spec.qk_rope_head_dim
    projections = {
        "kv_a_proj_with_mqa": (r + dr, D),
        "kv_b_proj": (H * (spec.qk_nope_head_dim + spec.v_head_dim), r),
        "o_proj": (D, H * spec.v_head_dim),
    }
    if spec.q_lora_rank is None:
        projections["q_proj"] = (H * spec.qk_head_dim, D)
    else:
        projections |= {"q_a_proj": (spec.q_lora_rank, D), "q_b_proj": (H * spec.qk_head_dim, spec.q_lora_rank)}
    shapes = {f"{prefix}.{name}.weight": shape for name, shape in projections.items()}
    shapes[f"{prefix}.kv_a_layernorm.weight"] = (r,)
    if spec.q_lora_rank is not None:
        shapes[f"{prefix}.q_a_layernorm.weight"] = (spec.q_lora_rank,)
    if spec.attention_bias:  # transformers puts biases on the down-projections and o_proj only
        biased = ("kv_a_proj_with_mqa", "o_proj") + (("q_a_proj",) if spec.q_lora_rank is not None else ())
        shapes |= {f"{prefix}.{name}.bias": (projections[name][0],) for name in biased}
    return shapes


# ---- rope: interleaved pairs, plain or yarn -----------------------------------------------------
def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(dim: int, base: float, yarn: dict[str, Any]) -> Tensor:
    """transformers' `_compute_yarn_parameters` inverse frequencies: interpolated below the ramp, extrapolated above."""
    def correction_dim(rotations: float) -> float:
        return (dim * math.log(yarn["original_max_position"] / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(yarn["beta_fast"]), correction_dim(yarn["beta_slow"])
    if yarn["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high  # no division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolated = 1 - ramp
    return (1.0 / (yarn["factor"] * pos_freqs)) * (1 - extrapolated) + (1.0 / pos_freqs) * extrapolated


def yarn_attention_factor(yarn: dict[str, Any]) -> float:
    """The factor yarn multiplies cos and sin by (so q.k by its square)."""
    if yarn["attention_factor"] is not None:
        return yarn["attention_factor"]
    if yarn["mscale"] and yarn["mscale_all_dim"]:
        return yarn_mscale(yarn["factor"], yarn["mscale"]) / yarn_mscale(yarn["factor"], yarn["mscale_all_dim"])
    return yarn_mscale(yarn["factor"])


def rope_interleaved(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate adjacent pairs (x[2i], x[2i+1]) by angle i in float32, like transformers' complex rope; [..., dr]."""
    pairs = x.float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2).to(x.dtype)


# ---- the compressed KV cache --------------------------------------------------------------------
class LatentKVCache(KVCache):
    """MLA's compressed cache: `k` [L, 1, S, r] the normalised kv latents, `v` [L, 1, S, dr] the rotated rope keys.

    Same interface as KVCache (write/keys/values/crop). It does not call KVCache.__init__, which would
    first allocate a full-size v only to free it again (device memory is planned up front).
    """

    def __init__(self, layers: int, capacity: int, latent_dim: int, rope_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.capacity = capacity
        self.k = torch.zeros(layers, 1, capacity, latent_dim, dtype=dtype, device=device)
        self.v = torch.zeros(layers, 1, capacity, rope_dim, dtype=dtype, device=device)
        self.length = 0

    @property
    def nbytes(self) -> int:
        return (self.k.numel() + self.v.numel()) * self.k.element_size()


def attend_latent(q_latent: Tensor, q_rope: Tensor, latents: Tensor, rope_keys: Tensor, blocked: Tensor, softmax_scale: float) -> Tensor:
    """MLA's absorbed attention of R rows over the whole latent cache: q [R, H, r] and [R, H, dr], cache [S, r] and
    [S, dr], blocked [R, 1, S] -> context [R, H, r]. Every (row, head) is a row of one GEMM, so rows are independent.

    The arithmetic of DeepseekV2Transformer._attend_latent_row: latent and rope scores summed, times the
    softmax scale (yarn's mscale included), softmax in float32, probabilities back in the model's dtype.
    """
    rows, heads, rank = q_latent.shape
    scores = q_latent.reshape(rows * heads, rank) @ latents.T + q_rope.reshape(rows * heads, -1) @ rope_keys.T  # [R*H, S]
    scores = (scores * softmax_scale).float().view(rows, heads, -1).masked_fill(blocked, -math.inf)
    probs = torch.softmax(scores, dim=-1).to(q_latent.dtype).view(rows * heads, -1)
    return (probs @ finite_values(latents)).view(rows, heads, rank)


# ---- the model ----------------------------------------------------------------------------------
class DeepseekV2Transformer(Transformer):
    """DeepSeek-V2: MLA with the kv_b projection absorbed into queries and outputs, DeepSeek's gate, shared experts."""

    spec: DeepseekSpec
    family = FamilySpec(attention="mla", routing="group_limited")

    def __init__(self, spec: ModelSpec, dense: dict[str, Tensor], *, exact: bool = True, row_bucket: int = 16,
                 max_context: int = 2048, kernels: KernelTuning | None = None) -> None:
        super().__init__(spec, dense, exact=exact, row_bucket=row_bucket, max_context=max_context, kernels=kernels)
        yarn = self.spec.yarn
        self.softmax_scale = self.spec.qk_head_dim**-0.5
        if yarn is not None and yarn["mscale_all_dim"]:
            self.softmax_scale *= yarn_mscale(yarn["factor"], yarn["mscale_all_dim"]) ** 2
        self.kv_up = {layer: self._split_kv_up(layer) for layer in range(self.spec.num_layers)}

    def _split_kv_up(self, layer: int) -> tuple[Tensor, Tensor]:
        """Views of kv_b_proj per head: W_uk [H, dn, r] (latent -> no-rope key) and W_uv [H, dv, r] (latent -> value)."""
        spec = self.spec
        weight = self.w[f"{spec.layer_prefix(layer)}.self_attn.kv_b_proj.weight"]
        per_head = weight.view(spec.num_heads, spec.qk_nope_head_dim + spec.v_head_dim, spec.kv_lora_rank)
        return per_head[:, : spec.qk_nope_head_dim], per_head[:, spec.qk_nope_head_dim :]

    def _rope_tables(self, length: int) -> tuple[Tensor, Tensor]:
        """cos and sin [S, dr/2] in float32 (transformers applies this rope in float32), times yarn's factor."""
        spec = self.spec
        dim = spec.qk_rope_head_dim
        if spec.yarn is None:
            inv_freq, scale = 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
        else:
            inv_freq, scale = yarn_inv_freq(dim, spec.rope_theta, spec.yarn), yarn_attention_factor(spec.yarn)
        freqs = torch.arange(length, dtype=torch.float32)[:, None] * inv_freq[None, :]
        return (freqs.cos() * scale).to(self.device), (freqs.sin() * scale).to(self.device)

    def new_kv(self) -> LatentKVCache:
        spec = self.spec
        return LatentKVCache(spec.num_layers, self.max_context, spec.kv_lora_rank, spec.qk_rope_head_dim, self.dtype, self.device)

    # ---- multi-head latent attention ----------------------------------------------------------
    def attention(self, layer: int, x: Tensor, positions: Tensor, start: int, kv: KVCache) -> Tensor:
        prefix = f"{self.spec.layer_prefix(layer)}.self_attn"
        q_latent, q_rope, latent, k_rope = self.rows(lambda rows, pos: self._mla_project(layer, prefix, rows, pos), x, positions)
        kv.write(layer, start, latent, k_rope)
        context = self._attend_latent(layer, q_latent, q_rope, start, kv)  # [T, H, r]
        (x,) = self.rows(lambda c, res: res + self._mla_output(layer, prefix, c), context, x)
        return x

    def _mla_project(self, layer: int, prefix: str, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Row-wise: queries in latent space [T, H, r], rotated query rope part [T, H, dr], latent [T, 1, r], rope key [T, 1, dr]."""
        spec = self.spec
        h = self.norm(x, f"{spec.layer_prefix(layer)}.input_layernorm")
        q = self._query(prefix, h).view(x.shape[0], spec.num_heads, spec.qk_head_dim)
        q_nope, q_rope = q.split([spec.qk_nope_head_dim, spec.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.linear(h, f"{prefix}.kv_a_proj_with_mqa").split([spec.kv_lora_rank, spec.qk_rope_head_dim], dim=-1)
        latent = rms_norm(latent, self.w[f"{prefix}.kv_a_layernorm.weight"], LORA_NORM_EPS)
        cos, sin = self.cos[positions][:, None, :], self.sin[positions][:, None, :]  # [T, 1, dr/2]
        q_rope, k_rope = rope_interleaved(q_rope, cos, sin), rope_interleaved(k_rope[:, None, :], cos, sin)
        q_latent = torch.einsum("thn,hnr->thr", q_nope, self.kv_up[layer][0])  # absorb W_uk: q_nope . (W_uk c) = (W_uk^T q_nope) . c
        return q_latent, q_rope, latent[:, None, :], k_rope

    def _query(self, prefix: str, h: Tensor) -> Tensor:
        if self.spec.q_lora_rank is None:
            return self.linear(h, f"{prefix}.q_proj")
        compressed = rms_norm(self.linear(h, f"{prefix}.q_a_proj"), self.w[f"{prefix}.q_a_layernorm.weight"], LORA_NORM_EPS)
        return self.linear(compressed, f"{prefix}.q_b_proj")

    def _mla_output(self, layer: int, prefix: str, context: Tensor) -> Tensor:
        """Row-wise: latent context [T, H, r] -> values per head via W_uv [T, H, dv] -> o_proj [T, D]."""
        values = torch.einsum("thr,hvr->thv", context, self.kv_up[layer][1])
        return self.linear(values.reshape(context.shape[0], -1), f"{prefix}.o_proj")

    def _attend_latent(self, layer: int, q_latent: Tensor, q_rope: Tensor, first_position: int, kv: KVCache) -> Tensor:
        """Each query row over the cached latents up to its own position: [T, H, r]."""
        if self.exact or q_latent.shape[0] == 1:
            rows = [self._attend_latent_row(layer, q_latent[t], q_rope[t], first_position + t, kv) for t in range(q_latent.shape[0])]
            return torch.stack(rows)
        return self._attend_latent_block(layer, q_latent, q_rope, first_position, kv)

    def _attend_latent_row(self, layer: int, q_latent: Tensor, q_rope: Tensor, position: int, kv: KVCache) -> Tensor:
        """One query row, the decode kernel: q_latent [H, r], q_rope [H, dr] -> context [H, r]."""
        latents, rope_keys = kv.keys(layer, 0, position + 1)[0], kv.values(layer, 0, position + 1)[0]  # [L, r], [L, dr]
        scores = (q_latent @ latents.T + q_rope @ rope_keys.T) * self.softmax_scale  # [H, L]
        probs = torch.softmax(scores.float(), dim=-1).to(q_latent.dtype)
        return probs @ latents

    def _attend_latent_block(self, layer: int, q_latent: Tensor, q_rope: Tensor, first_position: int, kv: KVCache) -> Tensor:
        """Fast, non-exact path: all rows at once with a causal mask."""
        end = first_position + q_latent.shape[0]
        latents, rope_keys = kv.keys(layer, 0, end)[0], kv.values(layer, 0, end)[0]
        scores = (torch.einsum("thr,lr->htl", q_latent, latents) + torch.einsum("thd,ld->htl", q_rope, rope_keys)) * self.softmax_scale
        query_pos = torch.arange(first_position, end, device=scores.device)[:, None]
        allowed = torch.arange(end, device=scores.device)[None, :] <= query_pos  # [T, L]
        probs = torch.softmax(scores.float().masked_fill(~allowed, float("-inf")), dim=-1).to(q_latent.dtype)
        return torch.einsum("htl,lr->thr", probs, latents)

    def static_attention(self, layer: int, x: Tensor, positions: Tensor, blocked: Tensor, kv: KVCache, counters: Tensor) -> Tensor:
        """attention at device positions [R] for graphed.StaticStep (principle 6), with the same projections (W_uk
        absorbed) and output (W_uv, o_proj): the latent and rope key written with index_copy_, every row's query over
        the whole cache under `blocked` [1, R, 1, S] (attend_latent). `counters` is the standard draft's, unused."""
        prefix = f"{self.spec.layer_prefix(layer)}.self_attn"
        # [R, H, r] queries with W_uk absorbed, [R, H, dr] rotated, [R, 1, r] normalised latent, [R, 1, dr] rotated rope key
        q_latent, q_rope, latent, k_rope = self._mla_project(layer, prefix, x, positions)
        kv.k[layer].index_copy_(1, positions, latent.transpose(0, 1))  # latents [1, S, r]
        kv.v[layer].index_copy_(1, positions, k_rope.transpose(0, 1))  # rotated rope keys [1, S, dr]
        context = attend_latent(q_latent, q_rope, kv.k[layer, 0], kv.v[layer, 0], blocked[0], self.softmax_scale)  # [R, H, r]
        return x + self._mla_output(layer, prefix, context)

    # ---- DeepSeek's gate and shared experts -----------------------------------------------------
    def route_logits(self, layer: int, h: Tensor) -> Tensor:
        """Router logits in float32, as transformers keeps DeepSeek's gate."""
        return F.linear(h.float(), self.w[self.spec.router_name(layer)].float())

    def route(self, layer: int, h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Softmax gate in float32, group-limited when configured, top-A; weights scaled or renormalised."""
        spec = self.spec
        scores = torch.softmax(self.route_logits(layer, h), dim=-1)  # [T, E]
        if spec.topk_method == "group_limited_greedy":
            scores = self._keep_top_groups(scores)
        weights, ids = torch.topk(scores, spec.top_k, dim=-1, sorted=False)
        if spec.norm_topk_prob and spec.top_k > 1:  # DeepSeek-V2's own code: renormalise or scale, not both
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        else:
            weights = weights * spec.routed_scaling_factor
        return h, ids, weights.to(h.dtype)

    def _keep_top_groups(self, scores: Tensor) -> Tensor:
        """Zero every expert outside the topk_group groups whose best expert scores highest."""
        spec = self.spec
        grouped = scores.view(scores.shape[0], spec.n_group, -1)  # [T, G, E/G]
        top_groups = torch.topk(grouped.max(dim=-1).values, spec.topk_group, dim=-1, sorted=False).indices
        keep = torch.zeros(scores.shape[0], spec.n_group, dtype=torch.bool, device=scores.device).scatter_(1, top_groups, True)
        return grouped.masked_fill(~keep[:, :, None], 0.0).view_as(scores)

    def shared_expert(self, layer: int, h: Tensor) -> Tensor:
        return self.dense_mlp(f"{self.spec.layer_prefix(layer)}.mlp.shared_experts", h)


register_family("deepseek_v2", read_deepseek_v2)
register_transformer("deepseek_v2", DeepseekV2Transformer)
DENSE_SHAPES["deepseek_v2"] = deepseek_dense_shapes
