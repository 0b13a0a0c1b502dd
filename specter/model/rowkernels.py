"""The Triton bodies of the draft's one-row kernels (specter.model.rowfused launches them): plain functions, jitted on
first use by `jitted()`, so that importing this module does not need triton.

The float int4 GEMVs read the packed codes as bytes (even k in the low nibble: `moe_gate_up` without int8) or as
32-bit words (8 codes each, code k at bits 4 (k % 8) of word k // 8, as the bytes lie: `moe_finish` by default; RowTiles.
words_gate_up / words_finish: bytes are the faster read for gate/up, words for the finish),
and turn a code c into a float by the exponent trick (c | 0x4B000000 is 2^23 + c), not by an integer-to-float
conversion; a group's sum is scale * (sum c * a - 7.5 * sum a) (stored code c = q + 8, level q + 0.5). The int8
paths (RowTiles.int8_gate_up, int8_finish) sum codes x int8 activations in int32 by dp4a, four per instruction.
"""

from __future__ import annotations

import functools
from typing import Any

from specter.model import fused

tl: Any = None  # triton.language, bound by jitted(); the kernel bodies resolve it as a global
_top_k: Any = None  # fused's jitted router selection, bound by jitted()


@functools.cache
def jitted() -> Any:
    """The three kernels (norm_gemv, moe_gate_up, moe_finish), jitted on first use with their helpers."""
    global tl, _int4_rows, _int4_rows_int8, _int4_rows_q8, _pack_int8, _dp4a, _dot_words, _quantize_int8, _top_k
    global _store_picks
    import triton
    import triton.language

    tl = triton.language
    fused._kernels()  # jits fused's helpers, its router selection among them
    _top_k = fused._top_k
    _int4_rows = triton.jit(_int4_rows)
    _int4_rows_int8 = triton.jit(_int4_rows_int8)
    _dp4a = triton.jit(_dp4a)
    _int4_rows_q8 = triton.jit(_int4_rows_q8)
    _pack_int8 = triton.jit(_pack_int8)
    _dot_words = triton.jit(_dot_words)
    _quantize_int8 = triton.jit(_quantize_int8)
    _store_picks = triton.jit(_store_picks)

    class Kernels:
        norm_gemv = triton.jit(norm_gemv_kernel)
        moe_gate_up = triton.jit(moe_gate_up_kernel)
        moe_finish = triton.jit(moe_finish_kernel)

    return Kernels


def norm_gemv_kernel(x_ptr, norm_ptr, w_ptr, stride_w, bias_ptr, res_ptr, out_ptr, h_ptr, tail_ptr, ids_ptr,
                     sel_w_ptr, counts_ptr, sync_ptr, n_rows, k_dim, inter, experts, eps, SELECT: tl.constexpr,
                     COUNT: tl.constexpr, TOP_K: tl.constexpr, TOP_K_POW2: tl.constexpr, RENORMALIZE: tl.constexpr,
                     BLOCK_E: tl.constexpr, NORM: tl.constexpr, BIAS: tl.constexpr, RESIDUAL: tl.constexpr,
                     GATED: tl.constexpr, STORE_H: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
                     BLOCK_K: tl.constexpr, BLOCK_X: tl.constexpr, EVICT: tl.constexpr):  # fmt: skip
    """One row's GEMV over ROWS weight rows per program. NORM: the input is rms_norm(x) (float32 statistics over the
    whole row, computed by every program; rounded as rms_norm rounds). GATED (ROWS = 2 * BLOCK_N): the first
    cdiv(n_rows - 2 * inter, ROWS) programs store the rows from 2 * inter on (the tail: router, shared gate) as they
    are, into tail_ptr; the others read gate rows c and up rows inter + c and store silu(gate) * up at c. SELECT: the
    tail program that finishes last (counted on sync_ptr, which it sets back to 0) takes the router's top-k of the
    tail's first `experts` outputs (see Select). Else rows [pid * BLOCK_N, ...) plus the bias or the residual. STORE_H:
    program 0 stores the normalised row."""
    pid = tl.program_id(0)
    if NORM:
        xs = tl.arange(0, BLOCK_X)
        x_all = tl.load(x_ptr + xs, mask=xs < k_dim, other=0.0).to(tl.float32)
        inv = tl.rsqrt(tl.sum(x_all * x_all, axis=0) / k_dim + eps)
        if STORE_H:
            if pid == 0:
                normed = (x_all * inv).to(x_ptr.dtype.element_ty).to(tl.float32)
                scale = tl.load(norm_ptr + xs, mask=xs < k_dim, other=0.0).to(tl.float32)
                tl.store(h_ptr + xs, (scale * normed).to(h_ptr.dtype.element_ty), mask=xs < k_dim)
    else:
        inv = 1.0
    if GATED:
        tail_programs = tl.cdiv(n_rows - 2 * inter, ROWS)
        is_act = pid >= tail_programs
        cols = (pid - tail_programs) * BLOCK_N + tl.arange(0, BLOCK_N)
        half = tl.arange(0, 2)
        pair_rows = tl.reshape(cols[:, None] + inter * half[None, :], (ROWS,))  # gate c, up c, gate c + 1, ...
        pair_ok = tl.reshape((cols >= 0)[:, None] & (cols < inter)[:, None] & (half[None, :] < 2), (ROWS,))
        tail_rows = 2 * inter + pid * ROWS + tl.arange(0, ROWS)
        w_rows = tl.where(is_act, pair_rows, tail_rows)
        w_ok = tl.where(is_act, pair_ok, tail_rows < n_rows)
    else:
        w_rows = pid * BLOCK_N + tl.arange(0, ROWS)
        w_ok = w_rows < n_rows
    w_base = w_ptr + w_rows.to(tl.int64) * stride_w
    acc = tl.zeros((ROWS, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k_dim
        a = tl.load(x_ptr + ks, mask=k_ok, other=0.0)
        if NORM:
            normed = (a.to(tl.float32) * inv).to(x_ptr.dtype.element_ty).to(tl.float32)
            scale = tl.load(norm_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
            a = (scale * normed).to(x_ptr.dtype.element_ty)
        w = tl.load(w_base[:, None] + ks[None, :], mask=w_ok[:, None] & k_ok[None, :], other=0.0, eviction_policy=EVICT)
        acc += w.to(tl.float32) * a.to(tl.float32)[None, :]
    total = tl.sum(acc, axis=1)  # [ROWS]
    if BIAS:
        total += tl.load(bias_ptr + w_rows, mask=w_ok, other=0.0).to(tl.float32)
    if GATED:
        if is_act:
            gate, up = tl.split(tl.reshape(total, (BLOCK_N, 2)))
            tl.store(out_ptr + cols, (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty), mask=cols < inter)
        else:
            tl.store(tail_ptr + tail_rows - 2 * inter, total.to(tail_ptr.dtype.element_ty), mask=w_ok)
            if SELECT:
                tl.debug_barrier()  # every thread's stores before the count that publishes them
                if tl.atomic_add(sync_ptr, 1, sem="acq_rel", scope="gpu") == tail_programs - 1:
                    tl.debug_barrier()
                    picked, values = _top_k(tail_ptr, experts, TOP_K, TOP_K_POW2, RENORMALIZE, BLOCK_E, ".cg")
                    values = values.to(x_ptr.dtype.element_ty).to(tl.float32)  # the router's weights' rounding
                    _store_picks(ids_ptr, sel_w_ptr, counts_ptr, picked, values, TOP_K, TOP_K_POW2, COUNT)
                    tl.store(sync_ptr, 0)
    else:
        if RESIDUAL:
            total += tl.load(res_ptr + w_rows, mask=w_ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + w_rows, total.to(out_ptr.dtype.element_ty), mask=w_ok)


def _store_picks(ids_ptr, weights_ptr, counts_ptr, picked, values, TOP_K: tl.constexpr, TOP_K_POW2: tl.constexpr,
                 COUNT: tl.constexpr):  # fmt: skip
    """Store the router's picks (ids int32, weights float32) and, COUNT, add one per pick to its route counter."""
    slots = tl.arange(0, TOP_K_POW2)
    tl.store(ids_ptr + slots, picked.to(tl.int32), mask=slots < TOP_K)
    tl.store(weights_ptr + slots, values, mask=slots < TOP_K)
    if COUNT:
        tl.atomic_add(counts_ptr + picked, tl.full((TOP_K_POW2,), 1.0, tl.float32), mask=slots < TOP_K)


def _int4_rows(w_rows, s_rows, w_ok, a_rows, k_dim, stride_sg, GROUP: tl.constexpr, BLOCK_K: tl.constexpr,
               GROUPS: tl.constexpr, ROWS: tl.constexpr, SHARED_A: tl.constexpr, WORDS: tl.constexpr,
               EVICT: tl.constexpr):  # fmt: skip
    """[ROWS] float32 dot products of int4 weight rows with activations. w_rows [ROWS]: pointers to each row's
    packed codes (WORDS: 32-bit words, code k at bits 4 (k % 8) of word k // 8; else bytes, even k in the low
    nibble); s_rows [ROWS]: to each row's scale of group 0 (group g at + g * stride_sg); a_rows: one pointer
    (SHARED_A: every row reads the same activations) or [ROWS] pointers. A K step of BLOCK_K codes spans GROUPS whole
    groups, or lies inside one (GROUPS = 1). A code c becomes the float c by the exponent trick (c | 0x4B000000 is
    2^23 + c), and a group's sum is scale * (sum c * a - 7.5 * sum a)."""
    acc = tl.zeros((ROWS, GROUPS), dtype=tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        if WORDS:
            word = k0 // 8 + tl.arange(0, BLOCK_K // 8)
            packed = tl.load(w_rows[:, None] + word[None, :], mask=w_ok[:, None] & (word < k_dim // 8)[None, :], other=0,
                             eviction_policy=EVICT)  # fmt: skip
            codes = (packed[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 0xF  # [ROWS, BLOCK_K / 8, 8]
            levels = tl.reshape((codes | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0, (ROWS, BLOCK_K))
            ks = k0 + tl.arange(0, BLOCK_K)
            if SHARED_A:
                a = tl.load(a_rows + ks, mask=ks < k_dim, other=0.0).to(tl.float32)
                dots = tl.sum(tl.reshape(levels * a[None, :], (ROWS, GROUPS, BLOCK_K // GROUPS)), axis=2)
                a_sum = tl.sum(tl.reshape(a, (GROUPS, BLOCK_K // GROUPS)), axis=1)[None, :]
            else:
                a = tl.load(a_rows[:, None] + ks[None, :], mask=w_ok[:, None] & (ks < k_dim)[None, :], other=0.0)
                a = a.to(tl.float32)
                dots = tl.sum(tl.reshape(levels * a, (ROWS, GROUPS, BLOCK_K // GROUPS)), axis=2)
                a_sum = tl.sum(tl.reshape(a, (ROWS, GROUPS, BLOCK_K // GROUPS)), axis=2)
        else:
            pair = tl.arange(0, BLOCK_K // 2)
            byte = k0 // 2 + pair
            packed = tl.load(w_rows[:, None] + byte[None, :], mask=w_ok[:, None] & (byte < k_dim // 2)[None, :], other=0,
                             eviction_policy=EVICT)  # fmt: skip
            low = ((packed & 0xF).to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
            high = ((packed >> 4).to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
            k_even = k0 + 2 * pair
            if SHARED_A:
                a_even = tl.load(a_rows + k_even, mask=k_even < k_dim, other=0.0).to(tl.float32)
                a_odd = tl.load(a_rows + k_even + 1, mask=k_even + 1 < k_dim, other=0.0).to(tl.float32)
                both = low * a_even[None, :] + high * a_odd[None, :]
                dots = tl.sum(tl.reshape(both, (ROWS, GROUPS, BLOCK_K // (2 * GROUPS))), axis=2)
                a_sum = tl.sum(tl.reshape(a_even + a_odd, (GROUPS, BLOCK_K // (2 * GROUPS))), axis=1)[None, :]
            else:
                a_ok = w_ok[:, None] & (k_even < k_dim)[None, :]
                a_even = tl.load(a_rows[:, None] + k_even[None, :], mask=a_ok, other=0.0).to(tl.float32)
                a_odd = tl.load(a_rows[:, None] + k_even[None, :] + 1, mask=a_ok, other=0.0).to(tl.float32)
                both = low * a_even + high * a_odd
                dots = tl.sum(tl.reshape(both, (ROWS, GROUPS, BLOCK_K // (2 * GROUPS))), axis=2)
                a_sum = tl.sum(tl.reshape(a_even + a_odd, (ROWS, GROUPS, BLOCK_K // (2 * GROUPS))), axis=2)
        group = k0 // GROUP + tl.arange(0, GROUPS)
        scale = tl.load(s_rows[:, None] + (group * stride_sg)[None, :],
                        mask=w_ok[:, None] & (group * GROUP < k_dim)[None, :], other=0.0).to(tl.float32)
        acc += (dots - 7.5 * a_sum) * scale
    return tl.sum(acc, axis=1)


def _dp4a(a, b, c, DP4A: tl.constexpr):
    """c + the sum over the four bytes i of a's byte i (unsigned) times b's byte i (signed), int32 (the dp4a
    instruction; without DP4A, the same sum in plain integer operations, as Triton's interpreter needs)."""
    if DP4A:
        return tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                         is_pure=True, pack=1)  # fmt: skip
    else:
        total = c
        for lane in tl.static_range(4):
            total += ((a >> (8 * lane)) & 0xFF) * ((b << (24 - 8 * lane)) >> 24)
        return total


def _quantize_int8(a):
    """float32 rows a [G, n] -> (codes [G, n] int32 in [-127, 127], scales [G]): scale = max |a| / 127 per row (1 for
    a row of zeros, or one so tiny its scale would flush to zero), each value rounded to the nearest code, ties to
    even (adding and taking away 1.5 * 2^23)."""
    top = tl.max(tl.abs(a), axis=1)
    scale = tl.where(top > 1e-30, top / 127.0, 1.0)
    return ((a / scale[:, None] + 12582912.0) - 12582912.0).to(tl.int32), scale


def _dot_words(packed, a_even, a_odd, DP4A: tl.constexpr):
    """int32 sums, per word of int4 codes (packed [..., W] words of 8 codes), of codes x int8 activations: the low
    nibbles against a_even's bytes, the high ones against a_odd's (words as `_pack_int8` makes them; broadcast to
    packed's shape), by two dp4a."""
    dots = _dp4a(packed & 0x0F0F0F0F, tl.broadcast_to(a_even, packed.shape), tl.zeros(packed.shape, dtype=tl.int32), DP4A)
    return _dp4a((packed >> 4) & 0x0F0F0F0F, tl.broadcast_to(a_odd, packed.shape), dots, DP4A)


def _int4_rows_int8(w_rows, s_rows, w_ok, a_ptr, k_dim, stride_sg, GROUP: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUPS: tl.constexpr, ROWS: tl.constexpr, DP4A: tl.constexpr, EVICT: tl.constexpr):  # fmt: skip
    """`_int4_rows` of rows that share one activation vector (a_ptr [k_dim]), with the activations quantised to int8:
    per K step, each of its GROUPS parts of BLOCK_K / GROUPS values (a weight group, or the step inside one) gets the
    scale sa = max |a| / 127 and a8 = round(a / sa); the codes c (stored q + 8) and a8 are multiplied and summed in
    int32, four at a time (`_dp4a`: codes 8j + 2i as word j's low nibbles against the activations' even lanes, the
    high nibbles against the odd ones), and a part's sum is scale * sa * (sum c a8 - 7.5 sum a8). w_rows [ROWS]:
    pointers to each row's packed codes as 32-bit words."""
    WORDS_PER_STEP: tl.constexpr = BLOCK_K // 8
    acc = tl.zeros((ROWS, GROUPS), dtype=tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.reshape(tl.load(a_ptr + ks, mask=ks < k_dim, other=0.0).to(tl.float32), (GROUPS, BLOCK_K // GROUPS))
        a8, sa = _quantize_int8(a)  # [GROUPS, BLOCK_K / GROUPS], [GROUPS]
        a8_sum = tl.sum(a8, axis=1)  # [GROUPS]
        a_even, a_odd = _pack_int8(tl.reshape(a8, (BLOCK_K,)), WORDS_PER_STEP)  # [WORDS_PER_STEP] int32
        word = k0 // 8 + tl.arange(0, WORDS_PER_STEP)
        packed = tl.load(w_rows[:, None] + word[None, :], mask=w_ok[:, None] & (word < k_dim // 8)[None, :], other=0,
                         eviction_policy=EVICT)  # fmt: skip
        dots = _dot_words(packed, a_even[None, :], a_odd[None, :], DP4A)
        dots = tl.sum(tl.reshape(dots, (ROWS, GROUPS, WORDS_PER_STEP // GROUPS)), axis=2)  # [ROWS, GROUPS]
        group = k0 // GROUP + tl.arange(0, GROUPS)
        scale = tl.load(s_rows[:, None] + (group * stride_sg)[None, :],
                        mask=w_ok[:, None] & (group * GROUP < k_dim)[None, :], other=0.0).to(tl.float32)
        acc += (dots.to(tl.float32) - 7.5 * a8_sum.to(tl.float32)[None, :]) * (scale * sa[None, :])
    return tl.sum(acc, axis=1)


def _pack_int8(a8, WORDS: tl.constexpr):
    """int32 codes a8 [8 * WORDS] -> (even, odd) [WORDS] int32: byte i of word j holds a8[8j + 2i] (even) and
    a8[8j + 2i + 1] (odd), the order in which an int4 weight word's low and high nibbles lie."""
    lanes = tl.arange(0, 4)
    even, odd = tl.split(tl.reshape(a8, (WORDS, 4, 2)))
    return (tl.sum((even & 0xFF) << (8 * lanes)[None, :], axis=1),  # disjoint bytes: the sum is their OR
            tl.sum((odd & 0xFF) << (8 * lanes)[None, :], axis=1))  # fmt: skip


def _int4_rows_q8(w_rows, s_rows, w_ok, even_rows, odd_rows, scale_rows, bias_rows, k_dim, stride_sg,
                  GROUP: tl.constexpr, BLOCK_K: tl.constexpr, AGROUP: tl.constexpr, ROWS: tl.constexpr,
                  DP4A: tl.constexpr, EVICT: tl.constexpr):  # fmt: skip
    """`_int4_rows` against activations already in int8 (an Int8Act's rows: even_rows / odd_rows [ROWS] pointers to
    each row's words, scale_rows / bias_rows [ROWS] to its blocks of AGROUP values): per block, scale * (sum c a8) -
    bias, with sum c a8 in int32 by dp4a; times the weights' scale of the group holding the block (AGROUP divides
    GROUP and BLOCK_K)."""
    WORDS_PER_STEP: tl.constexpr = BLOCK_K // 8
    BLOCKS: tl.constexpr = BLOCK_K // AGROUP
    acc = tl.zeros((ROWS, BLOCKS), dtype=tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        word = k0 // 8 + tl.arange(0, WORDS_PER_STEP)
        word_ok = w_ok[:, None] & (word < k_dim // 8)[None, :]
        packed = tl.load(w_rows[:, None] + word[None, :], mask=word_ok, other=0, eviction_policy=EVICT)
        a_even = tl.load(even_rows[:, None] + word[None, :], mask=word_ok, other=0)
        a_odd = tl.load(odd_rows[:, None] + word[None, :], mask=word_ok, other=0)
        dots = tl.sum(tl.reshape(_dot_words(packed, a_even, a_odd, DP4A), (ROWS, BLOCKS, AGROUP // 8)), axis=2)  # [ROWS, BLOCKS]
        block = k0 // AGROUP + tl.arange(0, BLOCKS)
        block_ok = w_ok[:, None] & (block * AGROUP < k_dim)[None, :]
        a_scale = tl.load(scale_rows[:, None] + block[None, :], mask=block_ok, other=0.0)
        a_bias = tl.load(bias_rows[:, None] + block[None, :], mask=block_ok, other=0.0)
        w_scale = tl.load(s_rows[:, None] + ((block * AGROUP // GROUP) * stride_sg)[None, :], mask=block_ok,
                          other=0.0).to(tl.float32)  # fmt: skip
        acc += (dots.to(tl.float32) * a_scale - a_bias) * w_scale
    return tl.sum(acc, axis=1)


def moe_gate_up_kernel(h_ptr, logits_ptr, w_ptr, stride_we, stride_wn, s_ptr, stride_se, stride_sg, act_ptr,
                       q8_even_ptr, q8_odd_ptr, q8_scale_ptr, q8_bias_ptr,
                       ids_ptr, weights_ptr, counts_ptr, experts, inter, k_dim, TOP_K: tl.constexpr,
                       TOP_K_POW2: tl.constexpr, RENORMALIZE: tl.constexpr, COUNT: tl.constexpr,
                       PICKED: tl.constexpr, BLOCK_E: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUPS: tl.constexpr, WORDS: tl.constexpr, INT8_A: tl.constexpr, DP4A: tl.constexpr,
                       STORE_Q8: tl.constexpr, EVICT: tl.constexpr):  # fmt: skip
    """Program (pick j, column block): the router's top-k from the logits (fused's selection, every program alike;
    PICKED: read from ids_ptr instead), then silu(gate h) * up h of the j-th pick's expert for BLOCK_N columns.
    Program (0, 0) stores the picks and counts them (not with PICKED). INT8_A: h quantised to int8 and the products
    summed as integers (`_int4_rows_int8`; DP4A: with the dp4a instruction, else its emulation). STORE_Q8: the
    program's BLOCK_N outputs also leave in int8 (an Int8Act block: scale absmax / 127, words, bias)."""
    pick = tl.program_id(0)
    if PICKED:  # the input product's launch took the top-k (Select)
        expert = tl.load(ids_ptr + pick).to(tl.int64)
    else:
        picked, values = _top_k(logits_ptr, experts, TOP_K, TOP_K_POW2, RENORMALIZE, BLOCK_E, "")
        values = values.to(h_ptr.dtype.element_ty).to(tl.float32)  # the router's weights are in the activations' dtype
        if pick == 0:
            if tl.program_id(1) == 0:
                _store_picks(ids_ptr, weights_ptr, counts_ptr, picked, values, TOP_K, TOP_K_POW2, COUNT)
        expert = tl.sum(tl.where(tl.arange(0, TOP_K_POW2) == pick, picked, 0), axis=0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    half = tl.arange(0, 2)
    w_rows = tl.reshape(cols[:, None] + inter * half[None, :], (2 * BLOCK_N,))  # gate c, up c, gate c + 1, ...
    w_ok = tl.reshape((cols < inter)[:, None] & (half[None, :] < 2), (2 * BLOCK_N,))
    if INT8_A:
        total = _int4_rows_int8(w_ptr + expert * stride_we + w_rows.to(tl.int64) * stride_wn,
                                s_ptr + expert * stride_se + w_rows, w_ok, h_ptr, k_dim, stride_sg, GROUP, BLOCK_K, GROUPS,
                                2 * BLOCK_N, DP4A, EVICT)  # fmt: skip
    else:
        total = _int4_rows(w_ptr + expert * stride_we + w_rows.to(tl.int64) * stride_wn, s_ptr + expert * stride_se + w_rows,
                           w_ok, h_ptr, k_dim, stride_sg, GROUP, BLOCK_K, GROUPS, 2 * BLOCK_N, True, WORDS, EVICT)  # fmt: skip
    gate, up = tl.split(tl.reshape(total, (BLOCK_N, 2)))
    act = gate * tl.sigmoid(gate) * up
    tl.store(act_ptr + pick.to(tl.int64) * inter + cols, act.to(act_ptr.dtype.element_ty), mask=cols < inter)
    if STORE_Q8:  # int8_finish_fits: inter is a whole number of blocks of BLOCK_N, a multiple of 8
        a8, scale = _quantize_int8(act[None, :])
        a8 = tl.reshape(a8, (BLOCK_N,))
        scale = tl.sum(scale, axis=0)  # the one row's scale
        even, odd = _pack_int8(a8, BLOCK_N // 8)
        words = pick.to(tl.int64) * (inter // 8) + tl.program_id(1) * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
        tl.store(q8_even_ptr + words, even)
        tl.store(q8_odd_ptr + words, odd)
        block = pick.to(tl.int64) * (inter // BLOCK_N) + tl.program_id(1)
        tl.store(q8_scale_ptr + block, scale)
        tl.store(q8_bias_ptr + block, 7.5 * scale * tl.sum(a8, axis=0).to(tl.float32))


def moe_finish_kernel(x_ptr, act_ptr, q8_even_ptr, q8_odd_ptr, q8_scale_ptr, q8_bias_ptr, ids_ptr, weights_ptr, w_ptr,
                      stride_we, stride_wn, s_ptr, stride_se,
                      stride_sg, shared_ptr, sd_ptr, stride_sd, logit_ptr, out_ptr, hidden, inter, shared_inter,
                      TOP_K: tl.constexpr, TOP_K_POW2: tl.constexpr, SHARED: tl.constexpr, GATED: tl.constexpr,
                      GROUP: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUPS: tl.constexpr,
                      BLOCK_KS: tl.constexpr, WORDS: tl.constexpr, INT8_A: tl.constexpr, AGROUP: tl.constexpr,
                      DP4A: tl.constexpr, EVICT: tl.constexpr):  # fmt: skip
    """Program (block of BLOCK_N output rows): the routed down products of every pick (TOP_K_POW2 x BLOCK_N int4
    rows, picks placed in ascending expert id, so the sum over them is one fixed order whatever the picks' order),
    weighted; SHARED: the shared down product (bf16 rows), GATED: times sigmoid of the gate's logit; plus x; rounded
    once. INT8_A: the routed rows against gate/up's int8 output (`_int4_rows_q8`, blocks of AGROUP values)."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < hidden
    slots = tl.arange(0, TOP_K_POW2)
    slot_ok = slots < TOP_K
    ids = tl.load(ids_ptr + slots, mask=slot_ok, other=0)
    rank = tl.sum(((ids[None, :] < ids[:, None]) & slot_ok[None, :]).to(tl.int32), axis=1)  # ids are distinct
    rank = tl.where(slot_ok, rank, slots)  # padding lanes keep their own place, after every pick
    ordered = tl.sum(tl.where(rank[None, :] == slots[:, None], slots[None, :], 0), axis=1)  # slot of rank r
    expert = tl.load(ids_ptr + ordered, mask=slot_ok, other=0).to(tl.int64)
    weight = tl.load(weights_ptr + ordered, mask=slot_ok, other=0.0)
    rows: tl.constexpr = TOP_K_POW2 * BLOCK_N
    row_expert = tl.reshape(expert[:, None] + 0 * n[None, :], (rows,))
    row_slot = tl.reshape(ordered[:, None] + 0 * n[None, :], (rows,)).to(tl.int64)
    row_n = tl.reshape(n[None, :] + 0 * slots[:, None], (rows,))
    row_ok = tl.reshape(slot_ok[:, None] & n_ok[None, :], (rows,))
    if INT8_A:
        dots = _int4_rows_q8(w_ptr + row_expert * stride_we + row_n.to(tl.int64) * stride_wn,
                             s_ptr + row_expert * stride_se + row_n, row_ok, q8_even_ptr + row_slot * (inter // 8),
                             q8_odd_ptr + row_slot * (inter // 8), q8_scale_ptr + row_slot * (inter // AGROUP),
                             q8_bias_ptr + row_slot * (inter // AGROUP), inter, stride_sg, GROUP, BLOCK_K, AGROUP, rows,
                             DP4A, EVICT)  # fmt: skip
    else:
        dots = _int4_rows(w_ptr + row_expert * stride_we + row_n.to(tl.int64) * stride_wn, s_ptr + row_expert * stride_se + row_n,
                          row_ok, act_ptr + row_slot * inter, inter, stride_sg, GROUP, BLOCK_K, GROUPS, rows, False, WORDS, EVICT)  # fmt: skip
    routed = tl.sum(tl.reshape(dots, (TOP_K_POW2, BLOCK_N)) * weight[:, None], axis=0)
    x = tl.load(x_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
    if SHARED:
        acc = tl.zeros((BLOCK_N, BLOCK_KS), dtype=tl.float32)
        sd_rows = sd_ptr + n.to(tl.int64) * stride_sd
        for k0 in range(0, shared_inter, BLOCK_KS):
            ks = k0 + tl.arange(0, BLOCK_KS)
            k_ok = ks < shared_inter
            a = tl.load(shared_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
            w = tl.load(sd_rows[:, None] + ks[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0, eviction_policy=EVICT)
            acc += w.to(tl.float32) * a[None, :]
        shared = tl.sum(acc, axis=1)
        if GATED:
            shared = shared * tl.sigmoid(tl.load(logit_ptr).to(tl.float32))
        routed += shared
    tl.store(out_ptr + n, (x + routed).to(out_ptr.dtype.element_ty), mask=n_ok)
