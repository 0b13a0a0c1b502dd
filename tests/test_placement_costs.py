"""The placement's calibration at load (specter/experts/costs.py): the host expert timed on its own kind of thread, the
link (emulated, measured, or unknown on the CPU), the routing profile from a trace; none of it for `off`."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import numpy as np
import pytest
import torch

from specter import build, plugins
from specter.config import EngineConfig
from specter.engine import Runtime
from specter.errors import ConfigError
from specter.experts import costs
from specter.placement import Placement, PlacementState, RouteSequence
from specter.trace import TraceHeader, TraceRound, TraceWriter
from tests.test_hybrid import placed_by
from tests.test_speculative import DEVICE, checkpoint


class Recording:
    """A placement policy that records the state it was asked with and places nothing."""

    name = "recording"

    def __init__(self) -> None:
        self.states: list[PlacementState] = []

    def place(self, state: PlacementState) -> Placement:
        self.states.append(state)
        return Placement.device_only(state.num_layers, state.num_experts)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("costs"))


def load(path: str, config: EngineConfig) -> None:
    async def go():
        async with await Runtime.load(path, config):
            pass

    asyncio.run(go())


def write_trace(path, layers: int, experts: int, used_by_round: list[list[list[int]]]) -> None:
    header = TraceHeader(model="t", num_layers=layers, num_experts=experts, expert_bytes=64, top_k=2, slots_per_layer=2)
    with TraceWriter(path, header) as writer:
        for index, used in enumerate(used_by_round):
            writer.write_round(TraceRound.from_arrays(index, 1, 1, 1e-3, np.zeros((layers, experts)), used))


def test_calibration_times_the_host_and_takes_the_emulated_link(root):
    path = checkpoint("mixtral", root)
    policy = Recording()
    with placed_by(policy):
        load(path, EngineConfig(device=DEVICE, max_context=64, residents=2, cpu_threads=1, link="2"))
    [state] = policy.states
    assert set(state.host_expert_s) == {16} and 0 < state.host_expert_s[16] < 1.0
    assert state.link_bytes_per_s == 2e9 and state.route_counts is None and state.host_threads == 1


def test_no_link_is_measured_on_the_cpu_and_auto_then_places_nothing(root):
    path = checkpoint("mixtral", root)
    policy = Recording()
    with placed_by(policy):
        load(path, EngineConfig(device=DEVICE, max_context=64, residents=2, cpu_threads=1))
    if DEVICE == "cpu":
        assert policy.states[0].link_bytes_per_s is None
        assert plugins.load_policy("placement", "auto").place(state=policy.states[0]).total == 0
    else:
        assert policy.states[0].link_bytes_per_s > 1e9  # a pinned copy on the device


class Memory:
    def alloc_host(self, numel, dtype):
        return torch.empty(numel, dtype=dtype)


def small_pool(layers: int = 1, experts: int = 2, hidden: int = 8, inter: int = 4):
    from specter.experts.pool import ExpertPool

    pool = ExpertPool(Memory(), layers, experts, 3 * hidden * inter, torch.float32)
    for layer in range(layers):
        for expert in range(experts):
            pool.write(layer, expert, torch.randn(3 * hidden * inter))
    return pool


def run_calibration(pool, mlp, state):
    from specter.kernel import Kernel

    async def go():
        with Kernel() as kernel:
            return await costs.calibrate(kernel, pool, mlp, state, 8, torch.device("cpu"))

    return asyncio.run(go())


def test_the_host_is_timed_on_a_thread_of_its_own_with_cpu_threads(monkeypatch):
    seen = []
    real = costs.timed_once

    def spy(jobs):
        seen.append((threading.current_thread().name, torch.get_num_threads()))
        return real(jobs)

    monkeypatch.setattr(costs, "timed_once", spy)
    pool = small_pool()
    state = PlacementState(num_layers=1, num_experts=2, top_k=1, slots_per_layer=1, initial_residents=((),),
                           expert_bytes=pool.expert_bytes, row_bucket=4, host_threads=2)
    calibration = run_calibration(pool, costs.reference_expert(8, 4), state)
    assert seen == [("specter-host-calibration", 2 if "OpenMP" in torch.__config__.parallel_info() else torch.get_num_threads())]
    assert calibration.host_expert_s[4] > 0 and calibration.link_bytes_per_s is None
    placed = calibration.apply(state)
    assert placed.host_expert_s == calibration.host_expert_s and placed.link_bytes_per_s is None
    emulated = calibration.apply(dataclasses.replace(state, link_bytes_per_s=5e9))
    assert emulated.link_bytes_per_s == 5e9  # the emulated link wins over a probe


def test_cold_groups_read_every_expert_once_before_any_again():
    groups = costs.cold_groups(num_layers=3, num_experts=8, per_job=2, jobs=4)
    assert groups == [(0, [0, 1]), (0, [2, 3]), (0, [4, 5]), (0, [6, 7])]  # layer 0 first: written first at load
    assert costs.cold_groups(2, 5, 2, 5) == [(0, [0, 1]), (0, [2, 3]), (1, [0, 1]), (1, [2, 3]), (0, [0, 1])]
    assert costs.cold_groups(1, 2, 4, 2) == [(0, [0, 1]), (0, [0, 1])]  # more per job than experts: the layer's all
    pairs = [(layer, e) for layer, experts in costs.cold_groups(24, 60, 4, 4) for e in experts]
    assert len(set(pairs)) == 16


def test_the_host_is_timed_cold_on_the_host_paths_own_call(monkeypatch):
    """Decoding reads each host expert from memory through the host path's own call: the calibration times the same.
    Here an expert read again costs nothing and a first read costs 20 ms: the calibration must report the first read,
    through `HostExperts.compute_layer`, top_k experts a job, no expert in two jobs."""
    from specter.experts.host import HostExperts

    read: list[int] = []
    reference = costs.reference_expert(8, 4)

    def mlp(rows, packed):
        if packed.data_ptr() not in read:  # a first read: from memory
            read.append(packed.data_ptr())
            time.sleep(0.02)
        return reference(rows, packed)

    layers_of_calls = []
    real = HostExperts.compute_layer

    def spy(self, layer, routes, inputs, dense=False):
        layers_of_calls.append((layer, sorted(routes)))
        return real(self, layer, routes, inputs, dense)

    monkeypatch.setattr(HostExperts, "compute_layer", spy)
    pool = small_pool(layers=2, experts=8)
    state = PlacementState(num_layers=2, num_experts=8, top_k=2, slots_per_layer=2, initial_residents=((), ()),
                           expert_bytes=pool.expert_bytes, row_bucket=4, host_threads=1)
    calibration = run_calibration(pool, mlp, state)
    assert calibration.host_expert_s[4] >= 0.02
    assert layers_of_calls == [(0, [0, 1]), (0, [2, 3]), (0, [4, 5]), (0, [6, 7])]
    assert len(read) == 8  # every job read experts no other job had


def test_off_calibrates_nothing(root, monkeypatch):
    async def refuse(*args, **kwargs):
        raise AssertionError("off must not calibrate")

    monkeypatch.setattr(build, "calibrate", refuse)
    load(checkpoint("mixtral", root), EngineConfig(device=DEVICE, max_context=64, residents=2))


def test_the_routing_profile_comes_from_a_trace(root, tmp_path):
    path = checkpoint("mixtral", root)
    from specter.model.checkpoint import Checkpoint

    spec = Checkpoint(path).spec
    layers, experts = len(spec.moe_layers), spec.num_experts
    trace = tmp_path / "profile.jsonl"
    write_trace(trace, layers, experts, [[[0, 1]] * layers, [[1, 2, 1]] * layers])
    expected = [[1.0, 2.0, 1.0] + [0.0] * (experts - 3)] * layers
    assert costs.route_profile(trace, layers, experts) == expected
    policy = Recording()
    with placed_by(policy):
        load(path, EngineConfig(device=DEVICE, max_context=64, residents=2, cpu_threads=1, link="1", placement_profile=trace))
    assert [list(row) for row in policy.states[0].route_counts] == expected
    # and its rounds in order (`RouteSequence`): the cost model replays each layer's slots over them
    assert policy.states[0].route_sequence == RouteSequence(((((0, 1), (1, 2))),) * layers, (2, 2), 4)
    assert costs.routing_profile(trace, layers, experts)[1] == policy.states[0].route_sequence
    wrong = tmp_path / "wrong.jsonl"
    write_trace(wrong, layers + 1, experts, [[[0]] * (layers + 1)])
    with pytest.raises(ConfigError, match="placement_profile .* for a model of"):
        costs.route_profile(wrong, layers, experts)
    empty = tmp_path / "empty.jsonl"
    write_trace(empty, layers, experts, [])
    assert costs.route_profile(empty, layers, experts) is None
    assert costs.routing_profile(empty, layers, experts) == (None, None)


def test_the_profile_the_load_places_from_does_not_depend_on_k(root, tmp_path):
    """The exactness contract: what a placement is decided from (and so `auto`'s answer) is the same for speculative
    engines of any k with the same profile, and a k = 0 engine's differs only in saying it does not speculate (a
    config fact: the draft's prefetch then hides nothing); only the measured costs may differ from one load to the
    next."""
    from specter.config import DraftConfig
    from specter.model.checkpoint import Checkpoint
    from policies.placement import Auto

    path = checkpoint("mixtral", root)
    spec = Checkpoint(path).spec
    layers, experts = len(spec.moe_layers), spec.num_experts
    trace = tmp_path / "profile.jsonl"
    write_trace(trace, layers, experts, [[[r % experts, (r + 1) % experts]] * layers for r in range(12)])
    states = []
    for k in (0, 3, 5):
        policy = Recording()
        with placed_by(policy):
            load(path, EngineConfig(device=DEVICE, max_context=64, residents=2, cpu_threads=1, link="1",
                                    placement_profile=trace, draft=DraftConfig(k=k, quant="int8")))
        states.append(dataclasses.replace(policy.states[0], host_expert_s={16: 1e-3}))  # the one measured input
    assert states[1].route_sequence is not None and states[1] == states[2] and states[1].speculates
    assert states[0] == dataclasses.replace(states[1], speculates=False)
    assert Auto().place(states[1]) == Auto().place(states[2])


def test_time_link_is_none_off_cuda():
    assert costs.time_link(torch.zeros(4), torch.device("cpu")) is None


def test_a_trace_recorded_under_a_placement_lists_the_host_paths_experts_too(root, tmp_path):
    """A profile recorded by an engine with host experts counts them: the verify's `used` holds both paths' experts."""
    from specter.config import DraftConfig, GenerationConfig
    from specter.trace import read_trace

    path, trace = checkpoint("mixtral", root), tmp_path / "placed.jsonl"

    async def go():
        config = EngineConfig(device=DEVICE, max_context=64, residents=2, cpu_experts="all", cpu_threads=1,
                              draft=DraftConfig(k=2, quant="int8"))
        async with await Runtime.load(path, config) as runtime:
            runtime.record_trace(trace)
            await runtime.complete_ids([3, 1, 4, 1], GenerationConfig(max_new_tokens=8))
            return runtime.experts.host.placement

    placement = asyncio.run(go())
    header, rounds = read_trace(trace)
    assert rounds
    hosted = {(layer, e) for r in rounds for layer, routes in enumerate(r.layers) for e in routes.used if placement.is_host(layer, e)}
    assert hosted
    counts = costs.route_profile(trace, header.num_layers, header.num_experts)
    assert all(counts[layer][e] > 0 for layer, e in hosted)


def test_a_missing_profile_is_refused_before_loading(tmp_path):
    with pytest.raises(ConfigError, match="placement_profile"):
        EngineConfig.build(placement_profile=str(tmp_path / "absent.jsonl"))
