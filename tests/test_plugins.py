"""Plug-in loading: discovery, allow-list, validation, errors that name the plug-in, guarded decisions."""

from __future__ import annotations

import asyncio
from importlib.metadata import EntryPoint, PackageNotFoundError, distribution

import numpy as np
import pytest

from specter import plugins
from specter.errors import PluginError
from specter.policy import LinkTiming, LookaheadState, Plan, RoundOutcome, UseHistory

DUMMY_DIST = "specter-dummy-policy"


def _dist_installed(name: str) -> bool:
    try:
        distribution(name)
    except PackageNotFoundError:
        return False
    return True


needs_specter_dist = pytest.mark.skipif(
    not _dist_installed("specter"), reason="specter not pip-installed, so its entry points are not registered"
)

FAKE_ENTRY_POINTS = {
    "specter.eviction": [
        EntryPoint("lru", "policies.eviction:LRU", "specter.eviction"),
        EntryPoint("lfu", "policies.eviction:LFU", "specter.eviction"),
        EntryPoint("import-fails", "specter_no_such_module_xyz:Policy", "specter.eviction"),
        EntryPoint("not-a-factory", "policies.prefetch:__doc__", "specter.eviction"),
        EntryPoint("returns-none", "specter_dummy_policy:returns_none", "specter.eviction"),
        EntryPoint("returns-class", "specter_dummy_policy:returns_class", "specter.eviction"),
        EntryPoint("wrong-group", "policies.prefetch:TopMFrequency", "specter.eviction"),
    ],
    "specter.prefetch": [
        EntryPoint("none", "policies.prefetch:NoPrefetch", "specter.prefetch"),
        EntryPoint("topm-frequency", "policies.prefetch:TopMFrequency", "specter.prefetch"),
    ],
    "specter.lookahead": [EntryPoint("fixed", "policies.lookahead:Fixed", "specter.lookahead")],
    "specter.backends": [EntryPoint("fake", "policies.eviction:LRU", "specter.backends")],
}


pytestmark = pytest.mark.usefixtures("fresh_plugin_scan")


@pytest.fixture
def fake_entry_points(monkeypatch):
    """Entry points made in the test, so loader behaviour does not depend on what is pip-installed."""
    monkeypatch.setattr(plugins, "entry_points", lambda group: FAKE_ENTRY_POINTS.get(group, []))


def timing() -> LinkTiming:
    return LinkTiming(bandwidth_bytes_per_s=1e9, draft_step_s=0.01, expert_bytes=10_000_000)


def lookahead_state(k_max: int = 8) -> LookaheadState:
    return LookaheadState([0.5], (0.0, 0.001), (0.01, 0.001), 1e9, [0.0], k_max, "m")


# --- discovery and loading -------------------------------------------------------------------------------


def test_installed_lists_a_group_by_short_or_full_name(fake_entry_points):
    assert set(plugins.installed("prefetch")) == {"none", "topm-frequency"}
    assert plugins.installed("specter.prefetch") == plugins.installed("prefetch")


def test_unknown_group_is_a_plugin_error():
    with pytest.raises(PluginError, match="unknown plug-in group 'evictoin'"):
        plugins.installed("evictoin")


def test_load_policy_constructs_with_options_and_guards(fake_entry_points):
    policy = plugins.load_policy("prefetch", "topm-frequency", m=3)
    assert isinstance(policy, plugins.GuardedPrefetch)
    assert policy.name == "topm-frequency" and policy.m == 3  # extra attributes pass through
    raw = plugins.load_policy("prefetch", "topm-frequency", guard=False)
    assert type(raw).__name__ == "TopMFrequency"


def test_unknown_name_lists_the_installed_ones(fake_entry_points):
    with pytest.raises(PluginError, match="no eviction plug-in named 'lur'; installed: .*lfu.*lru"):
        plugins.load_policy("eviction", "lur")


def test_failing_import_names_the_plugin(fake_entry_points):
    with pytest.raises(PluginError, match="eviction plug-in 'import-fails' .*importing"):
        plugins.load_policy("eviction", "import-fails")


def test_a_non_callable_target_is_rejected(fake_entry_points):
    with pytest.raises(PluginError, match="'not-a-factory'.*not a class or factory"):
        plugins.load_policy("eviction", "not-a-factory")


@pytest.mark.parametrize("name, says", [
    ("returns-none", "returned None; a factory must return the policy object"),
    ("returns-class", "returned the class DummyRandom, not an instance; return an instance"),
])
def test_a_factory_that_returns_no_policy_object_says_what_it_returned(fake_entry_points, name, says):
    """A factory returning None read as `victims() missing; name missing`, one returning the class as "missing a
    required argument: 'self'; keep the protocol's parameter names": advice about the wrong mistake."""
    with pytest.raises(PluginError, match=f"'{name}'.*") as refused:
        plugins.load_policy("eviction", name)
    assert says in str(refused.value), str(refused.value)


def test_an_object_of_the_wrong_protocol_is_rejected(fake_entry_points):
    with pytest.raises(PluginError, match=r"eviction plug-in 'wrong-group' \(dist unknown\): victims\(\) missing"):
        plugins.load_policy("eviction", "wrong-group")


def test_bad_options_name_the_plugin(fake_entry_points):
    with pytest.raises(PluginError, match="lookahead plug-in 'fixed'.*options {'depth': 3}"):
        plugins.load_policy("lookahead", "fixed", depth=3)


def test_a_backend_group_name_is_not_a_policy(fake_entry_points):
    with pytest.raises(PluginError, match="not a policy group"):
        plugins.load_policy("backends", "fake")


def test_load_backend_checks_required_methods(fake_entry_points):
    assert plugins.load_backend("fake", required=["victims"]).name == "lru"
    with pytest.raises(PluginError, match=r"backends plug-in 'fake'.*copy_h2d\(\) missing"):
        plugins.load_backend("fake", required=["copy_h2d"])


def test_scan_is_cached_until_refreshed(monkeypatch):
    calls = []
    monkeypatch.setattr(plugins, "entry_points", lambda group: calls.append(group) or FAKE_ENTRY_POINTS[group])
    plugins.installed("eviction")
    plugins.load_policy("eviction", "lru")
    assert calls == ["specter.eviction"]
    plugins.installed("eviction", refresh=True)
    assert calls == ["specter.eviction"] * 2


def test_loading_twice_gives_independent_instances(fake_entry_points):
    first, second = plugins.load_policy("lookahead", "fixed", k=2), plugins.load_policy("lookahead", "fixed", k=5)
    assert (first.k, second.k) == (2, 5)


# --- allow-list ------------------------------------------------------------------------------------------


def test_allow_list_by_name_and_by_group(fake_entry_points, monkeypatch):
    monkeypatch.setenv(plugins.ALLOW_LIST_ENV, "lru, prefetch:none")
    assert plugins.load_policy("eviction", "lru").name == "lru"
    assert plugins.load_policy("prefetch", "none").name == "none"
    with pytest.raises(PluginError, match="'lfu' is installed but SPECTER_PLUGINS='lru, prefetch:none'"):
        plugins.load_policy("eviction", "lfu")
    with pytest.raises(PluginError, match="topm-frequency"):
        plugins.load_policy("prefetch", "topm-frequency")
    assert set(plugins.available("eviction")) == {"lru"}
    assert set(plugins.installed("eviction")) > {"lru", "lfu"}  # installed() still lists everything


def test_group_qualified_entry_does_not_allow_other_groups(fake_entry_points, monkeypatch):
    monkeypatch.setenv(plugins.ALLOW_LIST_ENV, "eviction:none")
    assert not plugins.is_allowed("prefetch", "none")
    assert plugins.is_allowed("eviction", "none")


def test_empty_allow_list_allows_nothing_and_unset_allows_all(fake_entry_points, monkeypatch):
    assert set(plugins.available("prefetch")) == {"none", "topm-frequency"}
    monkeypatch.setenv(plugins.ALLOW_LIST_ENV, "")
    assert plugins.available("prefetch") == {}


def test_allow_list_entries_that_match_nothing_are_named_once(fake_entry_points, monkeypatch):
    warnings = []
    monkeypatch.setattr(plugins.log, "warning", lambda event, **fields: warnings.append((event, fields)))
    monkeypatch.setenv(plugins.ALLOW_LIST_ENV, "lur, evictoin:lfu, prefetch:none, specter.eviction:lfu")
    assert plugins.is_allowed("eviction", "lfu")  # the full group name is a group too
    assert plugins.is_allowed("prefetch", "none") and not plugins.is_allowed("eviction", "lru")
    assert [event for event, _ in warnings] == ["plugin.allow_list_unmatched"]  # once per value
    named = warnings[0][1]["entries"]
    assert len(named) == 2
    assert "'evictoin:lfu' (no group 'evictoin'" in named[0] and named[1] == "'lur' (no such plug-in installed)"
    assert "lru" in warnings[0][1]["installed"]["eviction"]
    monkeypatch.setenv(plugins.ALLOW_LIST_ENV, "lru")
    plugins.is_allowed("eviction", "lru")
    assert len(warnings) == 1  # every entry matches


# --- guarded decisions -----------------------------------------------------------------------------------


class Misbehaving:
    """Every decision misbehaves in the way `mode` says."""

    name = "misbehaving"

    def __init__(self, mode: str) -> None:
        self.mode = mode

    def victims(self, layer, residents, protected, count, history, plan):
        if self.mode == "raise":
            raise KeyError("oops")
        if self.mode == "cancel":
            raise asyncio.CancelledError()
        if self.mode == "interrupt":
            raise KeyboardInterrupt
        if self.mode == "base":
            raise BaseException("a base exception")
        if self.mode == "lazy":  # a generator that fails while the guard reads it
            return (expert for expert in [1, 3] if expert != 3 or {}["lazy"])
        return {"protected": [2], "duplicate": [1, 1], "foreign": [9], "short": []}[self.mode]

    def checkpoints(self, k, timing):
        return [3, 1] if self.mode == "unsorted" else [k + 1]

    def plan(self, route_counts, resident, steps_done, k, timing, slots_per_layer):
        return {"too-many": Plan(experts={0: [0, 1, 2]}), "bad-id": Plan(experts={0: [7]}), "dict": {}}[self.mode]

    def next_k(self, state):
        return {"negative": -1, "too-deep": state.k_max + 1, "float": 2.0}[self.mode]

    def observe(self, outcome):
        raise RuntimeError("observe failed")


def guarded_victims(mode: str) -> list[int]:
    policy = plugins.guarded(Misbehaving(mode), "eviction")
    return policy.victims(0, [1, 2, 3], frozenset({2}), 2 if mode == "duplicate" else 1, UseHistory.empty(), None)


@pytest.mark.parametrize("mode", ["protected", "duplicate", "foreign", "short"])
def test_wrong_victims_are_plugin_errors(mode):
    with pytest.raises(PluginError, match="eviction plug-in 'misbehaving'.*victims\\(\\) returned a wrong answer"):
        guarded_victims(mode)


def test_an_exception_inside_a_decision_becomes_a_plugin_error_and_the_wrapper_stays_usable():
    policy = plugins.guarded(Misbehaving("raise"), "eviction")
    for _ in range(2):
        with pytest.raises(PluginError, match=r"'misbehaving'.*victims\(\) raised KeyError") as caught:
            policy.victims(0, [1, 2], frozenset(), 1, UseHistory.empty(), None)
        assert isinstance(caught.value.__cause__, KeyError)
    policy.policy.mode = "protected"
    assert policy.victims(0, [1, 2], frozenset(), 1, UseHistory.empty(), None) == [2]


def test_the_users_interrupt_passes_and_a_policys_own_cancellation_is_its_error():
    """A decision is synchronous, so the engine's cancellation reaches the task at an await, never inside one: a
    CancelledError or another BaseException raised there is the plug-in's bug. It was let through, and `generate
    --json` reported a plug-in's bug as the user's cancellation (or printed nothing for a BaseException)."""
    with pytest.raises(KeyboardInterrupt):
        guarded_victims("interrupt")
    for mode, kind in [("cancel", "CancelledError"), ("base", "BaseException")]:
        with pytest.raises(PluginError, match=rf"'misbehaving'.*victims\(\) raised {kind}"):
            guarded_victims(mode)


def test_an_answer_that_fails_while_it_is_read_is_the_plugins_error():
    """A generator of victims, or a plan's mapping, is the plug-in's code running when the guard reads it: its
    exception was a traceback through the engine's internals."""
    with pytest.raises(PluginError, match=r"'misbehaving'.*reading the answer of victims\(\) raised KeyError"):
        plugins.guarded(Misbehaving("lazy"), "eviction").victims(0, [1, 2, 3], frozenset(), 2, UseHistory.empty(), None)

    class Exploding(dict):
        def items(self):
            raise RuntimeError("items")

    class Planner(Misbehaving):
        def plan(self, route_counts, resident, steps_done, k, timing, slots_per_layer):
            return Plan(experts=Exploding({0: [1]}))

    with pytest.raises(PluginError, match=r"reading the answer of plan\(\) raised RuntimeError"):
        plugins.guarded(Planner("x"), "prefetch").plan(np.zeros((1, 4)), np.zeros((1, 4), bool), 1, 2, timing(), 2)


def test_a_name_that_raises_is_named_at_the_protocol_check():
    class Nameless(Misbehaving):
        @property
        def name(self):
            raise ValueError("no name")

    with pytest.raises(PluginError, match=r"checking its methods and name raised ValueError"):
        plugins.guarded(Nameless("x"), "eviction")


@pytest.mark.parametrize("mode", ["unsorted", "out-of-range"])
def test_wrong_checkpoints_are_plugin_errors(mode):
    with pytest.raises(PluginError, match="checkpoints\\(\\) returned a wrong answer"):
        plugins.guarded(Misbehaving(mode), "prefetch").checkpoints(4, timing())


@pytest.mark.parametrize("mode", ["too-many", "bad-id", "dict"])
def test_wrong_plans_are_plugin_errors(mode):
    policy = plugins.guarded(Misbehaving(mode), "prefetch")
    with pytest.raises(PluginError, match="plan\\(\\) returned a wrong answer"):
        policy.plan(np.zeros((2, 4)), np.zeros((2, 4), bool), 1, 4, timing(), 2)


@pytest.mark.parametrize("mode", ["negative", "too-deep", "float"])
def test_next_k_outside_range_is_a_plugin_error(mode):
    with pytest.raises(PluginError, match="next_k\\(\\) returned a wrong answer"):
        plugins.guarded(Misbehaving(mode), "lookahead").next_k(lookahead_state())


def test_observe_failure_is_a_plugin_error():
    with pytest.raises(PluginError, match="observe\\(\\) raised RuntimeError"):
        plugins.guarded(Misbehaving("x"), "lookahead").observe(RoundOutcome(2, 1, 0.01, 0.03))


def test_guarding_an_object_that_is_not_a_policy_is_a_plugin_error():
    with pytest.raises(PluginError, match=r"lookahead plug-in 'Misbehaving'.*name"):
        plugins.guarded(type("Misbehaving", (), {"next_k": lambda s, x: 0, "observe": lambda s, x: None})(), "lookahead")


def test_guarding_twice_wraps_once(fake_entry_points):
    policy = plugins.load_policy("eviction", "lru")
    assert plugins.guarded(policy, "eviction") is policy


# --- the real installation -------------------------------------------------------------------------------


@needs_specter_dist
def test_reference_policies_are_registered_by_entry_point():
    assert {"lru", "lfu", "plan-protect", "belady-lookahead"} <= set(plugins.installed("eviction"))
    assert {"none", "topm-frequency"} <= set(plugins.installed("prefetch"))
    assert "fixed" in plugins.installed("lookahead")
    origin = plugins.PluginOrigin.of("eviction", plugins.installed("eviction")["lru"])
    assert origin.dist == "specter"


def test_the_test_session_sees_the_dummy_plugin_without_an_install():
    """tests/conftest.py puts the dummy package and its metadata on sys.path (unless it is pip-installed), so
    these tests never skip for want of it and the quick start need not install it."""
    assert _dist_installed(DUMMY_DIST)
    assert {"dummy-random", "dummy-broken"} <= set(plugins.installed("eviction", refresh=True))


def test_the_generated_metadata_carries_every_entry_point_of_the_example_package(tmp_path):
    import tomllib
    from importlib.metadata import PathDistribution

    from tests.conftest import DUMMY_PLUGIN, dummy_dist_info

    declared = tomllib.loads((DUMMY_PLUGIN / "pyproject.toml").read_text())["project"]["entry-points"]
    found = PathDistribution(dummy_dist_info(DUMMY_PLUGIN / "pyproject.toml", tmp_path))
    assert found.metadata["Name"] == DUMMY_DIST
    assert {(ep.group, ep.name, ep.value) for ep in found.entry_points} == {
        (group, name, target) for group, points in declared.items() for name, target in points.items()}


def test_dummy_plugin_is_discovered_with_its_distribution():
    entry_point = plugins.installed("eviction")["dummy-random"]
    origin = plugins.PluginOrigin.of("eviction", entry_point)
    assert (origin.dist, origin.version) == (DUMMY_DIST, distribution(DUMMY_DIST).version)


def test_dummy_random_is_loaded_and_used_deterministically():
    residents, protected = [3, 5, 8, 13, 21], frozenset({8})
    answers = []
    for _ in range(2):
        policy = plugins.load_policy("eviction", "dummy-random", seed=7)
        answers.append(policy.victims(0, residents, protected, 2, UseHistory.empty(), None))
    assert answers[0] == answers[1]
    assert len(set(answers[0])) == 2 and set(answers[0]) <= set(residents) - protected


def test_dummy_random_drives_a_replay():
    from policies.prefetch import NoPrefetch
    from specter.replay import replay
    from specter.trace import LayerRoutes, TraceHeader, TraceRound

    header = TraceHeader("toy", 1, 4, 1000, 1, 2)
    rounds = [TraceRound(r, 0, 0, 0.01, [LayerRoutes({}, [r % 4])]) for r in range(8)]
    result = replay(header, rounds, plugins.load_policy("eviction", "dummy-random"), NoPrefetch(), 1.0)
    assert result.eviction == "dummy-random" and result.hits + result.misses == 8


def test_dummy_broken_is_rejected_naming_it_and_its_distribution():
    with pytest.raises(PluginError) as caught:
        plugins.load_policy("eviction", "dummy-broken")
    message = str(caught.value)
    assert "eviction plug-in 'dummy-broken'" in message
    assert f"dist {DUMMY_DIST} {distribution(DUMMY_DIST).version}" in message
    assert "victims() missing" in message


def test_allow_list_hides_the_dummy_plugin(monkeypatch):
    monkeypatch.setenv(plugins.ALLOW_LIST_ENV, "lru,plan-protect")
    assert "dummy-random" not in plugins.available("eviction")
    with pytest.raises(PluginError, match="SPECTER_PLUGINS"):
        plugins.load_policy("eviction", "dummy-random")


# ---- a policy author's mistakes, caught by the guards ------------------------------------------------------------
class _Author:
    """A small policy of each group, its answers set per test (what a misbehaving third-party policy returns)."""

    name = "author"


def _guarded(group: str, **methods):
    from specter.plugins import guarded

    policy = _Author()
    for method, answer in methods.items():
        setattr(policy, method, answer)
    if group == "prefetch" and "checkpoints" not in methods:
        policy.checkpoints = lambda k, timing: [1]
    if group == "placement":
        policy.place = methods["place"]
    return guarded(policy, group)


def _plan_args(layers=2, experts=8, slots=3):
    from specter.policy import LinkTiming

    return dict(route_counts=np.zeros((layers, experts)), resident=np.zeros((layers, experts), dtype=bool), steps_done=1,
                k=4, timing=LinkTiming(1e9, 1e-3, 1000), slots_per_layer=slots)


@pytest.mark.parametrize("answer, says", [
    (lambda: Plan(experts={0: [1.0, 2.0]}), "not a list of int ids"),  # floats broke the engine for good
    (lambda: Plan(experts={0: [True]}), "not a list of int ids"),
    (lambda: Plan(experts={0: ["1"]}), "not a list of int ids"),
    (lambda: Plan(experts={"0": [1]}), "names layers"),  # were bare TypeErrors from inside the guard
    (lambda: Plan(experts={0.5: [1]}), "names layers"),
    (lambda: Plan(experts=[[1, 2]]), "not a mapping"),
    (lambda: Plan(experts={0: None}), "not a list of ids"),
    (lambda: Plan(experts={0: 3}), "not a list of ids"),
    (lambda: Plan(experts={0: [1]}, scores={0: {999: 1.0}}), "ids outside 0..7"),  # the static verify indexed by it
    (lambda: Plan(experts={0: [1]}, scores={0: {1: "high"}}), "not finite numbers"),  # was blamed on the eviction
    (lambda: Plan(experts={0: [1]}, scores=None), "not a mapping"),
    (lambda: Plan(experts={0: list(range(8)) * 1000}), "not at most 3 distinct"),
])
def test_a_malformed_plan_is_a_plugin_error_naming_the_prefetch_policy(answer, says):
    policy = _guarded("prefetch", plan=lambda **_: answer())
    with pytest.raises(PluginError, match=says) as error:
        policy.plan(**_plan_args())
    assert "prefetch plug-in 'author'" in str(error.value) and len(str(error.value)) < 600


def test_the_engine_gets_a_read_only_copy_of_the_plan_with_the_ids_read_once():
    from specter.policy import Plan as PlanType

    class Subclass(PlanType):
        def for_layer(self, layer):
            return [999]

    answer = Subclass(experts={0: (e for e in (3, 1))}, scores={1: {np.int64(2): np.float32(0.5)}})
    plan = _guarded("prefetch", plan=lambda **_: answer).plan(**_plan_args())
    assert type(plan) is PlanType and plan.for_layer(0) == [3, 1] and plan.score(1, 2) == 0.5  # a generator read once
    with pytest.raises(TypeError):
        plan.experts[0] = [999]  # what an eviction policy editing the plan it is given did to the engine's own dict
    with pytest.raises(TypeError):
        plan.scores[1][2] = 9.0


def test_victims_are_checked_against_the_residents_before_the_call_and_as_ints():
    def clearing(layer, residents, protected, count, history, plan):
        residents.clear()  # the answer below was right when asked; the message said it was not resident
        return [5]

    assert _guarded("eviction", victims=clearing).victims(0, [5, 6], set(), 1, None, None) == [5]
    for answer in (["5"], [5.0], [True]):  # int() took them: 2.7 became expert 2
        policy = _guarded("eviction", victims=lambda answer=answer, **_: answer)
        with pytest.raises(PluginError, match="not a list of int ids"):
            policy.victims(layer=0, residents=[1, 5], protected=set(), count=1, history=None, plan=None)
    assert _guarded("eviction", victims=lambda **_: [np.int64(5)]).victims(0, [5, 6], set(), 1, None, None) == [5]


def test_a_policy_exit_is_a_plugin_error_and_a_slow_call_is_logged_once(caplog):
    import time as clock

    def exiting(**_):
        raise SystemExit(3)

    with pytest.raises(PluginError, match="SystemExit"):
        _guarded("eviction", victims=exiting).victims(layer=0, residents=[1], protected=set(), count=1, history=None,
                                                      plan=None)
    from specter.plugins import SLOW_CALL_S

    warnings = []
    policy = _guarded("eviction", victims=lambda **_: (clock.sleep(SLOW_CALL_S * 1.5), [1])[1])
    import specter.plugins

    original = specter.plugins.log.warning
    specter.plugins.log.warning = lambda event, **fields: warnings.append((event, fields))
    try:
        for _ in range(3):
            policy.victims(layer=0, residents=[1], protected=set(), count=1, history=None, plan=None)
    finally:
        specter.plugins.log.warning = original
    assert [event for event, _ in warnings] == ["plugin.slow_call"] and warnings[0][1]["method"] == "victims"


def test_a_placement_is_copied_into_frozen_sets_with_its_ids_checked():
    from specter.placement import Placement, PlacementState

    state = PlacementState(num_layers=2, num_experts=8, top_k=2, slots_per_layer=2,
                           initial_residents=((), ()), expert_bytes=1000, row_bucket=16)
    live = [{4, 5}, {6}]

    class Mutable:
        name = "mutable"

        def place(self, state):
            return Placement(tuple(live), 8)  # plain sets: the policy could change them after load

    from specter.plugins import guarded

    placement = guarded(Mutable(), "placement").place(state)
    live[0].clear()
    assert placement.host == (frozenset({4, 5}), frozenset({6}))  # the engine's copy did not change with them
    for bad in ((frozenset({1.5}), frozenset()), (frozenset({True}), frozenset())):  # Placement's range check takes them
        policy = Mutable()
        policy.place = lambda state, bad=bad: Placement(bad, 8)
        with pytest.raises(PluginError, match="not a list of int ids"):
            guarded(policy, "placement").place(state)


def test_prices_misses_is_guarded():
    from specter.placement import Placement, PlacementState

    state = PlacementState(num_layers=1, num_experts=8, top_k=2, slots_per_layer=2, initial_residents=((),),
                           expert_bytes=1000, row_bucket=16)

    class Pricing:
        name = "pricing"

        def place(self, state):
            return Placement.device_only(1, 8)

        def prices_misses(self, state):
            raise RuntimeError("prices_misses failed")

    from specter.plugins import guarded

    with pytest.raises(PluginError, match="prices_misses"):
        guarded(Pricing(), "placement").prices_misses(state)
    del Pricing.prices_misses
    assert guarded(Pricing(), "placement").prices_misses(state) is True  # none: nothing to warn about


@pytest.mark.parametrize("value", ["", ":", "badplug:"])
def test_an_entry_point_that_is_not_module_attribute_says_so(monkeypatch, value):
    """It said: importing '' failed: AttributeError("'NoneType' object has no attribute 'group'")."""
    point = EntryPoint(name="broken", value=value, group="specter.eviction")
    monkeypatch.setattr(plugins, "installed", lambda group, refresh=False: {"broken": point})
    with pytest.raises(PluginError, match="is not 'module:attribute'"):
        plugins.load_policy("eviction", "broken")


def test_a_lookahead_policy_is_observed_only_after_it_chose(tiny):
    """Without a draft (k_max 0) the engine asks no next_k, yet it called observe() every round: a policy that pairs
    the two (as the protocol promises) failed the run."""
    from specter import Engine, EngineConfig
    from specter.kernel import run

    class Paired:
        name = "paired"

        def __init__(self) -> None:
            self.pending, self.observed = False, 0

        def next_k(self, state):
            self.pending = True
            return min(2, state.k_max)

        def observe(self, outcome):
            if not self.pending:
                raise RuntimeError("observe() without next_k()")
            self.pending, self.observed = False, self.observed + 1

    async def tokens(k_max: int) -> tuple[list[int], int]:
        config = EngineConfig(device="cpu", residents=4, max_context=64, draft={"k_max": k_max})
        async with Engine.from_pretrained(tiny, config) as engine:
            paired = Paired()
            engine.runtime.lookahead = plugins.guarded(paired, "lookahead")
            return (await engine.complete([5, 17, 300], max_new_tokens=8)).token_ids, paired.observed

    plain, unobserved = run(tokens(0))
    speculated, observed = run(tokens(4))
    assert plain == speculated and unobserved == 0 and observed > 0
