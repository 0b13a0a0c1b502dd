"""The running estimates the lookahead policy reads: acceptance, verify fit, and the byte model of a depth-k round."""

from __future__ import annotations

import asyncio
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from specter.config import DraftConfig, EngineConfig, GenerationConfig
from specter.engine import Runtime
from specter.metrics import Estimates


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


def test_an_offloaded_run_on_the_cpu_measures_the_copy_busy_fraction(tiny):
    """On a slow emulated link the verify waits for copies; the copy stream was busy for part of that time."""

    async def go():
        config = EngineConfig(device="cpu", residents=2, link="0.25", draft=DraftConfig(k=2), lookahead="fixed")
        runtime = await Runtime.load(tiny, config)
        try:
            return (await runtime.complete_ids([3, 1, 4, 1, 5], GenerationConfig(max_new_tokens=12))).stats
        finally:
            await runtime.aclose()

    stats = asyncio.run(go())
    assert stats.stall_s > 0 and stats.copy_window_s > 0
    assert 0.0 < stats.copy_busy_fraction <= 1.0 + 1e-6
    assert stats.as_dict()["copy_busy_fraction"] == round(stats.copy_busy_fraction, 4)
