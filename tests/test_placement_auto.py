"""The `auto` placement policy (policies/placement.py) and the cost model it weighs (specter/placement.py): a pure
function of the PlacementState, checked on hand-computed cases and by a hypothesis property."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.placement import All, Auto
from specter import plugins
from specter.errors import PluginError
from specter.placement import (
    Placement,
    PlacementState,
    decision_record,
    expected_misses,
    hit_probabilities,
    overlapped,
    prefill_placement,
    token_seconds,
    use_rates,
)

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


def test_uniform_routing_with_equal_costs_splits_the_non_residents_only_where_the_paths_overlap():
    # 8 experts at 0.25 uses per token each; 2 stay. h host experts: misses (6 - h) x 0.25 copies and h x 0.25 host
    # blocks. Full overlap (the longer of the two, the first version's model): least at h = 3 (0.75 ms against off's
    # 1.5 ms). The sum (the default): 1.5 ms whatever h, so nothing is gained and nothing moves.
    overlapping = Auto(overlap=1.0).place(state())
    assert overlapping.counts() == [3, 3]
    assert all(overlapping.host_experts(layer) == {2, 3, 4} for layer in range(2))  # equal rates: lower ids first
    assert token_seconds(state(), overlapping, overlap=1.0) == pytest.approx(2 * 0.75 * MS)
    assert token_seconds(state(), overlapping) == pytest.approx(2 * 1.5 * MS)
    assert token_seconds(state(), Placement.device_only(2, 8)) == pytest.approx(2 * 1.5 * MS)
    assert Auto().place(state()).total == 0
    # Half hidden: 0.75 + 0.5 x 0.75 = 1.125 ms at h = 3, the best; h = 0 and h = 6 still cost 1.5 ms.
    assert Auto(overlap=0.5).place(state()).counts() == [3, 3]
    assert token_seconds(state(), overlapping, overlap=0.5) == pytest.approx(2 * 1.125 * MS)


def test_overlapped_runs_from_the_sum_to_the_longer():
    assert overlapped(3.0, 1.0, 0.0) == 4.0 and overlapped(3.0, 1.0, 1.0) == 3.0 and overlapped(1.0, 3.0, 0.25) == 3.75
    with pytest.raises(ValueError, match="overlap"):
        Auto(overlap=1.5)


def test_the_first_hybrid_run_on_the_h200_is_predicted_and_auto_picks_all():
    """The H200's first hybrid run (`git show 53cdb1d:docs/BENCHMARKS.md`, "Hybrid systems"): Mixtral-8x7B shape, 4 MoE layers, 2 of 8 experts resident,
    Gen4 (25 GB/s: 14.1 ms per 352 MB expert), host 7.77 ms per expert block of 16 rows. Measured per layer and
    token: cpu-experts (`all`, 6 host experts per layer) 48.6 / 4 = 12.1 ms, the first `auto` (4 host experts per
    layer) 57.8 / 4 = 14.5 ms, ondemand 81.2 / 4 = 20.3 ms. The model must pick `all` and predict each within 10 %;
    the first version's model (full overlap) picked 4 per layer, the slower one."""
    expert_bytes = 3 * 4096 * 14336 * 2  # 352.3 MB
    measured = PlacementState(num_layers=4, num_experts=8, top_k=2, slots_per_layer=2,
                              initial_residents=tuple((0, 1) for _ in range(4)), expert_bytes=expert_bytes, row_bucket=16,
                              host_threads=16, link_bytes_per_s=25e9, host_expert_s={16: 7.77 * MS})
    placement = Auto().place(measured)
    assert placement.counts() == [6, 6, 6, 6]  # `all`
    four = Placement.of([[2, 3, 4, 5]] * 4, 4, 8)  # the first auto's split: 2 device-path non-residents per layer
    per_layer = lambda p: token_seconds(measured, p) / 4 / MS  # noqa: E731
    assert per_layer(placement) == pytest.approx(48.6 / 4, rel=0.1)
    assert per_layer(four) == pytest.approx(57.8 / 4, rel=0.1)
    assert per_layer(Placement.device_only(4, 8)) == pytest.approx(81.2 / 4, rel=0.1)
    assert Auto(overlap=1.0).place(measured).counts() == [4, 4, 4, 4]  # what the first version did


QWEN_EXPERT_BYTES = 3 * 2048 * 1408 * 2  # Qwen1.5-MoE-A2.7B's routed expert in bf16: 17.3 MB


def qwen_cell(host_s: float, link_bytes_per_s: float = 25e9, initial: int = 32) -> PlacementState:
    """The H200's full-depth Qwen1.5-MoE-A2.7B cell of 2026-12-02 (benchmarks/results/h200-2026-12-02/
    fulldepth-qwen-gen4 as of commit bb10da2; a later checkpoint's run replaced it): 24 MoE layers of 60 experts,
    top-4, a 24 GiB budget that leaves `specter-hybrid` 40 slots per layer (the bench's "slots"), 15 host threads,
    Gen4 (25 GB/s: 0.692 ms per expert). The cell started from the warm-up's cache, about 32 experts per layer
    (`cpu-experts` placed 683 of 1440 on the host, the free slots left empty; they are filled since)."""
    return PlacementState(num_layers=24, num_experts=60, top_k=4, slots_per_layer=40,
                          initial_residents=tuple(tuple(range(initial)) for _ in range(24)),
                          expert_bytes=QWEN_EXPERT_BYTES, row_bucket=16, host_threads=15,
                          link_bytes_per_s=link_bytes_per_s, host_expert_s={16: host_s})


@pytest.mark.parametrize("host_ms", [0.717, 0.78, 0.825])
def test_the_full_depth_qwen_cell_at_gen4_stays_on_the_device(host_ms):
    """Measured there: `specter` 8.97 / 14.8 ms per token (greedy / sampled), `specter-hybrid` with `auto`'s 480 host
    experts (20 per layer, every non-resident) 18.9 / 22.2 ms; one host expert took 0.717-0.825 ms on the host thread
    across the placed cells. With those costs the model keeps every layer on the device: 20 host experts cost
    20 x 4/60 x host per layer and token against the same uses missing at 0.692 ms each, and the host is the slower."""
    measured = qwen_cell(host_ms * MS)
    placement = Auto().place(measured)
    off = Placement.device_only(24, 60)
    assert placement.total == 0
    assert token_seconds(measured, placement) == token_seconds(measured, off)
    assert token_seconds(measured, All().place(measured)) > token_seconds(measured, off)


def test_the_full_depth_qwen_cell_at_the_native_link_stays_on_the_device():
    """fulldepth-qwen-native (as of bb10da2): the same shape over the H200's own link (55 GB/s pinned, 0.315 ms per
    expert) placed nothing, as it should."""
    assert Auto().place(qwen_cell(0.78 * MS, link_bytes_per_s=55e9)).total == 0


def test_the_qwen_cell_calibrated_as_decoding_reads_experts_places_nothing():
    """The Qwen cell end to end on the CPU: a pool of its geometry (tiny experts), an expert function that costs the
    run's 0.78 ms on a first read and nothing on a read again (the weights then in the last-level cache), the
    calibration, then `auto`. The first calibration timed one expert after a warm-up on it, read ~0 here, and the model
    put every non-resident on the host (480, as on the H200: any host under 0.657 ms does)."""
    import asyncio
    import time

    import torch

    from specter.experts import costs
    from specter.experts.pool import ExpertPool
    from specter.kernel import Kernel

    class Memory:
        def alloc_host(self, numel, dtype):
            return torch.empty(numel, dtype=dtype)

    pool = ExpertPool(Memory(), 24, 60, 3 * 8 * 4, torch.float32)
    for layer in range(24):
        for expert in range(60):
            pool.write(layer, expert, torch.randn(3 * 8 * 4))
    reference, read = costs.reference_expert(8, 4), set()

    def mlp(rows, packed):
        if packed.data_ptr() not in read:
            read.add(packed.data_ptr())
            time.sleep(0.78 * MS)
        return reference(rows, packed)

    cell = dataclasses.replace(qwen_cell(0.0), host_threads=1, host_expert_s={})

    async def go():
        with Kernel() as kernel:
            return await costs.calibrate(kernel, pool, [costs.HostKernel("torch", mlp)], cell, 8, torch.device("cpu"))

    calibrated = asyncio.run(go()).apply(cell)
    assert Auto().place(calibrated).total == 0
    assert calibrated.host_expert_s[16] + calibrated.host_job_s >= 0.78 * MS  # a job of one: at least one first read
    assert Auto().place(dataclasses.replace(calibrated, host_expert_s={16: 0.65 * MS}, host_job_s=None)).total == 480


def test_the_decision_record_carries_the_calibration_and_the_predictions():
    """What the bench writes per placed cell (results.json's `placement`) and the load logs: the Qwen cell's inputs as
    the model reads them and its expected expert seconds per token of off and of the placement."""
    measured = qwen_cell(0.78 * MS)
    record = decision_record(measured, Auto().place(measured))
    assert record["copy_s_per_expert"] == pytest.approx(0.692 * MS, rel=1e-3)
    assert record["host_s_per_expert_by_rows"] == {"16": 0.78 * MS} and record["row_bucket"] == 16
    assert record["routing"] == "uniform" and record["host_threads"] == 15 and record["slots_per_layer"] == 40
    off = 24 * 20 * (4 / 60) * QWEN_EXPERT_BYTES / 25e9  # per layer, 20 of 60 experts' uses miss at 4/60 a token each
    assert record["predicted_s_per_token"] == pytest.approx({"off": off, "placed": off}) and record["host_experts"] == 0
    every = decision_record(measured, All().place(measured), overlap=0.5)
    assert every["host_experts"] == 24 * 20 and every["overlap"] == 0.5  # 32 residents and 8 free slots filled: 20 left
    assert every["predicted_s_per_token"]["placed"] == pytest.approx(24 * 20 * (4 / 60) * 0.78 * MS)
    assert json.loads(json.dumps(record)) == record


@pytest.mark.parametrize("host_ms", [6.2, 7.69, 7.95])
def test_the_mixtral_cell_at_gen4_puts_every_non_resident_on_the_host(host_ms):
    """benchmarks/results/h200-2026-12-02/hybrid-overlap1 (H200, 2026-12-02): Mixtral-8x7B shape, 4 MoE layers of
    random weights, 2 of 8 resident, Gen4 (14.1 ms per 352 MB expert), one host expert 6.2-7.95 ms on the host thread.
    Measured per token: ondemand 81 ms, specter 88.6, `cpu-experts` (all 6 non-residents of a layer on the host) 57.5,
    the half split 57.9-58.3; the earlier run of `auto`'s default placed all 24 and ran `specter-hybrid` at 54.5."""
    expert_bytes = 3 * 4096 * 14336 * 2
    measured = PlacementState(num_layers=4, num_experts=8, top_k=2, slots_per_layer=2,
                              initial_residents=tuple((0, 1) for _ in range(4)), expert_bytes=expert_bytes, row_bucket=16,
                              host_threads=15, link_bytes_per_s=25e9, host_expert_s={16: host_ms * MS})
    assert Auto().place(measured).counts() == [6, 6, 6, 6]


def lru_misses_per_token(weights, top_k: int, device: set[int], slots: int, tokens: int, seed: int = 0) -> tuple[float, list[float]]:
    """A simulated LRU cache of `slots` slots serving the device-path experts of a layer whose tokens each route to
    top_k distinct experts drawn by `weights`: (misses per token, measured use rate per expert)."""
    rng = random.Random(seed)
    cache: list[int] = []
    misses, counts = 0, [0] * len(weights)
    for _ in range(tokens):
        picks: set[int] = set()
        while len(picks) < top_k:
            picks.add(rng.choices(range(len(weights)), weights)[0])
        for expert in sorted(picks):
            counts[expert] += 1
            if expert not in device:
                continue
            if expert in cache:
                cache.remove(expert)
            else:
                misses += 1
                if len(cache) >= slots:
                    cache.pop(0)
            cache.append(expert)
    return misses / tokens, [c / tokens for c in counts]


def test_device_path_experts_beyond_the_slots_churn_them():
    # Uniform: each use misses with probability 1 - S/D, which equals "all but the S most used" (the first version).
    rates = [0.25] * 8
    assert hit_probabilities(rates[:4], 2) == [0.5] * 4
    assert expected_misses(rates, [0, 1, 2, 3], 2) == pytest.approx(4 * 0.25 * (1 - 2 / 4))
    assert expected_misses(rates, [0, 1], 2) == 0.0  # they fit: preloaded, never missed
    # Skewed: the much-used hit more, the rarely used less, and the layer misses more than the first version's floor;
    # a simulated LRU agrees with the estimate far better than with the floor.
    weights, device = [8, 4, 2, 1, 1, 1, 1, 1], [0, 1, 2, 3, 4]
    simulated, measured_rates = lru_misses_per_token(weights, 2, set(device), 2, tokens=20000)
    hits = hit_probabilities([measured_rates[e] for e in device], 2)
    assert hits == sorted(hits, reverse=True) and sum(hits) == pytest.approx(2)
    estimate = expected_misses(measured_rates, device, 2)
    floor = sum(sorted((measured_rates[e] for e in device), reverse=True)[2:])
    assert floor < estimate <= simulated and simulated - estimate < 0.5 * (simulated - floor)
    assert estimate == pytest.approx(simulated, rel=0.15)


def test_a_speculative_verify_scales_both_paths_alike_under_independent_uniform_use():
    """Why `auto` counts one row per forward for a speculative engine too: with rounds of R rows an LRU cache of S of E
    experts copies (E - S) q per round (q = 1 - (1 - r)^R, each expert once per round it is used), and the E - S
    experts of `all` on the host are computed (E - S) q times per round (one block each): the same count, so one copy
    against one host block decides as at k = 0. Simulated at the Qwen cell's shape (60 experts, top-4, 40 slots) with
    the verify's order: a round's residents are computed first (hot first), so its misses evict only experts it does
    not use, least recently used first."""
    rng = random.Random(1)
    experts, top_k, slots, rows, rounds = 60, 4, 40, 16, 3000
    cache: list[int] = list(range(slots))  # least recently used first
    misses = host = 0
    for _ in range(rounds):
        used = set()
        for _ in range(rows):
            used |= set(rng.sample(range(experts), top_k))
        host += len(used - set(range(slots)))  # `all`: the 20 non-residents on the host, once per round each
        misses += len(used - set(cache))
        cache = ([e for e in cache if e not in used] + sorted(used))[-slots:]
    q = 1 - (1 - top_k / experts) ** rows
    assert misses / rounds == pytest.approx((experts - slots) * q, rel=0.03)
    assert host / rounds == pytest.approx((experts - slots) * q, rel=0.03)


def test_skewed_routing_puts_the_least_used_on_the_host_and_keeps_the_most_used():
    counts = [[100, 80, 60, 40, 20, 10, 5, 1], [1, 5, 10, 20, 40, 60, 80, 100]]
    placement = Auto(overlap=1.0).place(state(counts=counts))
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
    # The sum, uniform use: h host experts cost (6 - h) x 0.25 copies + h x 0.25 host blocks, linear in h, so the best
    # is all six or none; all six save 1 - host / copy. Host 0.96 ms: 4 % saved, below the 5 % margin; 0.94 ms: 6 %.
    assert Auto().place(state(host_s=0.96 * MS)).total == 0
    assert Auto(margin=0.0).place(state(host_s=0.96 * MS)).counts() == [6, 6]
    assert Auto().place(state(host_s=0.94 * MS)).counts() == [6, 6]
    # Full overlap (the first version's): host 5.9 ms, one host expert saves 1.7 % of 1.5 ms; 5.5 ms saves 8.3 %.
    assert Auto(overlap=1.0).place(state(host_s=5.9 * MS)).total == 0
    assert Auto(margin=0.0, overlap=1.0).place(state(host_s=5.9 * MS)).counts() == [1, 1]
    assert Auto(overlap=1.0).place(state(host_s=5.5 * MS)).counts() == [1, 1]


def test_the_prefetch_discount_moves_experts_back_to_the_device():
    plain, discounted = Auto().place(state(copy_s=1.5 * MS)), Auto(prefetch_discount=0.5).place(state(copy_s=1.5 * MS))
    assert discounted.total < plain.total
    with pytest.raises(ValueError, match="prefetch_discount"):
        Auto(prefetch_discount=1.0)
    with pytest.raises(ValueError, match="margin"):
        Auto(margin=-0.1)


def test_initial_residents_stay_on_the_device():
    placement = Auto().place(state(copy_s=10 * MS, initial=((5, 6, 7), (3,))))
    assert placement.device_experts(0) == [6, 7]
    assert placement.device_experts(1) == [0, 3]  # one resident for two slots: the free one kept for the lowest other id


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
       overlap=st.sampled_from([0.0, 0.5, 1.0]), rows=st.integers(1, 4096))
def test_auto_never_hosts_a_resident_and_is_deterministic(placed, discount, margin, overlap, rows):
    policy = Auto(prefetch_discount=discount, margin=margin, overlap=overlap)
    placement = policy.place(placed)
    assert placement == Auto(prefetch_discount=discount, margin=margin, overlap=overlap).place(placed) == policy.place(placed)
    slots = min(placed.slots_per_layer, placed.num_experts)
    for layer in range(placed.num_layers):
        kept = placed.initial_residents[layer][-slots:]
        assert not placement.host_experts(layer) & set(kept)  # a preloaded resident never moves to the host
        assert len(placement.device_experts(layer)) >= slots
    off, auto = token_seconds(placed, Placement.device_only(placed.num_layers, placed.num_experts), discount, overlap), \
        token_seconds(placed, placement, discount, overlap)
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
    # info's engine speculates (the default k) and has no trace: it says why auto keeps every expert on the device
    assert summary["speculates"] and not summary["auto_prices_misses"] and summary["auto_host_experts"] == 0
    assert "no routing trace to price its misses" in out


def test_a_speculating_engine_without_a_trace_keeps_every_expert_on_the_device():
    """The H200's full-depth Qwen1.5-MoE cell at Gen4 and 16 GiB (benchmarks/results/h200-2026-12-02/fulldepth-qwen/
    gen4-16): 19 slots per layer, 0.586 ms per host expert as calibrated. Without a trace the model prices `off` at
    45.4 ms of misses per token and `all` at 38.4, so a k = 0 engine still hosts every non-resident; `specter-hybrid`
    placed so ran at 25.5 ms against `specter`'s 14.1, its misses mostly prefetched by the draft. A speculating engine
    now places nothing without a trace, unless the deployment gives a measured prefetch discount."""
    cell = dataclasses.replace(qwen_cell(0.586 * MS, initial=19), slots_per_layer=19)
    assert Auto().place(cell).counts() == [41] * 24  # k = 0 (`ondemand-hybrid`): what the uniform model says
    speculating = dataclasses.replace(cell, speculates=True)
    assert not Auto().prices_misses(speculating) and Auto().place(speculating).total == 0
    record = decision_record(speculating, Auto().place(speculating))
    assert record["speculates"] and record["routing"] == "uniform" and record["host_experts"] == 0
    assert record["predicted_s_per_token"]["off"] == pytest.approx(45.4e-3, rel=0.01)
    assert Auto(prefetch_discount=0.1).prices_misses(speculating)
    assert Auto(prefetch_discount=0.1).place(speculating).total > 0  # a measured discount is the model's input again
    assert Auto(prefetch_discount=0.9).place(speculating).total == 0  # and one that hides most copies keeps the device
