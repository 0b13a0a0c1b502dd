"""Acceptance rules: greedy on hand-made logits, coupled sampling token-identical to the baseline on a toy
model (hypothesis), and rejection sampling distributed as the target (chi-square)."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specter.accept import (
    Acceptance,
    accept_coupled,
    accept_greedy,
    accept_rejection,
    coupled_verdict,
    read_verdict,
)
from specter.sampling import SamplingParams, probs, sample

VOCAB = 16
CHI_SQUARE_CRITICAL_5_DOF = 20.515  # alpha = 1e-3
NEG = -10.0


def _rows_preferring(tokens: list[int], vocab: int = 8) -> torch.Tensor:
    """Logits [len(tokens), vocab] whose argmax in row i is tokens[i]."""
    logits = torch.full((len(tokens), vocab), NEG)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 1.0
    return logits


# ---------------------------------------------------------------------------------------------------
# Greedy


@pytest.mark.parametrize(
    ("drafts", "target_argmax", "expected"),
    [
        ([3, 1, 4], [3, 1, 4, 7], Acceptance(3, [3, 1, 4, 7])),  # all accepted: bonus token from row k
        ([3, 1, 4], [5, 1, 4, 7], Acceptance(0, [5])),  # first draft wrong
        ([3, 1, 4], [3, 2, 4, 7], Acceptance(1, [3, 2])),  # mismatch in the middle; later match ignored
        ([], [6], Acceptance(0, [6])),  # k = 0 is plain decoding
    ],
)
def test_accept_greedy(drafts, target_argmax, expected):
    result = accept_greedy(torch.tensor(drafts, dtype=torch.int64), _rows_preferring(target_argmax))
    assert result == expected
    assert result.next_token == target_argmax[result.n_accepted]


def test_accept_greedy_ties_go_to_the_lowest_index():
    logits = torch.full((3, 8), NEG)
    logits[0, [2, 5]] = 1.0  # tie: the target's token is 2
    logits[1, [4, 6]] = 1.0  # tie: the target's token is 4
    logits[2, 0] = 1.0
    assert accept_greedy(torch.tensor([2, 4]), logits) == Acceptance(2, [2, 4, 0])
    assert accept_greedy(torch.tensor([5, 4]), logits) == Acceptance(0, [2])
    assert accept_greedy(torch.tensor([2, 6]), logits) == Acceptance(1, [2, 4])


def test_read_verdict_slices_the_committed_tokens():
    assert read_verdict(torch.tensor([1, 9, 8, 7, 6])) == Acceptance(1, [9, 8])


# ---------------------------------------------------------------------------------------------------
# Coupled: a toy "model" is a fixed function of the last two tokens (bigram + skip-gram tables).


class ToyModel:
    def __init__(self, seed: int, perturb_from: ToyModel | None = None, perturbation: float = 0.0):
        generator = torch.Generator().manual_seed(seed)
        self.bigram = torch.randn(VOCAB, VOCAB, generator=generator) * 2.0
        self.skipgram = torch.randn(VOCAB, VOCAB, generator=generator)
        if perturb_from is not None:  # a draft: the target's tables plus some error
            self.bigram = perturb_from.bigram + perturbation * self.bigram
            self.skipgram = perturb_from.skipgram + perturbation * self.skipgram

    def logits(self, contexts: list[list[int]]) -> torch.Tensor:
        """[len(contexts), V]; each row depends only on its own context (batch-invariant by construction)."""
        last = torch.tensor([context[-1] for context in contexts])
        before_last = torch.tensor([context[-2] if len(context) > 1 else 0 for context in contexts])
        return self.bigram[last] + self.skipgram[before_last]


TARGET = ToyModel(seed=1)
DRAFT = ToyModel(seed=2, perturb_from=TARGET, perturbation=0.6)


def baseline_decode(prompt: list[int], n_new: int, params: SamplingParams) -> list[int]:
    tokens = list(prompt)
    for position in range(len(prompt), len(prompt) + n_new):
        tokens.append(int(sample(TARGET.logits([tokens]), torch.tensor([position]), params)))
    return tokens


def speculative_decode(
    prompt: list[int], n_new: int, params: SamplingParams, depths: list[int], draft: ToyModel = DRAFT
) -> tuple[list[int], list[Acceptance]]:
    tokens, rounds = list(prompt), []
    for k in itertools.cycle(depths):
        if len(tokens) >= len(prompt) + n_new:
            break
        drafts = _propose(draft, tokens, k, params)
        contexts = [tokens + drafts[:i] for i in range(k + 1)]
        # Row i produces the token at absolute index len(tokens) + i.
        positions = torch.arange(len(tokens), len(tokens) + k + 1)
        draft_tokens = torch.tensor(drafts, dtype=torch.int64)
        rounds.append(accept_coupled(draft_tokens, TARGET.logits(contexts), positions, params))
        tokens += rounds[-1].tokens
    return tokens[: len(prompt) + n_new], rounds


def _propose(draft: ToyModel, tokens: list[int], k: int, params: SamplingParams) -> list[int]:
    drafts: list[int] = []
    for step in range(k):
        position = torch.tensor([len(tokens) + step])
        drafts.append(int(sample(draft.logits([tokens + drafts]), position, params)))
    return drafts


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.3])
@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(min_value=0, max_value=2**63 - 1),
    prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=4),
    n_new=st.integers(1, 20),
    depths=st.lists(st.integers(0, 5), min_size=1, max_size=6).filter(any),
    top_k=st.sampled_from([None, 1, 3, 8]),
    top_p=st.sampled_from([None, 0.5, 0.9]),
)
def test_coupled_speculation_is_token_identical_to_baseline(temperature, seed, prompt, n_new, depths, top_k, top_p):
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    speculative, _ = speculative_decode(prompt, n_new, params, depths)
    assert speculative == baseline_decode(prompt, n_new, params)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_coupled_speculation_exercises_both_accept_and_reject(temperature):
    params = SamplingParams(temperature=temperature, seed=3)
    tokens, rounds = speculative_decode([1, 2], 60, params, [4])
    accepted = sum(r.n_accepted for r in rounds)
    assert 0 < accepted < 4 * len(rounds)  # the draft is neither useless nor perfect
    assert tokens == baseline_decode([1, 2], 60, params)


def test_coupled_with_a_perfect_draft_accepts_every_draft():
    params = SamplingParams(temperature=1.2, top_p=0.9, seed=8)
    _, rounds = speculative_decode([5], 40, params, [3], draft=TARGET)
    assert all(r.n_accepted == 3 for r in rounds)


def test_coupled_seeds_change_the_tokens():
    samples = {tuple(baseline_decode([0], 12, SamplingParams(temperature=1.0, seed=seed))) for seed in range(5)}
    assert len(samples) == 5


# ---------------------------------------------------------------------------------------------------
# Rejection sampling

P_ROWS = torch.tensor([[0.30, 0.05, 0.25, 0.10, 0.20, 0.10], [0.05, 0.40, 0.05, 0.20, 0.10, 0.20]])
Q_ROW = torch.tensor([[0.05, 0.35, 0.10, 0.30, 0.10, 0.10]])


def _chi_square(tokens: list[int], probabilities: torch.Tensor) -> float:
    observed = torch.bincount(torch.tensor(tokens), minlength=probabilities.numel()).double()
    expected = probabilities.double() * len(tokens)
    return (((observed - expected) ** 2) / expected).sum().item()


def test_rejection_first_and_bonus_tokens_follow_the_target_distribution():
    draws = torch.Generator().manual_seed(1234)
    proposal = torch.multinomial(Q_ROW[0], 20_000, replacement=True, generator=draws)
    rounds = [accept_rejection(draft.view(1), Q_ROW, P_ROWS, draws) for draft in proposal]
    first_tokens = [r.tokens[0] for r in rounds]
    bonus_tokens = [r.tokens[1] for r in rounds if r.n_accepted == 1]
    assert _chi_square(first_tokens, P_ROWS[0]) < CHI_SQUARE_CRITICAL_5_DOF
    assert _chi_square(bonus_tokens, P_ROWS[1]) < CHI_SQUARE_CRITICAL_5_DOF
    # The test has power: the draft's own proposals fail it.
    assert _chi_square(proposal.tolist(), P_ROWS[0]) > CHI_SQUARE_CRITICAL_5_DOF
    # The acceptance rate is sum(min(p, q)) = 0.5.
    assert sum(r.n_accepted for r in rounds) / len(rounds) == pytest.approx(0.5, abs=0.02)


def test_rejection_accepts_everything_when_draft_equals_target():
    generator = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(4, 6, generator=generator), dim=-1)
    for _ in range(50):
        drafts = torch.multinomial(p[:3], 1, generator=generator).view(3)
        assert accept_rejection(drafts, p[:3], p, generator).n_accepted == 3


def test_rejection_never_keeps_a_token_the_target_forbids():
    generator = torch.Generator().manual_seed(0)
    target = torch.tensor([[0.0, 0.5, 0.5], [0.2, 0.3, 0.5]])
    draft = torch.tensor([[0.9, 0.05, 0.05]])
    for _ in range(100):
        result = accept_rejection(torch.tensor([0]), draft, target, generator)
        assert result.n_accepted == 0 and result.tokens[0] in (1, 2)


def test_a_rejected_draft_ends_the_run_even_where_a_later_draft_would_be_kept():
    """d1 has target probability 0 (always rejected); d2 has p == q (kept whenever it is reached): n_accepted is 0,
    and the one committed token is the residual's draw at row 0, never d2."""
    target = torch.tensor([[0.0, 0.5, 0.5], [0.2, 0.3, 0.5], [0.3, 0.3, 0.4]])
    draft = torch.tensor([[1.0, 0.0, 0.0], [0.2, 0.3, 0.5]])
    generator = torch.Generator().manual_seed(0)
    for _ in range(50):
        result = accept_rejection(torch.tensor([0, 2]), draft, target, generator)
        assert result.n_accepted == 0 and len(result.tokens) == 1 and result.tokens[0] in (1, 2)


def test_rejection_is_a_different_rule_from_coupled():
    """Where the draft's seeded sample d differs from the target's and p(d) >= q(d), rejection must keep
    d while coupled must replace it with the target's own sample: same distribution, other tokens."""
    params = SamplingParams(temperature=1.0, seed=0)
    target_logits = torch.log(P_ROWS)
    draft_logits = torch.log(Q_ROW)
    generator = torch.Generator().manual_seed(0)
    differing = 0
    for seed in range(200):
        seeded = SamplingParams(temperature=1.0, seed=seed)
        positions = torch.tensor([10, 11])
        draft = sample(draft_logits, positions[:1], seeded)
        coupled = read_verdict(coupled_verdict(draft, target_logits, positions, seeded))
        token = int(draft)
        if coupled.n_accepted == 0 and P_ROWS[0, token] >= Q_ROW[0, token]:
            rejection = accept_rejection(draft, probs(draft_logits, params), probs(target_logits, params), generator)
            assert rejection.tokens[0] == token != coupled.tokens[0]
            differing += 1
    assert differing > 0
