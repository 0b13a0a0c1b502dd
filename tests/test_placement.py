"""Placements (specter/placement.py): the types, the reference policies `off` and `all`, the configuration fields
and the plug-in checks."""

from __future__ import annotations

import functools

import pytest
import torch

from specter import plugins
from specter.config import EngineConfig
from specter.errors import ConfigError, PluginError
from specter.placement import Placement, PlacementState, preloaded


def state(layers: int = 3, experts: int = 8, slots: int = 2, initial=None) -> PlacementState:
    return PlacementState(num_layers=layers, num_experts=experts, top_k=2, slots_per_layer=slots,
                          initial_residents=initial if initial is not None else tuple(() for _ in range(layers)),
                          expert_bytes=1024, row_bucket=16)


def test_placement_answers_per_layer():
    placement = Placement.of({1: [5, 2]}, num_layers=3, num_experts=8)
    assert placement.active and placement.counts() == [0, 2, 0] and placement.total == 2
    assert placement.is_host(1, 5) and not placement.is_host(0, 5)
    assert placement.split(1, [7, 5, 2, 0]) == ([7, 0], [5, 2])
    assert placement.device_experts(1) == [0, 1, 3, 4, 6, 7]
    off = Placement.device_only(3, 8)
    assert not off.active and off.total == 0 and preloaded(off, 2) == [[], [], []]
    with pytest.raises(AssertionError, match="outside"):
        Placement.of([[8]], 1, 8)


def test_preloaded_takes_the_layers_whose_device_experts_fit():
    placement = Placement.of([range(2, 8), range(1, 8), [7]], 3, 8)
    assert preloaded(placement, 2) == [[0, 1], [0], []]  # layer 2 keeps 7 experts on the device: served on demand


def test_off_and_all():
    off = plugins.load_policy("placement", "off")
    assert off.place(state=state()) == Placement.device_only(3, 8)
    every = plugins.load_policy("placement", "all")
    at_load = every.place(state=state())  # an empty cache: the lowest ids stay on the device
    assert at_load.counts() == [6, 6, 6] and all(at_load.device_experts(layer) == [0, 1] for layer in range(3))
    warm = every.place(state=state(initial=((4, 6, 1), (3,), ())))  # the most recent `slots` of each layer's residents
    assert warm.device_experts(0) == [1, 6] and warm.device_experts(2) == [0, 1]
    assert warm.device_experts(1) == [0, 3]  # a free slot beside the one resident: filled, not left to the host
    assert preloaded(warm, 2) == [[1, 6], [0, 3], [0, 1]]


def test_all_keeps_each_layers_own_slots_on_the_device():
    """With one slot more in some layers (`MemoryPlan.layer_slots`) `all` keeps that many there, and `preloaded`
    loads them: the extra slot holds an expert instead of staying empty beside a host-path expert."""
    import dataclasses

    uneven = dataclasses.replace(state(), layer_slots=(2, 3, 2))
    assert [uneven.slots(layer) for layer in range(3)] == [2, 3, 2] and state().slots(1) == 2
    placed = plugins.load_policy("placement", "all").place(state=uneven)
    assert placed.counts() == [6, 5, 6] and placed.device_experts(1) == [0, 1, 2]
    assert preloaded(placed, (2, 3, 2)) == [[0, 1], [0, 1, 2], [0, 1]]
    assert preloaded(placed, 2) == [[0, 1], [], [0, 1]]  # three device experts do not fit two slots: on demand


def test_a_placement_policy_answering_wrong_is_named():
    class Wrong:
        name = "wrong"

        def place(self, state):
            return Placement.device_only(state.num_layers + 1, state.num_experts)

    class Raising:
        name = "raising"

        def place(self, state):
            return Placement.of([[99]], state.num_layers, state.num_experts)

    with pytest.raises(PluginError, match="'wrong'.*4 layers x 8 experts for a model of 3 x 8"):
        plugins.guarded(Wrong(), "placement").place(state())
    with pytest.raises(PluginError, match="'raising'.*place\\(\\) raised"):
        plugins.guarded(Raising(), "placement").place(state())
    with pytest.raises(PluginError, match="place\\(\\) missing"):
        plugins.guarded(type("Nameless", (), {"name": "n"})(), "placement")


def test_unknown_placement_lists_the_installed_ones():
    with pytest.raises(PluginError, match="no placement plug-in named 'sometimes'; installed: ") as error:
        plugins.load_policy("placement", "sometimes")
    assert "all" in str(error.value) and "off" in str(error.value)


def test_cpu_fields_are_validated():
    assert EngineConfig().cpu_experts == "off" and EngineConfig().cpu_threads is None
    assert EngineConfig(cpu_experts="all", cpu_threads=3).cpu_threads == 3
    for bad in (0, -2, 4096):
        with pytest.raises(ConfigError, match="cpu_threads"):
            EngineConfig.build(cpu_threads=bad)
    with pytest.raises(ConfigError, match="cpu_experts"):
        EngineConfig.build(cpu_experts="")


def test_cpu_threads_none_leaves_the_loop_a_core(monkeypatch):
    """EngineConfig.cpu_threads=None resolves to the host's cores less one (the event loop's), at least one (the host
    path's own count; the builder's calibration state and `info` resolve it with the same function)."""
    import os

    from specter.experts import host
    from specter.experts.host import HostExperts, default_threads
    from specter.experts.pool import ExpertPool
    from specter.model.weights import swiglu

    assert [default_threads(cores) for cores in (16, 2, 1, None)] == [15, 1, 1, max(1, (os.cpu_count() or 1) - 1)]
    monkeypatch.setattr(host.os, "cpu_count", lambda: None)  # unknown: one thread
    assert default_threads() == 1
    monkeypatch.setattr(host.os, "cpu_count", lambda: 16)
    assert default_threads() == 15

    class Memory:
        def alloc_host(self, numel, dtype):
            return torch.empty(numel, dtype=dtype)

    pool = ExpertPool(Memory(), 1, 2, 12, torch.bfloat16)
    mlp = functools.partial(swiglu, hidden=2, inter=1)
    assert HostExperts(pool, Placement.device_only(1, 2), 16, mlp).threads == 15
    assert HostExperts(pool, Placement.device_only(1, 2), 16, mlp, threads=3).threads == 3


def test_info_counts_the_host_experts_of_a_placement(tiny):
    from specter.cli import checkpoint_summary

    off = checkpoint_summary(str(tiny))
    assert off["host_experts"] == 0 and off["cpu_experts"] == "off"
    every = checkpoint_summary(str(tiny), residents=3, cpu_experts="all")
    assert every["host_experts_per_layer"] == [every["experts"] - 3] * every["moe_layers"]
    assert every["host_experts"] == every["moe_layers"] * (every["experts"] - 3)
    with pytest.raises(ConfigError, match="--residents"):
        checkpoint_summary(str(tiny), residents=0, cpu_experts="all")


def test_kept_on_device_fills_the_slots_initial_residents_leave_free():
    """A part-filled cache: the device keeps its residents and the most used (else lowest) other experts up to the
    slots, so `all` never computes on the host an expert a free slot could hold."""
    from policies.placement import All, kept_on_device

    state_ = state(layers=2, experts=8, slots=4, initial=((5, 2), ()))
    assert kept_on_device(state_, 0) == [5, 2, 0, 1]
    assert kept_on_device(state_, 0, rates=[0.1, 0.0, 0.0, 0.3, 0.2, 0.0, 0.0, 0.9]) == [5, 2, 3, 7]
    assert kept_on_device(state_, 1) == [0, 1, 2, 3]
    placement = All().place(state_)
    assert placement.host[0] == frozenset({3, 4, 6, 7}) and placement.host[1] == frozenset({4, 5, 6, 7})
    full = state(layers=1, experts=8, slots=4, initial=((1, 2, 3, 4, 5),))
    assert kept_on_device(full, 0) == [2, 3, 4, 5]  # the most recent four
