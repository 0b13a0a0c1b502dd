"""The running estimates the lookahead policy reads: acceptance, verify fit, and the byte model of a depth-k round."""

from __future__ import annotations

import asyncio
import dataclasses
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from specter.config import DraftConfig, EngineConfig, GenerationConfig, TransferTuning, TuningConfig
from specter.engine import Runtime
from specter.metrics import Estimates, RequestStats


def test_without_a_measured_union_every_row_costs_the_same():
    estimates = Estimates(k_max=8)
    estimates.observe_verify(rows=1, compute_s=0.001, new_bytes=100)
    estimates.observe_verify(rows=5, compute_s=0.002, new_bytes=500)
    assert estimates.beta == 1.0
    assert estimates.predicted_new_bytes(4) == pytest.approx([100, 200, 300, 400, 500])


def test_shared_experts_between_rows_make_deeper_rounds_cheaper_than_linear():
    """Rows that share experts: 4 rows need 2x the first row's experts -> beta = 0.5; bytes follow (k+1)**0.5."""
    estimates = Estimates(k_max=8)
    estimates.observe_union(rows=4, first_row_experts=12, union_experts=24)
    assert estimates.beta == pytest.approx(0.5)
    estimates.observe_verify(rows=4, compute_s=0.002, new_bytes=800)  # unit = 800 / 4**0.5 = 400
    predicted = estimates.predicted_new_bytes(8)
    assert predicted[3] == pytest.approx(800)
    assert predicted[8] == pytest.approx(400 * 3.0)
    assert predicted[8] < 800 / 4 * 9  # the per-row model's prediction


def test_union_exponent_is_clamped_and_ignores_degenerate_verifies():
    estimates = Estimates(k_max=4)
    estimates.observe_union(rows=1, first_row_experts=4, union_experts=4)
    estimates.observe_union(rows=3, first_row_experts=0, union_experts=5)
    assert estimates.union_exponent is None
    estimates.observe_union(rows=2, first_row_experts=4, union_experts=4)
    assert estimates.beta == 0.0
    fresh = Estimates(k_max=4)
    fresh.observe_union(rows=2, first_row_experts=4, union_experts=16)  # impossible for 2 rows of top-4: clamped
    assert fresh.beta == 1.0


@given(st.integers(2, 17), st.integers(1, 64), st.integers(0, 64))
def test_union_exponent_stays_in_range(rows, first, extra):
    estimates = Estimates(k_max=16)
    estimates.observe_union(rows, first, first + extra)
    assert 0.0 <= estimates.beta <= 1.0
    expected = min(1.0, math.log((first + extra) / first) / math.log(rows))
    assert estimates.beta == pytest.approx(expected)


def test_an_offloaded_speculative_run_measures_the_union_exponent(tiny):
    """The engine feeds every speculative verify's first-row and union expert counts to the estimates."""

    async def go():
        runtime = await Runtime.load(tiny, EngineConfig(device="cpu", residents=3, draft=DraftConfig(k=4), lookahead="fixed"))
        try:
            await runtime.complete_ids([3, 1, 4, 1, 5], GenerationConfig(max_new_tokens=20))
            return runtime.estimates
        finally:
            await runtime.aclose()

    estimates = asyncio.run(go())
    assert estimates.union_exponent is not None and 0.0 <= estimates.union_exponent <= 1.0
    assert estimates.new_bytes_unit is not None and estimates.new_bytes_unit > 0


def slow_link_stats(model, tuning: TuningConfig | None = None) -> RequestStats:
    """One speculative request over a 0.25 GB/s emulated link with 2 slots per layer: its verifies stall on copies."""

    async def go():
        config = EngineConfig(device="cpu", residents=2, link="0.25", draft=DraftConfig(k=2), lookahead="fixed",
                              tuning=tuning or TuningConfig())
        runtime = await Runtime.load(model, config)
        try:
            return (await runtime.complete_ids([3, 1, 4, 1, 5], GenerationConfig(max_new_tokens=12))).stats
        finally:
            await runtime.aclose()

    return asyncio.run(go())


def test_an_offloaded_run_on_the_cpu_measures_the_copy_busy_fraction(tiny):
    """On a slow emulated link the verify waits for copies; the copy stream was busy for part of that time."""
    stats = slow_link_stats(tiny)
    assert stats.stall_s > 0 and stats.copy_window_s > 0
    assert 0.0 < stats.copy_busy_fraction <= 1.0 + 1e-6
    assert stats.as_dict()["copy_busy_fraction"] == round(stats.copy_busy_fraction, 4)


def test_only_positions_some_round_reached_count_as_measured():
    """Rounds of depth 2 measure positions 0 and 1; position 2 onwards stays unmeasured, not the initial EMA."""
    estimates = Estimates(k_max=8)
    assert estimates.measured_acceptance(8) == []
    for _ in range(20):
        estimates.observe_acceptance(k=2, accepted=2)
    assert estimates.measured_acceptance(8) == pytest.approx([1.0, 1.0], abs=0.01)  # from the prior 0.7: 0.3 * 0.8 ** 20 left
    estimates.observe_acceptance(k=4, accepted=0)  # position 0 rejected: nothing after it is reached
    assert len(estimates.measured_acceptance(8)) == 2
    estimates.observe_acceptance(k=4, accepted=4)
    assert len(estimates.measured_acceptance(8)) == 4
    assert len(estimates.measured_acceptance(3)) == 3


def test_a_governor_that_measured_shallow_rounds_tries_deeper_ones():
    """Measured: positions 0-1 accepted 95 % of the time, transfers dominate and rows share experts (beta 0.63).
    With the unreached positions read as the initial 0.7 the governor stayed at k = 2 (H200 reference model);
    extrapolating the measured ones it drafts deeper, where each round's bytes serve more tokens."""
    from policies.lookahead import Roofline
    from specter.policy import LookaheadState

    estimates = Estimates(k_max=8)
    for index in range(40):
        estimates.observe_acceptance(k=2, accepted=1 if index == 37 else 2)
        estimates.observe_union(rows=3, first_row_experts=10, union_experts=20)  # beta ~ 0.63
        estimates.observe_verify(rows=3, compute_s=0.003, new_bytes=1_000_000_000)
        estimates.observe_draft(2, 0.001)

    def state(acceptance: list[float]) -> LookaheadState:
        return LookaheadState(acceptance_by_position=acceptance, draft_step_s_fit=(0.0, estimates.draft_step_s),
                              verify_s_fit=estimates.verify_fit(), bandwidth_bytes_per_s=55e9,
                              predicted_new_bytes=estimates.predicted_new_bytes(8), k_max=8, model_key="m")

    assert Roofline().next_k(state(list(estimates.acceptance))) <= 3  # the old reading: stuck near the measured depth
    assert Roofline().next_k(state(estimates.measured_acceptance(8))) >= 6


def test_one_rejection_where_a_position_is_first_reached_does_not_cap_the_depth():
    """A deep first round rejected at position 7, then rounds at k = 7 that accept everything (they never reach
    position 7 again). With the first observation replacing the estimate, position 7 read 0 and so did every
    position past it (flat extrapolation): the governor stayed at 7 until a probe, though a verify of 16 rows cost
    little more than one of 8. Weighed against its predecessor's estimate, position 7 reads 0.75 and the governor
    drafts deeper, where that position is measured again."""
    from policies.lookahead import Roofline
    from specter.policy import LookaheadState

    estimates = Estimates(k_max=15)
    estimates.observe_acceptance(k=15, accepted=7)
    first = [0.7 * 0.8 + 0.2]  # position 0 from the prior, each later one from its predecessor
    for _ in range(6):
        first.append(first[-1] * 0.8 + 0.2)
    first.append(first[-1] * 0.8)  # position 7: rejected
    assert estimates.measured_acceptance(15) == pytest.approx(first)
    for _ in range(10):
        estimates.observe_acceptance(k=7, accepted=7)
        estimates.observe_verify(rows=8, compute_s=0.70, new_bytes=0)
        estimates.observe_draft(7, 0.035)
    estimates.observe_verify(rows=16, compute_s=0.86, new_bytes=0)  # host-bound verifies: mostly a fixed cost
    acceptance = estimates.measured_acceptance(15)
    assert acceptance[7] == pytest.approx(first[7]) and acceptance[7] > 0.7
    state = LookaheadState(acceptance_by_position=acceptance, draft_step_s_fit=estimates.draft_fit(),
                           verify_s_fit=estimates.verify_fit(), bandwidth_bytes_per_s=20e9,
                           predicted_new_bytes=estimates.predicted_new_bytes(15), k_max=15, model_key="m")
    assert Roofline().next_k(state) > 7
    assert Roofline().next_k(dataclasses.replace(state, acceptance_by_position=acceptance[:7] + [0.0])) == 7


def test_a_position_first_reached_is_weighed_against_its_predecessor_both_ways():
    """The first observation moves a position from its predecessor's estimate by alpha, up as well as down;
    position 0 from the prior (0.7)."""
    estimates = Estimates(k_max=4, alpha=0.2)
    estimates.observe_acceptance(k=1, accepted=0)
    assert estimates.measured_acceptance(4) == pytest.approx([0.56])
    for _ in range(30):
        estimates.observe_acceptance(k=2, accepted=1)  # position 0 accepted, position 1 rejected
    low = estimates.measured_acceptance(4)
    assert low[0] == pytest.approx(1.0, abs=1e-2) and low[1] == pytest.approx(0.0, abs=1e-2)
    estimates.observe_acceptance(k=3, accepted=3)  # position 1 accepted once more, position 2 reached first
    position1 = 0.8 * low[1] + 0.2
    assert estimates.measured_acceptance(4) == pytest.approx([low[0] * 0.8 + 0.2, position1, 0.8 * position1 + 0.2])


def test_the_deferred_copy_busy_reads_are_done_when_a_request_ends_even_one_left_early(tiny):
    """The copy-busy reads wait for the kernel's idle time (Kernel.defer); whatever is left is read when the
    request ends, so its stats are whole when read, whether the consumer ran to the end or stopped early."""

    async def go():
        config = EngineConfig(device="cpu", residents=2, link="0.25", draft=DraftConfig(k=2), lookahead="fixed")
        runtime = await Runtime.load(tiny, config)
        try:
            full = (await runtime.complete_ids([3, 1, 4, 1, 5], GenerationConfig(max_new_tokens=12))).stats
            left = runtime.kernel.deferred
            early = RequestStats()
            stream = runtime.generate_ids([2, 7, 1, 8], GenerationConfig(max_new_tokens=12), stats=early)
            chunks = 0
            async for _tokens in stream:
                chunks += 1
                if chunks == 3:
                    break
            await stream.aclose()
            return full, left, early, runtime.kernel.deferred
        finally:
            await runtime.aclose()

    full, left, early, left_early = asyncio.run(go())
    assert left == 0 and left_early == 0
    assert full.copy_window_s > 0 and 0.0 < full.copy_busy_fraction <= 1.0 + 1e-6
    assert early.rounds >= 2 and early.copy_window_s > 0


# ---- the copy stream's idle time by cause (TransferTuning.issue_marks, bench --copy-gaps) ---------------------------
def _chunk(start, end, issued, layer, urgent=True, queued=None, room=None):
    from specter.experts.transfer import ChunkTimes

    return ChunkTimes(start, end, issued, layer, urgent, queued, room)


def test_pump_gaps_say_how_late_each_late_prefetch_was_and_how_long_after_its_room():
    from specter.metrics import pump_gaps

    chunks = [
        _chunk(0.0, 1.0, 0.0, 0),
        _chunk(1.5, 2.0, 1.3, 0, urgent=False, queued=2.0, room=0.4),  # late by 0.3, 0.9 after its room
        _chunk(2.0, 3.0, 1.9, 0, urgent=False, queued=1.0),  # back to back: no gap
        _chunk(3.5, 4.0, 3.1, 1),  # an urgent chunk: not the pump's
        _chunk(4.2, 5.0, 4.2, 1, urgent=False, queued=0.5),  # late by 0.2, no wait for room
        _chunk(5.3, 6.0, 5.0, 1, urgent=False, room=4.9),  # issued before the stream ran dry: a slot wait, not late
    ]
    gaps = pump_gaps(chunks, 6.0)
    assert [late for late, _ in gaps] == pytest.approx([0.3, 0.2]) and gaps[0][1] == pytest.approx(0.9) and gaps[1][1] is None
    assert pump_gaps([_chunk(0.5, 1.0, 0.5, 0, urgent=False)], 1.0) == []  # before any chunk ran: the head


def test_idle_causes_name_each_gap_by_what_held_the_next_chunk():
    from specter.metrics import idle_causes

    chunks = [
        _chunk(0.2, 1.0, 0.1, 0),  # head: 0.1 not issued, 0.1 waiting on its slot
        _chunk(1.5, 2.0, 1.0, 0),  # same layer, issued at once: 0.5 slot wait
        _chunk(2.4, 3.0, 2.3, 1),  # another layer: 0.3 hand-over, 0.1 slot
        _chunk(3.2, 4.0, 3.2, 1),  # same layer, issued late: 0.2 issue
        _chunk(4.5, 5.0, 4.4, 2, urgent=False),  # a prefetch chunk (another layer even): 0.4 pump, 0.1 slot
        _chunk(5.6, 6.0, 5.5, 2, urgent=False, queued=0.2),  # queued 0.2 of its 0.5 late: 0.2 pump, 0.3 plan, 0.1 slot
    ]
    causes = idle_causes(chunks, span=6.0)
    assert causes == pytest.approx({"head": 0.1, "handover": 0.3, "issue": 0.2, "pump": 0.6, "plan": 0.3, "slot": 0.9})
    assert idle_causes([_chunk(0.2, 1.0, None, 0)], span=1.0) is None  # no issue marks: no split


def test_a_chunk_running_into_the_window_is_no_head_gap_but_one_that_ended_before_it_is():
    from specter.metrics import idle_causes

    assert idle_causes([_chunk(-0.5, 0.3, -0.6, 0), _chunk(0.5, 1.0, 0.5, 0)], 1.0) == pytest.approx(
        {"head": 0.0, "handover": 0.0, "issue": 0.2, "pump": 0.0, "plan": 0.0, "slot": 0.0})
    assert idle_causes([_chunk(-0.5, -0.1, -0.6, 0), _chunk(0.5, 1.0, 0.4, 0)], 1.0) == pytest.approx(
        {"head": 0.4, "handover": 0.0, "issue": 0.0, "pump": 0.0, "plan": 0.0, "slot": 0.1})


def test_chunks_without_a_mark_only_void_the_split_where_they_end_a_gap():
    from specter.metrics import idle_causes

    in_flight = _chunk(-0.5, 0.2, None, 0)  # issued before the marks (or the log) began: it ends no gap
    assert idle_causes([in_flight, _chunk(0.5, 1.0, 0.3, 1)], 1.0) == pytest.approx(
        {"head": 0.0, "handover": 0.1, "issue": 0.0, "pump": 0.0, "plan": 0.0, "slot": 0.2})
    assert idle_causes([], 1.0) == {"head": 1.0, "handover": 0.0, "issue": 0.0, "pump": 0.0, "plan": 0.0, "slot": 0.0}  # nothing ran: all head


def test_chunk_times_carry_each_chunks_layer_and_issue_mark():
    """With issue marks the transfer engine's chunks carry the cache's layer (the tag's first item), whether they were
    urgent, and an issue mark no later than their start; without, no mark."""
    from backends.cpu import CPUBackend
    from specter.experts import transfer
    from specter.kernel import Kernel, run

    backend = CPUBackend(link_gbps=1.0)
    kernel = Kernel(backend)
    sources = [torch.ones(1 << 16) for _ in range(3)]
    targets = [torch.zeros(1 << 16) for _ in range(3)]

    async def main(marks: bool):
        engine = transfer.TransferEngine(backend, kernel, chunk_bytes=1 << 18, tuning=TransferTuning(issue_marks=marks))
        reference = backend.record_event(backend.copy_stream, timed=True)
        engine.chunk_log = []
        for layer, (source, target) in enumerate(zip(sources, targets)):
            engine.submit(target, source, urgent=layer < 2, tag=(layer, 0, layer))  # the last one a prefetch
        await engine.drain()
        times = engine.chunk_times(engine.chunk_log, reference, open_end=0.0)
        await engine.aclose()
        return times

    try:
        marked, plain = run(main(True)), run(main(False))
    finally:
        kernel.close()
        backend.close()
    assert [t.layer for t in marked] == [0, 1, 2] and all(t.issued is not None and t.issued <= t.start + 1e-9 for t in marked)
    assert [t.urgent for t in marked] == [True, True, False] and all(t.queued is not None and t.queued >= 0 for t in marked)
    assert all(t.room is None for t in marked)  # the prefetch found room: the pump did not wait
    assert all(t.issued is None for t in plain)


@given(st.lists(st.tuples(st.floats(-1, 5), st.floats(0, 2), st.floats(0, 1), st.integers(0, 2), st.booleans(),
                          st.none() | st.floats(0, 2)), max_size=12),
       st.floats(0.01, 6))
def test_busy_and_idle_by_cause_add_up_to_the_window(raw, span):
    """However the chunks overlap, the causes are non-negative and busy + idle = the window."""
    from specter.metrics import busy_within, idle_causes

    chunks = [_chunk(start, start + length, start - lead, layer, urgent, queued)
              for start, length, lead, layer, urgent, queued in raw]
    causes = idle_causes(chunks, span)
    assert all(seconds >= -1e-12 for seconds in causes.values())
    busy = busy_within([(c.start, c.end) for c in chunks], 0.0, span)
    assert busy + sum(causes.values()) == pytest.approx(span, abs=1e-9)


def test_an_offloaded_run_with_issue_marks_splits_its_copy_idle_time(tiny):
    """With issue marks on, a stalled run's idle copy time is split by cause, adding up to window - busy."""
    stats = slow_link_stats(tiny, TuningConfig(transfer=TransferTuning(issue_marks=True)))
    assert stats.copy_window_s > 0 and set(stats.copy_idle_s) == {"head", "handover", "issue", "pump", "plan", "slot"}
    assert stats.copy_idle_s["handover"] > 0, "each layer's misses wait for its router: some hand-over gap must show"
    idle = sum(stats.copy_idle_s.values())
    assert idle == pytest.approx(stats.copy_window_s - stats.copy_busy_s, abs=1e-6)


def test_one_rejection_at_the_first_position_does_not_end_speculation():
    """The first round's single draft token rejected: with the observation taken whole position 0 read 0 and the
    governor decoded plainly for the rest of the request (no probe comes within a 32-token request at DDR4 rates).
    Weighed against the prior it reads 0.56, and where rows share experts a shallow draft still pays."""
    from policies.lookahead import Roofline
    from specter.policy import LookaheadState

    estimates = Estimates(k_max=15)
    estimates.observe_acceptance(k=1, accepted=0)
    assert estimates.measured_acceptance(15) == pytest.approx([0.56])
    estimates.observe_union(rows=8, first_row_experts=64, union_experts=150)  # beta ~ 0.41
    plain = 6.5e9
    state = LookaheadState(acceptance_by_position=estimates.measured_acceptance(15), draft_step_s_fit=(0.005, 0.004),
                           verify_s_fit=(0.03, 0.001), bandwidth_bytes_per_s=20e9,
                           predicted_new_bytes=[plain] + [plain * (k + 1) ** estimates.beta for k in range(1, 16)],
                           k_max=15, model_key="m")
    assert Roofline().next_k(state) >= 1
    assert Roofline().next_k(dataclasses.replace(state, acceptance_by_position=[0.0])) == 0


def test_consecutive_plain_tokens_measure_the_union_exponent():
    """Plain rounds' routes: the union of the last tokens against one token's experts gives beta before any
    speculative round ran; a break (speculative round, new request) starts the window again."""
    estimates = Estimates(k_max=3, alpha=1.0)  # alpha 1: each observation replaces the estimate, to read it exactly
    estimates.observe_plain_token(frozenset({(0, 1), (0, 2)}))
    estimates.observe_plain_token(frozenset({(0, 1), (0, 2)}))
    assert estimates.union_exponent is None  # two tokens: too few (alike, they would read beta 0)
    estimates.observe_plain_token(frozenset({(0, 1), (0, 3)}))
    assert estimates.beta == pytest.approx(math.log(3 / 2) / math.log(3))
    estimates.observe_plain_token(frozenset({(0, 1), (0, 2)}))
    assert estimates.beta == pytest.approx(math.log(3 / 2) / math.log(4))  # 4 rows, 3 distinct pairs
    estimates.observe_plain_token(frozenset({(0, 5), (0, 6)}))  # the window holds k_max + 1 = 4 tokens: the first left
    assert estimates.beta == pytest.approx(math.log(5 / 2) / math.log(4))
    estimates.break_plain_run()
    estimates.observe_plain_token(frozenset({(0, 7), (0, 8)}))
    estimates.observe_plain_token(frozenset({(0, 7), (0, 8)}))
    assert estimates.beta == pytest.approx(math.log(5 / 2) / math.log(4))  # two after the break: unchanged
    estimates.observe_plain_token(frozenset({(0, 7), (0, 8)}))
    assert estimates.beta == 0.0


@pytest.mark.parametrize("cpu_experts", ["off", "all"])
def test_a_plain_offloaded_run_measures_the_union_exponent(tiny, cpu_experts):
    """An engine that never speculates (lookahead fixed at 0) still measures beta from its consecutive tokens, counting
    the experts of both paths: with every non-resident on the host, the device path alone (2 residents a layer) saw
    about as many experts in a run of tokens as in one, and read beta near 0."""
    from specter.engine import _routed_pairs

    async def go():
        config = EngineConfig(device="cpu", residents=2, link="0.25", draft=DraftConfig(k=0, k_max=4), lookahead="fixed",
                              cpu_experts=cpu_experts, cpu_threads=1)
        runtime = await Runtime.load(tiny, config)
        pairs: list[tuple[int, int]] = []
        adapt = runtime._adapt

        def counted(report, clock):
            pairs.append((len(_routed_pairs(report.verify)), sum(report.verify.first_row.values())))
            adapt(report, clock)

        runtime._adapt = counted
        try:
            await runtime.complete_ids([3, 1, 4, 1, 5], GenerationConfig(max_new_tokens=8))
            return runtime.estimates, pairs
        finally:
            await runtime.aclose()

    estimates, pairs = asyncio.run(go())
    assert pairs and all(routed == first for routed, first in pairs)  # one row: its pairs on both paths, all of them
    assert estimates.union_exponent is not None and 0.2 <= estimates.union_exponent <= 1.0
    assert not estimates._plain_window  # the request's end broke the run


def test_a_host_bound_verify_is_fitted_over_its_distinct_experts():
    """A hybrid's verify is host-bound: its time follows the host experts its rows need, which grow as rows ** beta.
    Fitted from shallow rounds (1 to 7 rows) as a line in rows, a deep verify looked about 1.5x dearer than it is and
    the governor stopped at k = 6; fitted over rows ** beta it drafts as deep as the true optimum (i.i.d. acceptance
    0.95, Phi-3.5-MoE's shape: 32 layers, 2 experts a row, 3.24 ms a host expert, union exponent 0.65)."""
    from policies.lookahead import Roofline
    from specter.policy import LookaheadState

    beta, acceptance = 0.65, 0.95

    def verify_s(rows: int) -> float:
        return 0.030 + 32 * 2 * rows**beta * 0.00324

    def true_s_per_token(k: int) -> float:
        expected = sum(acceptance**i for i in range(1, k + 1))
        return (0.014 + 0.008 * k + verify_s(k + 1)) / (expected + 1)

    estimates = Estimates(k_max=15)
    estimates.observe_union(rows=16, first_row_experts=64, union_experts=round(64 * 16**beta))
    for rows in (1, 6, 6, 7, 4, 6, 1):
        estimates.observe_verify(rows=rows, compute_s=verify_s(rows), new_bytes=0)
    for k in (5, 6, 4, 5):
        estimates.observe_draft(k, 0.004 + 0.008 * k)
    assert estimates.beta == pytest.approx(beta, abs=0.01)

    def chosen(union_exponent: float, fit: tuple[float, float]) -> int:
        state = LookaheadState(acceptance_by_position=[acceptance] * 5, draft_step_s_fit=estimates.draft_fit(),
                               verify_s_fit=fit, bandwidth_bytes_per_s=20e9, predicted_new_bytes=[0.0] * 16, k_max=15,
                               model_key="m", union_exponent=union_exponent)
        return Roofline().next_k(state)

    fit = estimates.verify_fit()  # the verifies lie on a + b * rows ** beta: the fit recovers a and b
    assert fit == pytest.approx((0.030, 32 * 2 * 0.00324), rel=0.02)
    best = min(range(16), key=true_s_per_token)
    deep = chosen(estimates.beta, fit)
    assert true_s_per_token(deep) <= 1.01 * true_s_per_token(best)
    linear = Estimates(k_max=15)  # the same verifies with beta unmeasured: the fit is a line in rows
    for rows in (1, 6, 6, 7, 4, 6, 1):
        linear.observe_verify(rows=rows, compute_s=verify_s(rows), new_bytes=0)
    shallow = chosen(1.0, linear.verify_fit())
    assert shallow < deep and true_s_per_token(shallow) > 1.05 * true_s_per_token(best)
