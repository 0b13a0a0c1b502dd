"""The placement cost model's replay of a trace at the trace header's bounds (thousands of experts per layer): what it
keeps per layer grows with the experts, not their square, a round's work with the stack, not misses x stack, and
its answers equal a straightforward reference, written here, bit for bit (specter/placement.py: `layer_path_uses`,
`layer_host_uses`, `lru_misses_by_host`, `lru_misses`)."""

from __future__ import annotations

import dataclasses
import math
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import specter.placement as placement
from specter.placement import (
    PlacementState,
    RouteSequence,
    _prefix_sums,
    layer_host_uses,
    layer_path_uses,
    lru_misses,
    lru_misses_by_host,
    use_rates,
)
from specter.trace import LayerRoutes, TraceRound, use_counts


def reference_stack(rounds: list[list[int]], slots: int, residents) -> list[int]:
    """The warm LRU stack, least recent first: one uncounted pass, each round's experts within the top `slots` first,
    then the others, each in the round's order; then `residents` one at a time."""
    stack: list[int] = []
    for experts in rounds:
        head = stack[max(0, len(stack) - slots):] if slots > 0 else []
        moved = [e for e in experts if e in head] + [e for e in experts if e not in head]
        stack = [e for e in stack if e not in moved] + moved
    for e in dict.fromkeys(residents):
        stack = [e2 for e2 in stack if e2 != e] + [e]
    return stack


def reference_misses(rounds: list[list[int]], host: set[int], slots: int, residents=()) -> int:
    """`lru_misses_by_host`'s docstring for one host set: one stack, sorted into hits and misses by its top `slots`
    as every h = 0 round does; a device-path use misses iff at least `slots` device-path experts are above it."""
    rounds = [list(dict.fromkeys(experts)) for experts in rounds]
    stack = reference_stack(rounds, slots, residents)
    missed = 0
    for experts in rounds:
        for e in experts:
            if e not in host:
                above = stack[stack.index(e) + 1:]
                missed += sum(x not in host for x in above) >= slots
        head = stack[max(0, len(stack) - slots):] if slots > 0 else []
        moved = [e for e in experts if e in head] + [e for e in experts if e not in head]
        stack = [e for e in stack if e not in moved] + moved
    return missed


@st.composite
def layers(draw):
    """A layer's rounds (repeats within a round included), slots from none to more than the experts, residents (with
    repeats) and a host candidate order of distinct experts, some never used."""
    experts = draw(st.integers(1, 12))
    rng = random.Random(draw(st.integers(0, 10**6)))
    width = draw(st.integers(1, experts))
    rounds = [[rng.randrange(experts) for _ in range(rng.randint(0, width))] for _ in range(draw(st.integers(0, 24)))]
    slots = draw(st.integers(-1, experts + 1))
    residents = [rng.randrange(experts) for _ in range(rng.randint(0, experts))]
    order = rng.sample(range(experts + 2), rng.randint(0, experts + 2))
    return rounds, slots, residents, order


@settings(max_examples=300, deadline=None)
@given(case=layers())
def test_the_one_pass_counts_equal_the_reference_for_every_host_set(case):
    rounds, slots, residents, order = case
    by_host = lru_misses_by_host(rounds, order, slots, residents)
    assert by_host == [reference_misses(rounds, set(order[:h]), slots, residents) for h in range(len(order) + 1)]
    host = set(order[:len(order) // 2]) | {0}
    assert lru_misses(rounds, host, slots, residents) == reference_misses(rounds, host, slots, residents)


finite = st.floats(allow_nan=False, allow_infinity=False, min_value=-1e300, max_value=1e300)


@settings(max_examples=300, deadline=None)
@given(values=st.lists(st.one_of(finite, st.sampled_from([0.0, -0.0, 5e-324, -5e-324, 1 / 3, 0.1])), max_size=40))
def test_prefix_sums_are_fsum_of_every_prefix_bit_for_bit(values):
    """The exact running sum, rounded once per prefix, is fsum's own answer: both exactly rounded."""
    assert [s.hex() for s in _prefix_sums(values)] == [math.fsum(values[:h]).hex() for h in range(len(values) + 1)]


def test_prefix_sums_of_values_that_are_not_finite_are_fsums():
    for values in ([math.inf, 1.0], [1.0, math.nan, 2.0], [-math.inf, 3.0, 0.5]):
        got, want = _prefix_sums(values), [math.fsum(values[:h]) for h in range(len(values) + 1)]
        assert [repr(g) for g in got] == [repr(w) for w in want]


def sequenced_state(experts: int, slots: int, k: int, rounds: int, seed: int, speculates: bool) -> PlacementState:
    """One layer's rounds of k + 1 rows of top-2 routes with reuse; no link, so no prefetch replay scales the misses."""
    rng = random.Random(seed)
    made, previous = [], rng.sample(range(experts), 2)
    for index in range(rounds):
        used = []
        for _ in range(k + 1):
            kept = [e for e in previous if rng.random() < 0.5]
            previous = kept + rng.sample([e for e in range(experts) if e not in kept], 2 - len(kept))
            used += previous
        made.append(TraceRound(round=index, k=k, accepted=rng.randint(0, k), draft_step_s=1e-3,
                               layers=[LayerRoutes({}, list(dict.fromkeys(used)))]))
    return PlacementState(num_layers=1, num_experts=experts, top_k=2, slots_per_layer=slots,
                          initial_residents=(tuple(rng.sample(range(experts), rng.randint(0, slots))),),
                          expert_bytes=1024, row_bucket=rng.choice([1, 2, 16]), host_expert_s={16: 1e-3},
                          route_counts=use_counts(made, 1, experts), route_sequence=RouteSequence.of_rounds(made, 1),
                          speculates=speculates)


def reference_uses(state: PlacementState, host: set[int]) -> tuple[float, float]:
    """(device misses, host blocks) per committed token of layer 0 with `host` on the host path: the reference's
    misses (none where the device experts fit the slots), and per host expert ceil(rows / row_bucket) per round that
    used it for an engine that speculates, its use rate for one that does not, summed exactly rounded."""
    sequence, slots = state.route_sequence, state.slots(0)
    used = [list(experts) for experts in sequence.used[0]]
    misses = reference_misses(used, host, slots, state.initial_residents[0])
    if state.speculates:
        blocks = [sum(math.ceil(rows / state.row_bucket) for experts, rows in zip(used, sequence.rows) if e in experts)
                  / sequence.tokens for e in host]
    else:
        blocks = [use_rates(state)[0][e] for e in host]
    device = 0.0 if state.num_experts - len(host) <= slots else misses / sequence.tokens
    return device, math.fsum(blocks)


@settings(max_examples=150, deadline=None)
@given(experts=st.integers(2, 12), data=st.data())
def test_every_host_set_a_pass_answers_equals_the_reference_and_its_set_alone(experts, data):
    slots = data.draw(st.integers(1, experts))
    placed = sequenced_state(experts, slots, data.draw(st.sampled_from([0, 1, 3])), data.draw(st.integers(1, 30)),
                             data.draw(st.integers(0, 10**6)), data.draw(st.booleans()))
    rates = use_rates(placed)[0]
    order = data.draw(st.permutations(range(experts)))[:data.draw(st.integers(0, experts))]
    uses = layer_path_uses(placed, 0, rates, order)
    alone = dataclasses.replace(placed)  # nothing replayed yet: each set replayed on its own (`lru_misses`)
    for h in range(len(order) + 1):
        want = reference_uses(placed, set(order[:h]))
        assert uses[h] == want
        assert layer_host_uses(placed, 0, rates, reversed(order[:h])) == want
        assert layer_host_uses(alone, 0, rates, order[:h]) == want
    other = set(data.draw(st.lists(st.integers(0, experts - 1), unique=True)))
    assert layer_host_uses(placed, 0, rates, other) == reference_uses(placed, other)


def test_a_pass_keeps_one_entry_per_order_not_one_per_prefix(monkeypatch):
    """The state keeps what a layer's pass over E candidates found as that order and its E + 1 answers, O(E) per
    layer (one host set per prefix kept E + 1 sets of up to E experts: at 4096 experts and 512 layers, gigabytes), and
    still answers every prefix, in any order, without replaying the rounds again."""
    placed = sequenced_state(300, 40, 1, 60, seed=3, speculates=True)
    rates = use_rates(placed)[0]
    order = sorted(range(300), key=lambda e: (rates[e], e))[:260]
    uses = layer_path_uses(placed, 0, rates, order)
    held = sum(len(key[1]) for key in placed._replayed if isinstance(key, tuple) and isinstance(key[1], (tuple, frozenset)))
    assert held <= len(order)  # experts named in the memo's keys: the order once
    assert sum(len(v) for v in placed._replayed.values() if isinstance(v, list)) <= 2 * (len(order) + 1)

    def replayed(*args, **kwargs):
        raise AssertionError("a prefix of the pass's order was replayed again")

    monkeypatch.setattr(placement, "lru_misses", replayed)
    rng = random.Random(0)
    for h in (0, 1, 7, 130, 259, 260):
        prefix = order[:h]
        rng.shuffle(prefix)
        assert layer_host_uses(placed, 0, rates, prefix) == uses[h]


def test_a_round_partitions_at_most_the_stack_above_its_misses_not_misses_x_stack(monkeypatch):
    """Each round with misses finds every miss's `slots`-th highest key above it from one pass down the stack, so the
    keys partitioned per round stay within a small multiple of the stack, however many experts the round misses
    (a misses x stack table per round: 40 times more here)."""
    rng = random.Random(5)
    experts, slots = 400, 50
    rounds = [rng.sample(range(experts), 40) for _ in range(30)]  # ~35 misses a round
    partitioned = []
    real = np.partition

    def counting(array, kth, *args, **kwargs):
        partitioned.append(np.size(array))
        return real(array, kth, *args, **kwargs)

    monkeypatch.setattr(np, "partition", counting)
    misses = lru_misses_by_host(rounds, list(range(300)), slots)
    assert misses[0] > 20 * len(rounds)  # most uses miss
    assert sum(partitioned) <= len(rounds) * 3 * (experts + 40)


@pytest.mark.parametrize("order", [list(range(100)), list(range(0, 100, 2)) + list(range(1, 100, 2))])
def test_a_deep_miss_below_many_higher_keys_equals_the_reference(order):
    """The last round misses 5 just below the slots (under 0-3, whose keys are lowest) and 99 below 49 experts of
    higher keys, which all enter the `slots` highest at once (`_miss_ranks` takes such a stretch in one partition)."""
    rounds = [[99], list(range(50, 99)), [5], [0, 1, 2, 3], [5, 99]]
    misses = lru_misses_by_host(rounds, order, 4)
    assert misses == [reference_misses(rounds, set(order[:h]), 4) for h in range(len(order) + 1)]


def test_an_order_that_names_an_expert_twice_is_refused():
    """Each expert has one candidate rank: a repeat would give an expert outside the order a rank inside it."""
    with pytest.raises(AssertionError, match="twice"):
        lru_misses_by_host([[0, 1], [2, 3]], [0, 0, 1], 2)
