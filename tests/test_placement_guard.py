"""What the engine does around a placement plug-in at load, as a policy author meets it: a slow `place()` is not a slow
decision, the state it is given is read-only, `placement.needs_trace` is logged only where the policy's answer speaks
of this engine, and an eviction plug-in's error inside `auto`'s pricing of the routing trace says where it came from."""

from __future__ import annotations

import asyncio
import operator
import time
from importlib.metadata import EntryPoint

import pytest
from structlog.testing import capture_logs

from specter import log, plugins
from specter.config import DraftConfig, EngineConfig, GenerationConfig
from specter.engine import Runtime
from specter.errors import PluginError
from specter.model.checkpoint import Checkpoint
from specter.placement import Placement, PlacementState
from tests.test_hybrid import placed_by
from tests.test_placement_costs import write_trace
from tests.test_speculative import DEVICE, checkpoint

SLEEP_S = 0.1
"""Twice the per-decision threshold (`plugins.SLOW_CALL_S`), far below the load-time one (`LOAD_SLOW_CALL_S`)."""


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("guard"))


def state(**fields) -> PlacementState:
    base = dict(num_layers=2, num_experts=8, top_k=2, slots_per_layer=2, initial_residents=((), ()), expert_bytes=1000,
                row_bucket=16, host_expert_s={16: 1e-3}, link_bytes_per_s=1e9, route_counts=[[1.0] * 8, [2.0] * 8])
    return PlacementState(**{**base, **fields})


def load(path: str, config: EngineConfig, prompt: list[int] | None = None) -> None:
    async def go():
        async with await Runtime.load(path, config) as runtime:
            if prompt is not None:
                await runtime.complete_ids(prompt, GenerationConfig(max_new_tokens=2))

    asyncio.run(go())


def events(logs: list[dict], name: str) -> list[dict]:
    return [entry for entry in logs if entry["event"] == name]


# ---- slow calls: a load-time call is held to the load's threshold --------------------------------------------------

class SlowPlace:
    name = "slow-place"

    def place(self, state: PlacementState) -> Placement:
        time.sleep(SLEEP_S)
        return Placement.device_only(state.num_layers, state.num_experts)

    def prices_misses(self, state: PlacementState) -> bool:
        time.sleep(SLEEP_S)
        return True

    def place_prefill(self, state: PlacementState, decode: Placement, rows: int) -> Placement:
        time.sleep(SLEEP_S)  # before each prompt, on the event loop: a decision
        return decode


class SlowVictims:
    name = "slow-victims"

    def victims(self, layer, residents, protected, count, history, plan):
        time.sleep(SLEEP_S)
        return [e for e in residents if e not in protected][:count]


def test_a_slow_place_is_not_a_slow_decision_but_a_slow_eviction_or_prompt_placement_is():
    """`auto`'s place() took 58 ms replaying a trace at load and was logged with the advice for a decision on the
    event loop; place() and prices_misses() run once while the engine loads, before any request waits."""
    placement, eviction = plugins.guarded(SlowPlace(), "placement"), plugins.guarded(SlowVictims(), "eviction")
    decode = Placement.device_only(2, 8)
    with capture_logs() as logs:
        placement.place(state())
        placement.prices_misses(state())
        placement.place_prefill(state(), decode, 4)
        eviction.victims(layer=0, residents=[1, 2], protected=set(), count=1, history=None, plan=None)
    slow = events(logs, "plugin.slow_call")
    assert [entry["method"] for entry in slow] == ["place_prefill", "victims"]
    assert all("event loop" in entry["advice"] for entry in slow)


def test_a_place_slower_than_the_load_threshold_says_it_delays_the_load(monkeypatch):
    monkeypatch.setattr(plugins, "LOAD_SLOW_CALL_S", SLEEP_S / 2)
    with capture_logs() as logs:
        plugins.guarded(SlowPlace(), "placement").place(state())
    [slow] = events(logs, "plugin.slow_call")
    assert slow["method"] == "place" and "delayed the load" in slow["advice"] and "event loop" not in slow["advice"]


# ---- the state a placement is given is read-only ----------------------------------------------------------------

class Tampering:
    """Tries to change each part of the state it is given (and carries on where it cannot), places the experts past
    each layer's slots on the host, and records what each call saw."""

    name = "tampering"

    def __init__(self) -> None:
        self.seen: list[tuple] = []
        self.refused: list[str] = []

    def _see(self, call: str, state: PlacementState) -> None:
        rounds = state.route_sequence.rounds
        self.seen.append((call, dict(state.host_expert_s), [list(row) for row in state.route_counts],
                          [list(routes.used) for routes in rounds[0].layers], list(state.initial_residents)))

    def place(self, state: PlacementState) -> Placement:
        self._see("place", state)
        routes = state.route_sequence.rounds[0].layers[0]
        for tamper in (lambda: operator.setitem(state.host_expert_s, 16, 0.0), lambda: state.route_counts[0].append(99.0),
                       lambda: routes.used.append(7), lambda: operator.setitem(routes.predicted, 0, 9.0),
                       lambda: state.route_sequence.rounds[0].layers.append(routes)):
            try:
                tamper()
            except (TypeError, AttributeError) as error:
                self.refused.append(type(error).__name__)
        return Placement.of([range(state.slots(layer), state.num_experts) for layer in range(state.num_layers)],
                            state.num_layers, state.num_experts)

    def place_prefill(self, state: PlacementState, decode: Placement, rows: int) -> Placement:
        self._see("place_prefill", state)
        return decode


def test_a_placement_cannot_change_the_state_the_engine_records_and_hands_to_the_next_call(root, tmp_path):
    """`state.host_expert_s[16] = 0.0` in place() went through: the load logged `host_s_per_expert_by_rows={'16': 0.0}`
    as what the placement was decided from, and every prompt's place_prefill() got the changed state."""
    path = checkpoint("mixtral", root)
    spec = Checkpoint(path).spec
    layers, experts = len(spec.moe_layers), spec.num_experts
    trace = tmp_path / "profile.jsonl"
    write_trace(trace, layers, experts, [[[r % experts, (r + 1) % experts]] * layers for r in range(6)])
    policy = Tampering()
    log.configure(level="INFO")  # the decision record is an info event (`logging_as_found` restores the level)
    with placed_by(policy), capture_logs() as logs:
        load(path, EngineConfig(device=DEVICE, max_context=64, residents=2, cpu_threads=1, link="1", placement_profile=trace,
                                draft=DraftConfig(k=0)), prompt=[3, 1, 4])
    assert policy.refused == ["TypeError", "AttributeError", "AttributeError", "TypeError", "AttributeError"]
    [(_, measured, counts, used, residents), prompt] = policy.seen
    assert prompt[0] == "place_prefill" and prompt[1:] == (measured, counts, used, residents)
    assert 0.0 not in measured.values() and all(99.0 not in row for row in counts) and used == [[0, 1]] * layers
    [decided] = events(logs, "placement.decided")
    assert decided["host_s_per_expert_by_rows"] == {str(rows): seconds for rows, seconds in measured.items()}


def test_a_policy_writing_into_its_state_gets_a_plugin_error_and_the_state_is_unchanged():
    class Writes:
        name = "writes"

        def place(self, state):
            state.host_expert_s[16] = 0.0
            return Placement.device_only(state.num_layers, state.num_experts)

    given = state()
    with pytest.raises(PluginError, match=r"placement plug-in 'writes' .*place\(\) raised TypeError") as caught:
        plugins.guarded(Writes(), "placement").place(given)
    assert isinstance(caught.value.__cause__, TypeError) and dict(given.host_expert_s) == {16: 1e-3}
    frozen = state(host_expert_s=(source := {16: 1e-3}), route_counts=(counts := [[1.0] * 8, [2.0] * 8]))
    source[16], counts[0][0] = 0.0, 5.0  # what the builder keeps of its own inputs does not reach the state either
    assert frozen.host_expert_s == {16: 1e-3} and frozen.route_counts[0][0] == 1.0


# ---- placement.needs_trace: only where the policy's "no" speaks of this engine ------------------------------------

class NeedsTrace:
    name = "needs-trace"

    def __init__(self) -> None:
        self.asked = 0

    def place(self, state: PlacementState) -> Placement:
        return Placement.device_only(state.num_layers, state.num_experts)

    def prices_misses(self, state: PlacementState) -> bool:
        self.asked += 1
        return False


@pytest.mark.parametrize("speculates, traced, own_tokens, asked, warned, profiled", [
    (False, True, 256, 0, False, False),  # --k-max 0 --k 0 with a trace: the warning said the engine speculates and has no trace
    (False, False, 256, 0, False, False),  # an engine that does not speculate records no trace of its own either
    (True, True, 256, 0, False, False),
    (True, False, 0, 1, True, False),  # self_profile_tokens 0: no trace of its own
    (True, False, 256, 1, False, True),  # the engine's own trace has rounds: priced from it, nothing to warn of
    (True, False, 1, 2, True, True),  # one token is the prompt's: the own trace holds no round, and the warning says so
])
def test_needs_trace_is_logged_only_for_a_speculating_engine_without_a_traces_rounds(root, tmp_path, speculates, traced,
                                                                                    own_tokens, asked, warned, profiled):
    path = checkpoint("mixtral", root)
    spec = Checkpoint(path).spec
    layers, experts = len(spec.moe_layers), spec.num_experts
    trace = None
    if traced:
        trace = tmp_path / "profile.jsonl"
        write_trace(trace, layers, experts, [[[r % experts, (r + 1) % experts]] * layers for r in range(6)])
    draft = DraftConfig(k=2, quant="int8") if speculates else DraftConfig(k=0, k_max=0)
    policy = NeedsTrace()
    log.configure(level="INFO")  # the own profile's record is an info event (`logging_as_found` restores the level)
    with placed_by(policy), capture_logs() as logs:
        load(path, EngineConfig(device=DEVICE, max_context=64, residents=2, cpu_threads=1, link="1", placement_profile=trace,
                                self_profile_tokens=own_tokens, draft=draft))
    logged = events(logs, "placement.needs_trace")
    assert policy.asked == asked and len(logged) == int(warned)
    assert len(events(logs, "placement.own_profile")) == int(profiled)
    if warned:
        given = ("no placement_profile was given" if not profiled
                 else "the engine's own routing trace, recorded at load (self_profile_tokens) holds no speculative round")
        assert logged[0]["hint"].startswith("placement plug-in 'needs-trace' says it cannot price a speculating engine's "
                                            "misses without a routing trace with rounds, and this engine speculates and "
                                            f"{given}; record one with `specter generate --trace")
        assert "device path" not in logged[0]["hint"] and logged[0]["host_experts"] == 0


# ---- a plug-in's error inside the pricing of the routing trace at load ---------------------------------------------

class DuplicateVictims:
    """An eviction plug-in that names one expert `count` times."""

    name = "ev-dup"

    def victims(self, layer, residents, protected, count, history, plan):
        return [[e for e in residents if e not in protected][0]] * count


@pytest.fixture
def duplicate_eviction(monkeypatch, fresh_plugin_scan):
    """`ev-dup` installed as an eviction plug-in (this module's `DuplicateVictims`)."""
    listed, installed = [EntryPoint("ev-dup", f"{__name__}:DuplicateVictims", "specter.eviction")], plugins.entry_points
    monkeypatch.setattr(plugins, "entry_points",
                        lambda group: [*installed(group=group), *listed] if group == "specter.eviction" else installed(group=group))
    plugins.refresh()


@pytest.mark.parametrize("placement, says", [
    ("auto", "while the placement plug-in 'auto' priced the routing trace {trace} at load"),
    ("all", "while the engine priced the placement of plug-in 'all' against the routing trace {trace} at load (its "
            "decision record)"),
], ids=["auto", "all"])
def test_an_eviction_error_in_the_pricing_of_the_trace_says_so(root, tmp_path, duplicate_eviction, placement, says):
    """`--cpu-experts auto --placement-profile TRACE --eviction BROKEN` printed only the eviction plug-in's wrong answer,
    nothing saying that the placement's cost model met it replaying the trace at load (`prefetch_misses`)."""
    path = checkpoint("mixtral", root)
    spec = Checkpoint(path).spec
    layers, experts = len(spec.moe_layers), spec.num_experts
    trace = tmp_path / "profile.jsonl"  # each round the last two of the last round, hot, and two misses: two victims at once
    write_trace(trace, layers, experts, [[[(2 * r + i) % experts for i in range(4)]] * layers for r in range(6)])
    with pytest.raises(PluginError) as caught:
        load(path, EngineConfig(device=DEVICE, max_context=64, residents=2, cpu_threads=1, link="1", placement_profile=trace,
                                cpu_experts=placement, eviction="ev-dup", draft=DraftConfig(k=2, quant="int8")))
    original = caught.value.__cause__
    assert isinstance(original, PluginError)
    assert str(original).startswith("eviction plug-in 'ev-dup'") and "is not 2 distinct experts" in str(original)
    assert str(caught.value) == f"{original}, {says.format(trace=trace)}"
