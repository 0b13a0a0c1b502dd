"""Reference lookahead (draft depth) policies: fixed, profiled sweep, roofline governor (`specter.lookahead`)."""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Sequence
from pathlib import Path

from specter.errors import ConfigError
from specter.log import get_logger
from specter.policy import LookaheadState, RoundOutcome

log = get_logger(__name__)

PROFILE_DEPTHS = (0, 2, 4, 6, 8, 12, 16, 24, 32)


class Fixed:
    """Always the same depth `k` (clamped to k_max); k=0 is plain decoding."""

    def __init__(self, *, k: int = 4) -> None:
        if k < 0:
            raise ConfigError(f"fixed lookahead: k={k} is invalid; expected an int >= 0 (0 = plain decoding)")
        self.name = "fixed"
        self.k = k

    def next_k(self, state: LookaheadState) -> int:
        return min(self.k, state.k_max)

    def observe(self, outcome: RoundOutcome) -> None:
        return None


class Profiled:
    """Sweep k over `depths` (capped at k_max), `rounds` rounds each; keep the lowest median TPOT.

    The winner is remembered per `state.model_key` in `self.best_k`, and in the JSON file `path` when given
    (read at construction, rewritten after each decision), so a later run skips the sweep.
    """

    def __init__(
        self, *, depths: Sequence[int] = PROFILE_DEPTHS, rounds: int = 3, path: str | Path | None = None
    ) -> None:
        if rounds < 1 or not depths or min(depths) < 0:
            raise ConfigError(
                f"profiled lookahead: rounds={rounds}, depths={list(depths)}; need rounds >= 1 and every depth >= 0"
            )
        self.name = "profiled"
        self.depths = tuple(depths)
        self.rounds = rounds
        self.path = Path(path) if path is not None else None
        self.best_k: dict[str, int] = _read_memory(self.path) if self.path else {}
        self._sweep_key: str | None = None
        self._tpots: dict[int, list[float]] = {}

    def next_k(self, state: LookaheadState) -> int:
        if state.model_key in self.best_k:
            return min(self.best_k[state.model_key], state.k_max)
        if state.model_key != self._sweep_key:
            self._start_sweep(state)
        return next(k for k, tpots in self._tpots.items() if len(tpots) < self.rounds)

    def observe(self, outcome: RoundOutcome) -> None:
        tpots = self._tpots.get(outcome.k)
        if self._sweep_key is None or tpots is None or len(tpots) >= self.rounds:
            return  # not sweeping, or a depth the sweep did not ask for (the engine clamped it)
        tpots.append(outcome.tpot_s)
        if all(len(samples) >= self.rounds for samples in self._tpots.values()):
            self._decide()

    def _start_sweep(self, state: LookaheadState) -> None:
        capped = sorted({min(depth, state.k_max) for depth in self.depths})
        self._sweep_key = state.model_key
        self._tpots = {k: [] for k in capped}
        log.debug("lookahead.profile.start", model_key=state.model_key, depths=capped)

    def _decide(self) -> None:
        assert self._sweep_key is not None, "decide() without a sweep"
        medians = {k: statistics.median(tpots) for k, tpots in self._tpots.items()}
        best = min(medians, key=lambda k: (medians[k], k))
        self.best_k[self._sweep_key] = best
        log.info("lookahead.profile.chosen", model_key=self._sweep_key, k=best, tpot_s=medians[best])
        self._sweep_key, self._tpots = None, {}
        if self.path is not None:
            _write_memory(self.path, self.best_k)


def _read_memory(path: Path) -> dict[str, int]:
    if not path.exists():
        return {}
    try:
        remembered = json.loads(path.read_text())
        return {str(key): int(k) for key, k in remembered.items()}
    except (ValueError, TypeError, AttributeError) as exc:
        raise ConfigError(
            f"profiled lookahead: {path} is not a JSON object of model_key -> k ({exc}); fix or delete it"
        ) from exc


def _write_memory(path: Path, best_k: dict[str, int]) -> None:
    # Write then rename, so a crash never leaves a half-written file for the next run to reject.
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(best_k, indent=1, sort_keys=True))
    os.replace(partial, path)


class Roofline:
    """The MoE-SpeQ governor: pick the k that commits the most tokens per second by the cost model.

    Expected tokens of depth k: E[k] + 1, where E[k] = sum_{i<=k} prod_{j<=i} a_j (a = acceptance by
    position; positions past the measured ones reuse the last measured, so a depth is tried once the
    measured ones say it pays, and is then measured; `prior_acceptance` when none is) and the 1 is
    the target's own token. Time: draft(k) + verify(k+1 rows: a + b * (k + 1) ** beta, the verify's expert work
    following its distinct experts) + the part of the new bytes' transfer the draft
    does not hide, max(0, bytes[k]/bandwidth - draft(k)). k=0 is plain decode: verify(1) + bytes[0]/bandwidth,
    or with a scout (`state.scout_s` > 0) scout + verify(1) + max(0, bytes[0]/bandwidth - scout).
    Ties go to the smaller k.

    The round's measured time outside draft and verify (sampling, acceptance, commit) is added per round,
    and the draft's time is fitted as a per-draft plus a per-step cost, so deeper rounds are credited with
    sharing both among more tokens.

    Probing: what is only measured at the depths the governor picks (acceptance of later positions, the
    slopes of the draft and verify fits) could keep it at one depth for good: after a bad patch at k = 0,
    or at a shallow k whose deeper positions it never measured. After `probe_every` rounds in a row at
    one depth below k_max, one round runs deeper instead: at k = 1 from k = 0 (the cheapest round that
    measures the first position's acceptance), else at 2k; 0 turns probing off. A probe that leaves the
    decision where it was doubles the run before the next one (up to `max_backoff` times `probe_every`);
    a change of decision, after a probe or not, resets it. Where speculation does not pay, a probe costs
    several plain rounds (its verify loads the experts of k + 1 tokens), which is why the run between probes
    doubles while they change nothing.
    """

    def __init__(self, *, prior_acceptance: float = 0.7, probe_every: int = 16, max_backoff: int = 16) -> None:
        if not 0.0 <= prior_acceptance <= 1.0:
            raise ConfigError(f"roofline lookahead: prior_acceptance={prior_acceptance} must lie in [0, 1]")
        if probe_every < 0:
            raise ConfigError(f"roofline lookahead: probe_every={probe_every} must be >= 0 (0: never probe)")
        if max_backoff < 1:
            raise ConfigError(f"roofline lookahead: max_backoff={max_backoff} must be >= 1 (1: probe every probe_every rounds)")
        self.name = "roofline"
        self.prior_acceptance = prior_acceptance
        self.probe_every = probe_every
        self.max_backoff = max_backoff
        self._last, self._streak = -1, 0  # the last decision and how many rounds in a row it was taken
        self._interval = probe_every  # rounds at one depth before the next probe (grows while probes change nothing)
        self._probed_from: int | None = None  # the decision the last round's probe replaced

    def next_k(self, state: LookaheadState) -> int:
        rates = [self.tokens_per_s(state, k) for k in range(state.k_max + 1)]
        best = max(range(len(rates)), key=lambda k: (rates[k], -k))
        if self._probed_from is not None:  # the probe has been measured; one that left the decision where it was
            if best == self._probed_from:  # makes the next run longer (one that moved it: see below)
                self._interval = min(2 * self._interval, self.max_backoff * self.probe_every)
            self._probed_from = None
        if self.probe_every and best < state.k_max and best == self._last and self._streak >= self._interval:
            self._streak = 0  # a probe: one round at another depth, so the fits see more than one point
            self._probed_from = best
            return 1 if best == 0 else min(state.k_max, 2 * best)
        if best != self._last:  # the measurements moved the decision: probe at the base rate again
            self._streak, self._interval = 1, self.probe_every
        else:
            self._streak += 1
        self._last = best
        return best

    def observe(self, outcome: RoundOutcome) -> None:
        # The engine keeps the EMAs and fits this policy reads. A probe the engine clamped back to the
        # depth it replaced or below (few tokens left) measured nothing new: it must not lengthen the next run.
        if self._probed_from is not None and outcome.k <= self._probed_from:
            self._probed_from = None

    def expected_accepted(self, state: LookaheadState, k: int) -> float:
        """E[k]: expected accepted draft tokens of a depth-k round."""
        expected, all_accepted = 0.0, 1.0
        for position in range(k):
            all_accepted *= _at_or_last(state.acceptance_by_position, position, default=self.prior_acceptance)
            expected += all_accepted
        return expected

    def round_s(self, state: LookaheadState, k: int) -> float:
        """Modelled seconds of a depth-k round."""
        transfer_s = _at_or_last(state.predicted_new_bytes, k, default=0.0) / state.bandwidth_bytes_per_s
        verify_s = state.verify_s_fit[0] + state.verify_s_fit[1] * (k + 1) ** state.union_exponent
        if k == 0:  # a scout, if any, is charged like a one-step draft (its plan's copies overlap what follows)
            return state.round_overhead_s[0] + state.scout_s + verify_s + max(0.0, transfer_s - state.scout_s)
        draft_s = state.draft_step_s_fit[0] + state.draft_step_s_fit[1] * k
        return state.round_overhead_s[1] + draft_s + verify_s + max(0.0, transfer_s - draft_s)

    def tokens_per_s(self, state: LookaheadState, k: int) -> float:
        return (self.expected_accepted(state, k) + 1.0) / max(self.round_s(state, k), 1e-12)


def _at_or_last(values: Sequence[float], index: int, default: float) -> float:
    """values[index], the last value past the end (measurements extrapolate flat), `default` when empty."""
    return float(values[min(index, len(values) - 1)]) if values else default
