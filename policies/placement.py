"""Reference placement policies: `off` and `all` (entry points `specter.placement`).

A placement is made once per engine (specter/placement.py); `auto`, from measured copy and host-compute costs, is
another plug-in of the same group.
"""

from __future__ import annotations

from specter.placement import Placement, PlacementState


class Off:
    """No host experts: every expert takes the device path (the engine without placements)."""

    def __init__(self) -> None:
        self.name = "off"

    def place(self, state: PlacementState) -> Placement:
        return Placement.device_only(state.num_layers, state.num_experts)


class All:
    """Every expert not resident on the device is computed on the host, so nothing is ever copied after load: the
    in-engine llama.cpp `--n-cpu-moe` / KTransformers style (the `cpu-experts` baseline).

    The device keeps each layer's initial residents (`PlacementState.initial_residents`, at most `slots_per_layer`,
    the most recently used); a layer with none (a cache that starts empty, at load) keeps its lowest
    `slots_per_layer` expert ids, which the builder loads once.
    """

    def __init__(self) -> None:
        self.name = "all"

    def place(self, state: PlacementState) -> Placement:
        host = []
        for layer in range(state.num_layers):
            initial = state.initial_residents[layer] if layer < len(state.initial_residents) else ()
            kept = set(initial[-state.slots_per_layer:]) if initial else set(range(min(state.slots_per_layer, state.num_experts)))
            host.append([e for e in range(state.num_experts) if e not in kept])
        return Placement.of(host, state.num_layers, state.num_experts)
