"""The MoE decoder forward, read top to bottom: embed, layers (attention, then experts or MLP), head.

Shape legend: T tokens in this forward, B row bucket, D hidden, H heads, Hkv kv heads, hd head dim,
S cache length, E experts, A active experts per token, I expert width, V vocabulary.

Exact mode (docs/ARCHITECTURE.md, "Exactness") makes every row's result independent of which other rows share the
forward: row-wise work runs on blocks of exactly B rows (padding rows are thrown away), attention runs
one query row at a time with the same code as a single-token step, and expert outputs are summed per
token in expert-id order. A forward over T rows then gives bit-identical logits and KV to T one-row
steps, which is what lets a k+1-row verify reproduce plain decoding token for token.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import ClassVar, Literal, Protocol

import torch
import torch.nn.functional as F

from specter.config import KernelTuning
from specter.model import fused, rowfused
from specter.model.kv import KVCache
from specter.model.spec import ModelSpec
from specter.model.tiers import KernelTiers
from specter.model.weights import swiglu

Tensor = torch.Tensor
ExpertMLP = Callable[[Tensor, Tensor], Tensor]


class ExpertProvider(Protocol):
    """Where routed-expert weights come from: all resident, an offloading cache, or a quantized draft."""

    async def run(self, layer: int, x: Tensor, ids: Tensor, weights: Tensor, mlp: ExpertMLP) -> Tensor:
        """Return sum_a weights[t, a] * expert_{ids[t, a]}(x[t]) for every row t, as [T, D].

        Called once per MoE layer per forward, in layer order. `mlp(rows, packed_expert)` computes one
        expert on some rows. Implementations must add contributions per token in ascending expert id
        (use `combine_in_expert_order`) so the result does not depend on arrival order.
        """
        ...


@dataclasses.dataclass(frozen=True)
class FamilySpec:
    """What a Transformer class declares about its forward, read by `declared` (the one place support is decided).

    attention: "standard" (q/k/v, rope, grouped heads over a KVCache) or "mla" (DeepSeek-V2's latent attention
      over a LatentKVCache); norm: "rms" (rms_norm) or "layer" (LayerNorm with bias); routing: "softmax_topk"
      (float32 softmax, top-A, optional renormalisation: the base class's route, shared expert, dense MLP and
      linear, which the draft's packed and one-row paths compute in their place), "sparsemixer" (Phi-MoE) or
      "group_limited" (DeepSeek's float32 gate, group-limited when configured, and its shared experts);
      static: whether graphed.StaticStep runs this family (through the family's `static_attention`).
    """

    attention: Literal["standard", "mla"] = "standard"
    norm: Literal["rms", "layer"] = "rms"
    routing: Literal["softmax_topk", "sparsemixer", "group_limited"] = "softmax_topk"
    static: bool = True


def declared(model: Transformer | type[Transformer]) -> FamilySpec | None:
    """The FamilySpec the model's own class declares (`family = FamilySpec(...)` in its body), or None: a subclass
    that does not declare its own is not assumed to keep its base's forward, so it runs the eager forward with
    torch's ops only (no static step, no packed or one-row draft paths)."""
    cls = model if isinstance(model, type) else type(model)
    found = cls.__dict__.get("family")
    return found if isinstance(found, FamilySpec) else None


class StaticMoE(Protocol):
    """Routed experts of one layer for R rows, without a host sync; per-token sums in ascending expert id."""

    def __call__(self, layer: int, h: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        """h [R, D], ids [R, A], weights [R, A] (device) -> [R, D]; row r depends only on row r's inputs."""
        ...


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm as Hugging Face computes it: statistics in float32, scale in the weight's dtype."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def combine_in_expert_order(num_rows: int, hidden: int, parts: dict[int, tuple[Tensor, Tensor]], like: Tensor) -> Tensor:
    """Sum weighted expert outputs into [T, D], adding per token in ascending expert id.

    parts: expert -> (row indices [n], weighted output [n, D]). Within one expert the rows are
    distinct, so each index_add touches a row once and the per-row addition order is the expert order.
    """
    out = torch.zeros(num_rows, hidden, dtype=like.dtype, device=like.device)
    for expert in sorted(parts):
        rows, values = parts[expert]
        out.index_add_(0, rows, values)
    return out


PACK_ROWS = 16
"""Packed tensors get zero rows up to a multiple of this: the packed product's output rows then start 16-byte
aligned, which cuBLAS's tensor-core kernels need (an unaligned pack, such as the Qwen shape's router + shared-expert
pack of 11,325 rows, falls back to a plain GEMV kernel off the tensor cores, well below the HBM rate)."""


def pack_projections(w: dict[str, Tensor], names: Sequence[str]) -> bool:
    """Make the projections `<name>.weight` (and their biases, when all have one) consecutive row blocks of
    one tensor, in place in `w`: each entry becomes a view of the packed tensor, values unchanged, so every
    reader of `w` (the target, and the draft that shares its dict) still finds its own tensors, and the draft can
    run the packed product in one launch (packed_projections). The packed tensor ends in zero rows up to a
    multiple of PACK_ROWS (their outputs are never read). A no-op when any is missing, when their shapes, dtypes
    or devices differ, or when they are packed already. Returns whether it packed."""
    weights = [w.get(f"{name}.weight") for name in names]
    if any(t is None or t.dim() != 2 for t in weights):
        return False
    first = weights[0]
    if any(t.shape[1] != first.shape[1] or t.dtype != first.dtype or t.device != first.device for t in weights):
        return False
    biases = [w.get(f"{name}.bias") for name in names]
    with_bias = all(b is not None for b in biases)
    if not with_bias and any(b is not None for b in biases):
        return False
    if packed_projections(w, names) is not None:
        return False
    groups = [("weight", weights)] + ([("bias", biases)] if with_bias else [])
    for kind, tensors in groups:
        rows_total = sum(t.shape[0] for t in tensors)  # type: ignore[union-attr]
        padding = -rows_total % PACK_ROWS
        pad = [tensors[0].new_zeros((padding, *tensors[0].shape[1:]))] if padding else []  # type: ignore[union-attr]
        packed = torch.cat([t.detach() for t in tensors] + pad)  # type: ignore[union-attr]
        offset = 0
        for name, tensor in zip(names, tensors):
            rows = tensor.shape[0]  # type: ignore[union-attr]
            w[f"{name}.{kind}"] = packed[offset : offset + rows]
            offset += rows
    return True


def packed_projections(w: dict[str, Tensor], names: Sequence[str]) -> tuple[Tensor, Tensor | None, tuple[int, ...]] | None:
    """(packed weight, packed bias or None, rows of each) when the projections `<name>.weight` are consecutive views
    of one tensor (pack_projections), else None. The packed tensors include their padding rows."""
    weights = [w.get(f"{name}.weight") for name in names]
    biases = [w.get(f"{name}.bias") for name in names]

    def packed(parts: list[Tensor | None]) -> Tensor | None:
        if any(t is None for t in parts):
            return None
        base = parts[0]._base  # type: ignore[union-attr]
        if base is None or not base.is_contiguous() or base.dim() != parts[0].dim():  # type: ignore[union-attr]
            return None
        offset = 0
        for part in parts:
            assert part is not None
            if part._base is not base or part.storage_offset() != base.storage_offset() + offset or not part.is_contiguous():
                return None
            offset += part.numel()
        width = base.numel() // base.shape[0]  # elements per row (1 for biases)
        rows = offset // width
        return base if base.shape[0] in (rows, rows + -rows % PACK_ROWS) else None  # with or without the padding

    weight = packed(weights)
    if weight is None:
        return None
    bias = packed(biases) if any(b is not None for b in biases) else None
    if bias is None and any(b is not None for b in biases):
        return None
    return weight, bias, tuple(t.shape[0] for t in weights)  # type: ignore[union-attr]


def finite_values(values: Tensor) -> Tensor:
    """The whole-cache attention's values with non-finite entries zeroed, in float16 only. It multiplies positions a
    row must not see (stale K/V beyond the committed length, later rows) by a probability of exactly 0, and 0 x inf
    is NaN: float16 overflows where a draft token's hidden state runs large (its K/V stay in the cache after a
    rejection, and after the request), which bfloat16's and float32's range do not. A position a row does see with a
    non-finite value is broken decoding either way (plain decoding's logits are NaN there too)."""
    return torch.nan_to_num(values, nan=0.0, posinf=0.0, neginf=0.0) if values.dtype == torch.float16 else values


class Transformer:
    """A loaded MoE decoder: non-expert weights by on-disk name, the spec, and the forward pass."""

    family: ClassVar[FamilySpec] = FamilySpec()  # qwen2_moe, qwen3_moe, mixtral, olmoe

    def __init__(self, spec: ModelSpec, dense: dict[str, Tensor], *, exact: bool = True, row_bucket: int = 16, max_context: int = 2048,
                 kernels: KernelTuning | None = None) -> None:
        self.spec = spec
        self._kernels = kernels or KernelTuning()  # EngineConfig.tuning.kernels: the fused paths (the draft's; exact_rowwise)
        self.w = dense
        self.exact = exact
        self.bucket = row_bucket
        self.max_context = max_context
        embed = dense["model.embed_tokens.weight"]
        self.device, self.dtype = embed.device, embed.dtype
        # which kernel each product runs (torch's ops, fused Triton, the one-row kernels): chosen here, once
        self.tiers = KernelTiers.choose(self._kernels, exact=exact, device=self.device, family=declared(self))
        self.cos, self.sin = self._rope_tables(max_context)
        # the eager one-row step's decode_attention counters, one set per layer (kernels.merge_in_launch; the graphed
        # step keeps its own)
        self.attention_counters = torch.zeros(spec.num_layers, spec.num_kv_heads, dtype=torch.int32, device=self.device)
        # key positions [S] for the static step's causal mask of a windowed model's full-attention layers (static_attention)
        self._key_positions: Tensor | None = torch.arange(max_context, device=self.device) if spec.full_attention_layers else None
        # The draft looks its packed tensors up once (_packed): the entries of `dense` are fixed from here on.
        self._packed: dict[tuple[str, int], tuple[Tensor, Tensor | None, tuple[int, ...]] | None] = {}
        packed_any = False
        for layer in range(spec.num_layers):
            for names in (self._qkv_names(layer), self._ffn_input_names(layer)):
                if names:
                    packed_any |= pack_projections(dense, names)
        if packed_any and self.device.type == "cuda":
            torch.cuda.empty_cache()  # the unpacked originals' blocks: too small for the next pack, kept reserved otherwise

    @property
    def kernels(self) -> KernelTuning:
        """EngineConfig.tuning.kernels as given at construction (read-only: the tiers were chosen from it; a forward
        with other kernels is another Transformer over the same weights)."""
        return self._kernels

    # ---- set-up -------------------------------------------------------------------------------
    def _rope_tables(self, length: int) -> tuple[Tensor, Tensor]:
        spec = self.spec
        inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, spec.head_dim, 2, dtype=torch.int64).float() / spec.head_dim))
        positions = torch.arange(length, dtype=torch.float32)
        if spec.rope_scaling is not None:  # linear scaling, the only kind the spec admits
            positions = positions / float(spec.rope_scaling["factor"])
        freqs = positions[:, None] * inv_freq[None, :]  # [S, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.device, self.dtype), emb.sin().to(self.device, self.dtype)

    def new_kv(self) -> KVCache:
        spec = self.spec
        return KVCache(spec.num_layers, spec.num_kv_heads, self.max_context, spec.head_dim, self.dtype, self.device)

    # ---- row blocks (exact mode) --------------------------------------------------------------
    def rows(self, fn: Callable[..., Tensor | tuple[Tensor, ...]], *tensors: Tensor) -> tuple[Tensor, ...]:
        """Apply a row-wise fn to blocks of exactly B rows (exact mode) or to all rows at once."""
        num_rows = tensors[0].shape[0]
        if not self.exact:
            out = fn(*tensors)
            return out if isinstance(out, tuple) else (out,)
        padded = -(-num_rows // self.bucket) * self.bucket
        if padded != num_rows:
            tensors = tuple(F.pad(t, (0, 0) * (t.dim() - 1) + (0, padded - num_rows)) for t in tensors)
        if padded == self.bucket:  # the common case (decode, verify): one block, nothing to concatenate
            out = fn(*tensors)
            return tuple(part[:num_rows] for part in (out if isinstance(out, tuple) else (out,)))
        blocks = []
        for start in range(0, padded, self.bucket):
            out = fn(*(t[start : start + self.bucket] for t in tensors))
            blocks.append(out if isinstance(out, tuple) else (out,))
        return tuple(torch.cat(parts)[:num_rows] for parts in zip(*blocks))

    def linear(self, x: Tensor, name: str) -> Tensor:
        bias = self.w.get(name + ".bias")
        return F.linear(x, self.w[name + ".weight"], bias)

    def plus_linear(self, residual: Tensor, x: Tensor, name: str) -> Tensor:
        """residual + linear(x, name): without a bias, in the draft one product with the residual as its addend (one
        launch fewer per call), or for one row the one-row kernel with the add in its epilogue."""
        if name + ".bias" in self.w:
            return residual + self.linear(x, name)
        if self.tiers.one_row(x):
            return rowfused.linear_residual(x, self.w[name + ".weight"], residual, self.tiers.row)
        if self.tiers.residual_addend:
            return torch.addmm(residual, x, self.w[name + ".weight"].t())
        return residual + self.linear(x, name)

    # ---- the forward --------------------------------------------------------------------------
    async def forward(self, tokens: Tensor, start: int, kv: KVCache, experts: ExpertProvider) -> Tensor:
        """Run T tokens at positions start..start+T-1, writing their KV; returns final hidden [T, D]."""
        assert start + tokens.shape[0] <= kv.capacity, f"positions up to {start + tokens.shape[0]} exceed the KV capacity {kv.capacity}"
        positions = torch.arange(start, start + tokens.shape[0], device=self.device)
        x = self.w["model.embed_tokens.weight"][tokens]  # [T, D]
        for layer in range(self.spec.num_layers):
            x = self.attention(layer, x, positions, start, kv)
            x = await self.feed_forward(layer, x, experts)
        return x

    def logits(self, hidden: Tensor) -> Tensor:
        """Final norm and LM head over some rows: [T, D] -> [T, V] in float32."""
        (out,) = self.rows(lambda h: F.linear(self.norm(h, "model.norm"), self.w["lm_head.weight"], self.w.get("lm_head.bias")), hidden)
        return out.float()

    def norm(self, x: Tensor, name: str) -> Tensor:
        """The model's normalisation layer `name` (RMSNorm here; families with LayerNorm override this).
        Where `tiers.norm` (the draft on CUDA; the target too with kernels.exact_rowwise): one fused launch instead of
        eight (specter.model.fused)."""
        if self.tiers.norm:
            return fused.rms_norm(x, self.w[name + ".weight"], self.spec.rms_eps)
        return rms_norm(x, self.w[name + ".weight"], self.spec.rms_eps)

    # ---- attention ----------------------------------------------------------------------------
    def attention(self, layer: int, x: Tensor, positions: Tensor, start: int, kv: KVCache) -> Tensor:
        prefix = f"{self.spec.layer_prefix(layer)}.self_attn"
        q, k, v = self.rows(lambda rows, pos: self._qkv(layer, prefix, rows, pos), x, positions)
        kv.write(layer, start, k, v)
        out = self._attend(layer, q, start, kv)  # [T, H*hd]
        (x,) = self.rows(lambda o, res: self.plus_linear(res, o, f"{prefix}.o_proj"), out, x)
        return x

    def _qkv(self, layer: int, prefix: str, x: Tensor, positions: Tensor, rotate: bool = True) -> tuple[Tensor, Tensor, Tensor]:
        """q [T, H, hd], k, v [T, Hkv, hd] of x at `positions`, q and k rotated unless `rotate` is False (the
        caller rotates them itself: fused.rope_and_cache)."""
        spec = self.spec
        norm_name = f"{spec.layer_prefix(layer)}.input_layernorm"
        packed = self._packed_qkv(layer) if self.tiers.packed_qkv else None
        if packed is not None and self.tiers.one_row(x):  # the draft step: the norm in the packed product's prologue
            weight, bias, sizes = packed
            q, k, v = rowfused.norm_linear(x, self.w[norm_name + ".weight"], spec.rms_eps, weight, bias, sum(sizes),
                                           self.tiers.row).split(sizes, dim=-1)
        elif packed is not None:  # the draft: one product over the packed weights (the target's own storage)
            h = self.norm(x, norm_name)
            weight, bias, sizes = packed
            q, k, v = F.linear(h, weight, bias)[:, : sum(sizes)].split(sizes, dim=-1)  # (padding rows dropped)
        else:
            h = self.norm(x, norm_name)
            q, k, v = (self.linear(h, f"{prefix}.{name}") for name in ("q_proj", "k_proj", "v_proj"))
        if spec.qk_norm == "full":
            q, k = self.norm(q, f"{prefix}.q_norm"), self.norm(k, f"{prefix}.k_norm")
        if spec.clip_qkv is not None:  # after the norms, as transformers' OLMoE clamps (every path computes q/k/v here)
            q, k, v = (t.clamp(-spec.clip_qkv, spec.clip_qkv) for t in (q, k, v))
        rows = x.shape[0]
        q = q.view(rows, spec.num_heads, spec.head_dim)
        k = k.view(rows, spec.num_kv_heads, spec.head_dim)
        v = v.view(rows, spec.num_kv_heads, spec.head_dim)
        if spec.qk_norm == "head":
            q, k = self.norm(q, f"{prefix}.q_norm"), self.norm(k, f"{prefix}.k_norm")
        if not rotate:
            return q, k, v
        if self.tiers.rope:  # the draft on CUDA (and the target with exact_rowwise): one launch for both rotations
            q, k = fused.rope(q, k, self.cos, self.sin, positions)
            return q, k, v
        cos, sin = self.cos[positions][:, None, :], self.sin[positions][:, None, :]  # [T, 1, hd]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        return q, k, v

    # ---- packed projections (the draft's products: one launch where the target runs several) ----------
    def _qkv_names(self, layer: int) -> tuple[str, ...]:
        prefix = f"{self.spec.layer_prefix(layer)}.self_attn"
        return tuple(f"{prefix}.{name}" for name in ("q_proj", "k_proj", "v_proj"))

    def _ffn_input_names(self, layer: int) -> tuple[str, ...]:
        """The products of a MoE layer's normalised input: router, shared gate, shared expert's gate and up (Qwen2-MoE's
        layout; families that route or share otherwise pack nothing here)."""
        spec = self.spec
        if not spec.shared_intermediate or layer in spec.dense_layers or not self._base_feed_forward():
            return ()
        shared = f"{spec.layer_prefix(layer)}.mlp.shared_expert"
        gate = (f"{spec.layer_prefix(layer)}.mlp.shared_expert_gate",) if spec.shared_gate else ()
        return (f"{shared}.gate_proj", f"{shared}.up_proj", spec.router_name(layer).removesuffix(".weight"), *gate)

    def _packed_qkv(self, layer: int) -> tuple[Tensor, Tensor | None, tuple[int, ...]] | None:
        """(weight [Nq+Nk+Nv, D], bias or None, (Nq, Nk, Nv)) of a layer whose q/k/v projections are views of one
        packed tensor (pack_projections did it at load), else None. Looked up once per layer."""
        if ("qkv", layer) not in self._packed:
            family = declared(self)  # the packed product stands for three calls of the base class's linear
            own = family is not None and family.attention == "standard"
            self._packed[("qkv", layer)] = packed_projections(self.w, self._qkv_names(layer)) if own else None
        return self._packed[("qkv", layer)]

    def packed_ffn_input(self, layer: int) -> tuple[Tensor, tuple[int, ...]] | None:
        """(weight, rows of each) of a MoE layer whose router and shared-expert input products are packed without
        biases (see _ffn_input_names), where the tiers pack them (the draft, with kernels.packed_ffn_input and
        router_and_gate: without the latter the draft runs torch's router and gate as the target does); else None."""
        if not self.tiers.packed_ffn_input:
            return None
        if ("ffn", layer) not in self._packed:
            names = self._ffn_input_names(layer)
            found = packed_projections(self.w, names) if names else None
            self._packed[("ffn", layer)] = None if found is None or found[1] is not None else found
        found = self._packed[("ffn", layer)]
        return None if found is None else (found[0], found[2])

    def packed_route(self, layer: int, h: Tensor, packed: tuple[Tensor, tuple[int, ...]]) -> tuple[Tensor, Tensor, Tensor]:
        """The non-exact MoE layer's input products in one launch: ids [T, A], weights [T, A] and the packed product
        [T, 2I + E (+ 1) + padding] (the shared expert's gate and up, the router's logits, its gate's logit), for
        packed_finish."""
        weight, sizes = packed
        product = F.linear(h, weight)
        inter2, experts = sizes[0] + sizes[1], sizes[2]
        ids, weights = self._select(product[:, inter2 : inter2 + experts], h.dtype)
        return ids, weights, product

    def packed_finish(self, layer: int, x: Tensor, routed: Tensor, product: Tensor) -> Tensor:
        """x + routed + the shared expert from the packed product (packed_route): the gated activation in one launch
        (the gate scales the activation instead of the output: the product is linear), then the down product added
        to the sum (plus_linear)."""
        inter, gated = self.spec.shared_intermediate, self.spec.shared_gate
        gate_logit = product[:, 2 * inter + self.spec.num_experts :][:, :1] if gated else None  # [T, 1]
        if self.tiers.gated_silu:  # (the packed product is the draft's alone)
            act = fused.gated_silu(product, inter, gate_logit)
        else:
            act = F.silu(product[:, :inter]) * product[:, inter : 2 * inter]
            if gate_logit is not None:
                act = act * torch.sigmoid(gate_logit)
        return self.plus_linear(x + routed, act, f"{self.spec.layer_prefix(layer)}.mlp.shared_expert.down_proj")

    def row_feed_forward(self, layer: int, x: Tensor, experts: object) -> Tensor | None:
        """The draft step's MoE layer (one row, non-exact) in three launches of specter.model.rowfused: the norm and the
        layer's input product (Qwen2-MoE: the packed shared gate/up, router and gate, the shared activation in the
        epilogue; without a shared expert: the router alone; its last router program takes the top-k), the routed
        experts' gate/up, then routed down (+ shared down) + residual together. None where that does not apply: more rows, the exact forward, a
        family with its own routing, shared expert or linear, a shared expert that packs nothing (packed_ffn_input),
        biases on the router or the shared down, experts rowfused does not take (rowfused.supports with the row tiles), or
        experts that do not offer `row_experts(layer) -> (QuantizedExperts, route counter [E], int32 [1] zero for
        rowfused.Select) | None` (the draft's DraftExperts does)."""
        if not self.tiers.one_row_moe(x) or layer in self.spec.dense_layers:
            return None
        spec = self.spec
        offer = getattr(experts, "row_experts", None)
        found = offer(layer) if offer is not None else None
        if found is None or spec.router_name(layer).removesuffix(".weight") + ".bias" in self.w:
            return None
        quantized, counts, sync = found
        tiles = self.tiers.row  # EngineConfig.tuning.kernels.row
        if not rowfused.supports(quantized, tiles):  # int8, int3, int2, odd shapes
            return None
        norm = self.w[f"{spec.layer_prefix(layer)}.post_attention_layernorm.weight"]
        select = None  # the router's top-k in the input product's launch (RowTiles.topk_in_router), else in gate/up's
        if tiles.topk_in_router:
            select = rowfused.Select.new(spec.num_experts, spec.top_k, spec.norm_topk_prob, sync, counts)
        int8 = tiles.int8_finish and rowfused.int8_finish_fits(quantized, tiles)  # gate/up's output in int8
        if not spec.shared_intermediate:
            h, logits = rowfused.norm_router(x, norm, spec.rms_eps, self.w[spec.router_name(layer)], tiles, select=select)
            routed, ids, weights, *q8 = rowfused.moe_gate_up(h, logits, quantized, spec.top_k, spec.norm_topk_prob,
                                                             counts, tiles, picks=select, int8_act=int8)  # fmt: skip
            return rowfused.moe_finish(x, routed, ids, weights, quantized, None, None, None, tiles,
                                       act_int8=q8[0] if q8 else None)  # fmt: skip
        packed = self.packed_ffn_input(layer)
        down = f"{spec.layer_prefix(layer)}.mlp.shared_expert.down_proj"
        if packed is None or down + ".bias" in self.w:
            return None
        weight, sizes = packed
        inter, num_experts = sizes[0], sizes[2]
        h, act, tail = rowfused.norm_ffn_input(x, norm, spec.rms_eps, weight, inter, sum(sizes[2:]), tiles, select=select)
        routed, ids, weights, *q8 = rowfused.moe_gate_up(h, tail[:, :num_experts], quantized, spec.top_k,
                                                         spec.norm_topk_prob, counts, tiles, picks=select, int8_act=int8)  # fmt: skip
        gate_logit = tail[:, num_experts : num_experts + 1] if spec.shared_gate else None
        return rowfused.moe_finish(x, routed, ids, weights, quantized, act, self.w[down + ".weight"], gate_logit, tiles,
                                   act_int8=q8[0] if q8 else None)

    def _base_feed_forward(self) -> bool:
        """Whether the family keeps the base class's routing, shared expert, dense MLP and linear (what the packed and
        one-row paths compute in their place)."""
        family = declared(self)
        return family is not None and family.routing == "softmax_topk"

    def _key_range(self, layer: int, position: int) -> tuple[int, int]:
        window = self.spec.window(layer)
        first = 0 if window is None or window <= 0 else max(0, position - window + 1)
        return first, position + 1

    def _attend(self, layer: int, q: Tensor, first_position: int, kv: KVCache) -> Tensor:
        """Attention of each query row over the cache up to its own position; [T, H, hd] -> [T, H*hd]."""
        if q.shape[0] == 1 and self.tiers.decode_attention:
            # the eager draft step attends as its graphed twin does (graphed.StaticStep: the same launch, the runs merged
            # in it with a counter per layer), so both propose alike
            positions = torch.arange(first_position, first_position + 1, device=q.device)
            counters = self.attention_counters[layer] if self.tiers.merge_in_launch else None
            splits = fused.split_count(kv.k[layer].shape[1], self.kernels)
            return fused.decode_attention(q, kv.k[layer], kv.v[layer], positions, self.spec.window(layer), splits, counters)
        if self.tiers.exact_attention:  # every row over its visible positions in one launch, as the static step does
            return self._attend_visible(q, torch.arange(first_position, first_position + q.shape[0], device=q.device),
                                        kv.k[layer], kv.v[layer], self.spec.window(layer))
        if self.exact or q.shape[0] == 1:
            return torch.cat([self._attend_row(layer, q[t], first_position + t, kv) for t in range(q.shape[0])])
        return self._attend_block(layer, q, first_position, kv)

    def _attend_visible(self, q: Tensor, positions: Tensor, keys: Tensor, values: Tensor, window: int | None) -> Tensor:
        """The exact forward's attention with kernels.exact_rowwise: each row q [T, H, hd] over the positions it sees
        (fused.decode_attention, its runs merged in a second launch): a row's result depends on its own query,
        position and keys only, so the eager forward and the static step give each row the same bits. At most
        `row_bucket` rows per launch: the runs' float32 partials grow with rows x heads x runs, and a long prompt's
        would outgrow the workspace the memory plan holds for one row block. `window`: the layer's (spec.window)."""
        splits = fused.split_count(keys.shape[1], self.kernels)
        if q.shape[0] <= self.bucket:
            return fused.decode_attention(q, keys, values, positions, window, splits, None)
        return torch.cat([fused.decode_attention(q[start : start + self.bucket], keys, values,
                                                 positions[start : start + self.bucket], window, splits, None)
                          for start in range(0, q.shape[0], self.bucket)])

    def _attend_row(self, layer: int, q: Tensor, position: int, kv: KVCache) -> Tensor:
        """One query row, the decode kernel: q [H, hd] -> [1, H*hd]."""
        spec = self.spec
        first, end = self._key_range(layer, position)
        keys, values = kv.keys(layer, first, end), kv.values(layer, first, end)  # [Hkv, L, hd]
        group = spec.num_heads // spec.num_kv_heads
        q = q.view(spec.num_kv_heads, group, spec.head_dim)  # [Hkv, G, hd]
        scores = torch.matmul(q, keys.transpose(1, 2)) * spec.head_dim**-0.5  # [Hkv, G, L]
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        return torch.matmul(probs, values).reshape(1, spec.num_heads * spec.head_dim)

    def _attend_block(self, layer: int, q: Tensor, first_position: int, kv: KVCache) -> Tensor:
        """Fast, non-exact path: all rows at once with a causal (and sliding-window) mask."""
        spec = self.spec
        rows = q.shape[0]
        end = first_position + rows
        keys, values = kv.keys(layer, 0, end), kv.values(layer, 0, end)
        query_pos = torch.arange(first_position, end, device=q.device)[:, None]
        key_pos = torch.arange(end, device=q.device)[None, :]
        allowed = key_pos <= query_pos
        window = spec.window(layer)
        if window:
            allowed &= key_pos > query_pos - window
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), keys, values, attn_mask=allowed, enable_gqa=spec.num_heads != spec.num_kv_heads
        )  # [H, T, hd]
        return out.transpose(0, 1).reshape(rows, spec.num_heads * spec.head_dim)

    # ---- the static step's attention (graphed.StaticStep: R rows at device positions, whole cache) ----
    def static_attention(self, layer: int, x: Tensor, positions: Tensor, blocked: Tensor, kv: KVCache, counters: Tensor) -> Tensor:
        """Attention of R rows at device positions [R] for graphed.StaticStep: KV written with index_copy_, every row
        over the whole cache [0, S) under `blocked` [1, R, 1, S] (graphed.py's principles 2-4: causal, within
        spec.sliding_window; a layer that spec.window leaves unwindowed masks causally itself); x [R, D] -> [R, D].
        The draft (non-exact, CUDA) ropes and writes in one launch and attends the visible positions only,
        merging its runs in the launch with `counters` [R*Hkv] (kernels.merge_in_launch)."""
        prefix = f"{self.spec.layer_prefix(layer)}.self_attn"
        if self.tiers.rope_writes_cache:  # the draft: one launch, no index_copy_
            q, k, v = self._qkv(layer, prefix, x, positions, rotate=False)
            q = fused.rope_and_cache(q, k, v, self.cos, self.sin, positions, kv.k[layer], kv.v[layer])
        else:
            q, k, v = self._qkv(layer, prefix, x, positions)  # [R, H, hd], [R, Hkv, hd] x 2
            kv.k[layer].index_copy_(1, positions, k.transpose(0, 1))
            kv.v[layer].index_copy_(1, positions, v.transpose(0, 1))
        window = self.spec.window(layer)
        if self.tiers.decode_attention:  # the draft: the visible positions only
            merged = counters if self.tiers.merge_in_launch else None
            splits = fused.split_count(kv.k[layer].shape[1], self.kernels)
            out = fused.decode_attention(q, kv.k[layer], kv.v[layer], positions, window, splits, merged)
        elif self.tiers.exact_attention:
            out = self._attend_visible(q, positions, kv.k[layer], kv.v[layer], window)
        else:
            if window != self.spec.sliding_window:  # a full-attention layer of a windowed model: `blocked` holds the window
                assert self._key_positions is not None, "made where the spec has full-attention layers"
                blocked = (self._key_positions[None, :] > positions[:, None])[None, :, None, :]
            out = self._attend_all(q, kv.k[layer], kv.v[layer], blocked)  # [R, H*hd]
        return self.plus_linear(x, out, f"{prefix}.o_proj")

    def _attend_all(self, q: Tensor, keys: Tensor, values: Tensor, blocked: Tensor) -> Tensor:
        """Every row over the whole cache [Hkv, S, hd]; rows of one GEMM, so each row is computed on its own."""
        spec = self.spec
        rows, kv_heads, head_dim = q.shape[0], spec.num_kv_heads, spec.head_dim
        group = spec.num_heads // kv_heads
        q = q.view(rows, kv_heads, group, head_dim).transpose(0, 1).reshape(kv_heads, rows * group, head_dim)
        scores = torch.matmul(q, keys.transpose(1, 2)) * head_dim**-0.5  # [Hkv, R*G, S]
        scores = scores.float().view(kv_heads, rows, group, -1).masked_fill(blocked, -math.inf)
        probs = torch.softmax(scores, dim=-1).to(q.dtype).view(kv_heads, rows * group, -1)
        out = torch.matmul(probs, finite_values(values))  # [Hkv, R*G, hd]
        return out.view(kv_heads, rows, group, head_dim).transpose(0, 1).reshape(rows, spec.num_heads * head_dim)

    # ---- feed-forward: routed experts, shared expert, or dense MLP ----------------------------
    async def feed_forward(self, layer: int, x: Tensor, experts: ExpertProvider) -> Tensor:
        spec = self.spec
        norm_name = f"{spec.layer_prefix(layer)}.post_attention_layernorm"
        if layer in spec.dense_layers:
            (x,) = self.rows(lambda r: r + self.dense_mlp(f"{spec.layer_prefix(layer)}.mlp", self.norm(r, norm_name)), x)
            return x
        row = self.row_feed_forward(layer, x, experts)
        if row is not None:  # the draft step: as graphed.StaticStep._feed_forward does it
            return row
        packed = self.packed_ffn_input(layer)
        if packed is not None:  # the draft: as graphed.StaticStep._feed_forward does it
            h = self.norm(x, norm_name)
            ids, weights, shared_input = self.packed_route(layer, h, packed)
            return self.packed_finish(layer, x, await experts.run(layer, h, ids, weights, self.expert_mlp), shared_input)
        h, ids, weights = self.rows(lambda r: self.route(layer, self.norm(r, norm_name)), x)
        shared = None
        if spec.shared_intermediate:  # launched before the routed experts, so it computes while misses load
            (shared,) = self.rows(lambda hh: self.shared_expert(layer, hh), h)
        routed = await experts.run(layer, h, ids, weights, self.expert_mlp)
        if shared is not None:
            (routed,) = self.rows(torch.add, routed, shared)
        (x,) = self.rows(torch.add, x, routed)
        return x

    def static_feed_forward(self, layer: int, x: Tensor, moe: StaticMoE) -> Tensor:
        """feed_forward for graphed.StaticStep: the same pieces over all R rows at once (no row blocks: the step's
        rows are the block), routed experts through `moe` without a host sync."""
        spec = self.spec
        norm_name = f"{spec.layer_prefix(layer)}.post_attention_layernorm"
        if layer in spec.dense_layers:
            return x + self.dense_mlp(f"{spec.layer_prefix(layer)}.mlp", self.norm(x, norm_name))
        row = self.row_feed_forward(layer, x, moe)
        if row is not None:  # the draft step: three launches (specter.model.rowfused, as the eager draft)
            return row
        packed = self.packed_ffn_input(layer)
        if packed is not None:  # the draft: router and shared expert's inputs in one product (as the eager draft)
            h = self.norm(x, norm_name)
            ids, weights, shared_input = self.packed_route(layer, h, packed)
            return self.packed_finish(layer, x, moe(layer, h, ids, weights), shared_input)
        h, ids, weights, shared = self.static_moe_input(layer, x)
        return self.static_moe_output(x, moe(layer, h, ids, weights), shared)

    def static_moe_input(self, layer: int, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """A MoE layer of the static step up to its routed experts, over its rows x [R, D]: the post-attention norm, the
        family's routing and its shared expert. Returns h [R, D], ids [R, A], weights [R, A] and the shared expert's
        output [R, D] (None without one). The segmented verify runs it before it awaits the routing."""
        h, ids, weights = self.route(layer, self.norm(x, f"{self.spec.layer_prefix(layer)}.post_attention_layernorm"))
        return h, ids, weights, self.shared_expert(layer, h) if self.spec.shared_intermediate else None

    @staticmethod
    def static_moe_output(x: Tensor, routed: Tensor, shared: Tensor | None) -> Tensor:
        """The MoE layer's output: its input x plus the routed experts' sum (plus the shared expert's output)."""
        return x + (routed if shared is None else routed + shared)

    def route(self, layer: int, h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Router: softmax over experts in float32, top-A, optional renormalisation. Returns h, ids [T, A], weights [T, A]."""
        logits = F.linear(h, self.w[self.spec.router_name(layer)])  # [T, E]
        ids, weights = self._select(logits, h.dtype)
        return h, ids, weights

    def _select(self, logits: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Top-A of the float32 softmax of router logits [T, E]: ids [T, A], weights [T, A] in `dtype`."""
        if self.tiers.router:  # the draft on CUDA (and the target with exact_rowwise): one launch
            return fused.topk_softmax(logits, self.spec.top_k, self.spec.norm_topk_prob, dtype)
        probs = torch.softmax(logits.float(), dim=-1)
        weights, ids = torch.topk(probs, self.spec.top_k, dim=-1)
        if self.spec.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights.to(dtype)

    def route_logits(self, layer: int, h: Tensor) -> Tensor:
        """Router logits for already-normalised rows (used by gate-based prediction)."""
        return F.linear(h, self.w[self.spec.router_name(layer)])

    def dense_mlp(self, prefix: str, h: Tensor) -> Tensor:
        gate, up = self.linear(h, f"{prefix}.gate_proj"), self.linear(h, f"{prefix}.up_proj")
        return self.linear(F.silu(gate) * up, f"{prefix}.down_proj")

    def shared_expert(self, layer: int, h: Tensor) -> Tensor:
        prefix = f"{self.spec.layer_prefix(layer)}.mlp"
        out = self.dense_mlp(f"{prefix}.shared_expert", h)
        if self.spec.shared_gate:
            gate = f"{prefix}.shared_expert_gate"
            if self.tiers.router and gate + ".bias" not in self.w:
                return fused.sigmoid_gate(h, self.w[gate + ".weight"], out)
            out = torch.sigmoid(self.linear(h, gate)) * out
        return out

    def expert_mlp(self, rows: Tensor, packed: Tensor) -> Tensor:
        """One routed expert over some rows [n, D] -> [n, D], in row blocks in exact mode; the host expert path runs it
        on one block of exactly `row_bucket` rows."""
        (out,) = self.rows(functools.partial(swiglu, packed=packed, hidden=self.spec.hidden_size,
                                             inter=self.spec.expert_intermediate), rows)
        return out


class RoutingTable:
    """One layer's routing on the host, with its row and top-A slot indices on the device.

    Built from the host copy of the router's ids [T, A]; the indices of every expert's rows travel to
    the device in one copy (pinned, non-blocking on CUDA) instead of two small blocking copies per expert.
    """

    def __init__(self, ids: Sequence[Sequence[int]], device: torch.device) -> None:
        pairs = sorted((expert, row, slot) for row, chosen in enumerate(ids) for slot, expert in enumerate(chosen))
        self.experts: list[int] = []
        self.bounds: dict[int, tuple[int, int]] = {}
        for index, (expert, _, _) in enumerate(pairs):
            if expert not in self.bounds:
                self.experts.append(expert)
                self.bounds[expert] = (index, index)
            self.bounds[expert] = (self.bounds[expert][0], index + 1)
        host = torch.tensor([[row for _, row, _ in pairs], [slot for _, _, slot in pairs]], dtype=torch.long)
        if device.type == "cuda":
            host = host.pin_memory()
        self._indices = host.to(device, non_blocking=True)  # [2, pairs]

    def rows(self, expert: int) -> tuple[Tensor, Tensor]:
        """Device (row indices, top-A slot indices) of the tokens that chose `expert`."""
        start, end = self.bounds[expert]
        return self._indices[0, start:end], self._indices[1, start:end]

    def weighted_output(self, expert: int, x: Tensor, weights: Tensor, mlp: ExpertMLP, packed: Tensor) -> tuple[Tensor, Tensor]:
        """(row indices, routing-weighted expert output) for `combine_in_expert_order`."""
        rows, slots = self.rows(expert)
        return rows, mlp(x[rows], packed) * weights[rows, slots, None]
