"""Draft-ahead beside the verify (DraftConfig.overlap, issue 4 item 8).

A speculative round drafts one step more (a guess at the target's next token) and, while its verify runs,
drafts on from that guess; when the verify takes every draft and its own token equals the guess, the next
round starts with those steps done. Output stays the target's own; these tests check that the carried
steps are the ones a fresh draft would have made, that a carry is used only where it belongs, and that a
cancelled round leaves nothing behind. The same tests run on the GPU (SPECTER_TEST_DEVICE=cuda), where the
draft-ahead runs on a second stream.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from specter.cli import build_parser, engine_config
from specter.config import DraftConfig, EngineConfig, GenerationConfig
from specter.ahead import DraftAhead
from specter.engine import Carry, Runtime
from specter.errors import ConfigError
from specter.sampling import SamplingParams
from tests.test_speculative import DEVICE, baseline, checkpoint, run

FAMILIES = ["mixtral", "qwen2_moe"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("overlap"))


def speculative(overlap: int, residents: int | None = None, k: int = 4, lookahead: str = "fixed") -> EngineConfig:
    return EngineConfig(device=DEVICE, max_context=96, residents=residents, lookahead=lookahead,
                        draft=DraftConfig(k=k, k_max=16, quant="int8", overlap=overlap))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_carried_steps_are_the_drafts_own_all_resident(root, family, temperature):
    """All experts resident. On the CPU the verify never waits, so the draft-ahead runs after it and reads the
    verified KV, exactly what the next round's own draft would read: every round is as without overlap (same
    drafts, same verdicts), and the carried rounds drafted fewer steps themselves. On CUDA the draft-ahead runs
    on its own stream beside the verify and mostly reads the draft's own scratch KV (what one deeper draft
    would read), so its proposals, and with them the rounds, may differ: only the tokens must not."""
    path = checkpoint(family, root)
    generation = GenerationConfig(max_new_tokens=30, temperature=temperature, seed=11)
    plain = run(path, speculative(0), [5, 9, 2], generation)
    ahead = run(path, speculative(6), [5, 9, 2], generation)
    assert ahead.tokens == plain.tokens == baseline(path, [5, 9, 2], generation)
    a, p = ahead.stats, plain.stats
    if DEVICE == "cpu":
        assert (a.rounds, a.drafted, a.accepted) == (p.rounds, p.drafted, p.accepted), (a.as_dict(), p.as_dict())
    assert p.ahead_rounds == p.carried_rounds == 0
    assert a.ahead_rounds > 0 and 0 < a.carried_rounds <= a.ahead_rounds, a.as_dict()
    assert 0 < a.carried_steps <= a.ahead_steps
    # a round is carried exactly when the one before it accepted every draft and the guess was the target's token
    full = sum(count for n, count in a.accepted_lengths.items() if n == 4)
    assert a.carried_rounds <= full


@pytest.mark.parametrize("family", FAMILIES + ["deepseek-v2"])
def test_draft_ahead_offloaded_is_exact_and_moves_bytes(root, family):
    """Offloaded (the verify waits on copies, the draft-ahead runs meanwhile): still the baseline's tokens,
    experts were loaded, and the window recall is measured on the round's own routes (kept before the
    draft-ahead resets the counters), so it is no worse than without the draft-ahead, which predicts one row less."""
    path = checkpoint(family, root)
    generation = GenerationConfig(max_new_tokens=30)
    plain = run(path, speculative(0, residents=3), [7, 1, 8], generation)
    ahead = run(path, speculative(5, residents=3), [7, 1, 8], generation)
    assert ahead.tokens == plain.tokens == baseline(path, [7, 1, 8], generation, residents=3)
    a = ahead.stats
    assert a.misses > 0 and a.h2d_bytes > 0
    if DEVICE == "cpu" or family != "deepseek-v2":  # on CUDA an eager DeepSeek draft (tuning.kernels.static_mla off) has no draft-ahead
        assert a.ahead_rounds > 0 and a.carried_rounds > 0, a.as_dict()
    assert a.window_recall >= plain.stats.window_recall - 0.05, (a.as_dict(), plain.stats.as_dict())


def test_roofline_with_draft_ahead_is_exact(root):
    path = checkpoint("mixtral", root)
    generation = GenerationConfig(max_new_tokens=40, temperature=0.7, top_p=0.9, seed=3)
    result = run(path, speculative(16, residents=2, lookahead="roofline"), [3, 3, 4], generation)
    assert result.tokens == baseline(path, [3, 3, 4], generation, residents=2)


def runtime_for(root, **draft) -> Runtime:
    path = checkpoint("mixtral", root)
    return asyncio.run(Runtime.load(path, EngineConfig(device=DEVICE, max_context=40, residents=3, draft=DraftConfig(**draft))))


def test_a_carry_is_taken_only_from_the_same_token_and_position(root):
    """A carry starts the round only from its own token and position; taken in part, the draft's counters
    become those after the steps taken (the draft-ahead's per-step snapshots)."""
    runtime = runtime_for(root, k=4, overlap=4)
    tokens = torch.arange(10, 14, device=runtime.model.device)
    counts = runtime.draft.route_counts
    runtime.ahead.counts = torch.arange(33 * counts.numel(), dtype=counts.dtype, device=counts.device).view(33, *counts.shape)
    try:
        for x0, start, steps, expected in ((5, 10, 4, [10, 11, 12, 13]), (5, 10, 2, [10, 11]), (5, 10, 6, [10, 11, 12, 13]),
                                           (6, 10, 4, None), (5, 11, 4, None), (5, 10, 0, None)):
            runtime.ahead.carry = Carry(start=10, x0=5, tokens=tokens)
            counts.fill_(-1.0)
            taken = runtime.ahead.take(x0, start, steps)
            assert (None if taken is None else taken.tolist()) == expected, (x0, start, steps)
            assert runtime.ahead.carry is None  # used or not, a carry lives for one round
            if expected is not None and len(expected) < 4:  # in part: the routes of exactly the steps taken
                assert torch.equal(counts, runtime.ahead.counts[len(expected) - 1])
            else:  # whole (the counters already hold its routes) or not at all (the draft resets them)
                assert bool((counts == -1.0).all())
    finally:
        asyncio.run(runtime.aclose())


def test_a_resumed_draft_counts_the_routes_of_the_steps_it_took_over(root, monkeypatch):
    """At every resume the route counters hold exactly the carried steps' routes: top_k experts per MoE
    layer per step. Depths alternating 4, 2 (as a governor may change them) make rounds take a carry in part."""
    from specter.draft import Draft

    path = checkpoint("mixtral", root)
    expected = baseline(path, [5, 9, 2], GenerationConfig(max_new_tokens=30))  # before the depths are patched
    seen, carried_lengths = [], []
    propose, take = Draft.propose, DraftAhead.take

    async def recording_propose(self, x0, start, k, kv, params, after_step=None, keep_logits=False, prefix=None):
        if prefix is not None:
            seen.append((prefix.shape[0], float(self.route_counts.sum())))
        return await propose(self, x0, start, k, kv, params, after_step, keep_logits, prefix)

    def recording_take(self, x0, start, steps):
        if self.carry is not None and self.carry.x0 == x0 and self.carry.start == start and steps:
            carried_lengths.append(self.carry.tokens.shape[0])
        return take(self, x0, start, steps)

    depths = iter([4, 2] * 40)
    monkeypatch.setattr(Draft, "propose", recording_propose)
    monkeypatch.setattr(DraftAhead, "take", recording_take)
    monkeypatch.setattr(Runtime, "_next_k", lambda self, remaining: max(0, min(next(depths), remaining - 1)))

    async def main():
        runtime = await Runtime.load(path, speculative(6))
        try:
            per_step = runtime.spec.top_k * len(runtime.spec.moe_layers)
            result = await runtime.complete_ids([5, 9, 2], GenerationConfig(max_new_tokens=30))
            return result, per_step
        finally:
            await runtime.aclose()

    result, per_step = asyncio.run(main())
    assert result.tokens == expected
    assert seen and all(total == taken * per_step for taken, total in seen), (seen, per_step)
    assert any(taken < whole for (taken, _), whole in zip(seen, carried_lengths)), (seen, carried_lengths)


def test_the_static_draft_resumes_and_drafts_ahead_like_the_eager_one(root):
    """The static one-row draft step (CUDA's path, run here without graphs) through a prefix and the
    draft-ahead: all resident, the same rounds as without overlap, steps carried, the baseline's tokens."""
    path = checkpoint("qwen2_moe", root)
    generation = GenerationConfig(max_new_tokens=30)

    async def main(overlap: int):
        runtime = await Runtime.load(path, speculative(overlap))
        runtime.draft.static = True
        try:
            return await runtime.complete_ids([5, 9, 2], generation)
        finally:
            await runtime.aclose()

    plain, ahead = asyncio.run(main(0)), asyncio.run(main(6))
    assert ahead.tokens == plain.tokens == baseline(path, [5, 9, 2], generation)
    a, p = ahead.stats, plain.stats
    assert (a.rounds, a.drafted, a.accepted) == (p.rounds, p.drafted, p.accepted), (a.as_dict(), p.as_dict())
    assert a.carried_rounds > 0 and a.carried_steps > 0


def test_draft_ahead_depth_is_clamped(root):
    runtime = runtime_for(root, k=4, overlap=6)
    greedy = SamplingParams(0.0, None, None, 0)
    try:
        assert runtime.ahead.steps(start=5, k=4, remaining=30, params=greedy, kv_capacity=runtime.kv.capacity) == 5  # at most k + 1: one round's worth
        assert runtime.ahead.steps(start=5, k=0, remaining=30, params=greedy, kv_capacity=runtime.kv.capacity) == 0  # no verify block to draft beside
        assert runtime.ahead.steps(start=5, k=4, remaining=7, params=greedy, kv_capacity=runtime.kv.capacity) == 1  # 2 tokens left after: 1 to draft
        assert runtime.ahead.steps(start=5, k=4, remaining=6, params=greedy, kv_capacity=runtime.kv.capacity) == 0  # the next round is plain
        assert runtime.ahead.steps(start=33, k=4, remaining=30, params=greedy, kv_capacity=runtime.kv.capacity) == 2  # KV room: positions 38, 39
        rejection = runtime_for(root, k=4, overlap=6, sampling="rejection")
        try:
            assert rejection.ahead.steps(start=5, k=4, remaining=30, params=SamplingParams(0.8, None, None, 1), kv_capacity=rejection.kv.capacity) == 0
            assert rejection.ahead.steps(start=5, k=4, remaining=30, params=greedy, kv_capacity=rejection.kv.capacity) == 5  # greedy keeps no logits
        finally:
            asyncio.run(rejection.aclose())
        runtime.ahead.depth = 0
        assert runtime.ahead.steps(start=5, k=4, remaining=30, params=greedy, kv_capacity=runtime.kv.capacity) == 0
    finally:
        asyncio.run(runtime.aclose())


def test_cancelled_round_with_draft_ahead_leaves_nothing_behind(root):
    path = checkpoint("mixtral", root)
    generation = GenerationConfig(max_new_tokens=30)
    expected = baseline(path, [2, 7], generation, residents=2)

    async def main():
        runtime = await Runtime.load(path, speculative(5, residents=2))
        try:
            for delay in (0.0, 0.002, 0.01, 0.03):
                task = asyncio.create_task(runtime.complete_ids([4, 4, 4], GenerationConfig(max_new_tokens=40)))
                await asyncio.sleep(delay)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                assert runtime.ahead.carry is None and runtime.ahead.done is None and runtime.kv.length == 0
                round_tasks = {"specter-verify", "specter-draft-ahead", "specter-draft-stage", "specter-transfer-stage"}
                assert not [t for t in asyncio.all_tasks() if t.get_name() in round_tasks]
            return await runtime.complete_ids([2, 7], generation)
        finally:
            await runtime.aclose()

    result = asyncio.run(main())
    assert result.tokens == expected and result.stats.carried_rounds > 0


def test_overlap_is_validated_and_reaches_the_config_from_the_command_line():
    with pytest.raises(ConfigError, match="overlap"):
        DraftConfig(overlap=33)
    with pytest.raises(ConfigError, match="overlap"):
        DraftConfig(overlap=-1)
    args = build_parser().parse_args(["generate", "--model", "tiny", "--overlap", "8"])
    assert engine_config(args).draft.overlap == 8
    default = engine_config(build_parser().parse_args(["generate", "--model", "tiny"])).draft
    assert default.overlap is None  # resolved by the device: on with CUDA graphs (measured faster there), off elsewhere
    assert (default.overlap_steps("cuda", True), default.overlap_steps("cuda", False), default.overlap_steps("cpu", True)) == (16, 0, 0)
    assert DraftConfig(overlap=0).overlap_steps("cuda", True) == 0 and DraftConfig(overlap=5).overlap_steps("cpu", False) == 5


def test_the_draft_fit_keeps_what_a_carried_round_paid():
    """A carried round's draft (the steps it ran itself) enters the depth fit; the per-step time only from
    rounds that ran steps. Leaving carried rounds out charged the draft-ahead twice (it is in the verify's
    measured time already) and made the roofline governor choose shallow depths (the journal in git history, draft-ahead)."""
    from specter.metrics import Estimates

    estimates = Estimates(8)
    estimates.observe_draft(4, 5e-3, steps=5)  # a depth-4 round with a draft-ahead: 4 drafts and the guess
    assert estimates.draft_step_s == pytest.approx(1e-3)
    estimates.observe_draft(4, 1e-4, steps=0)  # carried: every step taken over, only the round's fixed cost
    assert estimates.draft_step_s == pytest.approx(1e-3) and list(estimates.draft_points) == [(4, 5e-3), (4, 1e-4)]
    estimates.observe_draft(2, 3e-3)  # without a draft-ahead: k steps, 1.5 ms each
    assert len(estimates.draft_points) == 3 and estimates.draft_step_s > 1e-3


def test_every_speculative_round_with_draft_ahead_is_in_the_draft_fit(root):
    path = checkpoint("mixtral", root)

    async def main():
        runtime = await Runtime.load(path, speculative(6))
        try:
            result = await runtime.complete_ids([5, 9, 2], GenerationConfig(max_new_tokens=30))
            return result.stats, list(runtime.estimates.draft_points)
        finally:
            await runtime.aclose()

    stats, points = asyncio.run(main())
    assert stats.carried_rounds > 0 and len(points) == sum(stats.accepted_lengths.values())
    assert all(1 <= k <= 4 for k, _ in points)  # the last rounds are clamped to the tokens left
