"""Routed experts that all live on the device: the resident ceiling and the plain baseline's provider."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from specter.model.transformer import ExpertMLP, RoutingTable, combine_in_expert_order


class ResidentExperts:
    """Every packed expert of every MoE layer in one device tensor per layer, [E, expert_numel]."""

    def __init__(self, packed: dict[int, torch.Tensor]) -> None:
        self.packed = packed

    @classmethod
    def from_iter(cls, experts: Iterable[tuple[int, int, torch.Tensor]], num_experts: int, device: torch.device) -> "ResidentExperts":
        packed: dict[int, torch.Tensor] = {}
        for layer, expert, flat in experts:
            if layer not in packed:
                packed[layer] = torch.empty(num_experts, flat.numel(), dtype=flat.dtype, device=device)
            packed[layer][expert].copy_(flat)
        return cls(packed)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.packed.values())

    def expert(self, layer: int, expert: int) -> torch.Tensor:
        return self.packed[layer][expert]

    async def run(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, mlp: ExpertMLP) -> torch.Tensor:
        # Await point: the routing table crosses to the host (one small D2H copy on CUDA).
        table = RoutingTable(ids.tolist(), x.device)
        parts = {e: table.weighted_output(e, x, weights, mlp, self.packed[layer][e]) for e in table.experts}
        return combine_in_expert_order(x.shape[0], x.shape[1], parts, x)
