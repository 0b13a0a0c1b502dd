"""The verify pass's expert provider: routed experts from the device cache, hot first, misses overlapped.

At each MoE layer it awaits the target router's choice (one small D2H copy), computes the experts that
are already resident, and loads the misses on demand through the cache's rolling window of slots, so a
miss's copy overlaps the compute of the hits. Outputs are summed in expert-id order (exact mode).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch

from specter.experts.cache import ExpertCache
from specter.kernel import Kernel
from specter.model.transformer import ExpertMLP, RoutingTable, combine_in_expert_order

Tensor = torch.Tensor


async def to_host(kernel: Kernel, tensor: Tensor) -> list:
    """Await point: a small device tensor copied to the host without blocking the event loop."""
    if tensor.device.type == "cpu":
        return tensor.tolist()
    backend = kernel.backend
    assert backend is not None, "a CUDA tensor needs a kernel bound to a backend"
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    event = backend.copy_d2h(host, tensor, backend.compute_stream)
    await kernel.wait(event, spin_s=50e-6)
    return host.tolist()


@dataclasses.dataclass
class VerifyRecord:
    """What one forward's MoE layers used: layer -> experts in the order they were computed, and stall."""

    used: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    hits: int = 0  # resident, or its prefetch already issued, when the router chose it (waits show in stall_s)
    misses: int = 0  # loaded on demand
    stall_s: float = 0.0


class OffloadedExperts:
    """ExpertProvider over an ExpertCache; `layer_index` maps model layers to the cache's compact MoE layers."""

    def __init__(self, cache: ExpertCache, kernel: Kernel, layer_index: dict[int, int],
                 on_routed: Callable[[int, Tensor, list[int]], None] | None = None) -> None:
        self.cache = cache
        self.kernel = kernel
        self.layer_index = layer_index
        self.on_routed = on_routed  # e.g. gate-prefetch: sees each layer's hidden rows and chosen experts
        self.record = VerifyRecord()

    def start_record(self) -> VerifyRecord:
        self.record = VerifyRecord()
        return self.record

    async def run(self, layer: int, x: Tensor, ids: Tensor, weights: Tensor, mlp: ExpertMLP) -> Tensor:
        table = RoutingTable(await to_host(self.kernel, ids), x.device)  # await point: the router's choice
        needed = table.experts
        if self.on_routed is not None:
            self.on_routed(layer, x, needed)
        cache_layer = self.layer_index[layer]
        hot = {e for e in needed if self.cache.lookup(cache_layer, e) is not None}
        mapped = set(self.cache.lru_order(cache_layer))  # resident or with a (prefetch) copy already in flight
        parts: dict[int, tuple[Tensor, Tensor]] = {}
        order: list[int] = []
        backend = self.kernel.backend
        waited = time.perf_counter()
        async for expert, slot in self.cache.iter_ready(cache_layer, needed):
            if expert not in hot:
                self.record.stall_s += time.perf_counter() - waited
            parts[expert] = table.weighted_output(expert, x, weights, mlp, self.cache.slot_weights(slot))
            self.cache.mark_used(cache_layer, expert, backend.record_event(backend.compute_stream))
            order.append(expert)
            waited = time.perf_counter()
        self.record.used[layer] = order
        prefetched = sum(1 for e in needed if e in mapped)
        self.record.hits += prefetched
        self.record.misses += len(needed) - prefetched
        return combine_in_expert_order(x.shape[0], x.shape[1], parts, x)
