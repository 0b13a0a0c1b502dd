"""Triton fused draft MoE over packed int2/3/4/8 experts: sync-free, CUDA-graph capturable; `fused_moe` dispatches.

Kernel design (decode: T <= 16 tokens, P = T * A (token, expert) pairs):

1. Route (one program): sorts the P pairs by (expert id, pair index) with an all-pairs rank (P <= 256, so
   P^2 compares are nothing); writes per sorted slot its token, expert, routing weight and offset within
   its expert's run, plus, per token, the slots of its pairs in ascending expert id.
2. Gate/up GEMM, grid (P, cdiv(I, BLOCK_N), S): the program at the start of each BLOCK_M-chunk of an
   expert's run reads that expert's packed tile once for all its tokens (other programs exit at once),
   dequantizes in registers and writes h = silu(gate x) * up x. Gate and up rows are interleaved in one tile.
3. Down GEMM, grid (P, cdiv(D, BLOCK_N), S): out_pair = weight * down h, fp32, one row per sorted slot and
   K part (split-K: program s covers one S-th of I; S = 2 by default, MoETiles.split_k_down: more programs for a
   short GEMM; the gate/up GEMM is not split: its parts would have to be added before the activation, and adding
   them in the down GEMM's operand load redoes that sum in every down program, which costs more than the split saves).
4. Combine, grid (T, cdiv(D, BLOCK_D)): each token adds its A rows (each the sum of its S parts) in ascending
   expert id (fixed order, deterministic; no atomics).

Every expert weight byte crosses HBM once per step, so the floor is (distinct active experts x bytes per
expert) / HBM bandwidth. Nothing reads back to the host: the grid depends only on T and A.
Triton is imported lazily; with TRITON_INTERPRET=1 CPU tensors run the same kernels in its interpreter (tests).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from specter.config import MoETiles
from specter.log import get_logger
from specter.quant.groupwise import QuantizedExperts
from specter.quant.moe_torch import check_routes, moe_forward

log = get_logger(__name__)

KERNEL_BITS = (2, 3, 4, 8)
MAX_PAIRS = 256  # the route kernel ranks all pairs in one program
BLOCK_M = 16  # tokens per expert chunk; tl.dot needs at least 16 rows


@functools.cache
def triton_available() -> bool:
    """True when triton imports (it is optional; checked once per process)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def kernel_supports(x: Tensor, expert_ids: Tensor, qe: QuantizedExperts) -> bool:
    """Whether the Triton path handles this call (else the torch reference does). The kernels read a pair of
    elements (k, k + 1) under one scale, so a group must be even (int4 groups always are; an int8 group may not)."""
    pairs = expert_ids.shape[0] * expert_ids.shape[1]
    even_groups = qe.w13_group % 2 == 0 and qe.w2_group % 2 == 0
    return (qe.bits in KERNEL_BITS and even_groups and pairs <= MAX_PAIRS
            and x.dtype in (torch.float16, torch.bfloat16, torch.float32))  # fmt: skip


def fused_moe(
    x: Tensor, expert_ids: Tensor, weights: Tensor, qe: QuantizedExperts, tiles: MoETiles | None = None,
    counts: Tensor | None = None,
) -> Tensor:
    """[T, D] MoE output; Triton on CUDA (every packed width), the torch reference otherwise. Never syncs.
    tiles: the kernels' tiles, EngineConfig.tuning.kernels.moe (the draft's DraftExperts passes them; None: their
    defaults). counts [E] float32, when given, gets +1 per (token, slot) at its expert (the draft's route counter):
    inside the kernels on the Triton path, by index_add_ otherwise."""
    if x.is_cuda and kernel_supports(x, expert_ids, qe) and triton_available():
        return fused_moe_triton(x, expert_ids, weights, qe, tiles, counts)
    if counts is not None:
        flat = expert_ids.reshape(-1)
        counts.index_add_(0, flat, torch.ones(flat.numel(), dtype=counts.dtype, device=counts.device))
    return moe_forward(x, expert_ids, weights, qe)


def fused_moe_triton(
    x: Tensor, expert_ids: Tensor, weights: Tensor, qe: QuantizedExperts, tiles: MoETiles | None = None,
    counts: Tensor | None = None,
) -> Tensor:
    """The Triton path (CUDA, or the interpreter for CPU tensors); four launches, no host sync."""
    check_routes(x, expert_ids, weights, qe.hidden)
    assert kernel_supports(x, expert_ids, qe), f"Triton MoE: {KERNEL_BITS} bits, even groups, <= {MAX_PAIRS} pairs"
    tiles = tiles or MoETiles()
    assert x.is_cuda or interpreting(), "the Triton MoE needs CUDA tensors (or TRITON_INTERPRET=1 for CPU ones)"
    kernels = _kernels()
    x = x.contiguous()
    assert counts is None or (counts.dtype == torch.float32 and counts.is_contiguous() and counts.device == x.device)
    if tiles.single_token_gemv and x.shape[0] == 1:
        return _single_token(kernels, x, expert_ids, weights, qe, tiles, counts)
    routes = _route(kernels, expert_ids, weights, counts)
    hidden_act = torch.empty(routes.pairs, qe.intermediate, device=x.device, dtype=x.dtype)  # [P, I]
    _launch_gemm(kernels, x, qe, routes, hidden_act, gate_up=True, tiles=tiles, split=1)
    split = _down_parts(qe, _block_k(qe.w2_group, tiles.block_k), tiles)
    pair_out = torch.empty(split, routes.pairs, qe.hidden, device=x.device, dtype=torch.float32)  # [S, P, D]
    _launch_gemm(kernels, hidden_act, qe, routes, pair_out, gate_up=False, tiles=tiles, split=split)
    return _combine(kernels, pair_out, routes, x.dtype)


@dataclass(frozen=True)
class _Routes:
    """Route-kernel outputs, indexed by sorted slot (pairs ordered by expert id)."""

    pairs: int
    active: int
    token: Tensor  # [P] int32
    expert: Tensor  # [P] int32
    weight: Tensor  # [P] fp32
    run_offset: Tensor  # [P] int32, position within the expert's run
    token_slots: Tensor  # [T, A] int32, each token's slots in ascending expert id


@dataclass(frozen=True)
class _Operand:
    """One GEMM of the layer as the kernels read it: gate/up (w13, D -> I) or down (w2, I -> D)."""

    w: Tensor
    scales: Tensor
    group: int
    k_dim: int
    n_out: int

    @staticmethod
    def of(qe: QuantizedExperts, gate_up: bool) -> _Operand:
        if gate_up:
            return _Operand(qe.w13, qe.w13_scales, qe.w13_group, qe.hidden, qe.intermediate)
        return _Operand(qe.w2, qe.w2_scales, qe.w2_group, qe.intermediate, qe.hidden)

    def k_part(self, block_k: int, split: int) -> int:
        """Elements of K per part: a whole number of K steps."""
        return triton_cdiv(triton_cdiv(self.k_dim, block_k), split) * block_k


def _down_parts(qe: QuantizedExperts, block_k: int, tiles: MoETiles) -> int:
    """The down GEMM's K parts: tiles.split_k_down, at most one per K step."""
    return max(1, min(tiles.split_k_down, triton_cdiv(qe.intermediate, block_k)))


def _out_strides(out: Tensor) -> tuple[int, int]:
    """(row, part) strides of a GEMM output: [rows, N], or [parts, rows, N] for a split one."""
    return (out.stride(1), out.stride(0)) if out.dim() == 3 else (out.stride(0), 0)


def _route(kernels: Any, expert_ids: Tensor, weights: Tensor, counts: Tensor | None = None) -> _Routes:
    num_tokens, active = expert_ids.shape
    pairs, device = num_tokens * active, expert_ids.device
    new = functools.partial(torch.empty, device=device, dtype=torch.int32)
    routes = _Routes(pairs, active, new(pairs), new(pairs), new(pairs, dtype=torch.float32), new(pairs),
                     new(num_tokens, active))  # fmt: skip
    block_pairs = max(16, _next_power_of_2(pairs))
    kernels.route[(1,)](
        expert_ids.contiguous(), weights.contiguous(), routes.token, routes.expert, routes.weight,
        routes.run_offset, routes.token_slots, routes.weight if counts is None else counts, pairs, ACTIVE=active,
        BLOCK_P=block_pairs, COUNT=counts is not None,
    )  # fmt: skip
    return routes


def _launch_gemm(
    kernels: Any, a: Tensor, qe: QuantizedExperts, routes: _Routes, out: Tensor, gate_up: bool, tiles: MoETiles,
    split: int,
) -> None:
    """Gate/up (a = x, rows by token; out h [P, I]) or down (a = h, rows by slot; out [split, P, D]) over the sorted
    pairs, in `split` K parts."""
    op = _Operand.of(qe, gate_up)
    block_n = tiles.block_n_gate_up if gate_up else tiles.block_n_down
    block_k = _block_k(op.group, tiles.block_k)
    grid = (routes.pairs, triton_cdiv(op.n_out, block_n), split)
    assert split == 1 or not gate_up, "the gate/up GEMM is not split (its parts would need adding before silu)"
    kernels.gemm[grid](
        a, a.stride(0), op.w, op.w.stride(0), op.w.stride(1), op.scales, op.scales.stride(0), op.scales.stride(1),
        out, *_out_strides(out), routes.token, routes.expert, routes.weight, routes.run_offset,
        routes.pairs, op.n_out, op.k_dim, op.k_part(block_k, split), qe.intermediate,
        GROUP=op.group, BITS=qe.bits, GATE_UP=gate_up, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
        SCALE_PER_TILE=op.group % block_k == 0, DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip


def _single_token(kernels: Any, x: Tensor, expert_ids: Tensor, weights: Tensor, qe: QuantizedExperts,
                  tiles: MoETiles, counts: Tensor | None = None) -> Tensor:
    """One token (the draft's step): its A experts are distinct, so no route kernel and no 16-row tiles. Three
    launches: gate/up GEMV (grid A x cdiv(I, BN)), down GEMV in K parts (A x cdiv(D, BN) x S), and a combine that adds
    parts and experts in ascending expert id, as the general path does."""
    active = expert_ids.shape[1]
    ids = expert_ids.reshape(-1).contiguous()
    route_weights = weights.reshape(-1).contiguous()
    hidden_act = torch.empty(active, qe.intermediate, device=x.device, dtype=x.dtype)  # [A, I]
    k_steps = triton_cdiv(qe.hidden, _gemv_block_k(qe.w13_group, tiles.block_k_gemv))
    split_gate_up = max(1, min(tiles.split_k_gemv_gate_up, k_steps))
    if split_gate_up == 1:  # the activation in the GEMV's epilogue
        _launch_gemv(kernels, x, ids, route_weights, qe, hidden_act, gate_up=True, tiles=tiles, split=1)
    else:  # K parts of gate and up in float32, added (in part order) before the activation by a second launch
        parts = torch.empty(split_gate_up, active, 2 * qe.intermediate, device=x.device, dtype=torch.float32)
        _launch_gemv(kernels, x, ids, route_weights, qe, parts, gate_up=True, tiles=tiles, split=split_gate_up)
        block = min(1024, _next_power_of_2(qe.intermediate))
        kernels.gemv_act[(active, triton_cdiv(qe.intermediate, block))](
            parts, parts.stride(0), hidden_act, qe.intermediate, PARTS=split_gate_up, BLOCK=block)
    split = _down_parts(qe, _gemv_block_k(qe.w2_group, tiles.block_k_gemv), tiles)
    pair_out = torch.empty(split, active, qe.hidden, device=x.device, dtype=torch.float32)  # [S, A, D]
    _launch_gemv(kernels, hidden_act, ids, route_weights, qe, pair_out, gate_up=False, tiles=tiles, split=split)
    out = torch.empty(1, qe.hidden, device=x.device, dtype=x.dtype)
    block_d = 256
    kernels.gemv_combine[(triton_cdiv(qe.hidden, block_d),)](
        pair_out, pair_out.stride(0), ids, out, pair_out if counts is None else counts, qe.hidden, ACTIVE=active,
        ACTIVE_POW2=max(2, _next_power_of_2(active)), PARTS=split, BLOCK_D=block_d, COUNT=counts is not None,
    )  # fmt: skip
    return out


def _launch_gemv(kernels: Any, a: Tensor, ids: Tensor, route_weights: Tensor, qe: QuantizedExperts, out: Tensor,
                 gate_up: bool, tiles: MoETiles, split: int) -> None:
    """Gate/up (a = x [1, D], out h [A, I]) or down (a = h [A, I], out [split, A, D] weighted fp32), one expert per
    program row."""
    op = _Operand.of(qe, gate_up)
    block_k = _gemv_block_k(op.group, tiles.block_k_gemv)
    grid = (ids.numel(), triton_cdiv(op.n_out, tiles.block_n_gemv), split)
    groups = block_k // op.group if block_k % op.group == 0 else 1  # whole groups per K step: a scale per group
    kernels.gemv[grid](
        a, 0 if gate_up else a.stride(0), op.w, op.w.stride(0), op.w.stride(1), op.scales, op.scales.stride(0),
        op.scales.stride(1), out, *_out_strides(out), ids, route_weights, op.n_out, op.k_dim, op.k_part(block_k, split),
        qe.intermediate, GROUP=op.group, BITS=qe.bits, GATE_UP=gate_up, BLOCK_N=tiles.block_n_gemv, BLOCK_K=block_k,
        SCALE_PER_TILE=op.group % block_k == 0, GROUPS=groups, PARTIAL=gate_up and split > 1,
        ROWS=tiles.block_n_gemv * (2 if gate_up else 1),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip


def _combine(kernels: Any, pair_out: Tensor, routes: _Routes, dtype: torch.dtype) -> Tensor:
    """pair_out [S', P, D]: each token's rows and parts added in a fixed order."""
    num_tokens, hidden = routes.token_slots.shape[0], pair_out.shape[2]
    out = torch.empty(num_tokens, hidden, device=pair_out.device, dtype=dtype)
    block_d = 256
    kernels.combine[(num_tokens, triton_cdiv(hidden, block_d))](
        pair_out, pair_out.stride(0), routes.token_slots, out, hidden, ACTIVE=routes.active, PARTS=pair_out.shape[0],
        BLOCK_D=block_d,
    )  # fmt: skip
    return out


def _block_k(group: int, preferred: int) -> int:
    """The K step: the largest power of two <= preferred dividing the group (>= 32 for tl.dot), else 64."""
    block = preferred
    while block >= 32:
        if group % block == 0:
            return block
        block //= 2
    return 64  # odd-sized groups: the kernel then reads a scale per element


def _gemv_block_k(group: int, preferred: int) -> int:
    """The GEMV's K step: `preferred` when it is a whole number of groups (longer contiguous reads per weight row,
    a scale per group), else as for the GEMM (a divisor of the group, one scale per row and step)."""
    return preferred if preferred % group == 0 else _block_k(group, preferred)


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def triton_cdiv(a: int, b: int) -> int:
    """Ceil division (kept here so callers need not import triton)."""
    return -(-a // b)


# ---------------------------------------------------------------------------------------------------------
# kernels: plain functions jitted on first use, so that importing this module does not need triton.


@dataclass(frozen=True)
class _KernelSet:
    route: Any
    gemm: Any
    combine: Any
    gemv: Any
    gemv_combine: Any
    gemv_act: Any


tl: Any = None  # triton.language, bound by _kernels(); the kernel bodies resolve it as a global


@functools.cache
def _kernels() -> _KernelSet:
    """The three kernels, jitted on first use (interpreted when TRITON_INTERPRET=1 was set before import)."""
    global tl
    import triton
    import triton.language

    tl = triton.language
    global _dequantized, _codes  # the kernels' shared helpers: jitted too, under the names they resolve
    _codes = triton.jit(_codes)
    _dequantized = triton.jit(_dequantized)
    log.debug("moe.triton.jit", interpret=interpreting())
    return _KernelSet(triton.jit(route_kernel), triton.jit(gemm_kernel), triton.jit(combine_kernel),
                      triton.jit(gemv_kernel), triton.jit(gemv_combine_kernel), triton.jit(gemv_act_kernel))


def interpreting() -> bool:
    """Triton's interpreter runs kernels on CPU tensors; it must be chosen by the environment before import."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def route_kernel(ids_ptr, weights_ptr, token_ptr, expert_ptr, weight_ptr, run_offset_ptr, token_slots_ptr,
                 counts_ptr, num_pairs, ACTIVE: tl.constexpr, BLOCK_P: tl.constexpr, COUNT: tl.constexpr):  # fmt: skip
    """One program: rank the pairs by (expert id, pair index) and write the sorted route tables (COUNT: and add one
    per pair to its expert's route counter)."""
    pair = tl.arange(0, BLOCK_P)
    valid = pair < num_pairs
    expert = tl.load(ids_ptr + pair, mask=valid, other=0).to(tl.int32)
    # Padding pairs sort after every real one, and the pair index breaks ties, so ranks are unique.
    key = tl.where(valid, expert * BLOCK_P + pair, (1 << 30) + pair)  # expert ids < 2^22
    before = key[None, :] < key[:, None]  # [p, q]: q sorts before p
    slot = tl.sum(before.to(tl.int32), axis=1)
    same_expert = expert[None, :] == expert[:, None]
    run_offset = tl.sum((before & same_expert).to(tl.int32), axis=1)
    token = pair // ACTIVE
    same_token = token[None, :] == token[:, None]
    rank_in_token = tl.sum((before & same_token).to(tl.int32), axis=1)
    tl.store(token_ptr + slot, token.to(tl.int32), mask=valid)
    tl.store(expert_ptr + slot, expert.to(tl.int32), mask=valid)
    tl.store(weight_ptr + slot, tl.load(weights_ptr + pair, mask=valid, other=0.0).to(tl.float32), mask=valid)
    tl.store(run_offset_ptr + slot, run_offset, mask=valid)
    tl.store(token_slots_ptr + token * ACTIVE + rank_in_token, slot, mask=valid)
    if COUNT:
        tl.atomic_add(counts_ptr + expert, tl.full((BLOCK_P,), 1.0, tl.float32), mask=valid)


def gemm_kernel(a_ptr, stride_a, w_ptr, stride_we, stride_wn, s_ptr, stride_se, stride_sg,
                out_ptr, stride_out, stride_out_part, token_ptr, expert_ptr, weight_ptr, run_offset_ptr,
                num_pairs, n_out, k_dim, k_part, intermediate,
                GROUP: tl.constexpr, BITS: tl.constexpr, GATE_UP: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_PER_TILE: tl.constexpr,
                DOT_PRECISION: tl.constexpr):  # fmt: skip
    """Grouped dequantizing GEMM of one expert chunk against BLOCK_N output columns over one K part of k_part
    elements (program_id 2; a deliberate long kernel).

    GATE_UP: a = x [T, D] (rows by token), weights w13, out = h [P, I] = silu(gate) * up (one part only).
    else:    a = h [P, I] (rows by slot), weights w2, out = [S, P, D] fp32, scaled by the routing weight.
    """
    slot = tl.program_id(0)
    if tl.load(run_offset_ptr + slot) % BLOCK_M != 0:
        return  # the program leading this chunk of the expert's run computes this pair
    part = tl.program_id(2)
    k_begin = part * k_part
    k_end = tl.minimum(k_begin + k_part, k_dim)
    expert = tl.load(expert_ptr + slot).to(tl.int64)
    rows = slot + tl.arange(0, BLOCK_M)
    row_ok = rows < num_pairs
    row_ok = row_ok & (tl.load(expert_ptr + rows, mask=row_ok, other=-1) == expert)
    if GATE_UP:
        a_rows = tl.load(token_ptr + rows, mask=row_ok, other=0)
    else:
        a_rows = rows
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_out
    if GATE_UP:  # interleave gate row c and up row I + c so one tile (and one dot) serves both
        half = tl.arange(0, 2)
        w_rows = tl.reshape(cols[:, None] + intermediate * half[None, :], (2 * BLOCK_N,))
        w_ok = tl.reshape(col_ok[:, None] & (half[None, :] < 2), (2 * BLOCK_N,))
        acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
    else:
        w_rows = cols
        w_ok = col_ok
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_base = w_ptr + expert * stride_we + w_rows.to(tl.int64) * stride_wn  # [W]
    s_base = s_ptr + expert * stride_se + w_rows  # [W]; scales are [E, G, N]
    pair_idx = tl.arange(0, BLOCK_K // 2)
    a_row_base = a_ptr + a_rows[:, None].to(tl.int64) * stride_a
    for k0 in range(k_begin, k_end, BLOCK_K):
        k_even = k0 + 2 * pair_idx  # even k in the low nibble, odd k in the high one
        even_ok = k_even < k_dim
        odd_ok = k_even + 1 < k_dim
        a_even = tl.load(a_row_base + k_even[None, :], mask=row_ok[:, None] & even_ok[None, :], other=0.0)
        a_odd = tl.load(a_row_base + k_even[None, :] + 1, mask=row_ok[:, None] & odd_ok[None, :], other=0.0)
        w_even, w_odd = _dequantized(w_base, s_base, k0, k_even, pair_idx, w_ok, even_ok, odd_ok, k_dim, stride_sg,
                                     GROUP, BITS, SCALE_PER_TILE)  # fmt: skip
        w_even = w_even.to(a_ptr.dtype.element_ty)
        w_odd = w_odd.to(a_ptr.dtype.element_ty)
        acc += tl.dot(a_even, tl.trans(w_even), input_precision=DOT_PRECISION)
        acc += tl.dot(a_odd, tl.trans(w_odd), input_precision=DOT_PRECISION)
    out_rows = out_ptr + part * stride_out_part + rows[:, None].to(tl.int64) * stride_out
    out_mask = row_ok[:, None] & col_ok[None, :]
    if GATE_UP:
        gate, up = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2)))
        result = gate * tl.sigmoid(gate) * up
    else:
        route_weight = tl.load(weight_ptr + rows, mask=row_ok, other=0.0)
        result = acc * route_weight[:, None]
    tl.store(out_rows + cols[None, :], result.to(out_ptr.dtype.element_ty), mask=out_mask)


def _codes(w_base, k0, k_even, pair_idx, w_ok, even_ok, odd_ok, k_dim, BITS: tl.constexpr):
    """Float32 levels (code + 0.5, unscaled) of one tile at the even and the odd k of a K step: rows w_base [W]."""
    w_mask = w_ok[:, None] & even_ok[None, :]
    if BITS == 4:  # K is even (an even group divides it): a mask on the contiguous byte index keeps loads vectorised
        byte = k0 // 2 + pair_idx
        packed = tl.load(w_base[:, None] + byte[None, :], mask=w_ok[:, None] & (byte < k_dim // 2)[None, :], other=0)
        q_even = (packed & 0xF).to(tl.float32) - 7.5  # stored code + 8; level (code + 0.5) * scale
        q_odd = (packed >> 4).to(tl.float32) - 7.5
    elif BITS == 2:  # four codes a byte (code + 2, two bits each from the low end): a pair shares its byte
        packed = tl.load(w_base[:, None] + (k_even // 4)[None, :], mask=w_mask, other=0).to(tl.int32)
        shift = ((k_even % 4) * 2)[None, :]
        q_even = ((packed >> shift) & 0x3).to(tl.float32) - 1.5
        q_odd = ((packed >> (shift + 2)) & 0x3).to(tl.float32) - 1.5
    elif BITS == 3:  # eight codes in a 24-bit little-endian word of three bytes (code + 4, three bits each)
        unit = w_base[:, None] + ((k_even // 8) * 3)[None, :]
        word = (tl.load(unit, mask=w_mask, other=0).to(tl.int32)
                | (tl.load(unit + 1, mask=w_mask, other=0).to(tl.int32) << 8)
                | (tl.load(unit + 2, mask=w_mask, other=0).to(tl.int32) << 16))  # fmt: skip
        shift = ((k_even % 8) * 3)[None, :]
        q_even = ((word >> shift) & 0x7).to(tl.float32) - 3.5
        q_odd = ((word >> (shift + 3)) & 0x7).to(tl.float32) - 3.5
    else:
        q_even = tl.load(w_base[:, None] + k_even[None, :], mask=w_mask, other=0).to(tl.float32) + 0.5
        q_odd = tl.load(w_base[:, None] + k_even[None, :] + 1, mask=w_ok[:, None] & odd_ok[None, :],
                        other=0).to(tl.float32) + 0.5  # fmt: skip
    return q_even, q_odd


def _dequantized(w_base, s_base, k0, k_even, pair_idx, w_ok, even_ok, odd_ok, k_dim, stride_sg, GROUP: tl.constexpr,
                 BITS: tl.constexpr, SCALE_PER_TILE: tl.constexpr):  # fmt: skip
    """Float32 weights of one tile at the even and the odd k of a K step: rows w_base [W], scales s_base [W]. (The
    pair k, k + 1 shares one scale: groups are even, see kernel_supports.)"""
    q_even, q_odd = _codes(w_base, k0, k_even, pair_idx, w_ok, even_ok, odd_ok, k_dim, BITS)
    if SCALE_PER_TILE:
        scale = tl.load(s_base + (k0 // GROUP) * stride_sg, mask=w_ok, other=0.0).to(tl.float32)[:, None]
    else:
        scale = tl.load(s_base[:, None] + ((k_even // GROUP) * stride_sg)[None, :], mask=w_ok[:, None] & even_ok[None, :],
                        other=0.0).to(tl.float32)  # fmt: skip
    return q_even * scale, q_odd * scale


def combine_kernel(pair_out_ptr, stride_part, token_slots_ptr, out_ptr, hidden, ACTIVE: tl.constexpr,
                   PARTS: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    """out[t] = sum of token t's pair rows (each the sum of its K parts in order), added in ascending expert id
    (fixed order, no atomics)."""
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < hidden
    total = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for j in tl.static_range(0, ACTIVE):
        slot = tl.load(token_slots_ptr + token * ACTIVE + j).to(tl.int64)
        row = tl.load(pair_out_ptr + slot * hidden + cols, mask=col_ok, other=0.0)
        for index in tl.static_range(1, PARTS):
            row += tl.load(pair_out_ptr + index * stride_part + slot * hidden + cols, mask=col_ok, other=0.0)
        total += row
    tl.store(out_ptr + token * hidden + cols, total.to(out_ptr.dtype.element_ty), mask=col_ok)


def gemv_kernel(a_ptr, stride_a, w_ptr, stride_we, stride_wn, s_ptr, stride_se, stride_sg,
                out_ptr, stride_out, stride_out_part, ids_ptr, weights_ptr, n_out, k_dim, k_part, intermediate,
                GROUP: tl.constexpr, BITS: tl.constexpr, GATE_UP: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, SCALE_PER_TILE: tl.constexpr, GROUPS: tl.constexpr,
                PARTIAL: tl.constexpr, ROWS: tl.constexpr):  # fmt: skip
    """One token's expert (program_id 0) against BLOCK_N output rows over one K part: products and sums in float32
    on the CUDA cores, no 16-row padding. GATE_UP: a = x (stride_a 0: every expert reads the one row), out = h [A, I]
    = silu(gate) * up in a's dtype, or with PARTIAL the part's raw gate and up, out [S, A, 2I] float32 (gemv_act adds
    the parts). Else: a = h [A, I], out = [S, A, D] fp32 scaled by the routing weight. GROUPS > 1: a K step spans that
    many whole groups; levels times activations are summed per group, then scaled (one scale load per group). ROWS:
    weight rows per program (2 * BLOCK_N for gate/up, else BLOCK_N)."""
    pair = tl.program_id(0)
    part = tl.program_id(2)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    k_begin = part * k_part
    k_end = tl.minimum(k_begin + k_part, k_dim)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_out
    if GATE_UP:  # gate row c and up row I + c interleaved: rows 2c and 2c + 1 of the tile
        half = tl.arange(0, 2)
        w_rows = tl.reshape(cols[:, None] + intermediate * half[None, :], (2 * BLOCK_N,))
        w_ok = tl.reshape(col_ok[:, None] & (half[None, :] < 2), (2 * BLOCK_N,))
    else:
        w_rows = cols
        w_ok = col_ok
    if GROUPS > 1:
        acc = tl.zeros((ROWS, GROUPS), dtype=tl.float32)
    else:
        acc = tl.zeros((ROWS, BLOCK_K // 2), dtype=tl.float32)
    w_base = w_ptr + expert * stride_we + w_rows.to(tl.int64) * stride_wn
    s_base = s_ptr + expert * stride_se + w_rows
    a_row = a_ptr + pair.to(tl.int64) * stride_a
    pair_idx = tl.arange(0, BLOCK_K // 2)
    for k0 in range(k_begin, k_end, BLOCK_K):
        k_even = k0 + 2 * pair_idx
        even_ok = k_even < k_dim
        odd_ok = k_even + 1 < k_dim
        a_even = tl.load(a_row + k_even, mask=even_ok, other=0.0).to(tl.float32)
        a_odd = tl.load(a_row + k_even + 1, mask=odd_ok, other=0.0).to(tl.float32)
        if GROUPS > 1:
            q_even, q_odd = _codes(w_base, k0, k_even, pair_idx, w_ok, even_ok, odd_ok, k_dim, BITS)
            levels = q_even * a_even[None, :] + q_odd * a_odd[None, :]  # [ROWS, BLOCK_K / 2]
            per_group = tl.sum(tl.reshape(levels, (ROWS, GROUPS, BLOCK_K // (2 * GROUPS))), axis=2)
            group_idx = k0 // GROUP + tl.arange(0, GROUPS)
            scale = tl.load(s_base[:, None] + (group_idx * stride_sg)[None, :],
                            mask=w_ok[:, None] & (group_idx * GROUP < k_dim)[None, :], other=0.0).to(tl.float32)
            acc += per_group * scale
        else:
            w_even, w_odd = _dequantized(w_base, s_base, k0, k_even, pair_idx, w_ok, even_ok, odd_ok, k_dim,
                                         stride_sg, GROUP, BITS, SCALE_PER_TILE)  # fmt: skip
            acc += w_even * a_even[None, :] + w_odd * a_odd[None, :]
    total = tl.sum(acc, axis=1)
    out_row = out_ptr + part * stride_out_part + pair.to(tl.int64) * stride_out
    if GATE_UP:
        gate, up = tl.split(tl.reshape(total, (BLOCK_N, 2)))
        if PARTIAL:
            tl.store(out_row + cols, gate, mask=col_ok)
            tl.store(out_row + intermediate + cols, up, mask=col_ok)
        else:
            tl.store(out_row + cols, (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty), mask=col_ok)
    else:
        tl.store(out_row + cols, total * tl.load(weights_ptr + pair).to(tl.float32), mask=col_ok)


def gemv_act_kernel(parts_ptr, stride_part, out_ptr, intermediate, PARTS: tl.constexpr, BLOCK: tl.constexpr):
    """Program (expert of the token, column block): gate and up summed over the K parts in part order, then
    h = silu(gate) * up in out's dtype."""
    pair = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < intermediate
    row = parts_ptr + pair * 2 * intermediate
    gate = tl.load(row + cols, mask=ok, other=0.0)
    up = tl.load(row + intermediate + cols, mask=ok, other=0.0)
    for index in tl.static_range(1, PARTS):
        gate += tl.load(row + index * stride_part + cols, mask=ok, other=0.0)
        up += tl.load(row + index * stride_part + intermediate + cols, mask=ok, other=0.0)
    tl.store(out_ptr + pair * intermediate + cols, (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty), mask=ok)


def gemv_combine_kernel(pair_out_ptr, stride_part, ids_ptr, out_ptr, counts_ptr, hidden, ACTIVE: tl.constexpr,
                        ACTIVE_POW2: tl.constexpr, PARTS: tl.constexpr, BLOCK_D: tl.constexpr,
                        COUNT: tl.constexpr):  # fmt: skip
    """The one token's output: its experts' rows (each the sum of its parts) added in ascending expert id (COUNT: the
    first program adds one to each of its experts' route counters)."""
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < hidden
    lanes = tl.arange(0, ACTIVE_POW2)
    lane_ok = lanes < ACTIVE
    ids = tl.load(ids_ptr + lanes, mask=lane_ok, other=0)
    if COUNT:
        if tl.program_id(0) == 0:
            tl.atomic_add(counts_ptr + ids, tl.full((ACTIVE_POW2,), 1.0, tl.float32), mask=lane_ok)
    before = (ids[None, :] < ids[:, None]) | ((ids[None, :] == ids[:, None]) & (lanes[None, :] < lanes[:, None]))
    rank = tl.sum((before & lane_ok[None, :]).to(tl.int32), axis=1)  # [lane]: its place in ascending id order
    total = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for j in tl.static_range(0, ACTIVE):
        pair = tl.sum(tl.where((rank == j) & lane_ok, lanes, 0), axis=0).to(tl.int64)
        row = tl.load(pair_out_ptr + pair * hidden + cols, mask=col_ok, other=0.0)
        for index in tl.static_range(1, PARTS):
            row += tl.load(pair_out_ptr + index * stride_part + pair * hidden + cols, mask=col_ok, other=0.0)
        total += row
    tl.store(out_ptr + cols, total.to(out_ptr.dtype.element_ty), mask=col_ok)
