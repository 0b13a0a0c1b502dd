"""`auto` from a routing trace's rounds in order (`PlacementState.route_sequence`, specter/placement.py
`layer_path_uses`): each layer's slots replayed as an LRU cache over the rounds instead of Che's estimate for
independent uses, which over-counts the misses of routing that reuses experts from token to token."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.eviction import LRU
from policies.placement import Auto
from specter.errors import ConfigError
from specter.placement import (
    Placement,
    PlacementState,
    RouteSequence,
    copy_seconds,
    expected_misses,
    layer_host_jobs,
    layer_path_uses,
    lru_misses,
    lru_misses_by_host,
    token_seconds,
    use_rates,
)
from specter.replay import (
    CacheModel,
    _Tally,
    _verify_round,
    engine_roll,
    replay,
    replay_placements,
    trace_placement_state,
)
from specter.trace import LayerRoutes, TraceHeader, TraceRound, TraceWriter, read_trace, use_counts

MS = 1e-3
EXPERT_BYTES = 1024


def token_rounds(layers: int, experts: int, top_k: int, tokens: int, reuse: float, seed: int = 0) -> list[TraceRound]:
    """k = 0 rounds (one token each) whose token keeps each of the previous token's experts at a layer with probability
    `reuse` and draws the rest uniformly from the others: 0 is independent uniform routing, near 1 strong locality."""
    rng = random.Random(seed)
    previous = [rng.sample(range(experts), top_k) for _ in range(layers)]
    rounds = []
    for index in range(tokens):
        used = []
        for layer in range(layers):
            kept = [e for e in previous[layer] if rng.random() < reuse]
            fresh = rng.sample([e for e in range(experts) if e not in kept], top_k - len(kept))
            previous[layer] = kept + fresh
            used.append(LayerRoutes(predicted={}, used=list(previous[layer])))
        rounds.append(TraceRound(round=index, k=0, accepted=0, draft_step_s=1e-3, layers=used))
    return rounds


def state(rounds, experts: int, top_k: int, slots: int, copy_s: float = 1 * MS, host_s: float = 1 * MS,
          sequence: bool = True, initial=None) -> PlacementState:
    layers = len(rounds[0].layers)
    return PlacementState(num_layers=layers, num_experts=experts, top_k=top_k, slots_per_layer=slots,
                          initial_residents=initial if initial is not None else tuple(() for _ in range(layers)),
                          expert_bytes=EXPERT_BYTES, row_bucket=16, link_bytes_per_s=EXPERT_BYTES / copy_s,
                          host_expert_s={16: host_s}, route_counts=use_counts(rounds, layers, experts),
                          route_sequence=RouteSequence.of_rounds(rounds, layers) if sequence else None)


def replayed_misses(rounds: list[list[int]], host: set[int], slots: int, residents=()) -> int:
    """The replay's own cache (`CacheModel` with LRU eviction, each round's device-path uses through `_verify_round`,
    as the engine's verify counts them: per round), warmed by one uncounted pass over `rounds` and then by `residents`
    (least recently used first, one at a time), counting the misses of a second pass."""
    cache = CacheModel(1, slots, LRU())

    def verify(passed: list[list[int]]) -> int:
        tally = _Tally()
        for index, experts in enumerate(passed):
            device = [e for e in dict.fromkeys(experts) if e not in host]
            _verify_round(cache, TraceRound(round=index, k=0, accepted=0, draft_step_s=1e-3,
                                            layers=[LayerRoutes({}, device)]), None, set(), tally, engine_roll())
        return tally.misses

    verify(rounds)
    verify([[e] for e in residents if e not in host])
    return verify(rounds)


def layer_rounds(experts: int, top_k: int, rows: int, rounds: int, reuse: float, slots: int, rng: random.Random) -> list[list[int]]:
    """One layer's rounds of `rows` rows, each row top_k experts that keep each of the previous row's with probability
    `reuse`; a round uses at most `slots` distinct experts (the engine's window decides what a larger round keeps)."""
    previous, made = rng.sample(range(experts), top_k), []
    for _ in range(rounds):
        used: list[int] = []
        for _ in range(rows):
            kept = [e for e in previous if rng.random() < reuse]
            room = slots - len(set(used) | set(kept))
            fresh = [e for e in range(experts) if e not in kept and e not in used]
            old = [e for e in range(experts) if e not in kept and e in used]
            picked = rng.sample(fresh, min(top_k - len(kept), room, len(fresh)))
            picked += rng.sample(old, min(top_k - len(kept) - len(picked), len(old)))
            previous = kept + picked
            used += previous
        made.append(list(dict.fromkeys(used)))
    return made


@st.composite
def multi_row_layers(draw):
    """A layer's rounds of 1 to 16 rows with initial residents and a host candidate order."""
    experts = draw(st.integers(2, 16))
    slots = draw(st.integers(1, experts))
    top_k = draw(st.integers(1, min(experts, 3, slots)))
    rng = random.Random(draw(st.integers(0, 10**6)))
    rounds = layer_rounds(experts, top_k, draw(st.sampled_from([1, 2, 4, 16])), draw(st.integers(1, 30)), rng.random(),
                          slots, rng)
    residents = tuple(rng.sample(range(experts), rng.randint(0, slots)))
    order = rng.sample(range(experts), rng.randint(0, experts))
    return rounds, slots, residents, order


@settings(max_examples=300, deadline=None)
@given(case=multi_row_layers())
def test_the_one_pass_replay_counts_what_the_replays_cache_misses(case):
    """The verify checks a round's experts against the cache as the round found it, so an early miss never evicts an
    expert the same round uses later: with every expert on the device (h = 0), exactly the replay's count."""
    rounds, slots, residents, order = case
    misses = lru_misses_by_host(rounds, order, slots, residents)
    assert misses[0] == replayed_misses(rounds, set(), slots, residents)
    assert misses == sorted(misses, reverse=True)
    assert misses == [lru_misses(rounds, order[:h], slots, residents) for h in range(len(order) + 1)]  # one set alone
    assert misses[-1] == lru_misses_by_host(rounds, sorted(order), slots, residents)[-1]  # a function of the host set


def test_the_one_pass_replay_for_every_host_set_stays_within_a_percent_of_the_replays_cache():
    """Every h, over traces of k = 3 rounds (top-3 of 16 experts in 8 slots, with locality): the one pass orders a
    round's hits as h = 0 does, where the engine first uses those a host set turns into hits; within 1 % of the
    replay's count in total (a sequential LRU, one use at a time, over-counts these rounds by far more)."""
    rng = random.Random(7)
    error = total = 0
    for _ in range(40):
        rounds = layer_rounds(16, 3, 4, 60, rng.random(), 8, rng)
        order = rng.sample(range(16), 12)
        misses = lru_misses_by_host(rounds, order, 8)
        reference = [replayed_misses(rounds, set(order[:h]), 8) for h in range(len(order) + 1)]
        assert misses[0] == reference[0]
        error += sum(abs(m - r) for m, r in zip(misses, reference))
        total += sum(reference)
    assert error <= 0.01 * total


def test_strong_locality_keeps_on_the_device_what_independent_use_sends_to_the_host():
    """Tokens reuse each of the previous token's experts with probability 0.9 (top-2 of 16, 6 slots): an LRU cache
    misses about 0.14 uses per token, where independent use at the same (near uniform) rates predicts about 1.2
    (2 x (1 - 6/16)). The host at 0.8 ms per block against a 1 ms copy: Che's estimate sends every non-resident to
    the host; the replay keeps them all on the device, since a host expert is computed at every use and a cached one
    copied once per stay."""
    rounds = token_rounds(2, 16, 2, 3000, reuse=0.9, seed=1)
    with_sequence = state(rounds, 16, 2, 6, host_s=0.8 * MS)
    counts_only = dataclasses.replace(with_sequence, route_sequence=None)
    assert Auto().place(counts_only).counts() == [10, 10]  # independent uses: the host is cheaper per use
    assert Auto().place(with_sequence).total == 0  # the rounds: the device copies far fewer than the host computes
    rates = use_rates(counts_only)
    for layer in range(2):
        used = [list(r.layers[layer].used) for r in rounds]
        replayed = layer_path_uses(with_sequence, layer, rates[layer], [])[0][0]
        assert replayed == replayed_misses(used, set(), 6) / 3000  # the replay is the LRU count per token
        che = expected_misses(rates[layer], list(range(16)), 6)
        assert replayed < 0.4 * che
    assert token_seconds(with_sequence, Placement.device_only(2, 16)) < 0.4 * token_seconds(
        counts_only, Placement.device_only(2, 16))


def test_without_locality_the_replay_agrees_with_che():
    """Independent uniform routing: the replayed misses per token follow Che's estimate for every host set, and the
    host blocks per token the use rates, so both pick the same placement away from the break-even costs."""
    rounds = token_rounds(1, 16, 2, 6000, reuse=0.0, seed=2)
    replayed = state(rounds, 16, 2, 6)
    modelled = dataclasses.replace(replayed, route_sequence=None)
    rates = use_rates(modelled)[0]
    order = sorted(range(16), key=lambda e: (rates[e], e))[:10]
    from_rounds, from_rates = layer_path_uses(replayed, 0, rates, order), layer_path_uses(modelled, 0, rates, order)
    for (misses, host), (che, uses) in zip(from_rounds, from_rates):
        assert misses == pytest.approx(che, rel=0.05, abs=0.01)
        assert host == pytest.approx(uses, rel=1e-9, abs=1e-12)
    for host_ms in (0.5, 2.0):
        assert Auto().place(dataclasses.replace(replayed, host_expert_s={16: host_ms * MS})) == \
            Auto().place(dataclasses.replace(modelled, host_expert_s={16: host_ms * MS}))


def test_a_speculative_round_computes_a_host_expert_once_for_its_rows():
    """A round of k + 1 rows computes each host expert it used on ceil((k + 1) / row_bucket) blocks, and the round's
    misses and blocks count per token it committed (accepted + 1)."""
    layers = [LayerRoutes(predicted={}, used=[0, 1, 2])]
    rounds = [TraceRound(round=i, k=3, accepted=1, draft_step_s=1e-3, layers=layers) for i in range(4)]
    sequence = RouteSequence.of_rounds(rounds, 1)
    assert sequence.rows == (4, 4, 4, 4) and sequence.tokens == 8 and sequence.used == (((0, 1, 2),) * 4,)
    # a speculating engine (no link: the misses are the LRU's, without the prefetch replay's share)
    placed = dataclasses.replace(state(rounds, 4, 2, 1), row_bucket=2, speculates=True, link_bytes_per_s=None)
    uses = layer_path_uses(placed, 0, use_rates(placed)[0], [0, 1, 2])
    assert [host for _, host in uses] == [0.0, 2 * 4 / 8, 2 * 2 * 4 / 8, 3 * 2 * 4 / 8]
    assert uses[0][0] == 2 * 4 / 8  # one slot, three experts a round: the one the slot held hits, the other two miss
    assert uses[0][0] == replayed_misses([[0, 1, 2]] * 4, set(), 1) / 8
    assert uses[3][0] == 0.0  # the one device expert left fits its slot: preloaded
    assert RouteSequence.of_rounds(rounds, 1, max_tokens=3).tokens == 4  # the cap stops after the round that reaches it
    with pytest.raises(ConfigError, match="routes 1 of 2 MoE layers"):  # its layers' rounds would not line up with `rows`
        RouteSequence.of_rounds(rounds, 2)


def test_an_engine_that_does_not_speculate_computes_a_host_expert_for_each_token_that_routes_to_it():
    """A k = 0 engine runs each token as its own one-row forward, so a host expert costs a block per token that uses
    it (its use rate), not one per round of the speculating trace it was placed from: 4 rounds of 2 tokens each use
    experts 0, 1 and 2, so each has 4 of the 12 round uses, scaled to top_k = 2 uses per token: a rate of 2/3, where
    the rounds charge a speculating engine 4 blocks over 8 tokens (0.5). The misses are the same rounds' replay
    either way."""
    layers = [LayerRoutes(predicted={}, used=[0, 1, 2])]
    rounds = [TraceRound(round=i, k=3, accepted=1, draft_step_s=1e-3, layers=layers) for i in range(4)]
    plain = state(rounds, 4, 2, 1)
    assert not plain.speculates
    rates = use_rates(plain)[0]
    assert rates == [2 / 3, 2 / 3, 2 / 3, 0.0]
    uses = layer_path_uses(plain, 0, rates, [0, 1, 2])
    assert [host for _, host in uses] == pytest.approx([0.0, 2 / 3, 4 / 3, 2.0])
    speculating = dataclasses.replace(plain, speculates=True, link_bytes_per_s=None)
    spec_uses = layer_path_uses(speculating, 0, rates, [0, 1, 2])
    assert [host for _, host in spec_uses] == [0.0, 0.5, 1.0, 1.5]
    assert [misses for misses, _ in uses] == [misses for misses, _ in spec_uses]
    # the cost per token follows: with host and copy both 1 ms, hosting all three costs the k = 0 engine 2 ms a token
    everything = Placement.of([[0, 1, 2]], 1, 4)
    assert token_seconds(plain, everything) == pytest.approx(2.0 * MS)
    assert token_seconds(dataclasses.replace(plain, speculates=True), everything) == pytest.approx(1.5 * MS)


@st.composite
def sequenced_states(draw):
    experts = draw(st.integers(2, 10))
    slots = draw(st.integers(1, experts))
    top_k = draw(st.integers(1, min(experts, 3)))
    layers = draw(st.integers(1, 2))
    tokens = draw(st.integers(1, 40))
    k = draw(st.integers(0, 3))
    rng = random.Random(draw(st.integers(0, 10**6)))
    rounds = [TraceRound(round=i, k=k, accepted=rng.randint(0, k), draft_step_s=1e-3,
                         layers=[LayerRoutes({}, rng.sample(range(experts), top_k)) for _ in range(layers)])
              for i in range(tokens)]
    initial = tuple(tuple(rng.sample(range(experts), rng.randint(0, slots))) for _ in range(layers))
    seconds = st.floats(1e-5, 1e-1)
    return state(rounds, experts, top_k, slots, copy_s=draw(seconds), host_s=draw(seconds), initial=initial)


@settings(max_examples=200, deadline=None)
@given(placed=sequenced_states(), overlap=st.sampled_from([0.0, 1.0]), margin=st.sampled_from([0.0, 0.05]))
def test_auto_from_rounds_is_never_predicted_slower_than_off_whose_misses_are_the_replays(placed, overlap, margin):
    """`off`'s predicted time is the replay's cache misses per committed token times one copy (where every round fits
    the slots: the engine's window decides what a larger round keeps), and a state that has replayed nothing yet
    (`dataclasses.replace`: each host set replayed alone, `lru_misses`) predicts what the policy's own pass left."""
    placement = Auto(margin=margin, overlap=overlap).place(placed)
    for layer in range(placed.num_layers):
        assert not placement.host_experts(layer) & set(placed.initial_residents[layer])
    off = token_seconds(placed, Placement.device_only(placed.num_layers, placed.num_experts), overlap=overlap)
    assert token_seconds(placed, placement, overlap=overlap) <= off + 1e-12
    assert token_seconds(dataclasses.replace(placed), placement, overlap=overlap) == \
        token_seconds(placed, placement, overlap=overlap)
    sequence, slots = placed.route_sequence, placed.slots_per_layer
    if placed.num_experts > slots and all(len(used) <= slots for layer in sequence.used for used in layer):
        misses = sum(replayed_misses([list(used) for used in sequence.used[layer]], set(), slots,
                                     placed.initial_residents[layer]) for layer in range(placed.num_layers))
        assert off == pytest.approx(misses / sequence.tokens * copy_seconds(placed), rel=1e-9, abs=1e-15)


def write_trace(path, rounds: list[TraceRound], layers: int, experts: int, top_k: int) -> None:
    header = TraceHeader(model="t", num_layers=layers, num_experts=experts, expert_bytes=64, top_k=top_k, slots_per_layer=2)
    with TraceWriter(path, header) as writer:
        for trace_round in rounds:
            writer.write_round(TraceRound.from_arrays(trace_round.round, trace_round.k, trace_round.accepted, 1e-3,
                                                      np.zeros((layers, experts)), [r.used for r in trace_round.layers]))


@pytest.fixture
def quiet_logs_after():
    """specter.cli.main binds the logs to the stderr of the moment: rebind them once capsys has given stderr back."""
    yield
    from specter import log

    log.configure()


def test_info_weighs_a_trace_profile_by_its_rounds(quiet_logs_after, tiny, tmp_path, capsys):
    """`specter info --placement-profile TRACE`: the predicted time of `off` is the replayed LRU's misses per token
    times one copy, summed over the layers (the tiny model: 4 MoE layers of 16 experts, top-2; 2 slots)."""
    from specter.cli import checkpoint_summary, main

    rounds = token_rounds(4, 16, 2, 400, reuse=0.9, seed=5)
    trace = tmp_path / "local.jsonl"
    write_trace(trace, rounds, 4, 16, 2)
    summary = checkpoint_summary(str(tiny), residents=2, link="1", placement_profile=str(trace), measure=False)
    assert summary["routing"] == "sequence"
    misses = sum(replayed_misses([list(r.layers[layer].used) for r in rounds], set(), 2) for layer in range(4)) / 400
    assert summary["predicted_ms_per_token"]["off"] == pytest.approx(misses * summary["copy_ms_per_expert"], rel=1e-3)
    plain = checkpoint_summary(str(tiny), residents=2, link="1", measure=False)
    assert plain["routing"] == "uniform" and plain["predicted_ms_per_token"]["off"] > summary["predicted_ms_per_token"]["off"]
    assert main(["info", str(tiny), "--residents", "2", "--link", "1", "--placement-profile", str(trace), "--no-measure"]) == 0
    assert "(sequence routing)" in capsys.readouterr().out


H200_TRACES = Path(__file__).resolve().parents[1] / "benchmarks/results/h200-2026-11-30/sixteenth/trace16/traces"


@pytest.mark.parametrize("name", ["trace-r15.jsonl", "trace-r8.jsonl"])
def test_a_speculating_engines_off_is_the_replays_warm_off_and_auto_is_not_slower_than_it(name):
    """With the draft's predictions in the profile's rounds, a speculating engine's device path waits only for the
    verify's misses and the prefetch its drafting does not hide, as the replay models them: `off`'s prediction is the
    replay's over a warm cache (the second of two passes over the rounds), and at a host block of 0.8 ms, where the
    replay finds every host expert slower than its copy, `auto` places nothing (it placed 314 and 242 experts, 4-5 %
    slower, when each device miss counted its full copy)."""
    header, rounds = read_trace(H200_TRACES / name)
    off = Placement.device_only(header.num_layers, header.num_experts)
    for host_ms in (0.8, 0.5):
        state_ = trace_placement_state(header, rounds, 25.0, host_ms * MS)
        assert state_.speculates
        once = replay(header, rounds, "plan-protect", "topm-keep", 25.0)
        twice = replay(header, list(rounds) * 2, "plan-protect", "topm-keep", 25.0)
        assert token_seconds(state_, off) == pytest.approx((twice.modelled_s - once.modelled_s) / once.tokens, rel=1e-9)
    [off_replayed, auto_replayed] = replay_placements(header, rounds, ["off", "auto"], 25.0, 0.8 * MS)
    assert auto_replayed.result.modelled_s <= off_replayed.result.modelled_s
    assert auto_replayed.placement.total == 0
    [off_replayed, auto_replayed] = replay_placements(header, rounds, ["off", "auto"], 25.0, 0.5 * MS)
    # the host still wins where it is fast
    assert auto_replayed.result.modelled_s < 0.8 * off_replayed.result.modelled_s


def test_an_engine_that_does_not_speculate_is_placed_by_the_lru_alone():
    """k = 0 (or a profile without a link to pace the prefetch): every miss costs its full copy, and every token that
    routes to a host expert computes it."""
    header, rounds = read_trace(H200_TRACES / "trace-r15.jsonl")
    plain = dataclasses.replace(trace_placement_state(header, rounds, 25.0, 0.8 * MS), speculates=False)
    sequence = plain.route_sequence
    misses = sum(lru_misses(sequence.used[layer], (), plain.slots_per_layer) for layer in range(header.num_layers))
    off = Placement.device_only(header.num_layers, header.num_experts)
    assert token_seconds(plain, off) == pytest.approx(misses / sequence.tokens * header.expert_bytes / 25e9, rel=1e-12)
    # it pays a host block per token that routes to an expert (`_host_blocks`), so a host use must beat the misses it
    # saves: at 0.8 or 0.5 ms against a 0.69 ms copy none does; at 0.3 ms the least reused do, at 0.1 ms most
    states = {ms: dataclasses.replace(plain, host_expert_s={16: ms * MS}) for ms in (0.8, 0.5, 0.3, 0.1)}
    placed = {ms: Auto().place(states[ms]) for ms in states}
    assert placed[0.8].total == placed[0.5].total == 0
    assert 0 < placed[0.3].total < placed[0.1].total
    assert token_seconds(states[0.1], placed[0.1]) < 0.5 * token_seconds(states[0.1], off)


def test_a_host_job_costs_its_fixed_part_once_per_round_that_uses_any_of_the_layers_host_experts():
    """`layer_host_jobs`: a speculating engine's rounds pay a layer's host job once per round that used any of its host
    experts, whatever their number; a k = 0 engine's tokens once per token that routes to any: counted where the
    rounds are its own (k = 0, a token each), else 1 - P(none of a token's top_k distinct experts is one of them),
    C(E - h, k) / C(E, k) under uniform use. `token_seconds` adds `host_job_s` per job to the host path's blocks."""
    used = [[0, 1], [0, 2], [3, 1], [3, 2]]  # four rounds of k = 1, each committing 2 tokens
    rounds = [TraceRound(round=i, k=1, accepted=1, draft_step_s=1e-3, layers=[LayerRoutes(predicted={}, used=u)])
              for i, u in enumerate(used)]
    speculating = dataclasses.replace(state(rounds, 4, 2, 4), speculates=True, link_bytes_per_s=None)
    rates = use_rates(speculating)[0]
    # order 0, 3, 1: rounds using 0: two; then 3 adds the other two; 1 adds none
    assert layer_host_jobs(speculating, 0, rates, [0, 3, 1]) == [0.0, 2 / 8, 4 / 8, 4 / 8]
    assert layer_host_jobs(speculating, 0, rates, [1, 2]) == [0.0, 2 / 8, 4 / 8]
    plain = state(rounds, 4, 2, 4)
    assert rates == [0.5, 0.5, 0.5, 0.5]
    # k = 1 rounds are not a k = 0 engine's forwards: its tokens draw 2 of 4 distinct experts
    assert layer_host_jobs(plain, 0, rates, [0, 3, 1]) == pytest.approx([0.0, 1 - 3 / 6, 1 - 1 / 6, 1.0])
    # k = 0 rounds are its forwards: counted, as the replay charges them
    tokens = [TraceRound(round=i, k=0, accepted=0, draft_step_s=1e-3, layers=[LayerRoutes(predicted={}, used=u)])
              for i, u in enumerate(used)]
    own = state(tokens, 4, 2, 4)
    assert layer_host_jobs(own, 0, use_rates(own)[0], [0, 3, 1]) == [0.0, 2 / 4, 4 / 4, 4 / 4]
    # with 1 ms an expert block and 4 ms a job: experts 0 and 3 on the host cost a speculating engine 2 blocks of
    # 2 rounds each (4 blocks over 8 tokens) and 4 jobs over 8 tokens; the device path misses nothing (4 slots)
    both = Placement.of([[0, 3]], 1, 4)
    assert token_seconds(speculating, both) == pytest.approx((4 / 8) * MS)
    fixed = dataclasses.replace(speculating, host_job_s=4 * MS)
    assert token_seconds(fixed, both) == pytest.approx((4 / 8) * MS + (4 / 8) * 4 * MS)
    assert token_seconds(fixed, Placement.device_only(1, 4)) == 0.0  # no host expert: no job


def test_auto_weighs_a_host_jobs_fixed_part():
    """Two rarely used experts of four, with a copy at 1 ms and a host expert at 0.2 ms: without a fixed part `auto`
    puts both on the host; at 4 ms a job the host path of a round that uses one of them costs more than the copies
    its use brings (about two: it evicts expert 0 or 1, used again next round), and `auto` keeps them on the device
    path. The prediction `decision_record` reports carries the job's figure."""
    from specter.placement import decision_record

    rng = random.Random(3)
    rounds = []
    for index in range(200):  # experts 0 and 1 in every round, 2 or 3 in about one round in five
        extra = [rng.choice([2, 3])] if rng.random() < 0.2 else []
        rounds.append(TraceRound(round=index, k=0, accepted=0, draft_step_s=1e-3,
                                 layers=[LayerRoutes(predicted={}, used=[0, 1] + extra)]))
    base = state(rounds, 4, 2, 2, copy_s=1 * MS, host_s=0.2 * MS)
    assert Auto().place(base).host[0] == frozenset({2, 3})
    costly = dataclasses.replace(base, host_job_s=4 * MS)
    assert Auto().place(costly).host[0] == frozenset()
    record = decision_record(costly, Placement.of([[2, 3]], 1, 4))
    assert record["host_s_per_job"] == 4 * MS
    assert record["predicted_s_per_token"]["placed"] > record["predicted_s_per_token"]["off"]


def test_a_job_of_one_expert_and_a_job_of_several_split_into_a_fixed_part_and_each_experts():
    """`split_job_cost`: the line through a job of n experts and one of one; where the two cannot be such a line
    (noise), the job's share per expert and no fixed part."""
    from specter.experts.costs import first_unread, split_job_cost

    assert split_job_cost(1.5e-3, 4, 3e-3) == pytest.approx((1e-3, 2e-3))  # 6 ms for four, 3 for one
    assert split_job_cost(1e-3, 4, 0.9e-3) == (1e-3, 0.0)  # one alone cheaper than a share: no fixed part
    assert split_job_cost(1e-3, 4, 5e-3) == (1e-3, 0.0)  # one alone dearer than all four: no line
    assert split_job_cost(1e-3, 2, 1.99e-3) == pytest.approx((0.25e-3, 1.74e-3))  # each expert adds at least a quarter
    # the jobs of one start past what the jobs of two read: 4 jobs of 2 read layer 0's experts 0-7
    assert first_unread(2, 8, 2, 4) == 8 and first_unread(2, 8, 2, 3) == 6 and first_unread(2, 8, 2, 0) == 0
