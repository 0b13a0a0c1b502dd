"""Reference eviction policies: LRU, LFU, plan-protect and belady-lookahead (entry points `specter.eviction`)."""

from __future__ import annotations

from collections.abc import Sequence, Set

from specter.policy import Plan, UseHistory


def _unprotected(residents: Sequence[int], protected: Set[int]) -> list[int]:
    return [expert for expert in residents if expert not in protected]


def _lru_key(history: UseHistory):
    # Never-used residents (e.g. prefetched but not yet used) sort first; ties go to the lower id.
    return lambda expert: (history.last_use.get(expert, -1), expert)


class LRU:
    """Evict the least recently used residents (never-used ones first)."""

    def __init__(self) -> None:
        self.name = "lru"

    def victims(
        self,
        layer: int,
        residents: Sequence[int],
        protected: Set[int],
        count: int,
        history: UseHistory,
        plan: Plan | None,
    ) -> list[int]:
        return sorted(_unprotected(residents, protected), key=_lru_key(history))[:count]


class LFU:
    """Evict the least frequently used residents; ties by least recent use, then lower id."""

    def __init__(self) -> None:
        self.name = "lfu"

    def victims(
        self,
        layer: int,
        residents: Sequence[int],
        protected: Set[int],
        count: int,
        history: UseHistory,
        plan: Plan | None,
    ) -> list[int]:
        def frequency_key(expert: int) -> tuple[int, int, int]:
            return (history.use_count.get(expert, 0), history.last_use.get(expert, -1), expert)

        return sorted(_unprotected(residents, protected), key=frequency_key)[:count]


class PlanProtect:
    """Never evict an expert the plan lists for this layer while others remain; LRU among the rest.

    When only planned experts are left unprotected, the lowest-scored planned one goes first (ties: the
    one the plan ranks lower).
    """

    def __init__(self) -> None:
        self.name = "plan-protect"

    def victims(
        self,
        layer: int,
        residents: Sequence[int],
        protected: Set[int],
        count: int,
        history: UseHistory,
        plan: Plan | None,
    ) -> list[int]:
        plan = plan if plan is not None else Plan()
        rank = {expert: position for position, expert in enumerate(plan.for_layer(layer))}
        candidates = _unprotected(residents, protected)
        unplanned = sorted((e for e in candidates if e not in rank), key=_lru_key(history))
        planned = sorted((e for e in candidates if e in rank), key=lambda e: (plan.score(layer, e), -rank[e]))
        return (unplanned + planned)[:count]


class BeladyLookahead:
    """Evict the resident whose next predicted use is farthest away (Belady's rule on draft predictions).

    The draft's scores stand in for the future: experts with no predicted use go first (least recently
    used first), then predicted ones by ascending score, planned or not. Unlike plan-protect, an expert
    the draft scored but the plan left out (slot limit) outranks one it never predicted.
    """

    def __init__(self) -> None:
        self.name = "belady-lookahead"

    def victims(
        self,
        layer: int,
        residents: Sequence[int],
        protected: Set[int],
        count: int,
        history: UseHistory,
        plan: Plan | None,
    ) -> list[int]:
        planned = set(plan.for_layer(layer)) if plan is not None else set()
        recency = _lru_key(history)

        def farthest_first(expert: int) -> tuple[bool, float, tuple[int, int]]:
            score = plan.score(layer, expert) if plan is not None else 0.0
            predicted = score > 0 or expert in planned
            return (predicted, score, recency(expert))

        return sorted(_unprotected(residents, protected), key=farthest_first)[:count]
