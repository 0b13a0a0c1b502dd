"""The draft's one-row layer in few launches (KernelTuning.row_kernels): Triton GEMVs with their neighbours folded in.

The graphed draft step is one row per layer, and in a CUDA graph each node costs about 1-2 us whatever its size
(~18 nodes per Qwen2-MoE layer, ~21 us of them small). Here a Qwen2-MoE-style layer (a shared expert, its sigmoid gate, int4 routed
experts) runs as seven launches instead of ~18:

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
   int8 per weight group and sums codes x activations in int32 by dp4a, four per instruction (`rowkernels._int4_rows_int8`):
   the float path spends ~8 instructions per code and is issue-bound. With
   topk_in_router off every program takes the top-k itself (softmax over E logits) before its first weight load, and
   program 0 writes the picks and counts the routes.
7. `moe_finish`: per block of output rows, the routed experts' int4 down products (rows of all picks, weighted and
   added in ascending expert id), the shared expert's bf16 down product times its sigmoid gate (none without a shared
   expert), and the residual, rounded once (replaces the down GEMV, the combine, the routed + residual add, the
   addend copy, the shared down product and its split-K reduction).

This module packs the operands and launches; the kernels' Triton bodies, and how they read the int4 codes, are in
specter.model.rowkernels. The tiles are RowTiles (EngineConfig.tuning.kernels.row), given by the caller (the model's
KernelTiers). Every float sum is float32; nothing here is exact (the draft never is; the verify is).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from specter.config import RowTiles
from specter.model import rowkernels
from specter.quant.groupwise import QuantizedExperts


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
    rowkernels.jitted().norm_gemv[grid](
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
    rowkernels.jitted().norm_gemv[(-(-rows // block_n),)](
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
    rowkernels.jitted().norm_gemv[grid](
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
    rowkernels.jitted().moe_gate_up[grid](
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
    rowkernels.jitted().moe_finish[(-(-qe.hidden // tiles.block_n_finish),)](
        x, act, *q8, ids, weights, words, words.stride(0), words.stride(1), qe.w2_scales, qe.w2_scales.stride(0),
        qe.w2_scales.stride(1), shared_act, shared_down, shared_down.stride(0), x if gate_logit is None else gate_logit,
        out, qe.hidden, qe.intermediate, shared_inter, TOP_K=top_k, TOP_K_POW2=max(2, _pow2(top_k)),
        SHARED=shared, GATED=gate_logit is not None, GROUP=qe.w2_group, BLOCK_N=tiles.block_n_finish, BLOCK_K=block_k,
        GROUPS=max(1, block_k // qe.w2_group), BLOCK_KS=min(tiles.block_k_shared, _pow2(shared_inter)),
        WORDS=tiles.words_finish or int8, INT8_A=int8, AGROUP=act_int8.group if act_int8 is not None else 8,
        DP4A=x.is_cuda and tiles.dp4a, EVICT=_evict(tiles), num_warps=tiles.warps_finish, num_stages=tiles.num_stages,
    )  # fmt: skip
    return out
