"""The placement's calibration at load (specter/experts/costs.py): the host expert timed on its own kind of thread, the
link (emulated, measured, or unknown on the CPU), the routing profile from a trace; none of it for `off`."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import tempfile
from pathlib import Path
import os
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
            return await costs.calibrate(kernel, pool, [costs.HostKernel("torch", mlp)], state, 8, torch.device("cpu"))

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
    through `HostExperts.compute_layer`, top_k experts a job, then jobs of one expert (the job's fixed part), no expert
    in two jobs."""
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
    # a job of one expert costs its fixed part and one expert: at least one first read
    assert calibration.host_expert_s[4] + calibration.host_job_s >= 0.02
    assert layers_of_calls == [(0, [0, 1]), (0, [2, 3]), (0, [4, 5]), (0, [6, 7]), (1, [0]), (1, [1]), (1, [2]), (1, [3])]
    assert len(read) == 12  # every job read experts no other job had


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
    write_trace(trace, layers, experts, [[[0, 1]] * layers, [[1, 2]] * layers])
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


def test_a_load_parses_its_profile_once_and_a_rewritten_one_again(root, tmp_path, monkeypatch):
    """The load checked the trace before any weight, then the calibration parsed it again (3 s each for a 36 MB trace;
    the bench added one more before loading and one per host-thread count). Parsed once while the file is unchanged;
    a rewritten file is read anew, and each caller gets counts of its own."""
    path = checkpoint("mixtral", root)
    from specter.model.checkpoint import Checkpoint

    spec = Checkpoint(path).spec
    layers, experts = len(spec.moe_layers), spec.num_experts
    trace = tmp_path / "profile.jsonl"
    write_trace(trace, layers, experts, [[[0, 1]] * layers])
    parsed = []
    real = costs.read_trace
    monkeypatch.setattr(costs, "read_trace", lambda p: parsed.append(p) or real(p))
    costs._profile_of.cache_clear()
    policy = Recording()
    with placed_by(policy):
        load(path, EngineConfig(device=DEVICE, max_context=64, residents=2, cpu_threads=1, link="1", placement_profile=trace))
    assert len(parsed) == 1, parsed
    first = costs.route_profile(trace, layers, experts)
    first[0][0] = 99.0  # a caller's own copy
    assert costs.route_profile(trace, layers, experts)[0][0] == 1.0 and len(parsed) == 1
    write_trace(trace, layers, experts, [[[2, 3]] * layers, [[2]] * layers])
    assert costs.route_profile(trace, layers, experts)[0][:4] == [0.0, 0.0, 2.0, 1.0] and len(parsed) == 2


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


def counting_host_timer(monkeypatch, seconds: float = 2e-3) -> list[int]:
    """Replace the host expert's timing with a fixed figure; returns the list its calls append their thread counts to."""
    calls = []

    async def time_host_expert(kernel, pool, mlp, hidden_size, row_bucket, threads, device, per_job=1,
                               repeats=costs.REPEATS, parallel=False, first_job=0, **_):
        if not first_job:  # the jobs of top_k (those of one come after them): a job of one costs the same per expert
            calls.append(threads)
        return seconds * len(calls)  # each measurement differs from the last: a reused figure is told apart

    monkeypatch.setattr(costs, "time_host_expert", time_host_expert)
    return calls


def test_a_load_takes_the_costs_measured_before_on_this_machine(root, monkeypatch, placement_costs):
    """The first load measures the host and stores the figure; a second load with the same shape and threads takes
    it (no measurement, the same placement state); other threads, or `recalibrate`, measure anew and store."""
    path = checkpoint("mixtral", root)
    calls = counting_host_timer(monkeypatch)
    policy = Recording()
    with placed_by(policy):
        for config in (EngineConfig(device=DEVICE, max_context=64, residents=2, cpu_threads=1, link="2"),
                       EngineConfig(device=DEVICE, max_context=64, residents=2, cpu_threads=1, link="2"),
                       EngineConfig(device=DEVICE, max_context=64, residents=2, cpu_threads=2, link="2"),
                       EngineConfig(device=DEVICE, max_context=64, residents=2, cpu_threads=1, link="2", recalibrate=True),
                       EngineConfig(device=DEVICE, max_context=64, residents=2, cpu_threads=1, link="2")):
            load(path, config)
    assert calls == [1, 2, 1]
    assert [state.host_expert_s[16] for state in policy.states] == [2e-3, 2e-3, 4e-3, 6e-3, 6e-3]
    assert all(state.link_bytes_per_s == 2e9 for state in policy.states)  # an emulated link is never stored
    entries = json.loads(placement_costs.path.read_text())["entries"]
    assert sorted(json.loads(key)["threads"] for key in entries) == [1, 2]
    assert all("link_bytes_per_s" not in entry and entry["measured_at"] for entry in entries.values())


def test_auto_places_the_same_from_load_to_load(root, monkeypatch):
    """`auto` decides from the costs: with the figure stored by the first load, a second load places exactly as the
    first, though the host would have timed otherwise (here 1 us, then 100 ms per expert)."""
    from policies.placement import Auto

    path = checkpoint("mixtral", root)
    figures = iter([1e-6, 1e-6, 0.1])  # a load times jobs of top_k experts, then jobs of one

    async def time_host_expert(*args, **kwargs):
        return next(figures)

    monkeypatch.setattr(costs, "time_host_expert", time_host_expert)
    monkeypatch.setattr(Auto, "prices_misses", lambda self, state: True)
    placements = []
    for _ in range(2):
        async def go():
            async with await Runtime.load(path, EngineConfig(device=DEVICE, max_context=64, residents=2, cpu_threads=1,
                                                             link="1", cpu_experts="auto", draft=dict(k=0))) as runtime:
                host = runtime.experts.host
                placements.append(None if host is None else host.placement.host)

        asyncio.run(go())
    assert placements[0] is not None and placements[0] == placements[1]
    assert next(figures) == 0.1  # the second load never timed the host


def test_a_bad_or_unwritable_store_costs_only_the_measurement(tmp_path, monkeypatch, capsys):
    """A store file that is not JSON, of another version, or holds nonsense is read as empty (a warning for the
    unreadable one) and replaced by the next measurement; a store that cannot be written warns and the load goes on."""
    from specter.log import configure

    configure(level="WARNING")
    key = '{"k": 1}'
    store = costs.CostStore(tmp_path / "costs.json")
    store.path.write_text("{not json")
    assert store.get(key) == {}
    assert "placement.costs_unreadable" in capsys.readouterr().err
    store.path.write_text("[" * 100_000 + "]" * 100_000)  # was a RecursionError traceback
    assert store.get(key) == {}
    assert "placement.costs_unreadable" in capsys.readouterr().err
    store.update(key, {}, host_expert_s=1e-3, link_bytes_per_s=None)
    assert store.get(key)["host_expert_s"] == 1e-3 and "link_bytes_per_s" not in store.get(key)
    store.update(key, store.get(key), link_bytes_per_s=5e9)  # the link added beside the host figure
    assert (store.get(key)["host_expert_s"], store.get(key)["link_bytes_per_s"]) == (1e-3, 5e9)
    store.path.write_text(json.dumps({"version": 0, "entries": {key: {"host_expert_s": 1.0}}}))
    assert store.get(key) == {}
    store.path.write_text(json.dumps({"version": costs.CostStore.VERSION,
                                      "entries": {key: {"host_expert_s": -1, "link_bytes_per_s": "fast"}}}))
    assert store.get(key) == {}
    blocked = tmp_path / "file"
    blocked.write_text("")
    unwritable = costs.CostStore(blocked / "costs.json")  # its folder is a file
    unwritable.update(key, {}, host_expert_s=1e-3)
    assert "placement.costs_not_stored" in capsys.readouterr().err and unwritable.get(key) == {}


def test_the_key_names_what_a_figure_was_measured_for():
    """Machine, torch, device, shape, block, threads, jobs, the kernels chosen from and the host path's version (a job's
    own work is timed too); with the native kernel among them its identity (source, CPU), so that a changed kernel's
    or host path's stored time and choice do not carry over."""
    from specter.experts import native
    from specter.experts.host import HOST_PATH_VERSION

    key = json.loads(costs.cost_key(1024, torch.bfloat16, 8, 16, 3, 2, False, torch.device("cpu"), ["torch", "native"]))
    assert key == {"cpu": costs.cpu_name(), "cores": os.cpu_count(), "torch": torch.__version__, "device": "cpu",
                   "host_path": HOST_PATH_VERSION,
                   "expert_bytes": 1024, "dtype": "bfloat16", "hidden": 8, "rows": 16, "threads": 3, "per_job": 2,
                   "parallel": False, "kernels": ["torch", "native"], "native": native.digest()}
    assert costs.cost_key(1024, torch.bfloat16, 8, 16, 3, 2, True, torch.device("cpu"), ["torch", "native"]) != json.dumps(
        key, sort_keys=True)
    assert costs.cost_key(1024, torch.bfloat16, 8, 16, 3, 2, False, torch.device("cpu")) != json.dumps(key, sort_keys=True)
    assert "native" not in json.loads(costs.cost_key(1024, torch.bfloat16, 8, 16, 3, 2, False, torch.device("cpu")))


def test_what_the_store_gives_a_calibration_and_info_alike():
    """`stored_costs`, the one rule the load and `specter info` read the store by: the whole entry to merge into;
    to take, nothing when fresh, and a host figure only with a kernel among those offered."""
    store = costs.CostStore(Path(tempfile.mkdtemp()) / "costs.json")
    torch_only = [costs.HostKernel("torch", lambda rows, packed: rows)]
    native_only = [costs.HostKernel("native", lambda rows, packed: rows, row_invariant=True)]
    store.put("k", {"host_expert_s": 1e-3, "host_kernel": "torch", "link_bytes_per_s": 5e9})
    previous, usable = costs.stored_costs(store, "k", torch_only, fresh=False)
    assert (usable["host_expert_s"], usable["host_kernel"], usable["link_bytes_per_s"]) == (1e-3, "torch", 5e9)
    assert previous["link_bytes_per_s"] == 5e9
    previous, usable = costs.stored_costs(store, "k", torch_only, fresh=True)
    assert usable == {} and previous["host_expert_s"] == 1e-3
    _, usable = costs.stored_costs(store, "k", native_only, fresh=False)
    assert "host_expert_s" not in usable and "host_kernel" not in usable and usable["link_bytes_per_s"] == 5e9
    assert costs.stored_costs(None, "k", torch_only, fresh=False) == ({}, {})
