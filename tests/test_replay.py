"""Routing traces (write, read, reject malformed) and CPU replay of policy pairs on hand-made traces."""

from __future__ import annotations

import dataclasses
import os
import json
from importlib.metadata import EntryPoint

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policies.eviction import LRU, BeladyLookahead, PlanProtect
from policies.prefetch import NoPrefetch, TopMFrequency, TopMKeep
from specter import plugins
from policies.placement import Off
from specter.replay import (main, offline_bound, recorded_bytes, replay, replay_all, replay_placements,
                            trace_placement_state)
from specter.trace import LayerRoutes, TraceError, TraceHeader, TraceRound, TraceWriter, read_trace

EXPERT_BYTES = 10_000_000
HEADER = TraceHeader(model="toy", num_layers=2, num_experts=8, expert_bytes=EXPERT_BYTES, top_k=2, slots_per_layer=2)


def rotating_rounds(count: int, k: int = 4, predicted_right: bool = True) -> list[TraceRound]:
    """Round r uses experts {2r, 2r+1} mod 8 at every layer: LRU on demand never hits, a good draft always does."""
    rounds = []
    for r in range(count):
        used = [(2 * r) % 8, (2 * r + 1) % 8]
        guess = used if predicted_right else [(e + 4) % 8 for e in used]
        layer = LayerRoutes(predicted={guess[0]: 3.0, guess[1]: 2.0}, used=used)
        rounds.append(TraceRound(round=r, k=k, accepted=k - 1, draft_step_s=0.01, layers=[layer, layer]))
    return rounds


@pytest.fixture
def reference_plugins(monkeypatch):
    """The reference policies as entry points, whether or not specter is pip-installed."""
    fake = {
        "specter.eviction": [
            EntryPoint("lru", "policies.eviction:LRU", "specter.eviction"),
            EntryPoint("plan-protect", "policies.eviction:PlanProtect", "specter.eviction"),
        ],
        "specter.prefetch": [
            EntryPoint("none", "policies.prefetch:NoPrefetch", "specter.prefetch"),
            EntryPoint("topm-frequency", "policies.prefetch:TopMFrequency", "specter.prefetch"),
        ],
    }
    monkeypatch.delenv(plugins.ALLOW_LIST_ENV, raising=False)
    monkeypatch.setattr(plugins, "entry_points", lambda group: fake.get(group, []))
    plugins.refresh()
    yield
    plugins.refresh()


# --- trace format ----------------------------------------------------------------------------------------


def test_trace_round_trips_through_a_file(tmp_path):
    path = tmp_path / "toy.trace.jsonl"
    rounds = rotating_rounds(3)
    with TraceWriter(path, TraceHeader(**{**HEADER.__dict__, "extra": {"link_gbps": 25.0}})) as writer:
        for trace_round in rounds:
            writer.write_round(trace_round)
        writer.flush()
    header, read_back = read_trace(path)
    assert header.num_experts == 8 and header.extra == {"link_gbps": 25.0}
    assert read_back == rounds
    first_line = json.loads(path.read_text().splitlines()[0])
    assert first_line["format"] == "specter-trace" and first_line["version"] == 1


def test_a_rounds_recorded_bytes_round_trip_and_add_up(tmp_path):
    path = tmp_path / "loaded.jsonl"
    rounds = [dataclasses.replace(r, loaded_bytes=(r.round + 1) * EXPERT_BYTES) for r in rotating_rounds(3)]
    with TraceWriter(path, HEADER) as writer:
        for trace_round in rounds:
            writer.write_round(trace_round)
    _, read_back = read_trace(path)
    assert read_back == rounds and recorded_bytes(read_back) == 6 * EXPERT_BYTES
    assert recorded_bytes(rotating_rounds(3)) is None  # older traces do not say
    assert recorded_bytes(rotating_rounds(2) + rounds) is None  # nor does a trace where some rounds do not


def test_a_rounds_checkpoints_round_trip_and_drive_the_replays_plans(tmp_path):
    counts = np.zeros((2, 8))
    counts[:, 5] = 1.0  # the engine's one plan saw only expert 5; the round's totals name 0 and 1
    trace_round = TraceRound.from_arrays(0, 4, 3, 0.01, np.array([[3, 2, 0, 0, 0, 1, 0, 0]] * 2, dtype=float),
                                         [[0, 1], [0, 1]], checkpoints=[(1, counts)])
    path = tmp_path / "checkpoints.jsonl"
    with TraceWriter(path, HEADER) as writer:
        writer.write_round(trace_round)
    _, [read_back] = read_trace(path)
    assert read_back == trace_round and read_back.checkpoints == ((1, ({5: 1.0}, {5: 1.0})),)
    recorded = replay(HEADER, [read_back], PlanProtect(), TopMFrequency(), link_gbps=1.0)
    scaled = replay(HEADER, [dataclasses.replace(read_back, checkpoints=None)], PlanProtect(), TopMFrequency(), link_gbps=1.0)
    assert (recorded.prefetched_experts, recorded.prefetched_used, recorded.misses) == (2, 0, 4)  # 5 per layer, unused
    assert (scaled.prefetched_experts, scaled.prefetched_used, scaled.misses) == (4, 4, 0)
    # an empty schedule (a policy that plans nothing recorded it) holds no other policy to it: its own, scaled
    none = replay(HEADER, [dataclasses.replace(read_back, checkpoints=())], PlanProtect(), TopMFrequency(), link_gbps=1.0)
    assert (none.prefetched_experts, none.misses) == (scaled.prefetched_experts, scaled.misses)


def _named(policy, name):
    policy.name = name
    return policy


def test_only_the_prefetch_policy_that_recorded_the_checkpoints_is_held_to_them():
    """A header that names the recording engine's prefetch: that policy replays the plans the engine made (its
    checkpoints, their counts); another plans at its own steps, from the recorded counts where it plans at a step
    the engine planned at too, else from the round's totals scaled."""
    counts = np.zeros((2, 8))
    counts[:, 5] = 1.0
    trace_round = TraceRound.from_arrays(0, 4, 3, 0.01, np.array([[3, 2, 0, 0, 0, 1, 0, 0]] * 2, dtype=float),
                                         [[0, 1], [0, 1]], checkpoints=[(1, counts)])
    by = lambda name: dataclasses.replace(HEADER, extra={"prefetch": name})  # noqa: E731
    same = replay(by("topm-frequency"), [trace_round], PlanProtect(), TopMFrequency(), link_gbps=1.0)
    assert (same.prefetched_experts, same.prefetched_used, same.misses) == (2, 0, 4)  # the engine's plan: expert 5
    other = replay(by("none"), [trace_round], PlanProtect(), TopMFrequency(), link_gbps=1.0)
    # its own schedule: step 1 (as the engine's, from the counts it saw: expert 5) and later steps (scaled totals: 0, 1)
    assert (other.prefetched_experts, other.prefetched_used, other.misses) == (6, 4, 0)
    # planning at step 1, as the engine did, it takes the counts the engine's draft had seen then
    at_one = replay(by("none"), [trace_round], PlanProtect(), _named(TopMFrequency(fractions=(0.25,)), "at-one"),
                    link_gbps=1.0)
    assert (at_one.prefetched_experts, at_one.prefetched_used) == (2, 0)


def test_a_trace_recorded_without_prefetch_replays_each_prefetch_policy_on_its_own_schedule(tiny, tmp_path, capsys):
    """`generate --prefetch none --trace` records rounds with no checkpoint; every prefetch policy replayed on them
    read as `none` (the same misses and stall in every row). The header names the recording plug-ins, and a
    prefetching policy now plans, so it misses less than none on the same rounds."""
    from specter.cli import main as generate_main

    path = tmp_path / "none.jsonl"
    assert generate_main(["generate", "--model", str(tiny), "--device", "cpu", "--residents", "6", "--prompt-ids",
                          "1,2,3,4,5", "--max-new-tokens", "48", "--prefetch", "none", "--eviction", "lru",
                          "--trace", str(path)]) == 0
    capsys.readouterr()
    header, rounds = read_trace(path)
    assert (header.extra["prefetch"], header.extra["eviction"]) == ("none", "lru")
    assert rounds and all(r.checkpoints == () for r in rounds if r.k > 0)
    replayed, skipped = replay_all(header, rounds, 0.1, evictions=["lru"], prefetches=["none", "topm-keep"])
    results = {r.prefetch: r for r in replayed}
    assert not skipped
    assert results["none"].prefetched_experts == 0
    assert results["topm-keep"].prefetched_experts > 0 and results["topm-keep"].misses < results["none"].misses


def test_round_from_arrays_keeps_nonzero_counts():
    counts = np.array([[0, 2, 0, 1], [3, 0, 0, 0]], dtype=float)
    trace_round = TraceRound.from_arrays(0, 3, 1, 0.02, counts, [[1, 3], [0]])
    assert trace_round.layers[0].predicted == {1: 2.0, 3: 1.0}
    np.testing.assert_array_equal(trace_round.predicted_counts(4), counts)


GOOD_ROUND = {"round": 0, "k": 2, "accepted": 1, "draft_step_s": 0.01, "layers": [{"predicted": {"1": 2}, "used": [1]}]}


@pytest.mark.parametrize(
    ("bad_line", "complaint"),
    [
        ("{not json", "line 2"),
        (json.dumps({**GOOD_ROUND, "accepted": 3}), "accepted=3 exceeds k=2"),
        (json.dumps({**GOOD_ROUND, "layers": []}), "num_layers=1"),
        (json.dumps({**GOOD_ROUND, "layers": [{"predicted": {"9": 1}, "used": []}]}), "expert id '9'"),
        (json.dumps({**GOOD_ROUND, "layers": [{"predicted": {}, "used": [-1]}]}), "expert id -1"),
        # num_experts is 4: ids run 0..3
        (json.dumps({**GOOD_ROUND, "layers": [{"predicted": {}, "used": [4]}]}), "expert id 4 is not an int in 0..3"),
        (json.dumps({**GOOD_ROUND, "layers": [{"predicted": {"4": 1}, "used": []}]}), "expert id '4' is not an int in 0..3"),
        (json.dumps({key: v for key, v in GOOD_ROUND.items() if key != "k"}), "missing key 'k'"),
        (json.dumps({**GOOD_ROUND, "loaded_bytes": -5}), "loaded_bytes"),
        (json.dumps({**GOOD_ROUND, "checkpoints": [{"steps": 4, "predicted": [{}]}]}), "exceeds k + 1"),
        (json.dumps({**GOOD_ROUND, "checkpoints": [{"steps": 1, "predicted": []}]}), "num_layers=1"),
        (json.dumps({**GOOD_ROUND, "checkpoints": [{"steps": 1, "predicted": [{"1": -1}]}]}), "must be >= 0"),
        # json reads NaN and Infinity; float() took strings and booleans: none is a count or a time
        (json.dumps({**GOOD_ROUND, "layers": [{"predicted": {"1": float("nan")}, "used": [1]}]}), "count of expert 1=nan"),
        (json.dumps({**GOOD_ROUND, "layers": [{"predicted": {"1": float("inf")}, "used": [1]}]}), "count of expert 1=inf"),
        (json.dumps({**GOOD_ROUND, "checkpoints": [{"steps": 1, "predicted": [{"1": float("nan")}]}]}), "=nan must be"),
        (json.dumps({**GOOD_ROUND, "layers": [{"predicted": {"1": "2"}, "used": [1]}]}), "count of expert 1='2'"),
        (json.dumps({**GOOD_ROUND, "draft_step_s": "0.01"}), "draft_step_s='0.01' must be >= 0 and finite"),
        (json.dumps({**GOOD_ROUND, "draft_step_s": True}), "draft_step_s=True must be"),
        (json.dumps({**GOOD_ROUND, "draft_step_s": float("inf")}), "draft_step_s=inf must be"),
        (json.dumps({**GOOD_ROUND, "k": 10 ** 12}), "k=1000000000000; expected an int in 0..1024"),
        # top_k 1: the verify's k + 1 = 3 rows use at most 3 experts, each once
        (json.dumps({**GOOD_ROUND, "layers": [{"predicted": {}, "used": [0, 1, 2, 3]}]}), "4 experts used, more than"),
        (json.dumps({**GOOD_ROUND, "layers": [{"predicted": {}, "used": [1, 2, 1]}]}), "expert(s) [1] more than once"),
        (json.dumps({**GOOD_ROUND, "layers": [{"predicted": {}, "used": ["1"]}]}), "used expert '1' is not an int"),
        (json.dumps({**GOOD_ROUND, "round": 1.5}), "round=1.5; expected an int >= 0"),
        (json.dumps({**GOOD_ROUND, "round": -1}), "round=-1; expected an int >= 0"),
        (json.dumps({**GOOD_ROUND, "round": "7"}), "round='7'; expected an int >= 0"),
        ('{"layers": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),  # was a RecursionError traceback
    ],
)
def test_malformed_rounds_are_reported_with_their_line(tmp_path, bad_line, complaint):
    header = {"format": "specter-trace", "version": 1, "model": "m", "num_layers": 1, "num_experts": 4,
              "expert_bytes": 100, "top_k": 1, "slots_per_layer": 1}  # fmt: skip
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join([json.dumps(header), bad_line]) + "\n")
    with pytest.raises(TraceError, match="line 2") as caught:
        read_trace(path)
    assert complaint in str(caught.value)


def test_each_layers_slots_round_trip_and_malformed_ones_are_reported(tmp_path):
    path = tmp_path / "uneven.jsonl"
    uneven = dataclasses.replace(HEADER, layer_slots=(3, 2))
    with TraceWriter(path, uneven) as writer:
        writer.write_round(rotating_rounds(1)[0])
    header, _ = read_trace(path)
    assert header.slots() == (3, 2) and header.extra == {} and HEADER.slots() == (2, 2)
    with TraceWriter(path, dataclasses.replace(HEADER, layer_slots=(2, 2))) as writer:
        pass  # the same count everywhere: the header needs no list
    assert "layer_slots" not in json.loads(path.read_text())
    base = {"format": "specter-trace", "version": 1, "model": "m", "num_layers": 2, "num_experts": 4,
            "expert_bytes": 100, "top_k": 1, "slots_per_layer": 2}  # fmt: skip
    for bad, complaint in (([2, 3, 4], "num_layers=2"), ([3, 4], "fewest is slots_per_layer=2"),
                           ([2, 0], "layer_slots entry=0"), (3, "expected a list")):
        path.write_text(json.dumps({**base, "layer_slots": bad}) + "\n")
        with pytest.raises(TraceError, match="line 1") as caught:
            read_trace(path)
        assert complaint in str(caught.value)


@pytest.mark.parametrize(("field", "value", "complaint"), [
    # 200-byte headers that had a replay allocate per layer and expert until it hung
    ("num_experts", 10 ** 8, "num_experts=100000000; expected an int in 1..4096"),
    ("num_layers", 10 ** 7, "num_layers=10000000; expected an int in 1..512"),
    ("expert_bytes", 10 ** 30, "expected an int in 1..1099511627776"),
    ("top_k", 5, "top_k=5; expected an int in 1..4"),
    ("slots_per_layer", 5, "slots_per_layer=5; expected an int in 1..4"),
    ("layer_slots", [2, 9], "layer_slots entry=9; expected an int in 1..4"),
    ("model", {"a": 1}, "expected the model's name, a string"),
])
def test_a_header_beyond_any_real_models_shape_is_refused(tmp_path, field, value, complaint):
    header = {"format": "specter-trace", "version": 1, "model": "m", "num_layers": 2, "num_experts": 4,
              "expert_bytes": 100, "top_k": 1, "slots_per_layer": 2}  # fmt: skip
    path = tmp_path / "huge.jsonl"
    round_line = json.dumps({**GOOD_ROUND, "layers": [{"predicted": {}, "used": [1]}] * 2})
    path.write_text(json.dumps({**header, field: value}) + "\n" + round_line + "\n")
    with pytest.raises(TraceError, match="line 1") as caught:
        read_trace(path)
    assert complaint in str(caught.value) and str(path) in str(caught.value)


def test_a_json_line_holding_a_line_separator_is_one_line(tmp_path):
    """JSON leaves U+2028 (and U+0085, U+001C...) unescaped in a string; str.splitlines broke the line there. A CRLF
    file still reads."""
    path = tmp_path / "u2028.jsonl"
    path.write_text(json.dumps({**HEADER.to_json(), "model": "a\u2028b\x85c"}, ensure_ascii=False) + "\n"
                    + json.dumps(rotating_rounds(1)[0].to_json()) + "\n", encoding="utf-8")
    header, rounds = read_trace(path)
    assert header.model == "a\u2028b\x85c" and rounds == rotating_rounds(1)
    path.write_bytes(path.read_bytes().replace(b"\n", b"\r\n"))
    assert read_trace(path)[1] == rotating_rounds(1)


def test_a_file_that_is_not_a_trace_is_rejected(tmp_path):
    path = tmp_path / "other.jsonl"
    path.write_text(json.dumps({"format": "something-else", "version": 1}) + "\n")
    with pytest.raises(TraceError, match="line 1.*expected format='specter-trace'"):
        read_trace(path)
    path.write_text("")
    with pytest.raises(TraceError, match="empty file"):
        read_trace(path)


# --- replay ----------------------------------------------------------------------------------------------


def test_perfect_predictions_with_topm_and_plan_protect_never_miss():
    rounds = rotating_rounds(8)
    baseline = replay(HEADER, rounds, LRU(), NoPrefetch(), link_gbps=1.0)
    speculative = replay(HEADER, rounds, PlanProtect(), TopMFrequency(), link_gbps=1.0)
    assert baseline.hits == 0 and baseline.misses == 8 * 2 * 2
    assert speculative.misses == 0 and speculative.hit_rate == 1.0
    assert speculative.prefetched_used == speculative.prefetched_experts == 32
    assert speculative.stall_s < baseline.stall_s


def test_stall_counts_only_prefetch_bytes_the_draft_does_not_hide():
    # 4 experts per round at 1 GB/s take 40 ms; the draft hides k * 10 ms of them.
    rounds = rotating_rounds(5, k=2)
    result = replay(HEADER, rounds, PlanProtect(), TopMFrequency(), link_gbps=1.0)
    assert result.stall_s == pytest.approx(5 * (0.04 - 0.02))
    assert result.h2d_bytes == 5 * 4 * EXPERT_BYTES
    assert replay(HEADER, rotating_rounds(5, k=8), PlanProtect(), TopMFrequency(), link_gbps=1.0).stall_s == 0.0


def test_each_miss_costs_one_expert_transfer():
    result = replay(HEADER, rotating_rounds(3), LRU(), NoPrefetch(), link_gbps=2.0)
    assert result.stall_s == pytest.approx(result.misses * EXPERT_BYTES / 2e9)
    assert result.miss_bytes == result.misses * EXPERT_BYTES


def test_wrong_predictions_waste_prefetches():
    result = replay(HEADER, rotating_rounds(6, predicted_right=False), PlanProtect(), TopMFrequency(), link_gbps=1.0)
    assert result.prefetched_used < result.prefetched_experts
    assert result.misses > 0


def test_lru_on_demand_hits_when_experts_repeat():
    layer = LayerRoutes(predicted={}, used=[1, 2])
    rounds = [TraceRound(r, 0, 0, 0.01, [layer, layer]) for r in range(4)]
    result = replay(HEADER, rounds, LRU(), NoPrefetch(), link_gbps=1.0)
    assert (result.misses, result.hits) == (4, 12)  # cold misses only


def test_belady_keeps_a_scored_expert_the_plan_left_out():
    # Per cycle, two plain rounds fill the 2 slots with B (older) then C (newer). The third round's draft
    # scores A highest and B lower; a one-expert plan (m=1) loads A, evicting one of B and C. LRU and
    # plan-protect drop B (least recent, unplanned); belady drops C (never predicted), so B then hits.
    header = TraceHeader("toy", 1, 16, EXPERT_BYTES, 1, 2)
    rounds = []
    for cycle in range(4):
        a, b, c = 3 * cycle, 3 * cycle + 1, 3 * cycle + 2
        rounds += [
            TraceRound(3 * cycle, 0, 0, 0.01, [LayerRoutes({}, [b])]),
            TraceRound(3 * cycle + 1, 0, 0, 0.01, [LayerRoutes({}, [c])]),
            TraceRound(3 * cycle + 2, 2, 1, 0.01, [LayerRoutes({a: 3.0, b: 1.0}, [a, b])]),
        ]
    misses = {
        policy.name: replay(header, rounds, policy, TopMFrequency(m=1), link_gbps=1.0).misses
        for policy in (LRU(), PlanProtect(), BeladyLookahead())
    }
    assert misses == {"lru": 4 * 3, "plan-protect": 4 * 3, "belady-lookahead": 4 * 2}


def test_a_roll_window_keeps_the_planned_hot_experts_for_the_next_round():
    # Two slots. Round 1 loads the planned 0 and 1. Round 2 wants them and three misses: with no window both hot
    # experts give their slots to misses; with a window of one slot, plan-protect keeps one planned expert
    # (the misses roll through the other slot), so round 3, which wants 0 and 1 again, loads one expert, not two.
    header = TraceHeader("toy", 1, 16, EXPERT_BYTES, 2, 2)
    hot = {0: 5.0, 1: 5.0}
    rounds = [
        TraceRound(0, 2, 2, 0.0, [LayerRoutes(hot, [0, 1])]),
        TraceRound(1, 4, 4, 0.0, [LayerRoutes({**hot, 2: 1.0, 3: 1.0, 4: 1.0}, [0, 1, 2, 3, 4])]),
        TraceRound(2, 2, 2, 0.0, [LayerRoutes(hot, [0, 1])]),
    ]
    unlimited = replay(header, rounds, PlanProtect(), TopMFrequency(), link_gbps=1.0, roll=-1)
    window = replay(header, rounds, PlanProtect(), TopMFrequency(), link_gbps=1.0, roll=1)
    assert (unlimited.misses, unlimited.prefetched_experts) == (3, 2 + 2)
    assert (window.misses, window.prefetched_experts) == (3, 2 + 1)
    assert window.h2d_bytes == unlimited.h2d_bytes - EXPERT_BYTES


def test_topm_keep_loads_one_expert_where_topm_loads_two():
    # Two slots hold 1 and 2 after the first round. The second round routes 0 most, then 1, then 2, and uses all
    # three: Top-M loads 0 in place of 2, which the verify then loads back; topm-keep leaves both and loads 0 once.
    header = TraceHeader("toy", 1, 16, EXPERT_BYTES, 2, 2)
    rounds = [
        TraceRound(0, 2, 2, 0.0, [LayerRoutes({1: 3.0, 2: 3.0}, [1, 2])]),
        TraceRound(1, 4, 4, 0.0, [LayerRoutes({0: 3.0, 1: 2.0, 2: 1.0}, [0, 1, 2])]),
    ]
    topm = replay(header, rounds, PlanProtect(), TopMFrequency(), link_gbps=1.0)
    keep = replay(header, rounds, PlanProtect(), TopMKeep(), link_gbps=1.0)
    assert (topm.prefetched_experts, topm.misses) == (2 + 1, 1)
    assert (keep.prefetched_experts, keep.misses) == (2, 1)
    assert keep.h2d_bytes == topm.h2d_bytes - EXPERT_BYTES


def test_the_replay_takes_the_engines_window():
    from specter.config import CacheTuning
    from specter.replay import engine_roll

    assert engine_roll() == CacheTuning().roll_hot_window == 2
    for window, roll in ((None, -1), (2, 2), (0, 0)):
        assert engine_roll(CacheTuning(roll_hot_window=window)) == roll


def test_the_offline_bound_is_beladys_min_worked_by_hand():
    """One layer, two slots, rounds using {0, 1} {2, 0} {1, 2} {0}: load 0 and 1; round 2 serves its hit 0 first,
    then 2 evicts 0 (next used in round 4, 1 in round 3); round 3 hits 1 and 2; round 4 loads 0: 4 loads. With
    three slots, only the 3 first uses; with one slot, {0, 1} three times costs 2, then 1 a round (the hit first)."""
    header = dataclasses.replace(HEADER, num_layers=1)
    rounds = [TraceRound(round=r, k=2, accepted=1, draft_step_s=0.01, layers=[LayerRoutes(predicted={}, used=used)])
              for r, used in enumerate([[0, 1], [2, 0], [1, 2], [0]])]
    assert offline_bound(header, rounds) == 4
    assert offline_bound(header, rounds, slots_per_layer=3) == 3
    assert offline_bound(header, rounds[:1] * 3, slots_per_layer=1) == 4


def _exhaustive_optimum(used: list[list[int]], slots: int) -> int:
    """The fewest loads by search over every schedule: per round the hits first, then the misses in every order, each
    loaded into a free slot or in place of any resident (every one is used already, or not in this round)."""
    import functools

    @functools.lru_cache(maxsize=None)
    def ends(cache: frozenset, left: frozenset) -> frozenset:  # every cache the round can leave
        if not left:
            return frozenset({cache})
        out: set = set()
        for expert in left:
            rest = left - {expert}
            victims = [None] if len(cache) < slots else sorted(cache)
            for victim in victims:
                out |= ends((cache - {victim}) | {expert}, rest)
        return frozenset(out)

    best = {frozenset(): 0}
    for experts in used:
        after: dict[frozenset, int] = {}
        for held, cost in best.items():
            misses = frozenset(experts) - held
            for cache in ends(held, misses):
                after[cache] = min(after.get(cache, cost + len(misses)), cost + len(misses))
        best = after
    return min(best.values())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(used=st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=4, unique=True), min_size=1, max_size=6),
       slots=st.integers(1, 3))
def test_the_offline_bound_is_a_floor_under_every_schedule(used, slots):
    """The bound kept each round's loads in the order given, each evicting the farthest used resident: a round using
    {0..4} in 3 slots that loaded 0 (used again) before 2 (never) had to evict one used again, where loading 2 first
    lets 0 take its slot; it read 9 where the replay's LRU made 8 loads (a floor above a schedule). It is now
    `fewest_loads` per layer (the optimum of its relaxation: tests/test_bench.py searches that), and so at most the
    fewest loads of any real schedule, found here by exhaustive search."""
    from specter.replay import fewest_loads

    header = dataclasses.replace(HEADER, num_layers=1)
    rounds = [TraceRound(round=r, k=4, accepted=3, draft_step_s=0.01, layers=[LayerRoutes(predicted={}, used=experts)])
              for r, experts in enumerate(used)]
    bound = offline_bound(header, rounds, slots_per_layer=slots)
    assert bound == fewest_loads(used, slots) <= _exhaustive_optimum(used, slots)


def test_the_offline_bound_orders_a_rounds_loads_best():
    """The case hypothesis found: 3 slots, rounds {0, 2} {0..4} {0..4} {4, 0, 1}: a schedule can end the third round
    holding 4, 0 and 1 (it loads 2, never used again, before 0), and the last round loads nothing: 2 + 3 + 2 + 0."""
    header = dataclasses.replace(HEADER, num_layers=1)
    rounds = [TraceRound(round=r, k=4, accepted=3, draft_step_s=0.01, layers=[LayerRoutes(predicted={}, used=experts)])
              for r, experts in enumerate([[0, 2], [0, 1, 2, 3, 4], [0, 1, 2, 3, 4], [4, 0, 1]])]
    assert offline_bound(header, rounds, slots_per_layer=3) == 7 == _exhaustive_optimum(
        [[0, 2], [0, 1, 2, 3, 4], [0, 1, 2, 3, 4], [4, 0, 1]], 3)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(uses=st.lists(st.lists(st.lists(st.integers(0, 7), min_size=1, max_size=6, unique=True), min_size=2, max_size=2),
                     min_size=1, max_size=8),
       guesses=st.lists(st.lists(st.integers(0, 7), max_size=4, unique=True), min_size=16, max_size=16),
       slots=st.integers(2, 4))
def test_no_replayed_policy_pair_loads_fewer_experts_than_the_offline_bound(uses, guesses, slots):
    rounds = []
    for r, layers in enumerate(uses):
        routes = [LayerRoutes(predicted={e: 1.0 for e in guesses[(2 * r + l) % 16]}, used=used) for l, used in enumerate(layers)]
        rounds.append(TraceRound(round=r, k=4, accepted=3, draft_step_s=0.001, layers=routes))
    bound = offline_bound(HEADER, rounds, slots_per_layer=slots)
    assert bound >= len({(l, e) for layers in uses for l, used in enumerate(layers) for e in used})  # first uses
    for eviction in (LRU(), PlanProtect(), BeladyLookahead()):
        for prefetch in (NoPrefetch(), TopMFrequency(), TopMKeep()):
            result = replay(HEADER, rounds, eviction, prefetch, slots_per_layer=slots)
            assert result.misses + result.prefetched_experts >= bound, (type(eviction).__name__, type(prefetch).__name__)


def test_slots_override_the_header():
    rounds = rotating_rounds(4)
    assert replay(HEADER, rounds, LRU(), NoPrefetch(), slots_per_layer=8).hits == 0  # all first uses
    repeated = rotating_rounds(4) + rotating_rounds(4)
    assert replay(HEADER, repeated, LRU(), NoPrefetch(), slots_per_layer=8).hits == 16
    assert replay(HEADER, repeated, LRU(), NoPrefetch(), slots_per_layer=2).hits == 0


def test_each_layer_keeps_the_recording_runs_own_slots():
    """Layer 0 cycles through three experts, layer 1 through two. With the recording run's slots (3 and 2) only the
    first uses miss, in the cache, in the placement replay and in the offline bound; `--slots 2` in every layer
    misses every use of layer 0."""
    header = dataclasses.replace(HEADER, layer_slots=(3, 2))
    rounds = [TraceRound(r, 0, 0, 0.01, [LayerRoutes({}, [r % 3]), LayerRoutes({}, [r % 2])]) for r in range(12)]
    own = replay(header, rounds, LRU(), NoPrefetch())
    assert (own.misses, own.hits) == (3 + 2, 24 - 5)
    assert replay(header, rounds, LRU(), NoPrefetch(), slots_per_layer=2).misses == 12 + 2
    # in 2 slots the floor lets layer 0 use each third expert without keeping it: 3 first uses, then 1 load a cycle
    # (a real cache, which must give that load a slot, pays 7: Belady's MIN)
    assert offline_bound(header, rounds) == 5 and offline_bound(header, rounds, slots_per_layer=2) == 6 + 2
    [placed] = replay_placements(header, rounds, [Off()], 1.0)
    assert placed.result.misses == 5
    assert trace_placement_state(header, rounds, 1.0, None).slots(0) == 3
    assert trace_placement_state(header, rounds, 1.0, None, slots_per_layer=2).slots(0) == 2


def test_a_prefetching_replay_and_the_cli_keep_each_layers_slots(tmp_path, capsys, reference_plugins):
    """A prefetching replay runs with uneven slots (a draft that predicts every round's two experts: no miss in the
    layer of two slots or of three), and the CLI's JSON says the slots it replayed: each layer's, or --slots."""
    header = dataclasses.replace(HEADER, layer_slots=(3, 2))
    result = replay(header, rotating_rounds(6), PlanProtect(), TopMFrequency(), link_gbps=1.0)
    assert result.misses == 0 and result.prefetched_used == result.prefetched_experts > 0
    path = tmp_path / "uneven.jsonl"
    with TraceWriter(path, header) as writer:
        for trace_round in rotating_rounds(4):
            writer.write_round(trace_round)
    assert main([str(path), "--json", "--eviction", "lru", "--prefetch", "none"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["slots_per_layer"] == 2 and report["layer_slots"] == [3, 2]
    assert main([str(path), "--json", "--eviction", "lru", "--prefetch", "none", "--slots", "4"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["slots_per_layer"] == 4 and "layer_slots" not in report


def test_replay_all_sorts_by_stall(reference_plugins):
    results, skipped = replay_all(HEADER, rotating_rounds(6), link_gbps=1.0)
    assert skipped == []
    assert len(results) == 4
    assert [r.stall_s for r in results] == sorted(r.stall_s for r in results)
    assert results[-1].prefetch == "none"


def test_cli_prints_a_table_and_json(tmp_path, capsys, reference_plugins):
    path = tmp_path / "toy.jsonl"
    with TraceWriter(path, HEADER) as writer:
        for trace_round in rotating_rounds(4):
            writer.write_round(trace_round)
    assert main([str(path), "--link", "1", "--roll", "2"]) == 0
    table = capsys.readouterr().out
    assert "plan-protect" in table and "topm-frequency" in table and "stall s" in table
    assert "rolling window 2" in table and "recording engine" not in table  # the toy rounds record no bytes
    assert f"offline bound (a floor: Belady's MIN on the verify's uses, knowing the future): {offline_bound(HEADER, rotating_rounds(4))} loads" in table
    assert main([str(path), "--json", "--eviction", "lru", "--prefetch", "none,topm-frequency"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [(r["eviction"], r["prefetch"]) for r in report["results"]] == [("lru", "topm-frequency"), ("lru", "none")]
    assert report["offline_bound_loads"] == 16 and report["offline_bound_h2d_bytes"] == 16 * EXPERT_BYTES  # all first uses


@pytest.mark.parametrize("argv", [[], ["--placement", "off,auto", "--host-ms", "1"]])
def test_cli_refuses_a_trace_without_rounds(tmp_path, capsys, monkeypatch, argv):
    """A resident or k = 0 engine writes only the header: every pair would "hit" all of nothing (hit rate 1.000)."""
    monkeypatch.delenv("SPECTER_PLUGINS", raising=False)  # the installed plug-ins, placements included
    path = tmp_path / "resident.jsonl"
    with TraceWriter(path, HEADER):
        pass
    assert main([str(path), *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and f"error: {path} holds no speculative rounds" in captured.err, captured
    assert "resident engine" in captured.err and "k = 0" in captured.err


@pytest.mark.parametrize(("allowed", "group"), [("lru", "prefetch"), ("prefetch:none", "eviction")])
def test_cli_says_when_the_allow_list_leaves_a_group_no_plugin(tmp_path, capsys, reference_plugins, monkeypatch,
                                                               allowed, group):
    """It printed an empty table and exited 1 with nothing on stderr."""
    path = tmp_path / "toy.jsonl"
    with TraceWriter(path, HEADER) as writer:
        writer.write_round(rotating_rounds(1)[0])
    monkeypatch.setenv("SPECTER_PLUGINS", allowed)
    assert main([str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "", captured
    assert f"error: no {group} plug-in is allowed by SPECTER_PLUGINS={allowed!r}" in captured.err, captured.err


def test_cli_reports_a_bad_trace_and_unknown_plugins(tmp_path, capsys, reference_plugins):
    path = tmp_path / "bad.jsonl"
    path.write_text("nope\n")
    assert main([str(path)]) == 2
    assert "line 1" in capsys.readouterr().err
    good = tmp_path / "good.jsonl"
    with TraceWriter(good, HEADER) as writer:
        writer.write_round(rotating_rounds(1)[0])
    with pytest.raises(SystemExit):
        main([str(good), "--roll", "wide"])
    assert "expected a window size" in capsys.readouterr().err
    assert main([str(good), "--eviction", "nope"]) == 2  # named, so refused before any replay
    assert "installed: lru, plan-protect" in capsys.readouterr().err


@pytest.mark.parametrize("option", ["--eviction", "--prefetch", "--placement"])
@pytest.mark.parametrize("value", ["lru,,lfu", "lru,", ",lru"])
def test_cli_refuses_an_empty_name_in_a_list(tmp_path, capsys, option, value):
    """`--eviction lru,,lfu` ran as `lru,lfu`: a name may have been lost at the doubled comma."""
    path = tmp_path / "toy.jsonl"
    with TraceWriter(path, HEADER) as writer:
        for trace_round in rotating_rounds(4):
            writer.write_round(trace_round)
    assert main([str(path), option, value]) == 2
    assert f"error: an empty name in {value!r}" in capsys.readouterr().err


@pytest.mark.parametrize("option, value, says", [("--row-bucket", "0", "--row-bucket must be 1 or more rows, got 0"),
                                                 ("--overlap", "3", "--overlap must be from 0 to 1, got 3.0")])
def test_cli_names_the_placement_option_that_is_out_of_range(tmp_path, capsys, option, value, says):
    """Both were refused by one message naming both rules, whichever was wrong."""
    path = tmp_path / "toy.jsonl"
    with TraceWriter(path, HEADER) as writer:
        writer.write_round(rotating_rounds(1)[0])
    with pytest.raises(SystemExit) as refused:
        main([str(path), "--placement", "off", "--host-ms", "1", option, value])
    err = capsys.readouterr().err
    other = "--overlap must" if option == "--row-bucket" else "--row-bucket must"
    assert refused.value.code == 2 and says in err and other not in err, err


def test_a_placement_object_is_guarded_as_a_loaded_one_and_named_by_its_class():
    """replay_placements called an object's place() bare: None came back as an AttributeError deep in the replay.
    And an object named as a reference plug-in ('off') showed as that one in the error: its class is named now."""
    from specter.errors import PluginError

    class BadPlace:
        name = "off"

        def place(self, *, state):
            return None

    with pytest.raises(PluginError, match=r"placement plug-in 'off' \(an object of .*BadPlace\): place\(\) returned"):
        replay_placements(HEADER, rotating_rounds(4), [BadPlace()], 1.0)


# --- rounds that drafted ahead ------------------------------------------------------------------------------

def test_a_rounds_drafted_steps_round_trip_and_are_bounded_by_k_plus_one(tmp_path):
    ahead = TraceRound.from_arrays(0, 3, 2, 0.01, np.ones((2, 8)), [[0, 1], [0, 1]], drafted=4)
    plain = TraceRound.from_arrays(1, 3, 2, 0.01, np.ones((2, 8)), [[0, 1], [0, 1]], drafted=3)
    assert (ahead.drafted, ahead.plan_k, plain.drafted, plain.plan_k) == (4, 4, None, 3)
    path = tmp_path / "ahead.jsonl"
    with TraceWriter(path, HEADER) as writer:
        writer.write_round(ahead)
        writer.write_round(plain)
    lines = path.read_text().splitlines()
    assert json.loads(lines[1])["drafted"] == 4 and "drafted" not in json.loads(lines[2])
    assert read_trace(path)[1] == [ahead, plain]
    for drafted, says in ((5, "drafted=5; expected an int in 3..4"), (2, "drafted")):
        line = json.loads(lines[1]) | {"drafted": drafted}
        path.write_text(lines[0] + "\n" + json.dumps(line) + "\n")
        with pytest.raises(TraceError, match=says):
            read_trace(path)


class _PlanKs(TopMKeep):
    """TopMKeep that notes the (steps done, k) of every plan it is asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[tuple[int, int]] = []

    def plan(self, *, steps_done, k, **kwargs):
        self.asked.append((steps_done, k))
        return super().plan(steps_done=steps_done, k=k, **kwargs)


def test_a_replayed_round_that_drafted_ahead_plans_with_the_engines_k():
    """The engine plans a draft-ahead round's prefetch for its k + 1 steps; a replay gave the policy k."""
    [trace_round] = rotating_rounds(1, k=3)
    policy = _PlanKs()
    replay(HEADER, [dataclasses.replace(trace_round, drafted=4)], PlanProtect(), policy, link_gbps=1.0)
    assert policy.asked and {k for _, k in policy.asked} == {4}
    plain = _PlanKs()
    replay(HEADER, [trace_round], PlanProtect(), plain, link_gbps=1.0)
    assert plain.asked and {k for _, k in plain.asked} == {3}


def test_a_draft_ahead_engines_trace_replays_the_plans_it_made(tiny, tmp_path, monkeypatch):
    """Recorded on the CPU with the draft-ahead forced on: the replay asks the prefetch policy for the very
    (steps done, k) the engine asked, round by round (k + 1 where the round drafted ahead)."""
    from specter import Engine, EngineConfig
    from specter.kernel import run

    engine_policy = _PlanKs()
    monkeypatch.setattr("policies.prefetch.TopMKeep", lambda *args, **kwargs: engine_policy)
    config = EngineConfig(device="cpu", residents=4, lookahead="fixed", draft=dict(k=3, overlap=16))

    async def main():
        async with Engine.from_pretrained(tiny, config) as engine:
            engine.runtime.record_trace(tmp_path / "ahead.jsonl")
            await engine.complete([5, 17, 300, 42], max_new_tokens=24)

    run(main())
    header, rounds = read_trace(tmp_path / "ahead.jsonl")
    assert rounds and any(r.drafted == r.k + 1 for r in rounds)
    replayed = _PlanKs()
    replay(header, rounds, PlanProtect(), replayed, link_gbps=1.0)
    assert engine_policy.asked and replayed.asked == engine_policy.asked
    assert any(k == 4 for _, k in replayed.asked)


@pytest.mark.parametrize("code, advice", [(28, "; free space or choose another path"), (5, "; choose another path")])
def test_a_trace_write_that_fails_advises_free_space_only_for_a_full_disk(tmp_path, code, advice):
    """`--trace /proc/version` (EIO) was told to free space, as a full disk (ENOSPC) is."""
    import errno as errnos

    from specter.errors import OutputError

    assert code == (errnos.ENOSPC if "free" in advice else errnos.EIO)
    writer = TraceWriter(tmp_path / "t.jsonl", HEADER)

    class Failing:
        def write(self, text):
            raise OSError(code, os.strerror(code))

        def close(self):
            pass

    writer._file = Failing()
    with pytest.raises(OutputError) as failed:
        writer.write_round(rotating_rounds(1)[0])
    assert str(failed.value).endswith(os.strerror(code) + advice), str(failed.value)


class _FirstResident:
    """Evicts the first unprotected resident: an LRU where `residents` comes least recently used first (the engine's
    order), a FIFO where it comes in load order."""

    name = "first-resident"

    def victims(self, layer, residents, protected, count, history, plan):
        return [expert for expert in residents if expert not in protected][:count]


class _SortsInPlace(_FirstResident):
    name = "sorts-in-place"

    def victims(self, layer, residents, protected, count, history, plan):
        residents.sort(key=lambda expert: history.last_use.get(expert, -1))  # a list, as the engine gives
        return super().victims(layer, residents, protected, count, history, plan)


def test_an_eviction_policy_sees_residents_as_the_engine_gives_them():
    """The engine hands `residents` as a fresh list, least recently used first; the replay gave a tuple in load order,
    so a policy taking residents[0] replayed as FIFO and one sorting the list failed. Uses 0, 1, 0, 2, 0 in two
    slots: LRU evicts 1 for 2 and hits 0 again (3 misses), FIFO evicts 0 (4)."""
    rounds = [TraceRound.from_arrays(r, 0, 0, 0.01, np.zeros((2, 8)), [[expert], [expert]])
              for r, expert in enumerate([0, 1, 0, 2, 0])]
    lru = replay(HEADER, rounds, LRU(), NoPrefetch(), link_gbps=1.0, roll=-1)
    first = replay(HEADER, rounds, _FirstResident(), NoPrefetch(), link_gbps=1.0, roll=-1)
    sorts = replay(HEADER, rounds, _SortsInPlace(), NoPrefetch(), link_gbps=1.0, roll=-1)
    assert lru.misses == first.misses == sorts.misses == 6  # 3 a layer
