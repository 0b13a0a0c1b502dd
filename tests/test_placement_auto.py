"""The `auto` placement policy (policies/placement.py) and the cost model it weighs (specter/placement.py): a pure
function of the PlacementState, checked on hand-computed cases and by a hypothesis property."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.placement import Auto
from specter import plugins
from specter.errors import PluginError
from specter.placement import Placement, PlacementState, prefill_placement, token_seconds, use_rates

MS = 1e-3
EXPERT_BYTES = 1024


def state(copy_s: float | None = 1 * MS, host_s: float | None = 1 * MS, layers: int = 2, experts: int = 8, slots: int = 2,
          top_k: int = 2, counts=None, initial=None) -> PlacementState:
    """A model of `layers` x `experts` whose expert copies in `copy_s` and computes on the host in `host_s` (None: not
    measured)."""
    return PlacementState(num_layers=layers, num_experts=experts, top_k=top_k, slots_per_layer=slots,
                          initial_residents=initial if initial is not None else tuple(() for _ in range(layers)),
                          expert_bytes=EXPERT_BYTES, row_bucket=16,
                          link_bytes_per_s=EXPERT_BYTES / copy_s if copy_s is not None else None,
                          host_expert_s={16: host_s} if host_s is not None else {}, route_counts=counts)


def test_auto_is_installed_and_off_by_default_names_it():
    assert plugins.load_policy("placement", "auto").name == "auto"


def test_uniform_routing_with_equal_costs_splits_the_non_residents():
    # 8 experts at 0.25 uses per token each; 2 stay. h host experts: misses (6 - h) x 0.25 copies against h x 0.25
    # host blocks, least at h = 3 (0.75 ms against off's 1.5 ms).
    placement = Auto().place(state())
    assert placement.counts() == [3, 3]
    assert all(placement.host_experts(layer) == {2, 3, 4} for layer in range(2))  # equal rates: the lower ids go to the host first
    assert token_seconds(state(), placement) == pytest.approx(2 * 0.75 * MS)
    assert token_seconds(state(), Placement.device_only(2, 8)) == pytest.approx(2 * 1.5 * MS)


def test_skewed_routing_puts_the_least_used_on_the_host_and_keeps_the_most_used():
    counts = [[100, 80, 60, 40, 20, 10, 5, 1], [1, 5, 10, 20, 40, 60, 80, 100]]
    placement = Auto().place(state(counts=counts))
    rates = use_rates(state(counts=counts))
    assert sum(rates[0]) == pytest.approx(2)
    for layer, most_used in ((0, {0, 1}), (1, {6, 7})):
        host = placement.host_experts(layer)
        assert host and not host & most_used
        others = set(range(8)) - most_used - host
        assert max(rates[layer][e] for e in host) <= min(rates[layer][e] for e in others)  # least used first


def test_a_host_much_slower_than_the_link_takes_nothing():
    assert Auto().place(state(copy_s=1 * MS, host_s=10 * MS)).total == 0


def test_a_link_much_slower_than_the_host_sends_every_non_resident_to_the_host():
    placement = Auto().place(state(copy_s=10 * MS, host_s=1 * MS))
    assert placement.counts() == [6, 6] and all(placement.device_experts(layer) == [0, 1] for layer in range(2))


def test_everything_resident_or_nothing_measured_places_nothing():
    assert Auto().place(state(slots=8)).total == 0
    assert Auto().place(state(copy_s=None)).total == 0  # the CPU without an emulated link
    assert Auto().place(state(host_s=None)).total == 0


def test_the_margin_falls_back_to_off():
    # host 5.9 ms: one host expert saves 0.025 of 1.5 ms (1.7 %), below the 5 % margin; 5.5 ms saves 8.3 %.
    assert Auto().place(state(host_s=5.9 * MS)).total == 0
    assert Auto(margin=0.0).place(state(host_s=5.9 * MS)).counts() == [1, 1]
    assert Auto().place(state(host_s=5.5 * MS)).counts() == [1, 1]


def test_the_prefetch_discount_moves_experts_back_to_the_device():
    plain, discounted = Auto().place(state()), Auto(prefetch_discount=0.5).place(state())
    assert discounted.total < plain.total
    with pytest.raises(ValueError, match="prefetch_discount"):
        Auto(prefetch_discount=1.0)
    with pytest.raises(ValueError, match="margin"):
        Auto(margin=-0.1)


def test_initial_residents_stay_on_the_device():
    placement = Auto().place(state(copy_s=10 * MS, initial=((5, 6, 7), (3,))))
    assert placement.device_experts(0) == [6, 7]
    assert placement.device_experts(1) == [3, 7]  # one resident for two slots: the other slot holds a device expert free


def test_a_short_prompt_keeps_the_host_and_a_long_one_copies():
    decode = Auto().place(state(copy_s=10 * MS, host_s=1 * MS))
    auto = Auto()
    assert auto.place_prefill(state(copy_s=10 * MS, host_s=1 * MS), decode, rows=4) == decode
    long = auto.place_prefill(state(copy_s=10 * MS, host_s=1 * MS), decode, rows=2048)
    assert long.total == 0  # 2048 rows: ~32 blocks per host expert against one copy each
    rows = [auto.place_prefill(state(copy_s=10 * MS, host_s=1 * MS), decode, rows=r).total for r in range(1, 600, 7)]
    assert rows == sorted(rows, reverse=True)  # one threshold: host below it, device above


def test_prefill_placement_defaults_to_decode_and_is_checked():
    decode = Placement.of([[3], [4, 5]], 2, 8)

    class NoPrompt:
        name = "no-prompt"

        def place(self, state):
            return decode

    class Outside(NoPrompt):
        name = "outside"

        def place_prefill(self, state, decode, rows):
            return Placement.of([[3, 6], []], 2, 8)

    assert prefill_placement(NoPrompt(), state(), decode, 100) is decode
    assert plugins.guarded(NoPrompt(), "placement").place_prefill(state(), decode, 100) is decode
    with pytest.raises(PluginError, match="'outside'.*outside the decode placement's.*0: \\[6\\]"):
        plugins.guarded(Outside(), "placement").place_prefill(state(), decode, 100)


@st.composite
def states(draw):
    experts = draw(st.integers(2, 10))
    layers = draw(st.integers(1, 3))
    slots = draw(st.integers(1, experts))
    top_k = draw(st.integers(1, min(experts, 4)))
    initial = tuple(tuple(draw(st.permutations(range(experts)))[: draw(st.integers(0, slots + 1))]) for _ in range(layers))
    counts = draw(st.none() | st.lists(st.lists(st.integers(0, 50), min_size=experts, max_size=experts),
                                       min_size=layers, max_size=layers))
    seconds = st.none() | st.floats(1e-5, 1e-1)
    return state(copy_s=draw(seconds), host_s=draw(seconds), layers=layers, experts=experts, slots=slots, top_k=top_k,
                 counts=counts, initial=initial)


@settings(max_examples=300, deadline=None)
@given(placed=states(), discount=st.sampled_from([0.0, 0.3]), margin=st.sampled_from([0.0, 0.05]),
       rows=st.integers(1, 4096))
def test_auto_never_hosts_a_resident_and_is_deterministic(placed, discount, margin, rows):
    policy = Auto(prefetch_discount=discount, margin=margin)
    placement = policy.place(placed)
    assert placement == Auto(prefetch_discount=discount, margin=margin).place(placed) == policy.place(placed)
    slots = min(placed.slots_per_layer, placed.num_experts)
    for layer in range(placed.num_layers):
        kept = placed.initial_residents[layer][-slots:]
        assert not placement.host_experts(layer) & set(kept)  # a preloaded resident never moves to the host
        assert len(placement.device_experts(layer)) >= slots
    off, auto = token_seconds(placed, Placement.device_only(placed.num_layers, placed.num_experts), discount), \
        token_seconds(placed, placement, discount)
    if off is not None and auto is not None:
        assert auto <= off + 1e-12  # never predicted slower than off
    prompt = policy.place_prefill(placed, placement, rows)
    assert prompt == policy.place_prefill(placed, placement, rows)
    assert all(prompt.host[layer] in (placement.host[layer], frozenset()) for layer in range(placed.num_layers))


@pytest.fixture
def quiet_logs_after():
    """specter.cli.main binds the logs to the stderr of the moment (capsys's, closed after the test): rebind them once
    capsys has given stderr back (this fixture is set up before capsys, so torn down after it)."""
    yield
    from specter import log

    log.configure()


def test_info_prints_the_costs_and_what_auto_would_do(quiet_logs_after, tiny, capsys):
    from specter.cli import checkpoint_summary, main

    summary = checkpoint_summary(str(tiny), residents=2, cpu_experts="auto", link="1", cpu_threads=1)
    assert summary["copy_ms_per_expert"] == pytest.approx(summary["expert_bytes"] / 1e9 * 1e3, rel=1e-3)
    assert summary["link_source"] == "emulated" and summary["host_ms_per_expert"] > 0 and summary["host_threads"] == 1
    assert summary["host_experts"] == summary["auto_host_experts"] == sum(summary["auto_host_experts_per_layer"])
    predicted = summary["predicted_ms_per_token"]
    assert set(predicted) == {"off", "all", "auto"} and predicted["auto"] <= predicted["off"]
    unmeasured = checkpoint_summary(str(tiny), residents=2, link="1", measure=False)
    assert unmeasured["host_ms_per_expert"] is None and unmeasured["auto_host_experts"] == 0
    assert unmeasured["predicted_ms_per_token"]["off"] > 0 and unmeasured["predicted_ms_per_token"]["all"] is None
    assert main(["info", str(tiny), "--residents", "2", "--link", "1", "--cpu-threads", "1", "--cpu-experts", "auto"]) == 0
    out = capsys.readouterr().out
    assert "expert costs    copy" in out and "auto would" in out and "predicted expert ms per token: off" in out
