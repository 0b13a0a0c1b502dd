"""The host expert pool: every routed expert's weights, packed flat, in pinned host memory, written once.

One expert is one contiguous buffer of `expert_numel` elements, so it crosses PCIe in one copy.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from tqdm import tqdm

from backends.base import Backend
from specter.errors import CheckpointError
from specter.log import get_logger

log = get_logger(__name__)

_MAX_SLAB_GROWTH = 16
"""Slabs are at most this many times an expert's size (bounds the unused tail of the last slab)."""


def experts_per_slab(expert_bytes: int, total_experts: int) -> int:
    """How many experts to pack in one host allocation.

    torch's pinned allocator rounds every allocation up to a power of two, so one buffer per Mixtral
    expert (352 MB) would take 512 MB. Packing experts into a power-of-two slab wastes at most the tail
    that no whole expert fits in; this picks the slab size (up to 16 experts' worth) that wastes least.
    """
    smallest = max(0, math.ceil(math.log2(expert_bytes)))
    best_count, best_waste = 1, float("inf")
    for power in range(smallest, smallest + int(math.log2(_MAX_SLAB_GROWTH)) + 1):
        count = min((1 << power) // expert_bytes, total_experts)
        waste = ((1 << power) - count * expert_bytes) / (1 << power)
        if count >= 1 and waste < best_waste - 1e-9:
            best_count, best_waste = count, waste
    return best_count


class ExpertPool:
    """Host copies of all (layer, expert) weights. Layers are MoE-layer indices 0..num_layers-1.

    Filled once at load time (`load` or `write`), read by the transfer engine, never written back.
    """

    def __init__(self, backend: Backend, num_layers: int, num_experts: int, expert_numel: int, dtype: torch.dtype) -> None:
        self.backend = backend
        self.num_layers, self.num_experts = num_layers, num_experts
        self.expert_numel, self.dtype = expert_numel, dtype
        self.expert_bytes = expert_numel * torch.empty((), dtype=dtype).element_size()
        self.per_slab = experts_per_slab(self.expert_bytes, num_layers * num_experts)
        self._slabs: dict[int, torch.Tensor] = {}
        self._loaded = torch.zeros(num_layers, num_experts, dtype=torch.bool)

    @property
    def nbytes(self) -> int:
        """Host bytes allocated so far (slabs are allocated as the first expert of each is written)."""
        return sum(slab.numel() * slab.element_size() for slab in self._slabs.values())

    def write(self, layer: int, expert: int, flat: torch.Tensor) -> None:
        """Copy one expert's flat weights into its host buffer. Each expert is written exactly once."""
        self._check_address(layer, expert)
        self._check_tensor(layer, expert, flat)
        if self._loaded[layer, expert]:
            raise CheckpointError(f"expert (layer {layer}, expert {expert}) was given twice; each expert must appear once in the checkpoint")
        self.host(layer, expert, allocate=True).copy_(flat.reshape(-1))
        self._loaded[layer, expert] = True

    def load(self, experts: Iterable[tuple[int, int, torch.Tensor]], *, progress: bool = False) -> None:
        """Write every (layer, expert, flat) the iterator yields, then check that none is missing."""
        total = self.num_layers * self.num_experts
        with tqdm(total=total, disable=not progress, desc="experts -> host", unit="expert") as bar:
            for layer, expert, flat in experts:
                self.write(layer, expert, flat)
                bar.update(1)
        self.check_complete()
        log.info("pool.loaded", experts=total, bytes=self.nbytes, per_slab=self.per_slab)

    def host(self, layer: int, expert: int, *, allocate: bool = False) -> torch.Tensor:
        """The flat host buffer of one expert (a view into its slab)."""
        slab, position = self._slab(layer, expert, allocate)
        return slab[position * self.expert_numel : (position + 1) * self.expert_numel]

    def host_address(self, layer: int, expert: int) -> int:
        """Where `host(layer, expert)`'s bytes start: for a native kernel's call, without making a tensor view (a
        dispatcher call each, which a host job of many experts would pay per expert)."""
        slab, position = self._slab(layer, expert)
        return slab.data_ptr() + position * self.expert_numel * self.dtype.itemsize

    def _slab(self, layer: int, expert: int, allocate: bool = False) -> tuple[torch.Tensor, int]:
        """The slab holding one expert and its position there (the slab allocated first with `allocate`)."""
        self._check_address(layer, expert)
        slab_index, position = divmod(layer * self.num_experts + expert, self.per_slab)
        slab = self._slabs.get(slab_index)
        if slab is None:
            assert allocate, f"expert (layer {layer}, expert {expert}) read before it was written"
            slab = self._slabs[slab_index] = self._allocate_slab(slab_index)
        return slab, position

    def is_loaded(self, layer: int, expert: int) -> bool:
        return bool(self._loaded[layer, expert])

    def missing(self) -> list[tuple[int, int]]:
        """(layer, expert) pairs not written yet."""
        return [(int(layer), int(expert)) for layer, expert in (~self._loaded).nonzero().tolist()]

    def check_complete(self) -> None:
        """Raise CheckpointError naming the missing experts, if any."""
        missing = self.missing()
        if missing:
            shown = ", ".join(f"(layer {layer}, expert {expert})" for layer, expert in missing[:8])
            raise CheckpointError(
                f"{len(missing)} of {self.num_layers * self.num_experts} experts were not in the checkpoint: {shown}"
                f"{' ...' if len(missing) > 8 else ''}; check that the checkpoint matches the model config"
            )

    def _allocate_slab(self, slab_index: int) -> torch.Tensor:
        first = slab_index * self.per_slab
        count = min(self.per_slab, self.num_layers * self.num_experts - first)
        return self.backend.alloc_host(count * self.expert_numel, self.dtype)

    def _check_address(self, layer: int, expert: int) -> None:
        if not (0 <= layer < self.num_layers and 0 <= expert < self.num_experts):
            raise CheckpointError(
                f"expert (layer {layer}, expert {expert}) is outside the model: {self.num_layers} MoE layers x "
                f"{self.num_experts} experts; check that the checkpoint matches the model config"
            )

    def _check_tensor(self, layer: int, expert: int, flat: torch.Tensor) -> None:
        if flat.numel() != self.expert_numel or flat.dtype != self.dtype:
            raise CheckpointError(
                f"expert (layer {layer}, expert {expert}) has {flat.numel()} elements of {flat.dtype}; expected "
                f"{self.expert_numel} of {self.dtype} (gate, up and down packed flat); check the checkpoint's shapes and dtype"
            )
