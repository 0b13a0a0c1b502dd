"""Fused Triton kernels for the non-exact forward (the draft, and the target's fast mode): RMSNorm and RoPE.

In exact mode every row-wise operation keeps torch's own op sequence, so the target's rounding never
changes. The draft need not be exact: there each RMSNorm (eight small kernels in torch: cast, square,
mean, add, rsqrt, multiply, cast, scale) and each RoPE of q and k (two gathers, two multiplies, a negation,
a concatenation and an add, for each of q and k) is one launch, computed in float32 and rounded once.
In a CUDA graph every node costs a few microseconds whatever its size, and the one-row draft step is made
of such nodes (docs/BENCHMARKS.md: about 64 per layer outside the MoE).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

from specter.quant import moe_triton

tl: Any = None  # triton.language, bound by _kernels(); the kernel bodies resolve it as a global


def usable(x: Tensor) -> bool:
    """Whether the fused kernels can run on `x`: CUDA (or Triton's interpreter on the CPU) with triton installed."""
    return (x.is_cuda or moe_triton.interpreting()) and moe_triton.triton_available()


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dimension of `x` [..., D] with `weight` [D]: one launch, float32 statistics."""
    width = x.shape[-1]
    rows = x.reshape(-1, width)
    if not rows.is_contiguous():
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    _kernels().rms_norm[(rows.shape[0],)](rows, weight, out, width, eps, BLOCK=_pow2(width))
    return out.view(x.shape)


def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
    """Rotate-half RoPE of q [T, H, hd] and k [T, Hkv, hd] at `positions` [T], tables [max_context, hd]: one launch."""
    rows, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    q, k = q.contiguous(), k.contiguous()
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    _kernels().rope[(rows, heads + kv_heads)](q, k, q_out, k_out, cos, sin, positions, heads, kv_heads, head_dim,
                                              BLOCK=_pow2(head_dim))
    return q_out, k_out


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.cache
def _kernels() -> Any:
    """Jitted on first use, so importing this module does not need triton."""
    global tl
    import triton
    import triton.language

    tl = triton.language

    class Kernels:
        rms_norm = triton.jit(rms_norm_kernel)
        rope = triton.jit(rope_kernel)

    return Kernels


def rms_norm_kernel(x_ptr, w_ptr, out_ptr, width, eps, BLOCK: tl.constexpr):
    """One row: x * rsqrt(mean(x^2) + eps) in float32, rounded to x's dtype, times the weight (as torch does it)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < width
    x = tl.load(x_ptr + row * width + cols, mask=ok, other=0.0)
    x32 = x.to(tl.float32)
    normed = (x32 * tl.rsqrt(tl.sum(x32 * x32, axis=0) / width + eps)).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    out = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * width + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


def rope_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_ptr, sin_ptr, pos_ptr, heads, kv_heads, head_dim,
                BLOCK: tl.constexpr):
    """Program (row, head): heads below `heads` are q's, the rest k's. out = x * cos + rotate_half(x) * sin."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    is_q = head < heads
    if is_q:
        base, dst = q_ptr + (row * heads + head) * head_dim, q_out_ptr + (row * heads + head) * head_dim
    else:
        base = k_ptr + (row * kv_heads + head - heads) * head_dim
        dst = k_out_ptr + (row * kv_heads + head - heads) * head_dim
    position = tl.load(pos_ptr + row).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < head_dim
    half = head_dim // 2
    partner = tl.where(cols < half, cols + half, cols - half)
    x = tl.load(base + cols, mask=ok, other=0.0)
    rotated = tl.load(base + partner, mask=ok, other=0.0).to(tl.float32)
    rotated = tl.where(cols < half, -rotated, rotated)
    cos = tl.load(cos_ptr + position * head_dim + cols, mask=ok, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + position * head_dim + cols, mask=ok, other=0.0).to(tl.float32)
    out = x.to(tl.float32) * cos + rotated * sin
    tl.store(dst + cols, out.to(x.dtype), mask=ok)
