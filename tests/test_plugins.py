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


def test_cancellation_is_not_swallowed():
    with pytest.raises(asyncio.CancelledError):
        guarded_victims("cancel")


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
