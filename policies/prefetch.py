"""Reference prefetch policies: `none` and frequency Top-M (entry points `specter.prefetch`)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from specter.errors import ConfigError
from specter.policy import LinkTiming, Plan

# Shape legend: L MoE layers, E routed experts per layer.


class NoPrefetch:
    """Never plans: the verify pass loads every miss on demand (the `ondemand` baseline)."""

    def __init__(self) -> None:
        self.name = "none"

    def checkpoints(self, k: int, timing: LinkTiming) -> list[int]:
        return []

    def plan(
        self,
        route_counts: np.ndarray,
        resident: np.ndarray,
        steps_done: int,
        k: int,
        timing: LinkTiming,
        slots_per_layer: int,
    ) -> Plan:
        return Plan()


def link_paced_checkpoints(k: int, timing: LinkTiming, first_fraction: float, experts_per_chunk: float) -> list[int]:
    """The first checkpoint after about `first_fraction` of k, then one every chunk of draft steps.

    A chunk is as many draft steps as the link needs to move `experts_per_chunk` experts, so the bytes a
    plan puts in flight are on the GPU by the next checkpoint (never shorter than one step).
    """
    if k < 1:
        return []
    first = min(k, max(1, round(first_fraction * k)))
    link_experts_per_step = timing.experts_per_draft_step()
    if link_experts_per_step <= 0:  # nothing measured yet: plan once
        return [first]
    steps_per_chunk = max(1, math.ceil(experts_per_chunk / link_experts_per_step - 1e-9))
    return list(range(first, k + 1, steps_per_chunk))


def fixed_fraction_checkpoints(k: int, fractions: Sequence[float]) -> list[int]:
    """Checkpoints at fixed fractions of k (SpecMoEOff plans at 20 % and 60 %)."""
    return sorted({min(k, max(1, round(fraction * k))) for fraction in fractions}) if k >= 1 else []


class TopMFrequency:
    """Per layer, the M experts the draft routed to most so far (ties: lower id; never-routed excluded).

    Options: `m` (default: all of the layer's slots), `fractions` (plan at these fractions of k instead of
    link-paced checkpoints), `first_fraction` (default 0.2) and `experts_per_chunk` (default 1.0) for the
    link-paced schedule, `keep_predicted` (default False; see `TopMKeep`).
    """

    def __init__(
        self,
        *,
        m: int | None = None,
        fractions: Sequence[float] | None = None,
        first_fraction: float = 0.2,
        experts_per_chunk: float = 1.0,
        keep_predicted: bool = False,
    ) -> None:
        if m is not None and m < 1:
            raise ConfigError(f"topm-frequency: m={m} is invalid; expected an int >= 1, or None for all slots")
        if fractions is not None and not all(0.0 < f <= 1.0 for f in fractions):
            raise ConfigError(f"topm-frequency: fractions={fractions} must each lie in (0, 1]")
        self.name = "topm-frequency"
        self.m = m
        self.fractions = tuple(fractions) if fractions is not None else None
        self.first_fraction = first_fraction
        self.experts_per_chunk = experts_per_chunk
        self.keep_predicted = keep_predicted

    def checkpoints(self, k: int, timing: LinkTiming) -> list[int]:
        if self.fractions is not None:
            return fixed_fraction_checkpoints(k, self.fractions)
        return link_paced_checkpoints(k, timing, self.first_fraction, self.experts_per_chunk)

    def plan(
        self,
        route_counts: np.ndarray,  # [L, E] float
        resident: np.ndarray,  # [L, E] bool
        steps_done: int,
        k: int,
        timing: LinkTiming,
        slots_per_layer: int,
    ) -> Plan:
        m = min(self.m or slots_per_layer, slots_per_layer)
        experts: dict[int, list[int]] = {}
        scores: dict[int, dict[int, float]] = {}
        for layer, counts in enumerate(np.asarray(route_counts, dtype=np.float64)):
            routed = np.flatnonzero(counts > 0)
            if routed.size == 0:
                continue
            # lexsort sorts by the last key first: descending count, then ascending expert id.
            ranked = routed[np.lexsort((routed, -counts[routed]))]
            if self.keep_predicted:
                experts[layer] = _keeping_predicted(ranked, np.asarray(resident[layer], dtype=bool), m)
            else:
                experts[layer] = [int(e) for e in ranked[:m]]
            scores[layer] = {int(e): float(counts[e]) for e in ranked}
        return Plan(experts=experts, scores=scores)


def _keeping_predicted(ranked: np.ndarray, resident: np.ndarray, m: int) -> list[int]:
    """Every routed resident (best first), then the best routed non-residents, as many as there are slots that
    hold no routed expert (`m` in all, or the routed residents alone where they are more)."""
    kept = [int(e) for e in ranked if resident[e]]
    new = [int(e) for e in ranked if not resident[e]]
    return kept + new[: max(0, m - len(kept))]


class TopMKeep(TopMFrequency):
    """Top-M that never displaces an expert the draft routed to (entry point `topm-keep`).

    The plan lists every routed resident (so plan-protect and the cache's protection keep them), then the best
    routed non-residents, only as many as the layer has slots free or held by experts the draft did not route
    to. When a round wants more experts than a layer has slots, plain Top-M loads a routed expert in place of
    another routed one that the verify then loads back on demand: two copies where one would do. Replaying routing traces
    (`python -m specter.replay TRACE --prefetch topm-frequency,topm-keep`) shows the copies it saves at the same misses;
    it is the engine's default. The engine's first checkpoints see only the steps drafted so far, so a
    resident the draft routes to later may still be evicted by an earlier plan.
    """

    def __init__(self, **options) -> None:
        super().__init__(**{"keep_predicted": True, **options})
        self.name = "topm-keep"
