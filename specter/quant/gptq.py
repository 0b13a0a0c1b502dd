"""GPTQ-style calibrated quantization ("gptq4"): column-by-column rounding with Hessian error feedback.

Produces exactly the packed format of `groupwise` (same codes, scales and packing), so `dequantize()`,
the torch reference and the Triton kernel read GPTQ and round-to-nearest experts alike.

Everything runs on the device of the weights `w` (a CUDA caller's GPTQ runs on its GPU in float64; a CPU
caller's stays on the CPU): the Hessians are moved there chunk by chunk, nothing else picks a device. A
layer's experts go through the column loop in chunks sized by a working-memory budget (`experts_per_chunk`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from specter.errors import ConfigError
from specter.log import get_logger
from specter.quant.groupwise import (
    QuantizedExperts,
    QuantizedTensor,
    check_expert_shapes,
    choose_scales,
    codes_from_scales,
    default_scale_dtype,
    levels_from_codes,
    pack_codes,
    resolve_group,
    stack_experts,
)

log = get_logger(__name__)


class HessianAccumulator:
    """Running H = X^T X (fp64) over the calibration activations [n, K] that one expert saw."""

    def __init__(self, in_features: int, device: torch.device | str = "cpu") -> None:
        self.in_features = in_features
        self.hessian = torch.zeros(in_features, in_features, dtype=torch.float64, device=device)
        self.num_rows = 0

    def add(self, x: Tensor) -> None:
        """Add activations [n, K] (the tokens routed to this expert); an empty batch is a no-op."""
        if x.dim() != 2 or x.shape[1] != self.in_features:
            raise ConfigError(f"activations must be [n, {self.in_features}], got {tuple(x.shape)}")
        rows = x.to(self.hessian.device, torch.float64)
        self.hessian += rows.T @ rows
        self.num_rows += rows.shape[0]


class ExpertHessians:
    """One HessianAccumulator per routed expert of a layer, fed with routed batches (offline, may sync)."""

    def __init__(self, num_experts: int, in_features: int, device: torch.device | str = "cpu") -> None:
        self.experts = [HessianAccumulator(in_features, device) for _ in range(num_experts)]

    def add(self, x: Tensor, expert_ids: Tensor) -> None:
        """x [T, K], expert_ids [T, A]: each expert accumulates the tokens routed to it."""
        for expert, accumulator in enumerate(self.experts):
            routed = (expert_ids == expert).any(dim=1)
            accumulator.add(x[routed])

    def stacked(self) -> Tensor:
        """[E, K, K] fp64."""
        return torch.stack([a.hessian for a in self.experts])


def damped_inverse_cholesky(hessian: Tensor, damp: float) -> Tensor:
    """Upper Cholesky factors of (H + damp * mean(diag H) * I)^-1 for H [..., K, K], in fp64; dead inputs get
    H_ii = 1. Each matrix is damped on its own, ten times more per try, until it factors."""
    k = hessian.shape[-1]
    h = hessian.to(torch.float64).reshape(-1, k, k).clone()
    diagonal = torch.diagonal(h, dim1=-2, dim2=-1)  # a view: writes land in h
    diagonal[diagonal == 0] = 1.0
    ridge = damp * diagonal.mean(dim=-1)  # [B]
    result: Tensor | None = None  # made only when some matrix needs a second try
    pending = torch.arange(h.shape[0], device=h.device)
    for attempt in range(6):  # H from few tokens can be near-singular; more damping always helps
        # H + ridge * I with the ridge added on the diagonal in place: the same float64 sums as adding ridge * eye
        # (off the diagonal x + 0.0 = x), without two more [B, K, K] temporaries.
        damped = h[pending]
        torch.diagonal(damped, dim1=-2, dim2=-1).add_((ridge[pending] * 10**attempt)[:, None])
        factor, info = torch.linalg.cholesky_ex(damped)
        del damped
        factored = info == 0  # offline calibration: the host syncs below are fine
        if result is None and bool(factored.all()):
            return torch.linalg.cholesky(torch.cholesky_inverse(factor), upper=True).reshape(hessian.shape)
        if result is None:
            result = torch.empty_like(h)
        if bool(factored.any()):
            result[pending[factored]] = torch.linalg.cholesky(torch.cholesky_inverse(factor[factored]), upper=True)
        del factor
        pending = pending[~factored]
        if pending.numel() == 0:
            return result.reshape(hessian.shape)
    raise ConfigError("GPTQ: the calibration Hessian is not positive definite even after heavy damping; "
                      "use more calibration tokens or method='rtn'")  # fmt: skip


def gptq_codes(
    w: Tensor, hessian: Tensor, bits: int, group: int, scale_dtype: torch.dtype, damp: float = 0.01
) -> tuple[Tensor, Tensor]:
    """GPTQ codes [..., N, K] (int8) and scales [..., N, G] for w [..., N, K] and H [..., K, K]: a batch of weights
    (one layer's experts) runs its column loop once for all; groups start at block starts."""
    *batch, n_rows, k = w.shape
    # Unlike GPTQ for dense layers, columns never seen in calibration keep their weights (rounded to
    # nearest): a rarely routed expert still runs in the draft when its router picks it.
    # The inverse first: its [B, K, K] temporaries are gone before the float64 weights exist (a lower peak).
    inverse_factor = damped_inverse_cholesky(hessian.reshape(-1, k, k), damp)  # [B, K, K]
    weights = w.to(torch.float64, copy=True).reshape(-1, n_rows, k)  # [B, N, K], one copy (w is never written)
    block = _block_size(group)
    codes = torch.empty(weights.shape, dtype=torch.int8, device=w.device)
    scales = torch.empty(weights.shape[0], n_rows, k // group, dtype=torch.float32, device=w.device)
    for start in range(0, k, block):
        end = min(start + block, k)
        if start % group == 0:  # the group's columns already carry every earlier block's feedback
            g = start // group
            grouped = weights[:, :, start : start + group].float()[:, :, None, :]  # [B, N, 1, group]
            scales[:, :, g] = choose_scales(grouped, bits, scale_dtype, clip_search=bits <= 3)[..., 0]
        errors = _quantize_block(weights, inverse_factor, codes, scales[:, :, start // group], start, end, bits)
        weights[:, :, end:] -= errors @ inverse_factor[:, start:end, end:]
    return codes.reshape(*batch, n_rows, k), scales.reshape(*batch, n_rows, k // group)


def _block_size(group: int) -> int:
    """Columns updated together: a group or a divisor of it, so every group begins at a block start."""
    return 128 if group % 128 == 0 else group


def _quantize_block(
    weights: Tensor, inverse_factor: Tensor, codes: Tensor, scale: Tensor, start: int, end: int, bits: int
) -> Tensor:
    """Quantize columns [start, end) of weights [B, N, K] one by one, spreading each error over the block's later
    columns; scale [B, N]. Returns the block's scaled errors [B, N, end - start]."""
    block_weights = weights[:, :, start:end]  # a view: feedback inside the block lands in `weights`
    block_factor = inverse_factor[:, start:end, start:end]  # [B, b, b]
    errors = torch.empty_like(block_weights)
    for i in range(end - start):
        column = block_weights[:, :, i].float()  # [B, N]
        q = codes_from_scales(column[..., None], scale, bits)[..., 0]
        codes[:, :, start + i] = q
        error = (column - levels_from_codes(q[..., None], scale)[..., 0]).double() / block_factor[:, i, i, None]
        block_weights[:, :, i:] -= error[:, :, None] * block_factor[:, None, i, i:]
        errors[:, :, i] = error
    return errors


def gptq_quantize(
    w: Tensor,
    hessian: Tensor,
    bits: int = 4,
    group: int = 128,
    *,
    scale_dtype: torch.dtype | None = None,
    damp: float = 0.01,
) -> QuantizedTensor:
    """GPTQ-quantize w [N, K] given H = X^T X [K, K] of its calibration inputs; same format as `quantize`."""
    if w.dim() != 2 or hessian.shape != (w.shape[1], w.shape[1]):
        raise ConfigError(f"GPTQ needs w [N, K] and H [K, K]; got w {tuple(w.shape)}, H {tuple(hessian.shape)}")
    group = resolve_group(w.shape[1], group, bits)
    scale_dtype = scale_dtype or default_scale_dtype(w.dtype)
    codes, scales = gptq_codes(w, hessian.to(w.device), bits, group, scale_dtype, damp)  # on w's device
    return QuantizedTensor(pack_codes(codes, bits), scales.to(scale_dtype).T.contiguous(), bits, group, tuple(w.shape))


def gptq_quantize_batch(
    w: Tensor, hessian: Tensor, bits: int = 4, group: int = 128, *, scale_dtype: torch.dtype | None = None,
    damp: float = 0.01, chunk: int | None = None,
) -> list[QuantizedTensor]:
    """`gptq_quantize` of each w[e] [N, K] with hessian[e] [K, K], on w's device: one column loop per chunk of
    `chunk` experts (default `experts_per_chunk`), E / chunk times fewer Python steps than one call per expert. The
    codes do not depend on the chunking: every expert is damped, factored and rounded on its own."""
    if w.dim() != 3 or hessian.shape != (w.shape[0], w.shape[2], w.shape[2]):
        raise ConfigError(f"GPTQ needs w [E, N, K] and H [E, K, K]; got w {tuple(w.shape)}, H {tuple(hessian.shape)}")
    num, n_rows, k = w.shape
    group = resolve_group(k, group, bits)
    scale_dtype = scale_dtype or default_scale_dtype(w.dtype)
    if chunk is None:
        chunk = experts_per_chunk(num, n_rows, k, w.device)
    if chunk < 1:
        raise ConfigError(f"GPTQ chunk must be a positive number of experts, got {chunk}")
    out: list[QuantizedTensor] = []
    for start in range(0, num, chunk):
        end = min(start + chunk, num)
        codes, scales = gptq_codes(w[start:end], hessian[start:end].to(w.device), bits, group, scale_dtype, damp)
        packed = pack_codes(codes, bits)
        out += [QuantizedTensor(packed[e], scales[e].to(scale_dtype).T.contiguous(), bits, group, (n_rows, k))
                for e in range(end - start)]  # fmt: skip
        del codes, scales, packed
    log.debug("quant.gptq.batch", experts=num, rows=n_rows, k=k, chunk=chunk, device=str(w.device))
    return out


# Working memory one gptq_quantize_batch call may take for its chunk of experts. 16 GiB holds a Qwen1.5-MoE layer's
# 60 gate/up experts (2816 x 2048, ~0.25 GB each) in one chunk: every chunk costs ~20 small launches per column, so
# on a GPU fewer, larger chunks are faster. The chunk depends on the shapes alone, not on the free memory: batched
# float64 kernels may sum in another order for another batch size, so the codes would depend on what else is on the
# device (a layer that does not fit falls back to the CPU: specter.calibrate.gptq_layer).
GPTQ_WORKING_BYTES = 16 << 30


def gptq_bytes_per_expert(n_rows: int, k: int) -> int:
    """Peak bytes `gptq_codes` takes per weight [N, K]: the Hessian moved to the device (8 K^2), then the larger of
    the damped inverse's temporaries (about six [K, K] float64) and the column loop (float64 weights, the block
    update's product, int8 codes, the [K, K] factor)."""
    return 8 * k * k + max(8 * 6 * k * k, 8 * 2 * n_rows * k + n_rows * k + 8 * k * k)


def experts_per_chunk(num: int, n_rows: int, k: int, device: torch.device | str, budget: int | None = None) -> int:
    """How many of `num` weights [N, K] to quantize together within `budget` bytes (default GPTQ_WORKING_BYTES, on
    any device: the shapes alone decide); the chunks are then evened out (60 at most 36 apiece: two chunks of 30, not
    36 + 24). `device` is kept for the callers' symmetry."""
    del device
    if budget is None:
        budget = GPTQ_WORKING_BYTES
    most = max(1, min(num, budget // gptq_bytes_per_expert(n_rows, k)))
    chunks = -(-num // most)
    return -(-num // chunks)


def gptq_quantize_experts(
    gate: Tensor,
    up: Tensor,
    down: Tensor,
    hessian_in: Tensor,
    hessian_mid: Tensor,
    bits: int = 4,
    group: int = 128,
    *,
    scale_dtype: torch.dtype | None = None,
    chunk: int | None = None,
) -> QuantizedExperts:
    """GPTQ for one layer: hessian_in [E, D, D] from expert inputs, hessian_mid [E, I, I] from silu(g)*u; runs on the
    weights' device, `chunk` experts at a time (`gptq_quantize_batch`)."""
    num_experts, intermediate, hidden = check_expert_shapes(gate, up, down)
    expected_in, expected_mid = (num_experts, hidden, hidden), (num_experts, intermediate, intermediate)
    if hessian_in.shape != expected_in or hessian_mid.shape != expected_mid:
        raise ConfigError(f"GPTQ Hessians must be [E, D, D] and [E, I, I] = [{num_experts}, {hidden}, {hidden}] and "
                          f"[{num_experts}, {intermediate}, {intermediate}]; got {tuple(hessian_in.shape)}, "
                          f"{tuple(hessian_mid.shape)}")  # fmt: skip
    w13 = gptq_quantize_batch(torch.cat([gate, up], dim=1), hessian_in, bits, group, scale_dtype=scale_dtype, chunk=chunk)
    w2 = gptq_quantize_batch(down, hessian_mid, bits, group, scale_dtype=scale_dtype, chunk=chunk)
    log.debug("quant.gptq.layer", experts=num_experts, bits=bits, group=group)
    return stack_experts(w13, w2)
