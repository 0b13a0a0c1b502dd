"""Eviction as the cache sees it: the target's use history and the victim chooser handed to the cache at construction."""

from __future__ import annotations

from collections.abc import Sequence

from specter.policy import Plan, UseHistory


class UseClock:
    """The target's per-layer use history on a logical clock (what eviction policies read)."""

    def __init__(self, layers: int) -> None:
        self.clock = 0
        self.last_use: list[dict[int, int]] = [{} for _ in range(layers)]
        self.use_count: list[dict[int, int]] = [{} for _ in range(layers)]

    def used(self, layer: int, experts: Sequence[int]) -> None:
        for expert in experts:
            self.clock += 1
            self.last_use[layer][expert] = self.clock
            self.use_count[layer][expert] = self.use_count[layer].get(expert, 0) + 1

    def history(self, layer: int) -> UseHistory:
        return UseHistory(last_use=dict(self.last_use[layer]), use_count=dict(self.use_count[layer]), clock=self.clock)


class Victims:
    """The cache's victim chooser: asks the eviction policy, with the use history and the round's plan.

    Built before the cache and passed to its constructor. The runtime owns it: it sets `plan` when the transfer
    stage plans (cleared when the round ends) and may swap `policy` and `uses` between requests (the bench does).
    """

    def __init__(self, policy, layers: int) -> None:
        self.policy = policy
        self.uses = UseClock(layers)
        self.plan: Plan | None = None

    def __call__(self, layer: int, residents: Sequence[int], protected: set[int], count: int) -> list[int]:
        """Called by the cache when `layer` needs `count` free slots: `residents` least recently used first."""
        return self.policy.victims(layer=layer, residents=list(residents), protected=frozenset(protected), count=count,
                                   history=self.uses.history(layer), plan=self.plan)
