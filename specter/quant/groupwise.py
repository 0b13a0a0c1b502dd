"""Weight-only group-wise quantization (int8/int4/int3/int2) along the input dim K, packed for the draft MoE kernel.

Format (shared by RTN, GPTQ, the torch reference and the Triton kernel):

1. Grid. Every format is symmetric and *mid-rise*: a stored code q in [-2^(b-1), 2^(b-1) - 1] means
   w = (q + 0.5) * scale. All 2^b levels are used (±0.5s ... ±(2^(b-1) - 0.5)s), which matters at 2 and 3
   bits (a mid-tread grid would leave int2 ternary). Exact zero is not a level; a group of zeros gets
   scale 0 and dequantizes to exactly 0.
2. Scale. scale = clip * absmax(group) / (2^(b-1) - 0.5), so the outermost level sits on the (clipped)
   absmax. clip = 1 for 8 and 4 bits (round to nearest, never clips); for 3 and 2 bits a per-group search
   over clip in [0.3, 1] picks the least squared error (absmax scaling wastes most levels on outliers at
   low bit widths). Scales are stored in the model dtype when it is fp16/bf16 and fp32 otherwise, and the
   codes are computed with the *stored* (rounded) scale so that round-to-nearest stays exact.
3. Scales are laid out group-major, [..., K // group, N], so a kernel tile of N rows reads them contiguously.
4. Packing along K (little end first): int8 one int8 per code; int4 two per uint8 (even k in the low
   nibble, code + 8); int2 four per uint8 (code + 2, 2 bits each); int3 eight per three uint8 bytes
   (code + 4, 3 bits each, a 24-bit little-endian word). Bytes per parameter, group 128 and 2-byte scales:
   int8 1.0156, int4 0.5156, int3 0.3906, int2 0.2656 (fp32 scales add 0.0156 more).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from specter.errors import ConfigError

SUPPORTED_BITS = (2, 3, 4, 8)
# Codes packed together along K: a packed unit never straddles a group or a row.
CODES_PER_UNIT = {8: 1, 4: 2, 3: 8, 2: 4}
BYTES_PER_UNIT = {8: 1, 4: 1, 3: 3, 2: 1}
CLIP_CANDIDATES = torch.linspace(1.0, 0.3, 15).tolist()


def check_bits(bits: int) -> None:
    """Raise ConfigError unless `bits` is a supported width."""
    if bits not in SUPPORTED_BITS:
        raise ConfigError(f"quantization bits={bits!r} is not supported; use one of {SUPPORTED_BITS}")


def resolve_group(k: int, group: int, bits: int) -> int:
    """The group size actually used for rows of length k (-1 means one group per row); validates it."""
    check_bits(bits)
    size = k if group == -1 else group
    unit = CODES_PER_UNIT[bits]
    if size <= 0 or k % size != 0:
        divisors = [g for g in (256, 128, 64, 32, 16, 8) if k % g == 0 and g % unit == 0][:3]
        raise ConfigError(
            f"quantization group={group} does not divide the input dimension K={k}; "
            f"use a divisor of {k} (e.g. {divisors or [k]}) or -1 for one group per row"
        )
    if size % unit != 0:
        raise ConfigError(
            f"int{bits} packs {unit} values together, so the group size must be a multiple of {unit} "
            f"(got group={size} for K={k}); pick a larger group or -1"
        )
    return size


def default_scale_dtype(weight_dtype: torch.dtype) -> torch.dtype:
    """Scales follow a half-precision model dtype; anything else stores fp32 scales."""
    return weight_dtype if weight_dtype in (torch.float16, torch.bfloat16) else torch.float32


def packed_bytes_per_row(k: int, bits: int) -> int:
    """Bytes one packed row of k codes takes."""
    return k // CODES_PER_UNIT[bits] * BYTES_PER_UNIT[bits]


@dataclass(frozen=True)
class QuantizedTensor:
    """One [N, K] weight, packed along K with group-major scales (see the module docstring)."""

    packed: Tensor  # [N, packed_bytes_per_row(K)] uint8 (int8 for 8 bits)
    scales: Tensor  # [K // group, N], fp16/bf16/fp32
    bits: int
    group: int  # resolved: K when quantized per row
    shape: tuple[int, int]  # (N, K)

    @property
    def nbytes(self) -> int:
        """Bytes of packed codes plus scales."""
        return self.packed.numel() * self.packed.element_size() + self.scales.numel() * self.scales.element_size()


# ---------------------------------------------------------------------------------------------------------
# scales and codes


def level_limit(bits: int) -> float:
    """The outermost level in units of scale: 2^(b-1) - 0.5."""
    return 2 ** (bits - 1) - 0.5


def codes_from_scales(w: Tensor, scales: Tensor, bits: int) -> Tensor:
    """Nearest mid-rise codes of w [..., G, group] for per-group scales [..., G]; int8 codes."""
    safe = torch.where(scales == 0, torch.ones_like(scales), scales)
    low, high = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    # Levels sit at half-integers of the scale, and floor(x) + 0.5 is the half-integer nearest to x.
    ratio = (w / safe[..., None]).clamp(low, high + 1)
    truncated = ratio.to(torch.int32)  # floor by hand: torch.floor is ~500x slower on some CPU builds
    floored = truncated - (ratio < truncated).to(torch.int32)
    return floored.clamp(low, high).to(torch.int8)


def levels_from_codes(codes: Tensor, scales: Tensor) -> Tensor:
    """Dequantized values (q + 0.5) * scale for codes [..., G, group] and scales [..., G]; fp32."""
    return (codes.float() + 0.5) * scales.float()[..., None]


def choose_scales(w: Tensor, bits: int, scale_dtype: torch.dtype, clip_search: bool) -> Tensor:
    """Per-group scales [..., G] for fp32 groups w [..., G, group], already rounded to scale_dtype."""
    absmax = w.abs().amax(dim=-1)
    best = (absmax / level_limit(bits)).to(scale_dtype).float()
    if not clip_search:
        return best
    best_error = _group_sq_error(w, best, bits)
    for clip in CLIP_CANDIDATES[1:]:
        candidate = (absmax * clip / level_limit(bits)).to(scale_dtype).float()
        error = _group_sq_error(w, candidate, bits)
        better = error < best_error
        best = torch.where(better, candidate, best)
        best_error = torch.where(better, error, best_error)
    return best


def _group_sq_error(w: Tensor, scales: Tensor, bits: int) -> Tensor:
    """Squared quantization error per group for trial scales."""
    levels = levels_from_codes(codes_from_scales(w, scales, bits), scales)
    return (levels - w).square().sum(dim=-1)


def quantize_codes(
    w: Tensor, bits: int, group: int, scale_dtype: torch.dtype | None = None, clip_search: bool | None = None
) -> tuple[Tensor, Tensor, int]:
    """Round-to-nearest codes [..., N, K] (int8), scales [..., G, N] and the resolved group, for w [..., N, K]."""
    k = w.shape[-1]
    group = resolve_group(k, group, bits)
    scale_dtype = scale_dtype or default_scale_dtype(w.dtype)
    clip_search = bits <= 3 if clip_search is None else clip_search
    grouped = w.float().reshape(*w.shape[:-1], k // group, group)  # [..., N, G, group]
    scales = choose_scales(grouped, bits, scale_dtype, clip_search)  # [..., N, G]
    codes = codes_from_scales(grouped, scales, bits).reshape(w.shape)
    return codes, scales.to(scale_dtype).transpose(-1, -2).contiguous(), group


# ---------------------------------------------------------------------------------------------------------
# packing


def pack_codes(codes: Tensor, bits: int) -> Tensor:
    """Pack signed codes [..., K] along K into the stored layout (see the module docstring)."""
    if bits == 8:
        return codes.to(torch.int8).contiguous()
    unsigned = (codes.to(torch.int32) + 2 ** (bits - 1)).reshape(*codes.shape[:-1], -1, CODES_PER_UNIT[bits])
    shifts = torch.arange(CODES_PER_UNIT[bits], device=codes.device, dtype=torch.int32) * bits
    words = (unsigned << shifts).sum(dim=-1)  # disjoint bit fields, so the sum is a bitwise or
    if bits == 3:
        byte_shifts = torch.tensor([0, 8, 16], device=codes.device, dtype=torch.int32)
        words = (words[..., None] >> byte_shifts) & 0xFF  # [..., K/8, 3] little-endian bytes
    return words.to(torch.uint8).reshape(*codes.shape[:-1], -1).contiguous()


def unpack_codes(packed: Tensor, bits: int, k: int) -> Tensor:
    """Inverse of pack_codes: signed int8 codes [..., K]."""
    if bits == 8:
        return packed.to(torch.int8)
    words = packed.to(torch.int32)
    if bits == 3:
        bytes3 = words.reshape(*packed.shape[:-1], -1, 3)
        words = bytes3[..., 0] | (bytes3[..., 1] << 8) | (bytes3[..., 2] << 16)
    shifts = torch.arange(CODES_PER_UNIT[bits], device=packed.device, dtype=torch.int32) * bits
    unsigned = (words[..., None] >> shifts) & (2**bits - 1)
    return (unsigned - 2 ** (bits - 1)).reshape(*packed.shape[:-1], k).to(torch.int8)


def dequantize_packed(packed: Tensor, scales: Tensor, bits: int, group: int, k: int) -> Tensor:
    """Dequantize packed rows [..., N, bytes] with scales [..., G, N] to fp32 [..., N, K]; batched, sync-free."""
    codes = unpack_codes(packed, bits, k)
    grouped = codes.reshape(*codes.shape[:-1], k // group, group)  # [..., N, G, group]
    return levels_from_codes(grouped, scales.transpose(-1, -2)).reshape(codes.shape)


# ---------------------------------------------------------------------------------------------------------
# public API


def quantize(
    w: Tensor,
    bits: int = 4,
    group: int = 128,
    *,
    scale_dtype: torch.dtype | None = None,
    clip_search: bool | None = None,
) -> QuantizedTensor:
    """Quantize a weight [N, K] group-wise along K (round to nearest; clip search at <= 3 bits by default)."""
    if w.dim() != 2:
        raise ConfigError(f"quantize expects a 2-D weight [N, K], got shape {tuple(w.shape)}")
    codes, scales, group = quantize_codes(w, bits, group, scale_dtype, clip_search)
    return QuantizedTensor(pack_codes(codes, bits), scales, bits, group, (w.shape[0], w.shape[1]))


def dequantize(q: QuantizedTensor, dtype: torch.dtype | None = None) -> Tensor:
    """The weight [N, K] the quantized tensor stands for, in `dtype` (default: the scales' dtype)."""
    values = dequantize_packed(q.packed, q.scales, q.bits, q.group, q.shape[1])
    return values.to(dtype or q.scales.dtype)


@dataclass(frozen=True)
class QuantizedExperts:
    """All E routed experts of one layer, packed; w13 stacks gate rows [0, I) and up rows [I, 2I)."""

    w13: Tensor  # [E, 2I, packed_bytes_per_row(D)]
    w13_scales: Tensor  # [E, D // w13_group, 2I]
    w2: Tensor  # [E, D, packed_bytes_per_row(I)]
    w2_scales: Tensor  # [E, I // w2_group, D]
    bits: int
    w13_group: int
    w2_group: int
    hidden: int  # D
    intermediate: int  # I

    @property
    def num_experts(self) -> int:
        """E."""
        return self.w13.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes of all packed codes and scales of the layer."""
        tensors = (self.w13, self.w13_scales, self.w2, self.w2_scales)
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def bytes_per_expert(self) -> int:
        """Bytes one expert's codes and scales take (what a kernel reads per active expert)."""
        return self.nbytes // self.num_experts

    def to(self, device: torch.device | str) -> QuantizedExperts:
        """A copy with every tensor on `device`."""
        moved = {name: getattr(self, name).to(device) for name in ("w13", "w13_scales", "w2", "w2_scales")}
        return QuantizedExperts(**moved, **self._shape_fields())

    def dequantize_w13(self) -> Tensor:
        """fp32 [E, 2I, D]."""
        return dequantize_packed(self.w13, self.w13_scales, self.bits, self.w13_group, self.hidden)

    def dequantize_w2(self) -> Tensor:
        """fp32 [E, D, I]."""
        return dequantize_packed(self.w2, self.w2_scales, self.bits, self.w2_group, self.intermediate)

    def dequantize_experts(self) -> tuple[Tensor, Tensor, Tensor]:
        """fp32 (gate [E, I, D], up [E, I, D], down [E, D, I]) as the kernel sees them."""
        w13 = self.dequantize_w13()
        return w13[:, : self.intermediate], w13[:, self.intermediate :], self.dequantize_w2()

    def shapes(self) -> tuple:
        """The tensors' shapes and the groups, as `empty_experts_shapes` gives them."""
        return (tuple(self.w13.shape), tuple(self.w13_scales.shape), tuple(self.w2.shape), tuple(self.w2_scales.shape),
                (self.w13_group, self.w2_group))

    def _shape_fields(self) -> dict[str, int]:
        return dict(
            bits=self.bits,
            w13_group=self.w13_group,
            w2_group=self.w2_group,
            hidden=self.hidden,
            intermediate=self.intermediate,
        )


def check_expert_shapes(gate: Tensor, up: Tensor, down: Tensor) -> tuple[int, int, int]:
    """(E, I, D) of stacked expert weights; ConfigError when they do not fit together."""
    if gate.dim() != 3 or gate.shape != up.shape or down.shape != (gate.shape[0], gate.shape[2], gate.shape[1]):
        raise ConfigError(
            f"expert weights must be gate [E, I, D], up [E, I, D], down [E, D, I]; got gate "
            f"{tuple(gate.shape)}, up {tuple(up.shape)}, down {tuple(down.shape)}"
        )
    return gate.shape[0], gate.shape[1], gate.shape[2]


def quantize_experts(
    gate: Tensor,
    up: Tensor,
    down: Tensor,
    bits: int = 4,
    group: int = 128,
    *,
    scale_dtype: torch.dtype | None = None,
    clip_search: bool | None = None,
    out: QuantizedExperts | None = None,
) -> QuantizedExperts:
    """Round-to-nearest quantization of one layer's routed experts (gate/up fused into w13), one expert at a time
    into `out` (`empty_experts` of the same shape, bits, groups and scale dtype; default: allocated here on the
    weights' device). A caller that allocates `out` before the weights' temporaries keeps them out of its segments:
    on CUDA a long-lived tensor carved from a freed temporary's cached block pins that block's whole segment in the
    allocator's reserve, where `empty_cache` cannot give back its free part."""
    num_experts, intermediate, hidden = check_expert_shapes(gate, up, down)
    scale_dtype = scale_dtype or default_scale_dtype(gate.dtype)
    if out is None:
        out = empty_experts(num_experts, intermediate, hidden, bits, group, scale_dtype, gate.device)
    elif (expected := empty_experts_shapes(num_experts, intermediate, hidden, bits, group)) != out.shapes() \
            or out.bits != bits or out.w13_scales.dtype != scale_dtype:
        raise ConfigError(f"quantize_experts: `out` holds {out.shapes()} int{out.bits} with {out.w13_scales.dtype} "
                          f"scales; these experts need {expected} int{bits} with {scale_dtype} scales")
    options = dict(scale_dtype=scale_dtype, clip_search=clip_search)
    for e in range(num_experts):
        w13 = quantize(torch.cat([gate[e], up[e]]), bits, group, **options)
        w2 = quantize(down[e], bits, group, **options)
        out.w13[e].copy_(w13.packed)
        out.w13_scales[e].copy_(w13.scales)
        out.w2[e].copy_(w2.packed)
        out.w2_scales[e].copy_(w2.scales)
    return out


def empty_experts_shapes(num_experts: int, intermediate: int, hidden: int, bits: int, group: int) -> tuple:
    """(w13, w13_scales, w2, w2_scales) shapes and the resolved (w13_group, w2_group) of a layer's packed experts."""
    g13, g2 = resolve_group(hidden, group, bits), resolve_group(intermediate, group, bits)
    return ((num_experts, 2 * intermediate, packed_bytes_per_row(hidden, bits)), (num_experts, hidden // g13, 2 * intermediate),
            (num_experts, hidden, packed_bytes_per_row(intermediate, bits)), (num_experts, intermediate // g2, hidden), (g13, g2))


def empty_experts(num_experts: int, intermediate: int, hidden: int, bits: int, group: int, scale_dtype: torch.dtype,
                  device: torch.device | str) -> QuantizedExperts:
    """Uninitialised packed experts of one layer, for `quantize_experts(..., out=)` to fill."""
    w13, w13_scales, w2, w2_scales, (g13, g2) = empty_experts_shapes(num_experts, intermediate, hidden, bits, group)
    codes = torch.int8 if bits == 8 else torch.uint8  # pack_codes' dtypes
    return QuantizedExperts(
        w13=torch.empty(w13, dtype=codes, device=device),
        w13_scales=torch.empty(w13_scales, dtype=scale_dtype, device=device),
        w2=torch.empty(w2, dtype=codes, device=device),
        w2_scales=torch.empty(w2_scales, dtype=scale_dtype, device=device),
        bits=bits, w13_group=g13, w2_group=g2, hidden=hidden, intermediate=intermediate,
    )


def stack_experts(w13: list[QuantizedTensor], w2: list[QuantizedTensor]) -> QuantizedExperts:
    """Stack per-expert quantized w13 [2I, D] and w2 [D, I] (one expert at a time keeps peak memory low)."""
    first13, first2 = w13[0], w2[0]
    return QuantizedExperts(
        w13=torch.stack([q.packed for q in w13]),
        w13_scales=torch.stack([q.scales for q in w13]),
        w2=torch.stack([q.packed for q in w2]),
        w2_scales=torch.stack([q.scales for q in w2]),
        bits=first13.bits,
        w13_group=first13.group,
        w2_group=first2.group,
        hidden=first13.shape[1],
        intermediate=first2.shape[1],
    )
