"""Plain-torch fused draft MoE over quantized experts (the CPU path and the reference for the Triton kernel).

Shapes: T tokens, A active experts per token, P = T * A (token, expert) pairs, E experts, D hidden,
I expert intermediate. Sync-free: expert ids stay on the device, gathered with index_select.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from specter.errors import ConfigError
from specter.quant.groupwise import QuantizedExperts, dequantize_packed


def sort_routes(expert_ids: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
    """Each token's (ids, weights) in ascending expert id: the fixed order contributions are summed in."""
    sorted_ids, order = expert_ids.sort(dim=1, stable=True)
    return sorted_ids, weights.gather(1, order)


def sum_in_order(contributions: Tensor) -> Tensor:
    """[T, A, D] -> [T, D], adding a = 0, 1, ... left to right (torch.sum would pick its own tree)."""
    total = contributions[:, 0]
    for a in range(1, contributions.shape[1]):
        total = total + contributions[:, a]
    return total


def compute_dtype(x: Tensor) -> torch.dtype:
    """fp32 on the CPU (accuracy); the activation dtype on an accelerator (dequantized copies are large)."""
    return x.dtype if x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) else torch.float32


def check_routes(x: Tensor, expert_ids: Tensor, weights: Tensor, hidden: int) -> None:
    """Shape checks only (values stay on the device)."""
    if x.dim() != 2 or x.shape[1] != hidden:
        raise ConfigError(f"MoE input must be [T, D={hidden}], got {tuple(x.shape)}")
    if expert_ids.shape != weights.shape or expert_ids.dim() != 2 or expert_ids.shape[0] != x.shape[0]:
        raise ConfigError(
            f"expert_ids and weights must both be [T, A] with T={x.shape[0]}; "
            f"got {tuple(expert_ids.shape)} and {tuple(weights.shape)}"
        )


def moe_forward(x: Tensor, expert_ids: Tensor, weights: Tensor, qe: QuantizedExperts) -> Tensor:
    """y[t] = sum_a weights[t, a] * down_e(silu(gate_e x_t) * up_e x_t), e = expert_ids[t, a]; [T, D]."""
    check_routes(x, expert_ids, weights, qe.hidden)
    num_tokens, active = expert_ids.shape
    dtype = compute_dtype(x)
    sorted_ids, sorted_weights = sort_routes(expert_ids, weights)
    pair_experts = sorted_ids.reshape(-1)  # [P]
    pair_inputs = x.to(dtype)[:, None, :].expand(num_tokens, active, qe.hidden).reshape(-1, qe.hidden, 1)  # [P, D, 1]
    w13 = _gather_dequantized(qe.w13, qe.w13_scales, pair_experts, qe, qe.w13_group, qe.hidden, dtype)  # [P, 2I, D]
    gate_up = torch.bmm(w13, pair_inputs)[..., 0]  # [P, 2I]
    hidden_act = F.silu(gate_up[:, : qe.intermediate]) * gate_up[:, qe.intermediate :]  # [P, I]
    w2 = _gather_dequantized(qe.w2, qe.w2_scales, pair_experts, qe, qe.w2_group, qe.intermediate, dtype)  # [P, D, I]
    pair_out = torch.bmm(w2, hidden_act[..., None])[..., 0]  # [P, D]
    weighted = pair_out.float().view(num_tokens, active, qe.hidden) * sorted_weights.float()[..., None]
    return sum_in_order(weighted).to(x.dtype)


def _gather_dequantized(
    packed: Tensor, scales: Tensor, pair_experts: Tensor, qe: QuantizedExperts, group: int, k: int, dtype: torch.dtype
) -> Tensor:
    """Dequantized weights of the selected experts, one per pair: [P, N, K]."""
    selected_packed, selected_scales = packed.index_select(0, pair_experts), scales.index_select(0, pair_experts)
    return dequantize_packed(selected_packed, selected_scales, qe.bits, group, k).to(dtype)


def moe_reference(x: Tensor, expert_ids: Tensor, weights: Tensor, gate: Tensor, up: Tensor, down: Tensor) -> Tensor:
    """Float reference (fp64, one token and expert at a time, host loops): gate/up [E, I, D], down [E, D, I]."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        sorted_ids, sorted_weights = sort_routes(expert_ids[t : t + 1].cpu(), weights[t : t + 1].cpu())
        for e, w in zip(sorted_ids[0].tolist(), sorted_weights[0].tolist()):
            xt = x[t].cpu().double()
            hidden_act = F.silu(gate[e].cpu().double() @ xt) * (up[e].cpu().double() @ xt)
            out[t] += w * (down[e].cpu().double() @ hidden_act)
    return out.to(x.dtype).to(x.device)
