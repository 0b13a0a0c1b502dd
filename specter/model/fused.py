"""Fused Triton kernels for the non-exact forward (the draft, and the target's fast mode): RMSNorm, RoPE, the
router's softmax and top-k, and the shared expert's sigmoid gate.

In exact mode every row-wise operation keeps torch's own op sequence, so the target's rounding never
changes. The draft need not be exact: there each RMSNorm (eight small kernels in torch: cast, square,
mean, add, rsqrt, multiply, cast, scale) and each RoPE of q and k (two gathers, two multiplies, a negation,
a concatenation and an add, for each of q and k) is one launch, computed in float32 and rounded once. So
are the router after its matrix product (torch: a cast, softmax, top-k as two kernels, a cast, and for
renormalising models a sum and a division) and the shared expert's gate (torch: a cuBLAS dot and its
reduction for the [1, D] product, a sigmoid and a product).
In a CUDA graph every node costs a few microseconds whatever its size, and the one-row draft step is made
of such nodes (about 64 per layer outside the MoE). Which fused paths the non-exact
forward takes is chosen once per model (specter.model.tiers, from EngineConfig.tuning.kernels).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

from specter.config import KernelTuning
from specter.quant import moe_triton

tl: Any = None  # triton.language, bound by _kernels(); the kernel bodies resolve it as a global


def split_count(capacity: int, kernels: KernelTuning) -> int:
    """How many runs `decode_attention` cuts a cache of `capacity` positions into: one per
    `kernels.positions_per_split`, at most `kernels.max_splits`. Depends on the capacity only, so a graph captured
    once serves every position."""
    return max(1, min(kernels.max_splits, -(-capacity // kernels.positions_per_split)))


def usable(x: Tensor) -> bool:
    """Whether the fused kernels can run on `x`: CUDA (or Triton's interpreter on the CPU) with triton installed."""
    return usable_on(x.device)


def usable_on(device: torch.device) -> bool:
    """Whether the fused kernels can run on tensors of `device` (see `usable`)."""
    return (device.type == "cuda" or moe_triton.interpreting()) and moe_triton.triton_available()


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


def rope_and_cache(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, k_cache: Tensor,
                   v_cache: Tensor) -> Tensor:
    """`rope` of q [T, H, hd] and k [T, Hkv, hd], with the rotated k and v [T, Hkv, hd] written into one layer's
    cache k_cache / v_cache [Hkv, S, hd] at `positions` [T] (what index_copy_ along S does): one launch. Returns
    the rotated q."""
    rows, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    assert v.shape == k.shape and k_cache.shape == v_cache.shape and k_cache.shape[0] == kv_heads
    assert k_cache.stride(2) == 1 and v_cache.stride(2) == 1, "the cache's head dimension must be contiguous"
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    q_out = torch.empty_like(q)
    _kernels().rope_cache[(rows, heads + 2 * kv_heads)](
        q, k, v, q_out, k_cache, v_cache, cos, sin, positions, heads, kv_heads, head_dim, k_cache.stride(0),
        k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), BLOCK=_pow2(head_dim),
    )  # fmt: skip
    return q_out


def topk_softmax(logits: Tensor, top_k: int, renormalize: bool, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Router over `logits` [T, E]: float32 softmax, the top_k probabilities in descending order (ties to the lower
    expert id) and their ids [T, top_k] int64, renormalised to sum 1 when asked; weights in `dtype`. One launch."""
    rows, experts = logits.shape
    assert 1 <= top_k <= experts, f"top_k {top_k} of {experts} experts"
    logits = logits.contiguous()
    ids = torch.empty(rows, top_k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(rows, top_k, dtype=dtype, device=logits.device)
    _kernels().topk_softmax[(rows,)](logits, ids, weights, experts, TOP_K=top_k, TOP_K_POW2=_pow2(top_k),
                                     RENORMALIZE=renormalize, BLOCK=_pow2(experts))  # fmt: skip
    return ids, weights


def sigmoid_gate(h: Tensor, gate_weight: Tensor, out: Tensor) -> Tensor:
    """sigmoid(h @ gate_weight.T) * out for h, out [T, D] and gate_weight [1, D] (a bias-free gate): one launch, the
    dot in float32 rounded to h's dtype as F.linear does, then the sigmoid and the product."""
    rows, width = h.shape
    assert gate_weight.shape == (1, width) and out.shape == h.shape, "the gate is a [1, D] linear of [T, D] rows"
    h, gate_weight, out = h.contiguous(), gate_weight.contiguous(), out.contiguous()
    result = torch.empty_like(out)
    _kernels().sigmoid_gate[(rows,)](h, gate_weight, out, result, width, BLOCK=min(_pow2(width), 4096))
    return result


def gated_silu(gate_up: Tensor, inter: int, gate_logit: Tensor | None) -> Tensor:
    """silu(g) * u, times sigmoid(l) when gate_logit [T, 1] is given, of gate_up [T, >= 2I] = g [I], u [I], ... per
    row (views into a packed product: any row stride, unit column stride); float32 arithmetic, one rounding.
    [T, I], one launch."""
    rows = gate_up.shape[0]
    assert gate_up.shape[1] >= 2 * inter and gate_up.stride(1) == 1
    out = torch.empty(rows, inter, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, _pow2(inter))
    logit = gate_up if gate_logit is None else gate_logit
    _kernels().gated_silu[(rows, -(-inter // block))](gate_up, gate_up.stride(0), logit, logit.stride(0), out, inter,
                                                        GATED=gate_logit is not None, BLOCK=block)  # fmt: skip
    return out


def decode_attention(q: Tensor, keys: Tensor, values: Tensor, positions: Tensor, window: int | None,
                     splits: int | None = None, counters: Tensor | None = None) -> Tensor:
    """Attention of rows q [R, H, hd] over one layer's cache keys/values [Hkv, S, hd]: row r sees the positions
    max(0, p - window + 1)..p of p = positions[r] only (never the rest of the cache), scores in float32 scaled by
    hd^-0.5, an online softmax. Returns [R, H * hd] in q's dtype. No host sync.

    The visible positions are cut into `splits` equal runs (default: `split_count` with the default KernelTuning),
    each a program per (row, cache head): with one run, one launch writes the
    output; with more (long caches, where one program per head would stream the whole history alone), a second
    launch merges the runs' partial softmaxes (flash-decoding). The grid depends on the capacity only, so a CUDA
    graph captured once serves every position.

    With `counters` (int32 zeros, one per row and cache head, that no other launch uses at the same time: the graphed
    draft step and the eager one-row step each keep one set per layer), the merge happens in the same launch: where a row's visible positions fit in
    the first run, its first program writes the output alone and the others do nothing; else the program that finishes
    a (row, cache head) last (counted, and the count set back to zero) merges the runs' partials."""
    rows, heads, head_dim = q.shape
    kv_heads, capacity, _ = keys.shape
    assert heads % kv_heads == 0 and values.shape == keys.shape, "q heads must be a multiple of the cache's heads"
    assert keys.stride(2) == 1 and values.stride(2) == 1, "the cache's head dimension must be contiguous"
    splits = splits or split_count(capacity, KernelTuning())
    group = heads // kv_heads
    group_pow2 = _pow2(group)
    q = q.contiguous()
    out = torch.empty(rows, heads * head_dim, dtype=q.dtype, device=q.device)
    if splits == 1:
        stats = partial = out  # unused by the kernel
    else:
        stats = torch.empty(2, rows, heads, splits, dtype=torch.float32, device=q.device)  # running max, total
        partial = torch.empty(rows, heads, splits, head_dim, dtype=torch.float32, device=q.device)
    merged = counters is not None and splits > 1
    if merged:
        assert counters is not None and counters.dtype == torch.int32 and counters.numel() >= rows * kv_heads
    kernels = _kernels()
    kernels.decode_attention[(rows, kv_heads, splits)](
        q, keys, values, positions, out, stats, partial, out if counters is None else counters, keys.stride(0),
        keys.stride(1), values.stride(0), values.stride(1), rows * heads * splits, heads, head_dim, window or 0,
        head_dim**-0.5, GROUP=group, GROUP_POW2=group_pow2, BLOCK_D=_pow2(head_dim), SPLITS=splits,
        SPLITS_POW2=_pow2(splits), MERGE=merged,
        BLOCK_S=max(2, min(64, 8192 // (group_pow2 * _pow2(head_dim)))),  # the [G, S, D] product in registers
    )  # fmt: skip
    if splits > 1 and not merged:
        kernels.merge_splits[(rows, heads)](stats, partial, out, rows * heads * splits, head_dim, SPLITS=splits,
                                            SPLITS_POW2=_pow2(splits), BLOCK_D=_pow2(head_dim))  # fmt: skip
    return out


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.cache
def _kernels() -> Any:
    """Jitted on first use, so importing this module does not need triton."""
    global tl
    import triton
    import triton.language

    tl = triton.language
    global _rotated, _top_k  # the kernels' shared helpers: jitted too, under the names they resolve
    _rotated = triton.jit(_rotated)
    _top_k = triton.jit(_top_k)

    class Kernels:
        rms_norm = triton.jit(rms_norm_kernel)
        rope = triton.jit(rope_kernel)
        rope_cache = triton.jit(rope_cache_kernel)
        topk_softmax = triton.jit(topk_softmax_kernel)
        sigmoid_gate = triton.jit(sigmoid_gate_kernel)
        gated_silu = triton.jit(gated_silu_kernel)
        decode_attention = triton.jit(decode_attention_kernel)
        merge_splits = triton.jit(merge_splits_kernel)

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
    _rotated(base, dst, cos_ptr, sin_ptr, position, head_dim, BLOCK)


def _rotated(base, dst, cos_ptr, sin_ptr, position, head_dim, BLOCK: tl.constexpr):
    """dst = x * cos + rotate_half(x) * sin for the head vector x at base, in float32, stored in x's dtype (the
    kernels' shared helper: jitted under this name by _kernels())."""
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


def rope_cache_kernel(q_ptr, k_ptr, v_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, cos_ptr, sin_ptr, pos_ptr, heads,
                      kv_heads, head_dim, stride_kh, stride_ks, stride_vh, stride_vs, BLOCK: tl.constexpr):  # fmt: skip
    """Program (row, head): heads below `heads` rotate q into q_out, the next kv_heads rotate k into the key cache
    at the row's position, the last kv_heads copy v into the value cache there."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    position = tl.load(pos_ptr + row).to(tl.int64)
    if head >= heads + kv_heads:  # v: a copy
        h = (head - heads - kv_heads).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < head_dim
        x = tl.load(v_ptr + (row * kv_heads + h) * head_dim + cols, mask=ok, other=0.0)
        tl.store(v_cache_ptr + h * stride_vh + position * stride_vs + cols, x.to(v_cache_ptr.dtype.element_ty), mask=ok)
    elif head < heads:
        _rotated(q_ptr + (row * heads + head) * head_dim, q_out_ptr + (row * heads + head) * head_dim, cos_ptr,
                 sin_ptr, position, head_dim, BLOCK)  # fmt: skip
    else:
        h = (head - heads).to(tl.int64)
        _rotated(k_ptr + (row * kv_heads + h) * head_dim, k_cache_ptr + h * stride_kh + position * stride_ks,
                 cos_ptr, sin_ptr, position, head_dim, BLOCK)  # fmt: skip


def topk_softmax_kernel(logits_ptr, ids_ptr, weights_ptr, experts, TOP_K: tl.constexpr, TOP_K_POW2: tl.constexpr,
                        RENORMALIZE: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """One row: the router's selection (`_top_k`), stored."""
    row = tl.program_id(0).to(tl.int64)
    picked, values = _top_k(logits_ptr + row * experts, experts, TOP_K, TOP_K_POW2, RENORMALIZE, BLOCK, "")
    slots = tl.arange(0, TOP_K_POW2)
    keep = slots < TOP_K
    tl.store(ids_ptr + row * TOP_K + slots, picked, mask=keep)
    tl.store(weights_ptr + row * TOP_K + slots, values.to(weights_ptr.dtype.element_ty), mask=keep)


def _top_k(logits_ptr, experts, TOP_K: tl.constexpr, TOP_K_POW2: tl.constexpr, RENORMALIZE: tl.constexpr,
           BLOCK: tl.constexpr, CACHE: tl.constexpr):  # fmt: skip
    """The logits at logits_ptr [experts]: softmax in float32, then TOP_K rounds of (largest, lowest id among
    equals), masked out once taken; returns ids [TOP_K_POW2] int64 and probabilities [TOP_K_POW2] float32 (lanes
    from TOP_K on: 0), renormalised to sum 1 when asked (a helper jitted by _kernels(); specter.model.rowfused's
    MoE kernels take their picks with it too; CACHE: the logits' load cache modifier, ".cg" to read what other
    programs of the same launch stored).

    A probability that is not a number (a NaN or infinite logit makes the whole row NaN, as in torch) ranks below
    every number but above the padding lanes, so the ids stay real experts; its weight stays NaN."""
    cols = tl.arange(0, BLOCK)
    ok = cols < experts
    x = tl.load(logits_ptr + cols, mask=ok, other=-float("inf"), cache_modifier=CACHE).to(tl.float32)
    e = tl.where(ok, tl.exp(x - tl.max(x, axis=0)), 0.0)
    p = e / tl.sum(e, axis=0)
    score = tl.where(ok, tl.where(p == p, p, -1.0), -2.0)  # NaN below numbers, padding below NaN
    slots = tl.arange(0, TOP_K_POW2)
    values = tl.zeros((TOP_K_POW2,), dtype=tl.float32)
    picked = tl.zeros((TOP_K_POW2,), dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(score, axis=0)
        index = tl.minimum(tl.min(tl.where(score == best, cols, BLOCK), axis=0), experts - 1)
        value = tl.sum(tl.where(cols == index, p, 0.0), axis=0)  # (NaN stays NaN)
        values = tl.where(slots == j, value, values)
        picked = tl.where(slots == j, index.to(tl.int64), picked)
        score = tl.where(cols == index, -3.0, score)
    if RENORMALIZE:
        values = values / tl.sum(tl.where(slots < TOP_K, values, 0.0), axis=0)
    return picked, values


def sigmoid_gate_kernel(h_ptr, w_ptr, out_ptr, result_ptr, width, BLOCK: tl.constexpr):
    """One row: g = sigmoid(round(h . w)) rounded to the row's dtype, then result = g * out."""
    row = tl.program_id(0).to(tl.int64)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, width, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        ok = cols < width
        h = tl.load(h_ptr + row * width + cols, mask=ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        acc += h * w
    dot = tl.sum(acc, axis=0).to(h_ptr.dtype.element_ty).to(tl.float32)
    gate = tl.sigmoid(dot).to(out_ptr.dtype.element_ty).to(tl.float32)
    for start in range(0, width, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        ok = cols < width
        out = tl.load(out_ptr + row * width + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(result_ptr + row * width + cols, (gate * out).to(result_ptr.dtype.element_ty), mask=ok)


def gated_silu_kernel(in_ptr, stride_row, logit_ptr, stride_logit, out_ptr, inter, GATED: tl.constexpr,
                      BLOCK: tl.constexpr):  # fmt: skip
    """Program (row, column block): out = silu(g) * u (* sigmoid(l)) in float32, rounded once."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    g = tl.load(in_ptr + row * stride_row + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(in_ptr + row * stride_row + inter + cols, mask=ok, other=0.0).to(tl.float32)
    act = g * tl.sigmoid(g) * u
    if GATED:
        act = act * tl.sigmoid(tl.load(logit_ptr + row * stride_logit).to(tl.float32))
    tl.store(out_ptr + row * inter + cols, act.to(out_ptr.dtype.element_ty), mask=ok)


def decode_attention_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, out_ptr, stats_ptr, partial_ptr, count_ptr, stride_kh,
                            stride_ks, stride_vh, stride_vs, stats_plane, heads, head_dim, window, scale,
                            GROUP: tl.constexpr, GROUP_POW2: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                            SPLITS: tl.constexpr, SPLITS_POW2: tl.constexpr, MERGE: tl.constexpr):  # fmt: skip
    """Program (row, kv head, split): its GROUP query heads over one run of the row's visible positions, BLOCK_S
    keys at a time. SPLITS == 1: the normalised output; else the run's max, total and unnormalised sum (float32).
    MERGE (SPLITS > 1): where the visible positions fit in one run, split 0 writes the normalised output and the
    others do nothing; else the last program of the (row, kv head) to finish (counted at count_ptr, set back to 0)
    merges the runs' partials into the output."""
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    position = tl.load(pos_ptr + row).to(tl.int32)
    hi = position + 1
    lo = tl.where(window > 0, tl.maximum(position - window + 1, 0), 0)
    alone = SPLITS == 1
    if SPLITS > 1:  # equal runs of whole key blocks; trailing runs may be empty
        run = tl.cdiv(tl.cdiv(hi - lo, SPLITS), BLOCK_S) * BLOCK_S
        run_lo = lo + split * run
        run_hi = tl.minimum(hi, run_lo + run)
        if MERGE:
            alone = hi - lo <= run  # split 0 sees every position: the others have nothing to add
            run_hi = tl.where(alone, tl.where(split == 0, hi, lo), run_hi)
            run_lo = tl.where(alone, lo, run_lo)
        lo, hi = run_lo, run_hi
    g = tl.arange(0, GROUP_POW2)
    g_ok = g < GROUP
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    q_heads = kv_head * GROUP + g  # [G]
    q_mask = g_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + (row * heads + q_heads)[:, None] * head_dim + d[None, :], mask=q_mask, other=0.0)
    q = q.to(tl.float32) * scale  # [G, D]
    m = tl.full((GROUP_POW2,), -float("inf"), dtype=tl.float32)
    total = tl.zeros((GROUP_POW2,), dtype=tl.float32)
    acc = tl.zeros((GROUP_POW2, BLOCK_D), dtype=tl.float32)
    k_base = k_ptr + kv_head * stride_kh
    v_base = v_ptr + kv_head * stride_vh
    for start in range(lo, hi, BLOCK_S):
        s = start + tl.arange(0, BLOCK_S)
        s_ok = s < hi
        kv_mask = s_ok[:, None] & d_ok[None, :]
        keys = tl.load(k_base + s.to(tl.int64)[:, None] * stride_ks + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        vals = tl.load(v_base + s.to(tl.int64)[:, None] * stride_vs + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * keys[None, :, :], axis=2)  # [G, S]
        scores = tl.where(s_ok[None, :], scores, -float("inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        total = total * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * vals[None, :, :], axis=1)
        m = m_new
    out_at = out_ptr + (row * heads + q_heads)[:, None] * head_dim + d[None, :]
    if alone:
        if split == 0:
            tl.store(out_at, (acc / total[:, None]).to(out_ptr.dtype.element_ty), mask=q_mask)
    else:  # stats [2, R, H, SPLITS], partial [R, H, SPLITS, hd]
        slot = (row * heads + q_heads) * SPLITS + split  # [G]
        tl.store(stats_ptr + slot, m, mask=g_ok)
        tl.store(stats_ptr + stats_plane + slot, total, mask=g_ok)
        tl.store(partial_ptr + slot[:, None] * head_dim + d[None, :], acc, mask=q_mask)
        if MERGE:
            tl.debug_barrier()  # every thread's stores before the count that publishes them
            counter = count_ptr + row * tl.num_programs(1) + kv_head
            if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == SPLITS - 1:
                tl.debug_barrier()
                first = (row * heads + q_heads) * SPLITS  # [G]
                runs = tl.arange(0, SPLITS_POW2)
                run_mask = g_ok[:, None] & (runs < SPLITS)[None, :]
                run_m = tl.load(stats_ptr + first[:, None] + runs[None, :], mask=run_mask, other=-float("inf"),
                                cache_modifier=".cg")  # fmt: skip
                run_total = tl.load(stats_ptr + stats_plane + first[:, None] + runs[None, :], mask=run_mask, other=0.0,
                                    cache_modifier=".cg")  # fmt: skip
                top = tl.max(run_m, axis=1)  # [G]; the first run is never empty, so finite for real heads
                weight = tl.where(run_m > -float("inf"), tl.exp(run_m - top[:, None]), 0.0)  # [G, SPLITS]
                merged = tl.zeros((GROUP_POW2, BLOCK_D), dtype=tl.float32)
                for r in range(SPLITS):
                    part = tl.load(partial_ptr + (first + r)[:, None] * head_dim + d[None, :], mask=q_mask, other=0.0,
                                   cache_modifier=".cg")  # fmt: skip
                    merged += tl.sum(tl.where(runs[None, :] == r, weight, 0.0), axis=1)[:, None] * part
                norm = tl.sum(weight * run_total, axis=1)
                tl.store(out_at, (merged / norm[:, None]).to(out_ptr.dtype.element_ty), mask=q_mask)
                tl.store(counter, 0)


def merge_splits_kernel(stats_ptr, partial_ptr, out_ptr, stats_plane, head_dim, SPLITS: tl.constexpr,
                        SPLITS_POW2: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    """Program (row, head): the runs' partial softmaxes rescaled to their common max and added (empty runs, max
    -inf, weigh 0; the first run is never empty, so the common max is finite)."""
    slot = (tl.program_id(0).to(tl.int64) * tl.num_programs(1) + tl.program_id(1)) * SPLITS
    runs = tl.arange(0, SPLITS_POW2)
    run_ok = runs < SPLITS
    m = tl.load(stats_ptr + slot + runs, mask=run_ok, other=-float("inf"))
    total = tl.load(stats_ptr + stats_plane + slot + runs, mask=run_ok, other=0.0)
    top = tl.max(m, axis=0)
    weight = tl.where(m > -float("inf"), tl.exp(m - top), 0.0)  # [SPLITS]
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    parts = tl.load(partial_ptr + (slot + runs)[:, None] * head_dim + d[None, :], mask=run_ok[:, None] & d_ok[None, :],
                    other=0.0)  # fmt: skip
    out = tl.sum(weight[:, None] * parts, axis=0) / tl.sum(weight * total, axis=0)
    tl.store(out_ptr + (slot // SPLITS) * head_dim + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)
