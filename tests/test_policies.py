"""Reference policies on hand-made inputs whose right answer is known; protocol conformance."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.eviction import LFU, LRU, BeladyLookahead, PlanProtect
from policies.lookahead import Fixed, Profiled, Roofline
from policies.prefetch import NoPrefetch, TopMFrequency, TopMKeep
from specter.errors import ConfigError
from specter.policy import (
    EvictionPolicy,
    LinkTiming,
    LookaheadPolicy,
    LookaheadState,
    Plan,
    PrefetchPolicy,
    RoundOutcome,
    UseHistory,
    protocol_problems,
)

TIMING = LinkTiming(bandwidth_bytes_per_s=1e9, draft_step_s=0.01, expert_bytes=10_000_000)  # 1 expert per step


def history(last_use: dict[int, int], use_count: dict[int, int] | None = None) -> UseHistory:
    return UseHistory(last_use=last_use, use_count=use_count or {}, clock=max(last_use.values(), default=0))


def victims(policy: EvictionPolicy, residents, protected=(), count=1, hist=None, plan=None, layer=0) -> list[int]:
    return policy.victims(
        layer=layer,
        residents=residents,
        protected=frozenset(protected),
        count=count,
        history=hist or UseHistory.empty(),
        plan=plan,
    )


def lookahead_state(**overrides) -> LookaheadState:
    fields = dict(
        acceptance_by_position=[0.8] * 8,
        draft_step_s_fit=(0.0, 0.002),
        verify_s_fit=(0.005, 0.0005),
        bandwidth_bytes_per_s=1e9,
        predicted_new_bytes=[0.0] * 33,
        k_max=16,
        model_key="tiny@1GB",
    )
    return LookaheadState(**{**fields, **overrides})


# --- protocols -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", [LRU(), LFU(), PlanProtect(), BeladyLookahead()])
def test_eviction_policies_satisfy_protocol(policy):
    assert isinstance(policy, EvictionPolicy)
    assert protocol_problems(policy, "eviction") == []


@pytest.mark.parametrize("policy", [NoPrefetch(), TopMFrequency(m=2), TopMKeep()])
def test_prefetch_policies_satisfy_protocol(policy):
    assert isinstance(policy, PrefetchPolicy)
    assert protocol_problems(policy, "prefetch") == []


@pytest.mark.parametrize("policy", [Fixed(k=4), Profiled(), Roofline()])
def test_lookahead_policies_satisfy_protocol(policy):
    assert isinstance(policy, LookaheadPolicy)
    assert protocol_problems(policy, "lookahead") == []


def test_protocol_problems_names_what_is_missing():
    class NoVictims:
        name = "x"

    class NotCallable:
        name = ""
        victims = 3

    assert protocol_problems(NoVictims(), "eviction") == ["victims() missing"]
    problems = protocol_problems(NotCallable(), "eviction")
    assert "victims is not callable" in problems
    assert any("name" in problem for problem in problems)


# --- eviction --------------------------------------------------------------------------------------------


def test_lru_evicts_least_recent_and_never_used_first():
    hist = history({1: 5, 2: 3, 3: 9})
    assert victims(LRU(), [1, 2, 3, 4], count=2, hist=hist) == [4, 2]  # 4 never used


def test_lru_skips_protected():
    hist = history({1: 5, 2: 3, 3: 9})
    assert victims(LRU(), [1, 2, 3], protected={2}, count=2, hist=hist) == [1, 3]


def test_lru_breaks_ties_in_last_use_toward_the_lower_id():
    assert victims(LRU(), [5, 2, 7], count=2) == [2, 5]  # none used yet: all tie
    hist = history({3: 4, 1: 4, 6: 9})
    assert victims(LRU(), [6, 3, 1], count=1, hist=hist) == [1]


def test_lfu_evicts_least_frequent_then_least_recent():
    hist = history({1: 9, 2: 3, 3: 4}, {1: 1, 2: 5, 3: 1})
    assert victims(LFU(), [1, 2, 3], count=2, hist=hist) == [3, 1]


def test_plan_protect_keeps_planned_experts_while_others_remain():
    plan = Plan(experts={0: [1, 2]}, scores={0: {1: 4.0, 2: 1.0}})
    hist = history({1: 1, 2: 2, 3: 8, 4: 9})  # planned ones are the least recent: LRU would take them
    assert victims(PlanProtect(), [1, 2, 3, 4], count=2, hist=hist, plan=plan) == [3, 4]
    assert victims(LRU(), [1, 2, 3, 4], count=2, hist=hist, plan=plan) == [1, 2]


def test_plan_protect_evicts_lowest_scored_planned_when_only_planned_remain():
    plan = Plan(experts={0: [1, 2, 3]}, scores={0: {1: 4.0, 2: 1.0, 3: 2.0}})
    assert victims(PlanProtect(), [1, 2, 3, 4], protected={4}, count=2, plan=plan) == [2, 3]


def test_plan_protect_evicts_the_planned_expert_the_plan_ranks_lowest_among_equal_scores():
    plan = Plan(experts={0: [4, 1, 3]}, scores={0: {4: 2.0, 1: 2.0, 3: 2.0}})  # plan order: 4 first, 3 last
    assert victims(PlanProtect(), [1, 3, 4], count=2, plan=plan) == [3, 1]
    assert victims(PlanProtect(), [1, 3, 4, 9], protected={9}, count=1, plan=plan) == [3]


def test_plan_protect_only_reads_its_layer_of_the_plan():
    plan = Plan(experts={1: [1]}, scores={1: {1: 9.0}})
    hist = history({1: 1, 2: 2})
    assert victims(PlanProtect(), [1, 2], hist=hist, plan=plan, layer=0) == [1]


def test_belady_evicts_unpredicted_first_then_lowest_score():
    # 3 is scored but left out of the plan (slot limit): it outranks 4, which was never predicted.
    plan = Plan(experts={0: [1, 2]}, scores={0: {1: 5.0, 2: 3.0, 3: 1.0}})
    hist = history({1: 1, 2: 2, 3: 3, 4: 9})
    assert victims(BeladyLookahead(), [1, 2, 3, 4], count=3, hist=hist, plan=plan) == [4, 3, 2]
    assert victims(PlanProtect(), [1, 2, 3, 4], count=1, hist=hist, plan=plan) == [3]


def test_belady_without_plan_is_lru():
    hist = history({1: 7, 2: 3, 3: 5})
    assert victims(BeladyLookahead(), [1, 2, 3], count=2, hist=hist) == [2, 3]


@settings(max_examples=60, deadline=None)
@given(
    residents=st.lists(st.integers(0, 15), min_size=1, max_size=10, unique=True),
    data=st.data(),
)
def test_every_eviction_policy_returns_count_distinct_unprotected_residents(residents, data):
    protected = data.draw(st.sets(st.sampled_from(residents), max_size=len(residents) - 1))
    count = data.draw(st.integers(1, len(residents) - len(protected)))
    planned = data.draw(st.lists(st.sampled_from(residents), unique=True))
    plan = Plan(experts={0: planned}, scores={0: {e: float(data.draw(st.integers(0, 5))) for e in planned}})
    hist = history({e: data.draw(st.integers(0, 50)) for e in residents[::2]})
    for policy in (LRU(), LFU(), PlanProtect(), BeladyLookahead()):
        chosen = victims(policy, residents, protected, count, hist, plan)
        assert len(chosen) == count == len(set(chosen)), policy.name
        assert set(chosen) <= set(residents) - protected, policy.name


# --- prefetch --------------------------------------------------------------------------------------------


def test_no_prefetch_plans_nothing():
    policy = NoPrefetch()
    assert policy.checkpoints(8, TIMING) == []
    plan = policy.plan(np.ones((2, 4)), np.zeros((2, 4), bool), 2, 8, TIMING, 2)
    assert plan.experts == {}


def test_topm_takes_most_counted_with_ties_to_lower_id_and_no_zero_counts():
    counts = np.array([[0, 3, 1, 3, 0, 2], [0, 0, 0, 0, 0, 1], [0, 0, 0, 0, 0, 0]], dtype=float)
    plan = TopMFrequency(m=3).plan(counts, np.zeros_like(counts, bool), 4, 8, TIMING, 4)
    assert plan.experts == {0: [1, 3, 5], 1: [5]}
    assert plan.scores[0] == {1: 3.0, 3: 3.0, 5: 2.0, 2: 1.0}  # unplanned but routed experts keep a score


def test_topm_keep_never_plans_a_routed_resident_out():
    # Four slots hold 0 (routed once), 1 (routed 3 times), 4 and 5 (never routed); 2 and 3 are routed more than 0.
    counts = np.array([[1, 3, 4, 2, 0, 0]], dtype=float)
    resident = np.array([[True, True, False, False, True, True]])
    assert TopMFrequency().plan(counts, resident, 4, 8, TIMING, 4).experts == {0: [2, 1, 3, 0]}
    keep = TopMKeep().plan(counts, resident, 4, 8, TIMING, 4)
    assert keep.experts == {0: [1, 0, 2, 3]}  # the routed residents, then the new ones into the slots of 4 and 5
    assert keep.scores == TopMFrequency().plan(counts, resident, 4, 8, TIMING, 4).scores
    # one slot not held by a routed expert: only the best new one
    resident_more = np.array([[True, True, False, True, True, False]])  # 0, 1, 3 routed and resident; 4 not routed
    assert TopMKeep().plan(counts, resident_more, 4, 8, TIMING, 4).experts == {0: [1, 3, 0, 2]}
    assert TopMKeep(m=2).plan(counts, resident_more, 4, 8, TIMING, 4).experts == {0: [1, 3, 0]}  # never plans one out
    assert TopMKeep().name == "topm-keep" and TopMKeep(fractions=(0.5,)).checkpoints(8, TIMING) == [4]


def test_topm_defaults_to_and_never_exceeds_the_slots():
    counts = np.arange(1, 9, dtype=float)[None, :]  # expert 7 most counted
    resident = np.zeros_like(counts, bool)
    assert TopMFrequency().plan(counts, resident, 2, 8, TIMING, 2).experts == {0: [7, 6]}
    assert TopMFrequency(m=5).plan(counts, resident, 2, 8, TIMING, 3).experts == {0: [7, 6, 5]}


def test_topm_checkpoints_start_near_a_fifth_and_follow_the_link():
    fast_link = LinkTiming(bandwidth_bytes_per_s=2e9, draft_step_s=0.01, expert_bytes=10_000_000)  # 2/step
    slow_link = LinkTiming(bandwidth_bytes_per_s=0.25e9, draft_step_s=0.01, expert_bytes=10_000_000)  # 1/4 step
    policy = TopMFrequency()
    assert policy.checkpoints(10, fast_link) == [2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert policy.checkpoints(10, slow_link) == [2, 6, 10]
    assert policy.checkpoints(1, slow_link) == [1]
    assert policy.checkpoints(0, slow_link) == []
    unmeasured = LinkTiming(bandwidth_bytes_per_s=1e9, draft_step_s=0.0, expert_bytes=10_000_000)
    assert policy.checkpoints(10, unmeasured) == [2]


def test_topm_fixed_fraction_checkpoints_model_specmoeoff():
    assert TopMFrequency(fractions=(0.2, 0.6)).checkpoints(10, TIMING) == [2, 6]
    assert TopMFrequency(fractions=(0.2, 0.6)).checkpoints(3, TIMING) == [1, 2]


def test_topm_rejects_bad_options():
    with pytest.raises(ConfigError, match="m=0"):
        TopMFrequency(m=0)
    with pytest.raises(ConfigError, match="fractions"):
        TopMFrequency(fractions=(0.0, 1.5))


# --- lookahead -------------------------------------------------------------------------------------------


def test_fixed_is_clamped_to_k_max():
    assert Fixed(k=4).next_k(lookahead_state()) == 4
    assert Fixed(k=40).next_k(lookahead_state(k_max=6)) == 6
    with pytest.raises(ConfigError):
        Fixed(k=-1)


def sweep(policy: Profiled, state: LookaheadState, tpot_of_k, rounds: int) -> list[int]:
    chosen = []
    for _ in range(rounds):
        k = policy.next_k(state)
        chosen.append(k)
        policy.observe(RoundOutcome(k=k, accepted=k, tpot_s=tpot_of_k(k), round_s=1.0))
    return chosen


def test_profiled_sweeps_then_keeps_the_lowest_tpot():
    policy = Profiled(rounds=2)
    state = lookahead_state(k_max=16)
    chosen = sweep(policy, state, lambda k: 0.01 + abs(k - 6) * 0.001, rounds=2 * 7 + 3)
    assert sorted(set(chosen[:14])) == [0, 2, 4, 6, 8, 12, 16]  # capped at k_max=16
    assert chosen[14:] == [6, 6, 6]
    assert policy.best_k == {"tiny@1GB": 6}


def test_profiled_ignores_a_one_round_spike():
    spikes = iter([False, True, False])  # depth 6's second round hits a hiccup (e.g. a page fault)

    def tpot(k: int) -> float:
        if k == 6:
            return 0.5 if next(spikes) else 0.010
        return 0.012

    policy = Profiled(rounds=3, depths=(4, 6))
    sweep(policy, lookahead_state(), tpot, rounds=6)
    assert policy.best_k == {"tiny@1GB": 6}


def test_profiled_caps_depths_at_k_max_and_sweeps_per_model_key():
    policy = Profiled(rounds=1)
    chosen = sweep(policy, lookahead_state(k_max=5, model_key="a"), lambda k: 1.0 / (k + 1), rounds=5)
    assert chosen[:4] == [0, 2, 4, 5] and chosen[4] == 5
    assert sweep(policy, lookahead_state(k_max=5, model_key="b"), lambda k: float(k), rounds=5)[-1] == 0
    assert policy.best_k == {"a": 5, "b": 0}


def test_profiled_remembers_in_a_json_file(tmp_path):
    path = tmp_path / "lookahead.json"
    first = Profiled(rounds=1, path=path)
    sweep(first, lookahead_state(), lambda k: 0.02 - k * 0.0001 if k <= 8 else 1.0, rounds=8)
    assert json.loads(path.read_text()) == {"tiny@1GB": 8}
    second = Profiled(rounds=1, path=path)  # a later run: no sweep
    assert second.next_k(lookahead_state()) == 8
    assert second.next_k(lookahead_state(k_max=3)) == 3


def test_profiled_rejects_a_corrupt_memory_file(tmp_path):
    path = tmp_path / "lookahead.json"
    path.write_text("[1, 2")
    with pytest.raises(ConfigError, match="lookahead.json"):
        Profiled(path=path)


def test_roofline_expected_accepted_follows_the_product_formula():
    state = lookahead_state(acceptance_by_position=[0.5, 0.5])
    roofline = Roofline()
    assert roofline.expected_accepted(state, 0) == 0.0
    assert roofline.expected_accepted(state, 2) == pytest.approx(0.5 + 0.25)
    assert roofline.expected_accepted(state, 3) == pytest.approx(0.5 + 0.25 + 0.125)  # last EMA reused


def test_roofline_picks_plain_decode_when_drafts_are_never_accepted():
    state = lookahead_state(acceptance_by_position=[0.0] * 16, predicted_new_bytes=[20e6] * 17)
    assert Roofline().next_k(state) == 0


def test_roofline_goes_deep_when_acceptance_is_high_and_transfers_dominate():
    # Bytes saturate at 8 experts' worth: deeper drafts share the same transfers, so tokens per second grow.
    new_bytes = [50e6 * min(1 + k, 8) for k in range(17)]
    state = lookahead_state(acceptance_by_position=[0.99] * 16, predicted_new_bytes=new_bytes, k_max=16)
    roofline = Roofline()
    assert roofline.next_k(state) == 16
    assert roofline.tokens_per_s(state, 16) > 2 * roofline.tokens_per_s(state, 0)


def test_roofline_stays_shallow_when_verify_rows_cost_more_than_acceptance_pays():
    # k=0: 1 / 0.007 = 143 tok/s; k=1: 1.6 / 0.011 = 145; k=2: 1.78 / 0.015 = 119; deeper is worse still.
    state = lookahead_state(acceptance_by_position=[0.6, 0.3, 0.1], verify_s_fit=(0.005, 0.002), k_max=16)
    assert Roofline().next_k(state) == 1


def test_roofline_k0_time_is_verify_plus_transfer():
    state = lookahead_state(verify_s_fit=(0.01, 0.001), predicted_new_bytes=[1e7, 0.0], bandwidth_bytes_per_s=1e9)
    assert Roofline().round_s(state, 0) == pytest.approx(0.011 + 0.01)


def test_roofline_charges_a_scout_to_plain_rounds_like_a_one_step_draft():
    state = lookahead_state(verify_s_fit=(0.01, 0.001), predicted_new_bytes=[1e7, 0.0], bandwidth_bytes_per_s=1e9)
    scouting = dataclasses.replace(state, scout_s=0.004)
    assert Roofline().round_s(scouting, 0) == pytest.approx(0.004 + 0.011 + (0.01 - 0.004))
    assert Roofline().round_s(dataclasses.replace(state, scout_s=0.02), 0) == pytest.approx(0.02 + 0.011)
    assert Roofline().round_s(scouting, 1) == Roofline().round_s(state, 1)  # speculative rounds are not charged


def test_roofline_probe_clamped_by_the_engine_does_not_lengthen_the_next_run():
    state = lookahead_state(acceptance_by_position=[0.0] * 16, predicted_new_bytes=[20e6] * 17)
    roofline = Roofline(probe_every=2)
    assert [roofline.next_k(state) for _ in range(3)] == [0, 0, 1]
    roofline.observe(RoundOutcome(k=0, accepted=0, tpot_s=0.01, round_s=0.01))  # one token left: the engine ran k = 0
    assert [roofline.next_k(state) for _ in range(3)] == [0, 0, 1]  # still a run of 2
    roofline.observe(RoundOutcome(k=1, accepted=0, tpot_s=0.01, round_s=0.01))  # this probe ran
    assert [roofline.next_k(state) for _ in range(5)] == [0, 0, 0, 0, 1]  # it changed nothing: a run of 4
    deep = Roofline()
    deep._probed_from = 4  # a probe at k = 8 replaced k = 4, and the engine clamped it to 2 (three tokens left)
    deep.observe(RoundOutcome(k=2, accepted=2, tpot_s=0.01, round_s=0.03))
    assert deep._probed_from is None


def test_roofline_probes_speculation_after_a_run_of_plain_rounds():
    """Acceptance is only measured when drafting: after probe_every plain rounds, one cheap probe round."""
    state = lookahead_state(acceptance_by_position=[0.0] * 16, predicted_new_bytes=[20e6] * 17)
    roofline = Roofline(probe_every=4, max_backoff=4)
    decisions = [roofline.next_k(state) for _ in range(48)]
    # each probe that changes nothing doubles the run before the next one, up to 4 x 4 rounds
    probes = [index for index, k in enumerate(decisions) if k]
    assert probes == [4, 4 + 1 + 8, 13 + 1 + 16, 30 + 1 + 16] and set(decisions) == {0, 1}
    assert [Roofline(probe_every=0).next_k(state) for _ in range(40)] == [0] * 40
    k0_only = lookahead_state(acceptance_by_position=[0.0] * 16, predicted_new_bytes=[20e6] * 17, k_max=0)
    assert [Roofline(probe_every=1).next_k(k0_only) for _ in range(5)] == [0] * 5
    with pytest.raises(ConfigError, match="probe_every"):
        Roofline(probe_every=-1)
    with pytest.raises(ConfigError, match="max_backoff"):
        Roofline(max_backoff=0)


def test_roofline_probe_that_moves_the_decision_resets_the_backoff():
    """While probes change nothing they grow rarer; once the measurements move the decision, probing is frequent again."""
    plain = lookahead_state(acceptance_by_position=[0.0] * 16, predicted_new_bytes=[20e6] * 17)
    pays = lookahead_state(acceptance_by_position=[0.99] * 16, predicted_new_bytes=[20e6] * 17)
    roofline = Roofline(probe_every=2)
    assert [roofline.next_k(plain) for _ in range(9)] == [0, 0, 1, 0, 0, 0, 0, 1, 0]  # runs of 2, then 4
    assert roofline._interval == 8  # the second probe changed nothing either
    speculative = roofline.next_k(pays)  # the measurements after a probe now say speculation pays
    assert speculative > 0
    roofline.next_k(pays)
    roofline.next_k(plain)  # ... and then they say it does not: back to plain decode
    later = [roofline.next_k(plain) for _ in range(3)]
    assert later == [0, 1, 0]  # a run of 2 again, not 8
    assert roofline._interval == 4  # ... and that probe changed nothing, so the next run is 4


def test_roofline_does_not_probe_while_speculation_pays():
    new_bytes = [50e6 * min(1 + k, 8) for k in range(17)]
    state = lookahead_state(acceptance_by_position=[0.99] * 16, predicted_new_bytes=new_bytes, k_max=16)
    roofline = Roofline(probe_every=2)
    assert [roofline.next_k(state) for _ in range(6)] == [16] * 6
