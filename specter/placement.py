"""Which path serves each routed expert for the engine's whole life: the device or the host CPU (issue 29).

A `Placement` puts each (MoE layer, routed expert) on exactly one path. The device path is the expert cache as it
always was (resident, prefetched or copied on demand); the host path computes the expert on the host CPU from the
pinned pool's bytes (`specter.experts.host`) and never copies it. A `specter.placement` plug-in decides the placement
once, when the engine loads, from a `PlacementState`; it never changes with k, the draft or the cache, so the
target's function is fixed and speculative output equals target-only (k = 0) output with the same placement
(docs/ARCHITECTURE.md, "Contracts"). Pure data and a protocol: no torch, so placements replay on any CPU.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

# Layers here are the compact MoE-layer indices the expert cache and the pool use (0..L-1), not model layers.


@dataclass(frozen=True)
class Placement:
    """Per MoE layer, the routed experts computed on the host; every other expert takes the device path."""

    host: tuple[frozenset[int], ...]
    """Layer -> ids of the host-path experts of that layer (empty: the layer is all device path)."""
    num_experts: int
    """Routed experts per layer (ids are 0..num_experts-1)."""

    def __post_init__(self) -> None:
        for layer, experts in enumerate(self.host):
            bad = sorted(e for e in experts if not 0 <= e < self.num_experts)
            assert not bad, f"placement of layer {layer} names experts {bad} outside 0..{self.num_experts - 1}"

    @classmethod
    def device_only(cls, num_layers: int, num_experts: int) -> Placement:
        """Every expert on the device path: the engine as it was before host experts (`off`)."""
        return cls(tuple(frozenset() for _ in range(num_layers)), num_experts)

    @classmethod
    def of(cls, host: Mapping[int, Iterable[int]] | Sequence[Iterable[int]], num_layers: int, num_experts: int) -> Placement:
        """A placement from layer -> host experts (a mapping, layers absent are device only, or one entry per layer)."""
        items = host.items() if isinstance(host, Mapping) else enumerate(host)
        layers = [frozenset()] * num_layers
        for layer, experts in items:
            layers[layer] = frozenset(int(e) for e in experts)
        return cls(tuple(layers), num_experts)

    @property
    def num_layers(self) -> int:
        return len(self.host)

    @property
    def active(self) -> bool:
        """Whether any expert takes the host path (False: the engine runs exactly as without placements)."""
        return any(self.host)

    def is_host(self, layer: int, expert: int) -> bool:
        return expert in self.host[layer]

    def host_experts(self, layer: int) -> frozenset[int]:
        return self.host[layer]

    def device_experts(self, layer: int) -> list[int]:
        """The layer's device-path experts, ascending."""
        return [e for e in range(self.num_experts) if e not in self.host[layer]]

    def split(self, layer: int, experts: Iterable[int]) -> tuple[list[int], list[int]]:
        """(device-path, host-path) experts of `experts`, each in the order given."""
        chosen = list(experts)
        host = self.host[layer]
        return [e for e in chosen if e not in host], [e for e in chosen if e in host]

    def counts(self) -> list[int]:
        """Host-path experts per layer."""
        return [len(experts) for experts in self.host]

    @property
    def total(self) -> int:
        """Host-path (layer, expert) pairs in the model."""
        return sum(self.counts())


@dataclass(frozen=True)
class PlacementState:
    """What a placement policy may use, measured where the engine has measured it (others are None or empty)."""

    num_layers: int
    """MoE layers (the compact indices of `Placement.host`)."""
    num_experts: int
    """Routed experts per layer."""
    top_k: int
    """Experts each token routes to per layer."""
    slots_per_layer: int
    """Device expert-cache slots per MoE layer (all experts when everything fits: then there is nothing to place)."""
    initial_residents: tuple[tuple[int, ...], ...]
    """Per layer, the experts the device cache holds when the placement is made, least recently used first (empty at
    load; the bench places from the cache state each of its cells starts from)."""
    expert_bytes: int
    """Bytes one routed expert moves across the link (and the host reads to compute it)."""
    row_bucket: int
    """EngineConfig.row_bucket: the host computes an expert on blocks of exactly this many rows."""
    host_threads: int = 1
    """Torch intra-op threads of the host expert path (EngineConfig.cpu_threads resolved)."""
    link_bytes_per_s: float | None = None
    """Measured (or emulated) sustained H2D bandwidth; None: not measured yet."""
    host_expert_s: Mapping[int, float] = field(default_factory=dict)
    """Measured seconds to compute one expert on the host, by row count (empty: not calibrated yet)."""
    route_counts: Sequence[Sequence[float]] | None = None
    """Per layer and expert, how often the target routed to it on calibration tokens (None: not measured)."""


@runtime_checkable
class PlacementPolicy(Protocol):
    """Decides, once per engine, which routed experts are computed on the host CPU."""

    name: str

    def place(self, state: PlacementState) -> Placement:
        """Return the placement of every (MoE layer, routed expert).

        Called by the builder once, after the expert pool and the device cache exist and before the first request
        (the bench calls it again for each cell's starting cache). The answer is fixed for the engine's life: it must
        not depend on anything a request changes. Must return a `Placement` with `state.num_layers` layers and ids in
        0..num_experts-1; the device-path experts of a layer that fit in its slots are loaded once and stay.
        """
        ...


def preloaded(placement: Placement, slots_per_layer: int) -> list[list[int]]:
    """Per layer, the device-path experts to load once at start-up: all of them where they fit in the layer's slots
    (none of them is then ever missed, so nothing of that layer crosses the link again), none where they do not (the
    cache serves them on demand, as without placements). Nothing at all when no expert takes the host path."""
    if not placement.active:
        return [[] for _ in range(placement.num_layers)]
    device = [placement.device_experts(layer) for layer in range(placement.num_layers)]
    return [experts if len(experts) <= slots_per_layer else [] for experts in device]
