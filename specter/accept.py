"""Acceptance rules for one speculative round: greedy, coupled (seeded Gumbel, token-identical to the
baseline) and classic rejection sampling (same distribution, different tokens)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from specter.sampling import SamplingLike, sample

# Shape legend: k draft tokens, V vocabulary. Row i of the target's logits is its prediction after
# [x0, d1..di], i.e. for the token at absolute position n + i when x0 sits at index n - 1.
#
# Every rule is split in two: a sync-free `*_verdict` that leaves a tiny int64 tensor [k + 2] on the
# device, laid out as [n_accepted, t0, t1, .., tk] where the committed tokens are t0..t_{n_accepted}, and
# `read_verdict`, the round's single host sync. The `accept_*` helpers do both.


@dataclass(frozen=True)
class Acceptance:
    """What one round commits: the accepted drafts, then the target's own token (len n_accepted + 1)."""

    n_accepted: int
    tokens: list[int]

    @property
    def next_token(self) -> int:
        """The token the target adds after the accepted drafts (correction or bonus token)."""
        return self.tokens[-1]


def read_verdict(verdict: Tensor) -> Acceptance:
    """Turn a verdict [k + 2] into an Acceptance.

    AWAIT POINT: this `.tolist()` is the one host sync of a round (k + 2 integers). An async engine
    should record an event after the verdict (or copy it into pinned memory with non_blocking=True),
    `await` that event, and only then call this, so the loop never blocks here.
    """
    values = verdict.tolist()
    n_accepted = values[0]
    return Acceptance(n_accepted=n_accepted, tokens=values[1 : n_accepted + 2])


def greedy_verdict(draft_tokens: Tensor, target_logits: Tensor) -> Tensor:
    """Sync-free greedy rule: keep drafts while they equal the target's argmax (lowest index on ties)."""
    _check_round_shapes(draft_tokens, target_logits)
    return _longest_prefix_verdict(draft_tokens, target_logits.argmax(dim=-1))


def coupled_verdict(draft_tokens: Tensor, target_logits: Tensor, positions: Tensor, params: SamplingLike) -> Tensor:
    """Sync-free coupled rule: keep drafts while they equal the target's own seeded sample.

    positions [k + 1] are the absolute sequence indices of the tokens rows 0..k produce (the same ones
    the baseline would pass to `sample`). Token-identical to the baseline provided the draft proposed
    d_i with `sample(draft_logits, positions[i - 1], params)`, i.e. the same noise.
    """
    _check_round_shapes(draft_tokens, target_logits)
    assert positions.shape == (target_logits.shape[0],), f"positions {tuple(positions.shape)} != [k+1]"
    return _longest_prefix_verdict(draft_tokens, sample(target_logits, positions, params))


def _longest_prefix_verdict(draft_tokens: Tensor, target_tokens: Tensor) -> Tensor:
    # Accepted drafts equal the target's tokens, so the committed tokens are target_tokens[:n + 1].
    matches = draft_tokens == target_tokens[:-1]  # [k]
    n_accepted = matches.to(torch.int64).cumprod(dim=0).sum(dim=0, keepdim=True)  # [1]
    return torch.cat([n_accepted, target_tokens.to(torch.int64)])


def rejection_verdict(
    draft_tokens: Tensor, draft_probs: Tensor, target_probs: Tensor, generator: torch.Generator
) -> Tensor:
    """Sync-free speculative sampling (Leviathan et al. 2023, Chen et al. 2023).

    Accept d_i with probability min(1, p(d_i) / q(d_i)); at the first rejection draw from norm((p - q)+);
    when all k are accepted draw the bonus token from p at row k. `generator` must live on the probs'
    device; it supplies k uniforms and then one categorical draw per round.
    """
    _check_round_shapes(draft_tokens, target_probs)
    assert draft_probs.shape == (draft_tokens.shape[0], target_probs.shape[1]), "draft_probs must be [k, V]"
    n_accepted = _accepted_by_ratio(draft_tokens, draft_probs, target_probs, generator)  # [1]
    next_token = _residual_draw(n_accepted, draft_probs, target_probs, generator)  # [1]
    candidates = torch.cat([draft_tokens.to(torch.int64), next_token.new_zeros(1)])  # [k + 1]
    return torch.cat([n_accepted, candidates.scatter(0, n_accepted, next_token)])


def _accepted_by_ratio(
    draft_tokens: Tensor, draft_probs: Tensor, target_probs: Tensor, generator: torch.Generator
) -> Tensor:
    k = draft_tokens.shape[0]
    rows = torch.arange(k, device=draft_tokens.device)
    uniforms = torch.rand(k, generator=generator, device=target_probs.device, dtype=target_probs.dtype)
    p_of_draft = target_probs[rows, draft_tokens]  # [k]
    q_of_draft = draft_probs[rows, draft_tokens]  # [k]
    accepted = uniforms * q_of_draft < p_of_draft  # u < p/q without dividing by a q that may be 0
    return accepted.to(torch.int64).cumprod(dim=0).sum(dim=0, keepdim=True)


def _residual_draw(
    n_accepted: Tensor, draft_probs: Tensor, target_probs: Tensor, generator: torch.Generator
) -> Tensor:
    # Row k has no draft, so q = 0 there and the residual is p itself: the bonus token.
    q_padded = torch.cat([draft_probs, draft_probs.new_zeros(1, draft_probs.shape[1])])  # [k + 1, V]
    residual = (target_probs - q_padded).clamp_min(0.0).index_select(0, n_accepted)  # [1, V]
    target_row = target_probs.index_select(0, n_accepted)  # [1, V]
    # (p - q)+ is all zero only when p == q up to rounding, where rejection had probability ~0: use p.
    weights = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, target_row)
    return torch.multinomial(weights, 1, generator=generator).view(1)


def _check_round_shapes(draft_tokens: Tensor, target_rows: Tensor) -> None:
    assert draft_tokens.dim() == 1, f"draft_tokens must be [k], got {tuple(draft_tokens.shape)}"
    assert target_rows.dim() == 2 and target_rows.shape[0] == draft_tokens.shape[0] + 1, (
        f"target rows must be [k+1, V] for k={draft_tokens.shape[0]}, got {tuple(target_rows.shape)}"
    )


def accept_greedy(draft_tokens: Tensor, target_logits: Tensor) -> Acceptance:
    """Greedy acceptance; syncs once (see read_verdict)."""
    return read_verdict(greedy_verdict(draft_tokens, target_logits))


def accept_coupled(draft_tokens: Tensor, target_logits: Tensor, positions: Tensor, params: SamplingLike) -> Acceptance:
    """Coupled acceptance (the exact target sample); syncs once (see read_verdict)."""
    return read_verdict(coupled_verdict(draft_tokens, target_logits, positions, params))


def accept_rejection(
    draft_tokens: Tensor, draft_probs: Tensor, target_probs: Tensor, generator: torch.Generator
) -> Acceptance:
    """Rejection-sampling acceptance (the target's distribution); syncs once (see read_verdict)."""
    return read_verdict(rejection_verdict(draft_tokens, draft_probs, target_probs, generator))
