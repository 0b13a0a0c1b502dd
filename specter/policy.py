"""The policy protocols (eviction, prefetch, lookahead; placement's lives in specter/placement.py) and their data.

Policies are plain synchronous objects: they never await, never touch CUDA, and can be replayed on the
CPU from a routing trace (`specter.replay`). Each is built with keyword-only options and has a `name`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence, Set
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from specter.placement import PlacementPolicy

# Shape legend: L MoE layers, E routed experts per layer.


@dataclass(frozen=True)
class UseHistory:
    """How one layer's experts have been used by the target, on a logical clock.

    The engine owns the clock: it ticks once per target use of an expert (one verify pass using an expert
    counts once), so `clock - last_use[e]` is how many uses ago expert `e` last served. Experts never used
    are absent from both maps.
    """

    last_use: Mapping[int, int]
    """Expert id -> clock tick of its last use by the target."""
    use_count: Mapping[int, int]
    """Expert id -> number of target uses so far."""
    clock: int
    """The current tick; every value in `last_use` is <= clock."""

    @classmethod
    def empty(cls) -> UseHistory:
        return cls(last_use={}, use_count={}, clock=0)


@dataclass(frozen=True)
class Plan:
    """Which experts each layer should have resident for the coming verify pass.

    Produced by a `PrefetchPolicy`, read by the transfer engine (what to load, in layer order) and by the
    `EvictionPolicy` (what not to evict). Layers absent from `experts` have nothing planned.
    """

    experts: Mapping[int, list[int]] = field(default_factory=dict)
    """Layer -> distinct expert ids to have resident, highest priority first (at most the layer's slots)."""
    scores: Mapping[int, Mapping[int, float]] = field(default_factory=dict)
    """Layer -> expert -> predicted use weight (e.g. draft route counts); may score unplanned experts."""

    def for_layer(self, layer: int) -> list[int]:
        return list(self.experts.get(layer, ()))

    def score(self, layer: int, expert: int) -> float:
        return float(self.scores.get(layer, {}).get(expert, 0.0))


@dataclass(frozen=True)
class LinkTiming:
    """What the host-to-device link and the draft cost, as measured by the engine (`Runtime._timing`)."""

    bandwidth_bytes_per_s: float
    """Sustained H2D bandwidth of the copy stream (emulated links included); 25e9 until a copy has been measured."""
    draft_step_s: float
    """Seconds for one draft step (one token through the quantized draft); 1e-3 until a draft step has been timed."""
    expert_bytes: int
    """Bytes one routed expert moves across the link."""

    def experts_per_draft_step(self) -> float:
        """How many experts the link moves while the draft runs one step."""
        return self.bandwidth_bytes_per_s * self.draft_step_s / self.expert_bytes


@dataclass(frozen=True)
class LookaheadState:
    """Everything the lookahead policy may use to pick the next draft depth k: measured, but for the stand-ins a fresh
    engine gives before its first measurement (`bandwidth_bytes_per_s` 25e9, as `LinkTiming`'s)."""

    acceptance_by_position: list[float]
    """EMA of P(draft token i accepted | all before accepted); index 0 is the first draft token. Only the
    positions measured so far (a prefix, possibly empty): a policy extrapolates past them itself, so that a
    position no round has reached yet does not count as an unchanging prior."""
    draft_step_s_fit: tuple[float, float]
    """(a, b): k draft steps take a + b*k seconds."""
    verify_s_fit: tuple[float, float]
    """(a, b): a verify pass over `rows` tokens takes a + b * rows ** union_exponent seconds, transfers excluded."""
    bandwidth_bytes_per_s: float
    """Sustained H2D bandwidth."""
    predicted_new_bytes: list[float]
    """Index k: bytes the plan for depth k would move that are not resident (index 0: plain decode)."""
    k_max: int
    """The deepest draft the engine can run (scratch KV size); next_k must lie in 0..k_max."""
    model_key: str
    """Identifies model + memory budget, so a policy can remember what it learned per configuration."""
    round_overhead_s: tuple[float, float] = (0.0, 0.0)
    """(plain, speculative): a round's measured time outside its draft and verify (sampling, acceptance,
    commit, plans), which deeper rounds share among more tokens."""
    scout_s: float = 0.0
    """Seconds of the one-step scout draft a plain round runs first (DraftConfig.scout); 0: plain rounds do not scout."""
    union_exponent: float = 1.0
    """beta: the distinct experts a verify of `rows` rows needs grow as rows ** beta (measured, `Estimates.beta`; 1 until
    measured). A verify's expert work (weights read on the device, host experts computed) follows its distinct
    experts, not its rows, so `verify_s_fit` is fitted over rows ** beta."""


@dataclass(frozen=True)
class RoundOutcome:
    """What one decode round achieved, reported to the lookahead policy after commit."""

    k: int
    """Draft depth the round ran with (0: plain decode)."""
    accepted: int
    """Draft tokens accepted (0..k); the round committed accepted + 1 tokens."""
    tpot_s: float
    """Seconds per committed token this round."""
    round_s: float
    """Wall seconds of the whole round (draft, transfers, verify, accept)."""


@runtime_checkable
class EvictionPolicy(Protocol):
    """Chooses which resident experts of one layer give up their cache slots."""

    name: str

    def victims(
        self,
        layer: int,
        residents: Sequence[int],
        protected: Set[int],
        count: int,
        history: UseHistory,
        plan: Plan | None,
    ) -> list[int]:
        """Pick `count` experts of `layer` to evict.

        Called by the expert cache (and by `specter.replay`) whenever a load into `layer` needs slots and
        the layer has fewer than `count` free ones: while prefetching a plan during the draft, and when
        the verify pass misses. Called with keyword arguments.

        `residents` are the layer's resident expert ids, least recently used first (a load counts as a use), a
        fresh list in the engine and the replay alike; `protected` are ids that must stay (planned and not
        yet verified, or in use by the current pass); `history` is this layer's use history (copies); `plan` is the
        current round's plan, or None outside speculation. The caller guarantees at least `count`
        residents are unprotected, else it does not call.

        The verify also asks, when a layer's misses outnumber its free and evictable slots, which of the
        residents the pass is about to use should give up their slots: then every resident but those is in
        `protected`, the chosen ones are used first, and each is evicted once used (if nothing else holds it
        by then; a choice may therefore go unused).

        Must return exactly `count` distinct ids from `residents`, none in `protected`. Must not mutate
        its inputs; may keep its own state.
        """
        ...


@runtime_checkable
class PrefetchPolicy(Protocol):
    """Turns the draft's routing counters into a plan of experts to load ahead of verify."""

    name: str

    def checkpoints(self, k: int, timing: LinkTiming) -> list[int]:
        """Draft-step counts (sorted, distinct, each in 1..k) after which `plan` is called this round.

        Called once per round by the engine before the draft starts, with k >= 1 (k = 0 has no draft and
        no prefetch). The design: the first after about 20 % of k, then chunks sized so that the bytes in
        flight match what the link moves in that many draft steps. An empty list means never plan.
        """
        ...

    def plan(
        self,
        route_counts: np.ndarray,
        resident: np.ndarray,
        steps_done: int,
        k: int,
        timing: LinkTiming,
        slots_per_layer: int,
    ) -> Plan:
        """Plan which experts each layer should hold for the coming verify.

        Called by the engine at each checkpoint, after `steps_done` of `k` draft steps, with keyword
        arguments. `route_counts` `[L, E]` float counts how often the draft's router picked each expert
        (top-k hits) so far this round, 0 for the experts the placement computes on the host (the cache never holds
        them, so a plan's slots go elsewhere); `resident` `[L, E]` bool is the cache's residency now. Both are
        host copies the policy may read but not keep.

        Must return a `Plan` listing, per layer, at most that layer's slots of distinct expert ids in 0..E-1.
        `slots_per_layer` is the fewest slots a layer has (a budget between whole counts gives some layers one
        more, `MemoryPlan.layer_slots`): at most `slots_per_layer` fits every layer.
        The engine loads the non-resident ones in layer order and protects all of them until verified.
        """
        ...


@runtime_checkable
class LookaheadPolicy(Protocol):
    """Picks the draft depth k of the next round; k = 0 is plain decoding."""

    name: str

    def next_k(self, state: LookaheadState) -> int:
        """Return the next round's draft depth in 0..state.k_max.

        Called by the engine once at the start of every round, with measurements updated through the
        previous round. Must be cheap (it runs on the critical path between rounds).
        """
        ...

    def observe(self, outcome: RoundOutcome) -> None:
        """Learn from the round just committed.

        Called by the engine once per round after commit, always after the `next_k` that chose
        `outcome.k` (the engine may have clamped it); an engine without a draft asks no `next_k` and observes
        nothing. Must not raise for ordinary outcomes.
        """
        ...


PROTOCOLS: Mapping[str, type] = {
    "eviction": EvictionPolicy,
    "prefetch": PrefetchPolicy,
    "lookahead": LookaheadPolicy,
    "placement": PlacementPolicy,
}

REQUIRED_METHODS: Mapping[str, tuple[str, ...]] = {
    "eviction": ("victims",),
    "prefetch": ("checkpoints", "plan"),
    "lookahead": ("next_k", "observe"),
    "placement": ("place",),
}
"""Short group name -> methods a policy of that group must have (used by the plug-in loader)."""

OPTIONAL_METHODS: Mapping[str, tuple[str, ...]] = {"placement": ("prices_misses", "place_prefill")}
"""Short group name -> methods a policy may have, called when present (checked at load for what they can be checked)."""


def protocol_problems(policy: object, group: str) -> list[str]:
    """What keeps `policy` from satisfying the protocol of `group` ('eviction', ...); empty when fine."""
    problems = [f"{method}() missing" for method in REQUIRED_METHODS[group] if not hasattr(policy, method)]
    problems += [
        f"{method} is not callable"
        for method in REQUIRED_METHODS[group]
        if hasattr(policy, method) and not callable(getattr(policy, method))
    ]
    asynchronous = [method for method in (*REQUIRED_METHODS[group], *OPTIONAL_METHODS.get(group, ()))
                    if inspect.iscoroutinefunction(getattr(policy, method, None))
                    or inspect.isasyncgenfunction(getattr(policy, method, None))]
    problems += [f"{method}() is async; the engine calls policies synchronously (it would get a coroutine), so make "
                 "it a plain def" for method in asynchronous]
    problems += [problem for method in REQUIRED_METHODS[group]
                 if callable(getattr(policy, method, None)) and method not in asynchronous
                 for problem in _call_problems(getattr(policy, method), getattr(PROTOCOLS[group], method), method)]
    name = getattr(policy, "name", None)
    if not isinstance(name, str) or not name:
        problems.append("`name` attribute missing or not a non-empty str")
    return problems


def _call_problems(method: Callable[..., Any], protocol_method: Callable[..., Any], name: str) -> list[str]:
    """Whether `method` takes the engine's call, found at load and not at the first decision after the whole model
    loaded: parameter names other than the protocol's fail it (every call passes them as keywords)."""
    keywords = [parameter for parameter in inspect.signature(protocol_method).parameters if parameter != "self"]
    try:
        inspect.signature(method).bind(**dict.fromkeys(keywords))
    except ValueError:  # no signature to read (a builtin): the call itself will tell
        return []
    except TypeError as error:
        return [f"{name}() cannot take the engine's call {name}({', '.join(f'{k}=...' for k in keywords)}): {error}; "
                "keep the protocol's parameter names"]
    return []
