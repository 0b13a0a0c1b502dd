"""The draft's one-row layer in few launches (KernelTuning.row_kernels): Triton GEMVs with their neighbours folded in.

The graphed draft step is one row per layer, and in a CUDA graph each node costs about 1-2 us whatever its size
(docs/journal.md, ninth session: ~18 nodes per Qwen2-MoE layer, ~21 us of them small). Here a Qwen2-MoE-style
layer (a shared expert, its sigmoid gate, int4 routed experts) runs as seven launches instead of ~18:

1. `norm_linear`: RMSNorm in the GEMV's prologue (each program normalises the row itself, from L2), the q/k/v
   product over the packed weights, the bias in the epilogue (replaces the norm and cuBLAS's product).
2. RoPE + KV writes and 3. attention (specter.model.fused; attention merges its runs in its own launch with the
   static step's per-layer counters, KernelTuning.merge_in_launch).
4. `linear_residual`: the o_proj product with the residual added in its epilogue (replaces cuBLAS's addend copy
   and product).
5. `norm_ffn_input`: RMSNorm prologue, the packed product of the shared expert's gate and up, the router and the
   shared gate; gate and up rows are read by the same program and leave as silu(gate) * up; the router's and the
   gate's logits leave as they are; the program 0 also stores the normalised row (the routed experts' input). The
   router's rows run in the first programs, and the last of them to finish takes the router's top-k, writes the
   picks and counts the routes (`Select`, RowTiles.topk_in_router). A layer without a shared expert runs
   `norm_router` instead: the same launch with the router's rows alone.
6. `moe_gate_up`: the int4 gate/up GEMV of each pick's expert with the activation in the epilogue (replaces top-k,
   the gate/up GEMV, its K parts' activation launch). With RowTiles.int8_gate_up (on) each K step quantises h to
   int8 per weight group and sums codes x activations in int32 by dp4a, four per instruction (`_int4_rows_int8`):
   the float path spent ~8 instructions per code and was issue-bound (H200: 12.5 -> 7.2 us alone). With
   topk_in_router off every program takes the top-k itself (softmax over E logits) before its first weight load, and
   program 0 writes the picks and counts the routes.
7. `moe_finish`: per block of output rows, the routed experts' int4 down products (rows of all picks, weighted and
   added in ascending expert id), the shared expert's bf16 down product times its sigmoid gate (none without a shared
   expert), and the residual, rounded once (replaces the down GEMV, the combine, the routed + residual add, the
   addend copy, the shared down product and its split-K reduction).

The float int4 GEMVs read the packed codes as bytes (even k in the low nibble: `moe_gate_up` without int8) or as
32-bit words (8 codes each, code k at bits 4 (k % 8) of word k // 8, as the bytes lie: `moe_finish` by default; RowTiles.
words_gate_up / words_finish; H200: words cost gate/up 51.9 us against 14.3, bytes cost the finish 24.5 against 17.1),
and turn a code c into a float by the exponent trick (c | 0x4B000000 is 2^23 + c), not by an integer-to-float
conversion; a group's sum is scale * (sum c * a - 7.5 * sum a) (stored code c = q + 8, level
q + 0.5). Every float sum is float32; nothing here is exact (the draft never is; the verify is).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from specter.config import RowTiles
from specter.model import fused
from specter.quant.groupwise import QuantizedExperts

tl: Any = None  # triton.language, bound by _kernels()
_top_k: Any = None  # fused's jitted router selection, bound by _kernels()


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def int4_block_k(k_dim: int, group: int, preferred: int) -> int | None:
    """The int4 GEMV's K step for rows of k_dim codes in groups of `group`: the largest power of two <= preferred
    (and <= k_dim rounded up to one) of at least 8 that is a whole number of groups or divides a group; None if none."""
    block = min(preferred, _pow2(k_dim))
    while block >= 8:
        if block % group == 0 or group % block == 0:
            return block
        block //= 2
    return None


def supports(qe: QuantizedExperts, tiles: RowTiles | None = None) -> bool:
    """Whether moe_gate_up / moe_finish take these experts: int4, rows of whole 32-bit words, a usable K step."""
    tiles = tiles or RowTiles()
    return (qe.bits == 4 and qe.hidden % 8 == 0 and qe.intermediate % 8 == 0
            and qe.w13.stride(-1) == 1 and qe.w2.stride(-1) == 1
            and int4_block_k(qe.hidden, qe.w13_group, tiles.block_k_gate_up) is not None
            and int4_block_k(qe.intermediate, qe.w2_group, tiles.block_k_moe) is not None)  # fmt: skip


def int8_finish_fits(qe: QuantizedExperts, tiles: RowTiles | None = None) -> bool:
    """Whether moe_finish can take gate/up's output in int8 (RowTiles.int8_finish): a scale group of block_n_moe
    columns (a multiple of 8: whole words) that divides the intermediate size, the finish's K step and the down
    weights' group."""
    tiles = tiles or RowTiles()
    group = tiles.block_n_moe
    block_k = int4_block_k(qe.intermediate, qe.w2_group, tiles.block_k_moe)
    return (supports(qe, tiles) and group % 8 == 0 and qe.intermediate % group == 0 and block_k is not None
            and block_k % group == 0 and qe.w2_group % group == 0)  # fmt: skip


@dataclass(frozen=True)
class Int8Act:
    """gate/up's output [A, I] in int8 for moe_finish's dp4a path: per pick, word j holds codes a8[8j + 2i] (`even`)
    and a8[8j + 2i + 1] (`odd`) in byte i, the order in which the int4 down weights' word j splits into low and high
    nibbles; `scale` [A, I / group] float32 per block of `group` columns (absmax / 127) and `bias` = 7.5 * scale *
    (the block's sum of codes), the stored codes' offset."""

    even: Tensor  # [A, I / 8] int32
    odd: Tensor  # [A, I / 8] int32
    scale: Tensor  # [A, I / group] float32
    bias: Tensor  # [A, I / group] float32
    group: int

    @staticmethod
    def empty(picks: int, inter: int, group: int, device: torch.device) -> Int8Act:
        words = torch.empty(2, picks, inter // 8, dtype=torch.int32, device=device)
        blocks = torch.empty(2, picks, inter // group, dtype=torch.float32, device=device)
        return Int8Act(words[0], words[1], blocks[0], blocks[1], group)


def _evict(tiles: RowTiles) -> str:
    """The weight loads' eviction policy (a kernel constant)."""
    return "evict_first" if tiles.evict_first else ""


def _words(packed: Tensor) -> Tensor:
    """The packed int4 codes [E, N, K/2] uint8 viewed as [E, N, K/8] int32 (no copy)."""
    return packed.view(torch.int32)


def _check_row(x: Tensor, width: int) -> Tensor:
    assert x.dim() == 2 and x.shape == (1, width), f"a one-row kernel takes [1, {width}], got {tuple(x.shape)}"
    return x.contiguous()


@dataclass(frozen=True)
class Select:
    """The router's top-k taken inside the input product's launch (RowTiles.topk_in_router): the program that
    finishes the router's rows last (counted on `sync`, an int32 [1] zero that it sets back to zero) takes the
    softmax's top_k of the logits the others stored, writes `ids` [top_k] int32 and `weights` [top_k] float32 (rounded
    to the activations' dtype, as the router's are) and adds one per pick to `counts` [E] float32 when given.

    A counter serves one launch at a time: two launches sharing it on two streams at once would miscount (like the
    route counter, the draft's counters serve one draft step at a time)."""

    experts: int  # the router's rows: the first `experts` of the product's tail
    top_k: int
    renormalize: bool
    sync: Tensor
    ids: Tensor
    weights: Tensor
    counts: Tensor | None = None

    @staticmethod
    def new(experts: int, top_k: int, renormalize: bool, sync: Tensor, counts: Tensor | None = None) -> Select:
        assert sync.dtype == torch.int32 and sync.numel() == 1, "the sync counter is an int32 [1] zero"
        ids = torch.empty(top_k, dtype=torch.int32, device=sync.device)
        weights = torch.empty(top_k, dtype=torch.float32, device=sync.device)
        return Select(experts, top_k, renormalize, sync, ids, weights, counts)

    def args(self, dummy: Tensor) -> tuple[tuple[Tensor, ...], dict[str, Any]]:
        """The kernel's (ids, weights, counts, sync) pointers and its SELECT constants."""
        counts, experts = self.counts, self.experts
        assert counts is None or (counts.dtype == torch.float32 and counts.is_contiguous() and counts.numel() == experts)
        assert 1 <= self.top_k <= experts
        return ((self.ids, self.weights, dummy if counts is None else counts, self.sync),
                dict(SELECT=True, COUNT=counts is not None, TOP_K=self.top_k, TOP_K_POW2=max(2, _pow2(self.top_k)),
                     RENORMALIZE=self.renormalize, BLOCK_E=_pow2(experts)))  # fmt: skip


def _gemv_launch(tiles: RowTiles, k_dim: int) -> dict[str, Any]:
    """norm_gemv's K step, the row's padded width, the weight loads' policy and the launch parameters (every caller
    alike)."""
    return dict(BLOCK_K=min(tiles.block_k, _pow2(k_dim)), BLOCK_X=_pow2(k_dim), EVICT=_evict(tiles),
                num_warps=tiles.num_warps, num_stages=tiles.num_stages)  # fmt: skip


def _no_select(dummy: Tensor) -> tuple[tuple[Tensor, ...], dict[str, Any]]:
    return (dummy, dummy, dummy, dummy), dict(SELECT=False, COUNT=False, TOP_K=1, TOP_K_POW2=2, RENORMALIZE=False,
                                             BLOCK_E=2)  # fmt: skip


def norm_linear(x: Tensor, norm_weight: Tensor, eps: float, weight: Tensor, bias: Tensor | None, rows: int,
                tiles: RowTiles | None = None) -> Tensor:  # fmt: skip
    """F.linear(rms_norm(x, norm_weight, eps), weight[:rows], bias[:rows]) for one row x [1, K] -> [1, rows] in x's
    dtype: one launch (the normalised row rounded as rms_norm rounds it, the product in float32)."""
    tiles = tiles or RowTiles()
    k_dim = weight.shape[1]
    x = _check_row(x, k_dim)
    assert weight.stride(1) == 1 and rows <= weight.shape[0] and norm_weight.dtype == x.dtype
    out = torch.empty(1, rows, dtype=x.dtype, device=x.device)
    grid = (-(-rows // tiles.block_n),)
    pointers, constants = _no_select(x)
    _kernels().norm_gemv[grid](
        x, norm_weight, weight, weight.stride(0), weight if bias is None else bias, x, out, out, out, *pointers, rows,
        k_dim, 0, 1, eps, **constants, NORM=True, BIAS=bias is not None, RESIDUAL=False, GATED=False, STORE_H=False,
        BLOCK_N=tiles.block_n, ROWS=tiles.block_n, **_gemv_launch(tiles, k_dim),
    )  # fmt: skip
    return out


def linear_residual(x: Tensor, weight: Tensor, residual: Tensor, tiles: RowTiles | None = None) -> Tensor:
    """residual + F.linear(x, weight) for one row x [1, K], weight [N, K], residual [1, N] -> [1, N] in the residual's
    dtype, rounded once: one launch."""
    tiles = tiles or RowTiles()
    rows, k_dim = weight.shape
    x = _check_row(x, k_dim)
    residual = _check_row(residual, rows)
    assert weight.stride(1) == 1
    out = torch.empty_like(residual)
    pointers, constants = _no_select(x)
    block_n = tiles.block_n_residual
    residual_tiles = tiles.model_copy(update={"block_k": tiles.block_k_residual})  # (a copy: no validation)
    _kernels().norm_gemv[(-(-rows // block_n),)](
        x, x, weight, weight.stride(0), x, residual, out, out, out, *pointers, rows, k_dim, 0, 1, 0.0, **constants,
        NORM=False, BIAS=False, RESIDUAL=True, GATED=False, STORE_H=False, BLOCK_N=block_n, ROWS=block_n,
        **_gemv_launch(residual_tiles, k_dim),
    )  # fmt: skip
    return out


def norm_ffn_input(x: Tensor, norm_weight: Tensor, eps: float, weight: Tensor, inter: int, tail: int,
                   tiles: RowTiles | None = None, select: Select | None = None) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """A packed FFN input product of one row x [1, D]: weight rows [0, I) the shared expert's gate, [I, 2I) its up,
    then `tail` rows (the router, the shared gate), then padding. Returns h = rms_norm(x) [1, D], silu(gate) * up
    [1, I] (float32 products, rounded once) and the tail's outputs [1, tail] (rounded to x's dtype, as a product in
    x's dtype would be): one launch. With `select`, the router's top-k of the tail's first select.experts outputs is
    taken in the same launch."""
    tiles = tiles or RowTiles()
    x = _check_row(x, weight.shape[1])
    assert weight.shape[0] >= 2 * inter + tail
    act = torch.empty(1, inter, dtype=x.dtype, device=x.device)
    h, tail_out = _input_product(x, norm_weight, eps, weight, inter, tail, act, tiles, select)
    return h, act, tail_out


def norm_router(x: Tensor, norm_weight: Tensor, eps: float, router: Tensor, tiles: RowTiles | None = None,
                select: Select | None = None) -> tuple[Tensor, Tensor]:  # fmt: skip
    """h = rms_norm(x) [1, D] and the router's logits F.linear(h, router) [1, E] (rounded to x's dtype) for a layer
    without a shared expert: `norm_ffn_input`'s kernel with no gate/up rows, one launch (with `select`, the top-k
    too)."""
    tiles = tiles or RowTiles()
    x = _check_row(x, router.shape[1])
    assert select is None or select.experts == router.shape[0]
    return _input_product(x, norm_weight, eps, router, 0, router.shape[0], x, tiles, select)


def _input_product(x: Tensor, norm_weight: Tensor, eps: float, weight: Tensor, inter: int, tail: int, act: Tensor,
                   tiles: RowTiles, select: Select | None) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The gated launch of norm_gemv: the tail's programs first (the router's rows, then any after them), then the
    gate/up pairs'. Returns (h, tail outputs). (The norm weight has x's dtype: the normalised row is rounded to it,
    where rms_norm would round to the promoted dtype.)"""
    assert weight.stride(1) == 1 and norm_weight.dtype == x.dtype
    h = torch.empty_like(x)
    tail_out = torch.empty(1, tail, dtype=x.dtype, device=x.device)
    block_n = tiles.block_n_input
    assert select is None or select.experts <= tail
    pointers, constants = _no_select(x) if select is None else select.args(x)
    grid = (-(-inter // block_n) + -(-tail // (2 * block_n)),)
    _kernels().norm_gemv[grid](
        x, norm_weight, weight, weight.stride(0), x, x, act, h, tail_out, *pointers, 2 * inter + tail, weight.shape[1],
        inter, 1 if select is None else select.experts, eps, **constants, NORM=True, BIAS=False, RESIDUAL=False,
        GATED=True, STORE_H=True, BLOCK_N=block_n, ROWS=2 * block_n, **_gemv_launch(tiles, weight.shape[1]),
    )  # fmt: skip
    return h, tail_out


def moe_gate_up(h: Tensor, logits: Tensor | None, qe: QuantizedExperts, top_k: int, renormalize: bool,
                counts: Tensor | None = None, tiles: RowTiles | None = None, picks: Select | None = None,
                int8_act: bool = False) -> tuple[Tensor, ...]:  # fmt: skip
    """The routed experts' first half for one row h [1, D] with router logits [1, E]: the top_k of their float32
    softmax (renormalised when asked; weights rounded to h's dtype, as the router's are), then per pick
    silu(gate h) * up h. Returns act [top_k, I] in h's dtype (row j: the j-th pick), the picks' expert ids [top_k]
    int32 and weights [top_k] float32. counts [E] float32, when given, gets one per pick. One launch.
    With `picks` (a Select the input product filled in), its picks are taken as they are (logits, renormalize and
    counts unused: the Select counted them). With `int8_act` (int8_finish_fits), a fourth result: the output in int8
    for moe_finish (Int8Act), stored by the same launch."""
    tiles = tiles or RowTiles()
    h = _check_row(h, qe.hidden)
    experts = qe.num_experts
    assert 1 <= top_k <= experts and supports(qe, tiles)
    assert picks is not None or (logits is not None and logits.numel() == experts), "router logits [1, E], or picks"
    assert picks is None or (picks.top_k == top_k and picks.experts == experts)
    assert counts is None or (counts.dtype == torch.float32 and counts.is_contiguous() and counts.numel() == experts)
    assert qe.w13_scales.stride(2) == 1
    act = torch.empty(top_k, qe.intermediate, dtype=h.dtype, device=h.device)
    if picks is not None:
        ids, weights, logits, counts = picks.ids, picks.weights, h, None
    else:
        ids = torch.empty(top_k, dtype=torch.int32, device=h.device)
        weights = torch.empty(top_k, dtype=torch.float32, device=h.device)
    assert logits is not None
    block_k = int4_block_k(qe.hidden, qe.w13_group, tiles.block_k_gate_up)
    assert block_k is not None
    int8 = tiles.int8_gate_up
    words = _words(qe.w13) if tiles.words_gate_up or int8 else qe.w13
    grid = (top_k, -(-qe.intermediate // tiles.block_n_moe))
    assert not int8_act or int8_finish_fits(qe, tiles), "int8_act: block_n_moe must fit the shapes (int8_finish_fits)"
    quantized = Int8Act.empty(top_k, qe.intermediate, tiles.block_n_moe, h.device) if int8_act else None
    q8 = (weights,) * 4 if quantized is None else (quantized.even, quantized.odd, quantized.scale, quantized.bias)
    _kernels().moe_gate_up[grid](
        h, logits.contiguous(), words, words.stride(0), words.stride(1), qe.w13_scales, qe.w13_scales.stride(0),
        qe.w13_scales.stride(1), act, *q8, ids, weights, weights if counts is None else counts, experts, qe.intermediate,
        qe.hidden, TOP_K=top_k, TOP_K_POW2=max(2, _pow2(top_k)), RENORMALIZE=renormalize, COUNT=counts is not None,
        PICKED=picks is not None, BLOCK_E=_pow2(experts), GROUP=qe.w13_group, BLOCK_N=tiles.block_n_moe, BLOCK_K=block_k,
        GROUPS=max(1, block_k // qe.w13_group), WORDS=tiles.words_gate_up or int8, INT8_A=int8, DP4A=h.is_cuda and tiles.dp4a,
        STORE_Q8=int8_act, EVICT=_evict(tiles), num_warps=tiles.warps_moe, num_stages=tiles.num_stages,
    )  # fmt: skip
    return (act, ids, weights) if quantized is None else (act, ids, weights, quantized)


def moe_finish(x: Tensor, act: Tensor, ids: Tensor, weights: Tensor, qe: QuantizedExperts, shared_act: Tensor | None,
               shared_down: Tensor | None, gate_logit: Tensor | None, tiles: RowTiles | None = None,
               act_int8: Int8Act | None = None) -> Tensor:  # fmt: skip
    """x + sum over the picks in ascending expert id of weight * down(act row) + sigmoid(gate_logit) *
    shared_down @ shared_act, for one row x [1, D] (act [A, I], ids [A], weights [A] from moe_gate_up; shared_act
    [1, S] and shared_down [D, S], or both None: no shared expert; gate_logit [1, 1] or None: no gate). [1, D] in x's
    dtype, rounded once; one launch. With `act_int8` (moe_gate_up's int8_act result) the routed rows are summed
    against it in int32 by dp4a instead of against act in float."""
    tiles = tiles or RowTiles()
    x = _check_row(x, qe.hidden)
    top_k = ids.numel()
    shared = shared_down is not None
    assert shared == (shared_act is not None), "the shared expert's activation and down weight come together"
    if shared_down is not None and shared_act is not None:
        shared_inter = shared_down.shape[1]
        shared_act = _check_row(shared_act, shared_inter)
        assert shared_down.shape[0] == qe.hidden and shared_down.stride(1) == 1
    else:
        shared_inter, shared_act, shared_down = 1, x, x  # (never read)
    assert act.shape == (top_k, qe.intermediate) and act.is_contiguous() and weights.numel() == top_k
    assert supports(qe, tiles)
    assert qe.w2_scales.stride(2) == 1
    out = torch.empty_like(x)
    block_k = int4_block_k(qe.intermediate, qe.w2_group, tiles.block_k_moe)
    assert block_k is not None
    int8 = act_int8 is not None
    if act_int8 is not None:
        assert act_int8.group % 8 == 0 and block_k % act_int8.group == 0 and qe.w2_group % act_int8.group == 0
        assert act_int8.even.shape == (top_k, qe.intermediate // 8) and act_int8.even.is_contiguous()
        q8 = (act_int8.even, act_int8.odd, act_int8.scale, act_int8.bias)
    else:
        q8 = (weights,) * 4  # (never read)
    words = _words(qe.w2) if tiles.words_finish or int8 else qe.w2
    _kernels().moe_finish[(-(-qe.hidden // tiles.block_n_finish),)](
        x, act, *q8, ids, weights, words, words.stride(0), words.stride(1), qe.w2_scales, qe.w2_scales.stride(0),
        qe.w2_scales.stride(1), shared_act, shared_down, shared_down.stride(0), x if gate_logit is None else gate_logit,
        out, qe.hidden, qe.intermediate, shared_inter, TOP_K=top_k, TOP_K_POW2=max(2, _pow2(top_k)),
        SHARED=shared, GATED=gate_logit is not None, GROUP=qe.w2_group, BLOCK_N=tiles.block_n_finish, BLOCK_K=block_k,
        GROUPS=max(1, block_k // qe.w2_group), BLOCK_KS=min(tiles.block_k_shared, _pow2(shared_inter)),
        WORDS=tiles.words_finish or int8, INT8_A=int8, AGROUP=act_int8.group if act_int8 is not None else 8,
        DP4A=x.is_cuda and tiles.dp4a, EVICT=_evict(tiles), num_warps=tiles.warps_finish, num_stages=tiles.num_stages,
    )  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------------------
# kernels: plain functions jitted on first use, so that importing this module does not need triton.


@functools.cache
def _kernels() -> Any:
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
