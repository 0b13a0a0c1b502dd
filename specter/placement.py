"""Which path serves each routed expert for the engine's whole life: the device or the host CPU (issue 29).

A `Placement` puts each (MoE layer, routed expert) on exactly one path. The device path is the expert cache as it
always was (resident, prefetched or copied on demand); the host path computes the expert on the host CPU from the
pinned pool's bytes (`specter.experts.host`) and never copies it. A `specter.placement` plug-in decides the placement
once, when the engine loads, from a `PlacementState`; it never changes with k, the draft or the cache, so the
target's function is fixed and speculative output equals target-only (k = 0) output with the same placement
(docs/ARCHITECTURE.md, "Contracts"). Pure data and a protocol: no torch, so placements replay on any CPU.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol, runtime_checkable

import numpy as np

from specter.errors import ConfigError, PluginError

# Layers here are the compact MoE-layer indices the expert cache and the pool use (0..L-1), not model layers.


@dataclass(frozen=True)
class Placement:
    """Per MoE layer, the routed experts computed on the host; every other expert takes the device path."""

    host: tuple[frozenset[int], ...]
    """Layer -> ids of the host-path experts of that layer (empty: the layer is all device path)."""
    num_experts: int
    """Routed experts per layer (ids are 0..num_experts-1)."""

    def __post_init__(self) -> None:
        for layer, experts in enumerate(self.host):
            bad = sorted(e for e in experts if not 0 <= e < self.num_experts)
            assert not bad, f"placement of layer {layer} names experts {bad} outside 0..{self.num_experts - 1}"

    @classmethod
    def device_only(cls, num_layers: int, num_experts: int) -> Placement:
        """Every expert on the device path: the engine as it was before host experts (`off`)."""
        return cls(tuple(frozenset() for _ in range(num_layers)), num_experts)

    @classmethod
    def of(cls, host: Mapping[int, Iterable[int]] | Sequence[Iterable[int]], num_layers: int, num_experts: int) -> Placement:
        """A placement from layer -> host experts (a mapping, layers absent are device only, or one entry per layer)."""
        items = host.items() if isinstance(host, Mapping) else enumerate(host)
        layers = [frozenset()] * num_layers
        for layer, experts in items:
            layers[layer] = frozenset(int(e) for e in experts)
        return cls(tuple(layers), num_experts)

    @property
    def num_layers(self) -> int:
        return len(self.host)

    @property
    def active(self) -> bool:
        """Whether any expert takes the host path (False: the engine runs exactly as without placements)."""
        return any(self.host)

    def is_host(self, layer: int, expert: int) -> bool:
        return expert in self.host[layer]

    def host_experts(self, layer: int) -> frozenset[int]:
        return self.host[layer]

    def device_experts(self, layer: int) -> list[int]:
        """The layer's device-path experts, ascending."""
        return [e for e in range(self.num_experts) if e not in self.host[layer]]

    def split(self, layer: int, experts: Iterable[int]) -> tuple[list[int], list[int]]:
        """(device-path, host-path) experts of `experts`, each in the order given."""
        chosen = list(experts)
        host = self.host[layer]
        return [e for e in chosen if e not in host], [e for e in chosen if e in host]

    def counts(self) -> list[int]:
        """Host-path experts per layer."""
        return [len(experts) for experts in self.host]

    @property
    def total(self) -> int:
        """Host-path (layer, expert) pairs in the model."""
        return sum(self.counts())


@dataclass(frozen=True)
class PlacementState:
    """What a placement policy may use, measured where the engine has measured it (others are None or empty).

    Read-only all through: its mappings are `MappingProxyType`s and its sequences tuples (copies of what it is built
    from), and its `route_sequence` is read-only too. The engine hands this object to the policy and keeps it, for
    its decision record and every prompt's `place_prefill` (the bench and the replay likewise for the policies they
    compare): a policy that changed it (a measured cost set to 0, a count appended) would change what the engine
    records and what the next call is given. The cost model's own memo (`_replayed`) is the one part that fills in."""

    num_layers: int
    """MoE layers (the compact indices of `Placement.host`)."""
    num_experts: int
    """Routed experts per layer."""
    top_k: int
    """Experts each token routes to per layer."""
    slots_per_layer: int
    """Device expert-cache slots per MoE layer (all experts when everything fits: then there is nothing to place)."""
    initial_residents: tuple[tuple[int, ...], ...]
    """Per layer, the experts the device cache holds when the placement is made, least recently used first (empty at
    load; the bench places from the cache state each of its cells starts from)."""
    expert_bytes: int
    """Bytes one routed expert moves across the link (and the host reads to compute it)."""
    row_bucket: int
    """EngineConfig.row_bucket: the host computes an expert on blocks of exactly this many rows (torch's kernel; the
    native one computes each row on its own and takes the rows as they are)."""
    host_threads: int = 1
    """Torch intra-op threads of the host expert path (EngineConfig.cpu_threads resolved)."""
    link_bytes_per_s: float | None = None
    """Measured (or emulated) sustained H2D bandwidth; None: not measured yet."""
    host_expert_s: Mapping[int, float] = field(default_factory=dict)
    """Measured seconds to compute one expert on the host, by row count (empty: not calibrated yet). The engine
    measures it at `row_bucket` rows (`specter.experts.costs`): with torch's kernel the host runs every expert on
    blocks of exactly that many, so one row costs what `row_bucket` rows cost; the native kernel runs the rows as they
    are and is timed on a block's worth of them, so the figure is a block's cost either way."""
    host_job_s: float | None = None
    """Measured seconds a host job costs beyond its experts' `host_expert_s` (a job: one layer's host experts of one
    forward, one call of the host path, whatever their number): the kernel's thread team started, the rows down and the
    outputs back. With it `host_expert_s` is what one more expert in a job adds; None: not measured, no fixed part
    (`host_expert_s` then carries a job's share of it, as measured at a job's usual size)."""
    host_kernel: str | None = None
    """The host kernel `host_expert_s` was measured with and the host path runs (`costs.HostKernel`: 'torch', or
    'native' where the calibration found it faster); None: not calibrated."""
    route_counts: Sequence[Sequence[float]] | None = None
    """Per layer and expert, how often the target routed to it on calibration tokens (None: not measured; the cost
    model then assumes uniform routing). The engine reads it from `EngineConfig.placement_profile`, a routing trace."""
    route_sequence: RouteSequence | None = None
    """The same profile's rounds in order (None: counts only, or no profile): the cost model then replays each
    layer's slots over them instead of assuming independent uses (`layer_path_uses`)."""
    speculates: bool = False
    """Whether the engine drafts rounds of k > 0 whose draft prefetches the next experts (False: k = 0 only, e.g. a
    scout-only or plain engine). With `route_sequence`'s rounds, the cost model then counts only the copy time the
    prefetch does not hide (`prefetch_misses`, `_waited_share`). Filled from EngineConfig where the state is built."""
    eviction: str = "plan-protect"
    """EngineConfig.eviction: the `specter.eviction` plug-in the prefetch replay (`prefetch_misses`) evicts with."""
    prefetch: str = "topm-keep"
    """EngineConfig.prefetch: the `specter.prefetch` plug-in the prefetch replay plans with."""
    layer_slots: tuple[int, ...] = ()
    """Each MoE layer's own slots where they differ (`MemoryPlan.layer_slots`: one more in some layers); empty:
    `slots_per_layer` in every layer. Read through `slots`."""
    _replayed: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    """What `layer_path_uses` and `layer_host_uses` replayed of `route_sequence`, by layer and candidate order (which
    answers each host set that is a prefix of it: `_prefix_uses`) and by layer and host set (a set replayed alone), so
    that the load's `decision_record` and `token_seconds` read what the policy's pass made instead of replaying the
    rounds again. Not an input: a `dataclasses.replace` starts empty."""

    def __post_init__(self) -> None:
        frozen = {"initial_residents": tuple(tuple(layer) for layer in self.initial_residents),
                  "layer_slots": tuple(self.layer_slots), "host_expert_s": MappingProxyType(dict(self.host_expert_s)),
                  "route_counts": None if self.route_counts is None else tuple(tuple(row) for row in self.route_counts)}
        for name, value in frozen.items():
            object.__setattr__(self, name, value)

    def slots(self, layer: int) -> int:
        """The device slots of MoE layer `layer`."""
        return self.layer_slots[layer] if self.layer_slots else self.slots_per_layer


@dataclass(frozen=True)
class RouteSequence:
    """A routing profile's rounds in the order they ran: what use counts lose, the reuse of experts from one token to
    the next, which an LRU cache turns into hits and the host path does not."""

    used: tuple[tuple[tuple[int, ...], ...], ...]
    """Layer -> round -> the distinct experts the round's verify used at that layer, in the order it first used them."""
    rows: tuple[int, ...]
    """Per round, the rows its verify computed (k + 1): a host expert it used costs at most ceil(rows / row_bucket)
    blocks (the host path pads only the n rows routed to it, ceil(n / row_bucket); the trace keeps no per-expert row
    counts, and the two are equal while rows <= row_bucket)."""
    tokens: int
    """Tokens the rounds committed (accepted + 1 each): the cost model's misses and host blocks are per one of these."""
    rounds: tuple = field(default=(), compare=False, repr=False)
    """The trace's rounds themselves (`specter.trace.TraceRound`), with the draft's predictions: for an engine that
    speculates, the cost model replays the prefetch over them (`prefetch_misses`). Empty: uses only. Kept as read-only
    copies (`_read_only_round`: tuples and `MappingProxyType`s over the trace's own mappings), as the rest: a
    sequence is shared by every state placed from the same trace (`costs.routing_profile` keeps it for the next
    load), and by the replay that read the trace, so a policy must not be able to change it."""

    recorded_prefetch: str | None = None
    """The prefetch plug-in whose plans the rounds' checkpoints are (the trace header's `prefetch`; None where it does
    not say): the cost model's replay holds only that policy to them (`specter.replay.recorded_by`)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "used", tuple(tuple(tuple(experts) for experts in layer) for layer in self.used))
        object.__setattr__(self, "rows", tuple(self.rows))
        object.__setattr__(self, "rounds", tuple(_read_only_round(trace_round) for trace_round in self.rounds))

    @classmethod
    def of_rounds(cls, rounds: Iterable, num_layers: int, max_tokens: int | None = None,
                  recorded_prefetch: str | None = None) -> RouteSequence:
        """From a trace's rounds (`specter.trace.TraceRound`: `k`, `accepted` and per layer `used`), in order, the
        first ones up to `max_tokens` committed tokens (None: all; `SEQUENCE_TOKENS` bounds what the load replays).
        A round that routes fewer than `num_layers` layers is refused: it would put the later rounds' experts against
        another round's rows."""
        used: list[list[tuple[int, ...]]] = [[] for _ in range(num_layers)]
        rows, tokens, kept = [], 0, []
        for trace_round in rounds:
            if max_tokens is not None and tokens >= max_tokens:
                break
            if len(trace_round.layers) < num_layers:  # each layer's rounds must line up with `rows`
                raise ConfigError(f"routing trace round {trace_round.round} routes {len(trace_round.layers)} of "
                                  f"{num_layers} MoE layers: a trace records every layer of every round")
            for layer, routes in enumerate(trace_round.layers[:num_layers]):
                used[layer].append(tuple(dict.fromkeys(int(e) for e in routes.used)))
            rows.append(trace_round.k + 1)
            tokens += trace_round.accepted + 1
            kept.append(trace_round)
        return cls(tuple(tuple(layer) for layer in used), tuple(rows), tokens, tuple(kept), recorded_prefetch)


def _read_only_round(trace_round: Any) -> Any:
    """A `specter.trace.TraceRound` whose layers, their `used` and the checkpoints are tuples and whose predicted counts
    are read-only views of the round's own (one already so is returned as it is)."""
    if isinstance(trace_round.layers, tuple) and all(isinstance(routes.predicted, MappingProxyType)
                                                     and isinstance(routes.used, tuple) for routes in trace_round.layers):
        return trace_round
    layers = tuple(dataclasses.replace(routes, predicted=_read_only(routes.predicted), used=tuple(routes.used))
                   for routes in trace_round.layers)
    checkpoints = None if trace_round.checkpoints is None else tuple(
        (steps, tuple(_read_only(counts) for counts in rows)) for steps, rows in trace_round.checkpoints)
    return dataclasses.replace(trace_round, layers=layers, checkpoints=checkpoints)


def _read_only(mapping: Mapping) -> Mapping:
    return mapping if isinstance(mapping, MappingProxyType) else MappingProxyType(mapping)


@runtime_checkable
class PlacementPolicy(Protocol):
    """Decides, once per engine, which routed experts are computed on the host CPU."""

    name: str

    def place(self, state: PlacementState) -> Placement:
        """Return the placement of every (MoE layer, routed expert).

        Called by the builder once, after the expert pool and the device cache exist and before the first request
        (the bench calls it again for each cell's starting cache). The answer is fixed for the engine's life: it must
        not depend on anything a request changes. Must return a `Placement` with `state.num_layers` layers and ids in
        0..num_experts-1; the device-path experts of a layer that fit in its slots are loaded once and stay.
        """
        ...

    # Optional: place_prefill(state: PlacementState, decode: Placement, rows: int) -> Placement
    #   The placement of a prompt's forward of `rows` rows (called by the runtime before each prompt, with the state and
    #   the decode placement `place` gave). A prompt's forward is the same in a speculative and a k = 0 run, so it may
    #   differ from the decode placement without breaking exactness, as long as it is a function of `state`, `decode`
    #   and `rows` alone. Its host experts must be a subset of `decode`'s, layer by layer (the host path exists only
    #   where decoding uses it; a decode host expert the prompt computes on the device is copied for the prompt and
    #   dropped after). Absent: the prompt uses `decode` (`prefill_placement`).


def check_slot_count(option: str, slots: int, top_k: int, num_experts: int, beside: str = "") -> None:
    """Refuse `slots` per MoE layer outside top_k..num_experts, as the engine's load does (`memory._slots`), for the
    tools that model a cache without loading one (`specter info`, the replay); `option` names the flag given."""
    if not top_k <= slots <= num_experts:
        raise ConfigError(f"{option} {slots}: expected {top_k}..{num_experts} slots per MoE layer (at least one token's "
                          f"active experts, its top-k {top_k}; at most its {num_experts} experts){beside}")


def fill_slots(residents: Sequence[int], slots: int, num_experts: int,
               rates: Sequence[float] | None = None) -> tuple[list[int], list[int]]:
    """A layer's device experts from the cache it starts with: (kept, fill). `kept`: the last `slots` of `residents`
    (LRU order, most recent last); `fill`: the slots they leave free, taken by the most used other experts by `rates`
    (lower id first on ties), else the lowest other ids, ascending. A free slot left out would never be used by a
    placement that does not copy (`all`), nor by a bench cell that starts from that cache."""
    kept = list(residents[-slots:]) if slots > 0 else []
    held = set(kept)  # a set: the list would make this O(E x slots) per layer
    others = [e for e in range(num_experts) if e not in held]
    if rates is not None:
        others.sort(key=lambda e: (-rates[e], e))
    return kept, sorted(others[:max(0, min(slots, num_experts) - len(kept))])


def layer_counts(slots: int | Sequence[int], layers: int) -> tuple[int, ...]:
    """Each MoE layer's slots, from one count for every layer or one each (`MemoryPlan.layer_slots`)."""
    return (slots,) * layers if isinstance(slots, int) else tuple(slots)


def preloaded(placement: Placement, slots: int | Sequence[int]) -> list[list[int]]:
    """Per layer, the device-path experts to load once at start-up: all of them where they fit in the layer's slots
    (`slots`: one count for every layer, or one each), so that none of them is ever missed and nothing of that layer
    crosses the link again; none where they do not (the cache serves them on demand, as without placements). Nothing
    at all when no expert takes the host path."""
    if not placement.active:
        return [[] for _ in range(placement.num_layers)]
    device = [placement.device_experts(layer) for layer in range(placement.num_layers)]
    counts = layer_counts(slots, placement.num_layers)
    return [experts if len(experts) <= count else [] for experts, count in zip(device, counts, strict=True)]


def prefill_placement(policy: object, state: PlacementState, decode: Placement, rows: int) -> Placement:
    """The placement of a prompt of `rows` rows: the policy's `place_prefill` where it has one, else `decode`."""
    place_prefill = getattr(policy, "place_prefill", None)
    return decode if place_prefill is None else place_prefill(state=state, decode=decode, rows=rows)


# ---- the cost model a calibrated policy weighs (pure: the replay and `specter info` use it too) ----------------------
# Per MoE layer and token: the device path's expected misses times one expert's copy, and the host path's expected
# uses times one expert's host compute, combined by `overlap` (1: the layer costs the longer of the two; 0: their
# sum). Within a layer the two paths run at once (docs/ARCHITECTURE.md, step 4: the host job goes out as soon as the
# routing is read, before the misses' copies, and is awaited once the device path is launched), so per layer-forward
# the shorter one hides under the longer. But `overlap` applies to the expected times, and at one row per token the
# two paths share a layer only when a token's experts include both a host expert and a miss: the hidden time is
# E[min(device, host)], well below min(E[device], E[host]), so 1 here is a floor, not what full overlap gives, and the
# `overlap` that fits a measured layer time is E[hidden] / min(E[device], E[host]), which depends on the shape, the
# routing and the rows per forward. The device's own compute is left out: it is the same whichever path an expert
# takes off the device. Every function returns None where a cost is not measured.

OVERLAP = 0.0
"""Default `overlap`: the sum, kept until a run measures it. The H200's first hybrid run (docs/BENCHMARKS.md, "Hybrid
systems": Mixtral shape, 2 of 8 resident, Gen4, 4 of the 6 non-residents per layer on the host) measured 14.5 ms per
layer and token, which the sum predicts from the calibration (1.0 host use x 7.8 ms + 0.5 misses x 14.1 ms = 14.8 ms),
but which also fits paths that overlap wherever they meet: in those cells one host expert took 9.2-10.9 ms on its
thread against 7.2 ms in the same call's `all` cells (the host path slowed beside the link: the emulated link's pump
then kept the loop thread spinning through every copy, with 16 host threads on 16 cores, and the copies share the
host's memory bandwidth), and each request's host seconds plus its stall on copies exceeded its wall time by 0.24-0.31
s (about 2 ms per layer and token ran at once; the most one row per token allows there is E[min] ~2.2-2.9 ms). With
the sum, `auto` picks `all` there, which is also what E[max] over the tokens picks. To set it: the split run
(`PLACEMENT_OVERLAP=1 bash benchmarks/reproduce.sh hybrid`) gives `host_hidden_s`, and OVERLAP = the hidden seconds /
min(host seconds, misses x one copy) over its requests, once the host's time per expert there matches `all`'s."""


def use_rates(state: PlacementState) -> list[list[float]]:
    """Per layer and expert, its expected uses per token (the probability a token routes to it): `route_counts`
    scaled so that a layer's rates sum to top_k (each token picks top_k experts), capped at 1; uniform top_k / E
    without a profile (or for a layer the profile never saw)."""
    uniform = [state.top_k / state.num_experts] * state.num_experts
    rates = []
    for layer in range(state.num_layers):
        counts = list(state.route_counts[layer]) if state.route_counts is not None and layer < len(state.route_counts) else []
        total = sum(counts)
        rates.append([min(1.0, state.top_k * c / total) for c in counts] if len(counts) == state.num_experts and total > 0 else uniform)
    return rates


def copy_seconds(state: PlacementState) -> float | None:
    """One expert across the link (None: the link is not measured)."""
    return state.expert_bytes / state.link_bytes_per_s if state.link_bytes_per_s else None


def host_seconds(state: PlacementState, rows: int = 1) -> float | None:
    """One expert on `rows` rows on the host: ceil(rows / row_bucket) blocks of `row_bucket` rows, one after the other on
    the host thread (None: the host is not measured at `row_bucket` rows)."""
    per_block = state.host_expert_s.get(state.row_bucket)
    return per_block * math.ceil(max(1, rows) / state.row_bucket) if per_block is not None else None


def hit_probabilities(rates: Sequence[float], slots: int) -> list[float]:
    """Per expert of a set served by an LRU-like cache of `slots` slots, the probability that a token's use of it hits,
    by Che's approximation for independent references: the cache holds what was used within its last T tokens, T
    such that the expected number of distinct experts used within T tokens is `slots`; an expert of per-token use
    rate r was used within T tokens with probability 1 - (1 - r)^T. With equal rates over D experts every hit is S/D
    (a use misses with probability 1 - S/D); with skewed rates the much-used ones hit more, the rarely used less.
    All 1.0 when at most `slots` experts are ever used."""
    used = [r for r in rates if r > 0.0]
    if len(used) <= slots:
        return [1.0 if r > 0.0 else 0.0 for r in rates]
    if max(rates) - min(rates) <= 1e-12 * max(rates):  # equal rates: exactly S/D (no iteration)
        return [slots / len(rates)] * len(rates)
    logs = [math.log1p(-min(r, 1.0 - 1e-12)) for r in used]  # < 0: (1 - r)^T = exp(T log(1 - r))

    def distinct(t: float) -> float:  # expected distinct experts used within t tokens, minus the slots: concave, rising
        return sum(-math.expm1(t * lg) for lg in logs) - slots

    t = 0.0  # Newton from below on a concave rising function: every step stays below the root and climbs to it
    for _ in range(100):
        value = distinct(t)
        slope = -sum(lg * math.exp(t * lg) for lg in logs)
        step = -value / slope
        t += step
        if step <= 1e-9 * max(t, 1.0):
            break
    return [-math.expm1(t * math.log1p(-min(r, 1.0 - 1e-12))) if r > 0.0 else 0.0 for r in rates]


def expected_misses(rates: Sequence[float], device: Sequence[int], slots: int) -> float:
    """Expected misses per token of a layer whose device-path experts are `device`: none when they fit in the layer's
    slots (loaded once at start-up, `preloaded`); else each use of a device-path expert e misses with probability
    1 - hit_e (`hit_probabilities`: the D device-path experts churn through the S slots; uniform use gives
    (1 - S/D) x the layer's device uses = (D - S) x r per token), and never fewer than the device uses beyond the S
    experts the slots can hold at once."""
    if len(device) <= slots:
        return 0.0
    used = [rates[e] for e in device]
    hits = hit_probabilities(used, slots)
    misses = sum(r * (1.0 - hit) for r, hit in zip(used, hits))
    return max(misses, sum(used) - slots)


SEQUENCE_TOKENS = 4096
"""The committed tokens of a routing trace's rounds the load replays through each layer's slots (`RouteSequence`,
from the first round on): bounds the load's work, one pass per layer over the rounds' uses, each up to O(E log E).
It is part of the decision, not only of its cost: the misses and host blocks `auto` weighs come from these rounds
alone, so a longer trace places from its first SEQUENCE_TOKENS tokens, and another bound can place differently. Enough
rounds that the trace's noise stays small beside a layer's misses; the use counts that order the candidates still
come from the whole trace."""


def _recency(rounds: Sequence[Sequence[int]], slots: int, residents: Sequence[int]) -> list[int]:
    """The LRU stack (least recently used first) that one uncounted pass over `rounds` (each its distinct experts)
    leaves, each round's experts moved to the top as the verify uses them (those within the top `slots` as it found
    the stack first, then the others, each in the round's order), then `residents` used one at a time."""
    stack: dict = {}  # an ordered set, least recent first, so that moving an expert to the top is O(1)
    head: OrderedDict = OrderedDict()  # the stack's top `slots` (`_touch`)
    for experts in rounds:
        moved = [e for e in experts if e in head] + [e for e in experts if e not in head]
        for e in moved:
            stack.pop(e, None)
            stack[e] = None
        _touch(head, moved, slots)
    for e in dict.fromkeys(residents):
        stack.pop(e, None)
        stack[e] = None
    return list(stack)


def _touch(head: OrderedDict, moved: Sequence, slots: int) -> None:
    """Keep `head` the top `slots` of an LRU stack (most recent last) whose distinct experts `moved` go to the top, in
    order. Exact whatever the stack below holds: an expert moved from below the top enters it and pushes out its
    oldest, one moved within it only reorders it; `slots` of them or more are the top themselves."""
    slots = max(0, slots)
    if len(moved) >= slots:
        head.clear()
        head.update(dict.fromkeys(moved[len(moved) - slots:]))
        return
    for e in moved:
        head[e] = None
        head.move_to_end(e)
    while len(head) > slots:
        head.popitem(last=False)


def lru_misses_by_host(rounds: Sequence[Sequence[int]], order: Sequence[int], slots: int,
                       residents: Sequence[int] = ()) -> list[int]:
    """Per h in 0..len(order): the misses of a layer's LRU cache of `slots` slots over `rounds` (each round the distinct
    experts its verify used) when the experts order[:h] take the host path (never in the cache, their uses not
    counted), for every h in one pass. `order` names each expert at most once.

    As the engine counts them: per round, not per use. The verify checks each expert it uses against the cache as the
    round found it, and its misses take the slots of residents the round does not use, so an early miss never evicts
    an expert the same round uses later (`specter.experts.window`; the replay's `_verify_round`). After the round, its
    experts are the most recent: those that hit first, then those that missed, each in the round's order.

    LRU holds e at a round's start iff fewer than `slots` other cached experts are more recent (its stack distance),
    so a use misses under h iff at least `slots` of the experts above it in the stack as the round found it are device
    path, i.e. iff the `slots`-th highest candidate rank among them (an expert outside `order` never goes to the host:
    ranks past every h) is at least h; and a use of e counts only while e itself is device path (its rank >= h). The
    hits that go first are those within the top `slots` of the whole stack, which hit whatever goes to the host, so one
    stack serves every h: exact for h = 0 (`off`), and for any h where every round's hits are those of h = 0; where
    going to the host turns a round's miss into a hit, the engine uses that hit before the round's misses, which
    changes only which of the round's experts an eviction after the round finds oldest. A round that uses more experts
    than `slots` keeps its most recent ones here, where the engine's rolling window (`CacheTuning.roll_hot_window`)
    may keep others.

    The cache starts warm, as one uncounted pass over the rounds leaves it (as if they repeated: the one-time cold
    misses of a load are not what a layer pays per token over an engine's life), with `residents` (least recently
    used first) used last.

    The stack is kept as a timeline (`_Timeline`), so moving a round's experts to the top costs the round, not the
    stack; only a round's misses read the stack above them (`_miss_ranks`)."""
    top = len(order)
    rounds = [list(dict.fromkeys(experts)) for experts in rounds]
    stack = _recency(rounds, slots, residents)  # holds every expert the rounds use
    key = {e: index for index, e in enumerate(order)}  # its place in `order`; the others past every h, each its own
    assert len(key) == top, "lru_misses_by_host: `order` names an expert twice"  # a key must name one expert
    for e in stack:
        key.setdefault(e, len(key))
    keys = [key[e] for e in stack]
    head = OrderedDict.fromkeys(keys[max(0, len(keys) - max(0, slots)):])  # fewer than `slots` above: a hit for every h
    line = _Timeline(keys, top, len(key), max(map(len, rounds), default=0))
    found: list[int] = []  # per counted use, the largest h under which it misses (`_miss_ranks`)
    for experts in rounds:
        if not experts:
            continue
        own = [key[e] for e in experts]
        hits, misses = [k for k in own if k in head], [k for k in own if k not in head]
        if misses:
            found += _miss_ranks(line, misses, slots, top) if slots > 0 else [min(k, top) for k in misses]
        line.to_top(hits + misses)
        _touch(head, hits + misses, slots)
    counted = np.bincount(np.array(found, dtype=np.int64), minlength=top + 1)  # counted[m]: uses that miss for h <= m
    return np.cumsum(counted[::-1])[::-1].tolist()


class _Timeline:
    """An LRU stack of distinct keys as the places of their last moves, least recent first: `capped` holds each key
    (capped at `top`, past which every key is alike) at its place and -1 at the places keys have left, so a move to
    the top writes only the keys moved, and the stack above a key is the timeline after its place."""

    def __init__(self, keys: Sequence[int], top: int, count: int, most_moved: int) -> None:
        self.top, self.size, self.end = top, len(keys), len(keys)
        self.capped = np.full(2 * (len(keys) + most_moved) + 1, -1, dtype=np.int64)
        self.capped[:self.end] = np.minimum(keys, top)
        self.place = np.zeros(count, dtype=np.int64)  # key -> its place (keys not in the stack: never read)
        self.place[keys] = np.arange(self.end)

    def to_top(self, moved: Sequence[int]) -> None:
        """Move the keys `moved` to the top of the stack, in order (the last one most recent)."""
        if self.end + len(moved) > len(self.capped):  # full: drop the places left (once per stack's worth of moves)
            live = self.capped[:self.end] >= 0
            self.place = (np.cumsum(live) - 1)[self.place]
            self.capped[:self.size] = self.capped[:self.end][live]
            self.capped[self.size:] = -1
            self.end = self.size
        keys = np.array(moved, dtype=np.int64)
        self.capped[self.place[keys]] = -1
        self.capped[self.end:self.end + len(keys)] = np.minimum(keys, self.top)
        self.place[keys] = np.arange(self.end, self.end + len(keys))
        self.end += len(keys)


def _miss_ranks(line: _Timeline, misses: Sequence[int], slots: int, top: int) -> list[int]:
    """For a round's misses (keys each at least `slots` deep in `line`'s stack), each's min(own key, the `slots`-th
    highest key above it, `top`): the largest h under which it misses (`lru_misses_by_host`). Taken from the
    shallowest miss down, each one's keys above are the last one's plus those between the two, so a heap of the
    `slots` highest seen so far answers each, and only a key above its floor ever enters it. The floor only rises on
    the way down, so once it reaches every deeper miss's own key those misses are their own keys."""
    capped = line.capped[:line.end]
    own = np.array(misses, dtype=np.int64)
    at = line.place[own]
    rank = np.argsort(-at)  # shallowest first (each key has one place)
    at = at[rank].tolist()
    owns = np.minimum(own[rank], top).tolist()  # the floor never passes `top`
    above = capped[at[0] + 1:]  # at least `slots` keys, and places left behind (-1, below every key)
    cut = len(above) - slots
    best = np.partition(above, cut)[cut:]  # the `slots` highest keys above the shallowest miss
    floor = int(best[0])
    ranks = [min(owns[0], floor)]
    if len(at) == 1:
        return ranks
    deepest_own = list(itertools.accumulate(reversed(owns), max))[::-1]  # per miss, the highest own key from it down
    # each stretch between two misses (the keys one more miss down sees): its highest key, shallowest stretch first
    highest = np.maximum.reduceat(capped[at[-1] + 1:at[0] + 1], [place - at[-1] for place in reversed(at[1:])])
    highest = highest[::-1].tolist()
    heap: list[int] | None = None  # `best` as a heap, while keys enter it a few at a time
    for j in range(1, len(owns)):
        if floor >= deepest_own[j]:
            return ranks + owns[j:]
        if highest[j - 1] > floor:  # else the stretch leaves the `slots` highest as they are
            stretch = capped[at[j] + 1:at[j - 1] + 1]
            rising = stretch[stretch > floor]
            if len(rising) > 32:  # many: one partition costs less than a heap step each
                pool = np.concatenate((best if heap is None else np.array(heap, dtype=np.int64), rising))
                best, heap = np.partition(pool, len(pool) - slots)[len(pool) - slots:], None
                floor = int(best[0])
            else:
                if heap is None:
                    heap = best.tolist()
                    heapq.heapify(heap)
                for value in rising.tolist():
                    if value > heap[0]:
                        heapq.heapreplace(heap, value)
                floor = heap[0]
        ranks.append(min(owns[j], floor))
    return ranks


def lru_misses(rounds: Sequence[Sequence[int]], host: Iterable[int], slots: int, residents: Sequence[int] = ()) -> int:
    """`lru_misses_by_host`'s count for one host set, without the others: the same warm stack and the same order of
    each round's experts (its h = 0 hits first), so exactly lru_misses_by_host(rounds, order, ...)[len(order)] for any
    `order` of `host`. The device-path experts keep the whole stack's relative order, so a use misses iff its expert
    is not among the `slots` most recent of them. Only the top `slots` of the whole stack (which sorts a round into
    hits and misses) and of its device-path experts matter, each kept as it moves (`_touch`)."""
    host = frozenset(host)
    rounds = [list(dict.fromkeys(experts)) for experts in rounds]
    stack = _recency(rounds, slots, residents)
    device = [e for e in stack if e not in host]
    head = OrderedDict.fromkeys(stack[max(0, len(stack) - max(0, slots)):])
    near = OrderedDict.fromkeys(device[max(0, len(device) - max(0, slots)):])
    missed = 0
    for experts in rounds:
        moved = [e for e in experts if e in head] + [e for e in experts if e not in head]
        missed += sum(e not in host and e not in near for e in experts)
        _touch(head, moved, slots)
        _touch(near, [e for e in moved if e not in host], slots)
    return missed


def _replays(state: PlacementState, layer: int) -> bool:
    """Whether the cost model replays `layer` from the state's rounds (else it reads independent use rates)."""
    sequence = state.route_sequence
    return sequence is not None and layer < len(sequence.used) and sequence.tokens > 0


def has_rounds(state: PlacementState) -> bool:
    """Whether the state's profile carries a trace's rounds (with the draft's predictions): what the cost model
    replays a speculating engine's prefetch over (`prefetch_misses`); without them it cannot price that engine's
    misses (`Auto.prices_misses`)."""
    sequence = state.route_sequence
    return sequence is not None and sequence.tokens > 0 and bool(sequence.rounds)


def _hides(state: PlacementState, layer: int) -> bool:
    """Whether the cost model replays the draft's prefetch at `layer` (`prefetch_misses`)."""
    return state.speculates and _replays(state, layer) and has_rounds(state) and bool(state.link_bytes_per_s)


class PricingError(PluginError):
    """An eviction or prefetch plug-in's error (its own message, the plug-in's PluginError as the cause) raised inside
    the cost model's replay of a routing trace (`prefetch_misses`, with the engine's eviction and prefetch plug-ins),
    through the placement policy or the decision record that asked for the price: the loader says which placement
    priced which trace (`build.place_runtime`), which the plug-in's message alone cannot."""


def prefetch_misses(state: PlacementState, layer: int) -> float:
    """The copies of one expert `layer` waits for per pass over the state's rounds in `off`, in a speculating engine:
    the replay's verify misses after the draft's prefetch (`specter.replay.layer_prefetch_costs`, warm), plus the part
    of each round's prefetch its drafting does not hide, in expert copies. The replay charges a round's prefetch beyond
    what the link moves in its k draft steps to the round as a whole; each layer's share of that budget here is its
    share of the round's prefetched experts, so the layers sum to the replay's time exactly. A plug-in's error in that
    replay is raised as a `PricingError`."""
    memo = state._replayed
    if "off walks" not in memo:
        from specter.replay import hidden_bytes, layer_prefetch_costs  # the replay imports this module

        try:
            walks = [layer_prefetch_costs(state, other, frozenset(), state.eviction, state.prefetch)
                     for other in range(state.num_layers)]
        except PluginError as error:  # the plug-in's message cannot say that a placement's pricing ran it
            raise PricingError(str(error)) from error
        waited = [0.0] * state.num_layers
        for index, trace_round in enumerate(state.route_sequence.rounds):
            total = sum(walk[index][0] for walk in walks)
            budget = hidden_bytes(trace_round, state.link_bytes_per_s) / state.expert_bytes
            for other, walk in enumerate(walks):
                prefetched, misses = walk[index]
                share = prefetched / total if total else 1.0 / state.num_layers
                waited[other] += misses + max(0.0, prefetched - share * budget)
        memo["off walks"] = waited
    return memo["off walks"][layer]


def _waited_share(state: PlacementState, layer: int, lru_off: int) -> float:
    """What the speculating engine waits for at `layer` per miss of its LRU cache without prefetch, in `off`: the
    replay's (`prefetch_misses`) over the LRU's, 1 where the LRU misses nothing. It scales the LRU's misses for every
    host set: one replay per layer bounds the load's work, and hosting the least used experts leaves the device those
    the draft predicts best, so the share errs toward the device."""
    return prefetch_misses(state, layer) / lru_off if lru_off else 1.0


def _lru_off(state: PlacementState, layer: int) -> int:
    """The LRU misses of `layer` with no host experts (`off`), replayed once per state and layer."""
    memo = state._replayed
    if (layer, "lru off") not in memo:
        memo[layer, "lru off"] = lru_misses(state.route_sequence.used[layer], (), state.slots(layer),
                                            _residents(state, layer))
    return memo[layer, "lru off"]


def _residents(state: PlacementState, layer: int) -> tuple[int, ...]:
    return state.initial_residents[layer] if layer < len(state.initial_residents) else ()


def _round_blocks(state: PlacementState, layer: int) -> dict[int, int]:
    """Expert -> the host blocks its rounds would compute at `layer`: ceil(rows / row_bucket) per round that used it,
    an upper bound on the host path's ceil(n / row_bucket) for the n <= rows rows routed to it (`RouteSequence.rows`)."""
    memo = state._replayed
    if (layer, "blocks") not in memo:
        sequence, blocks = state.route_sequence, {}
        for experts_used, rows in zip(sequence.used[layer], sequence.rows, strict=True):
            for e in experts_used:
                blocks[e] = blocks.get(e, 0) + math.ceil(rows / state.row_bucket)
        memo[layer, "blocks"] = blocks
    return memo[layer, "blocks"]


def _host_blocks(state: PlacementState, layer: int, expert: int) -> float:
    """One host expert's blocks per committed token at `layer`, from the state's rounds. An engine that speculates
    computes it once per round that used it, for all the round's rows (`_round_blocks`, over the tokens the rounds
    committed). One that does not runs every token as its own one-row forward, which computes it once per token that
    routes to it: its use rate (`use_rates`, read here from the state, as the replays are, so that what the state keeps
    cannot mix rates). The rounds cannot say that (a round keeps the union of its rows' experts); charging a k = 0
    engine a speculating trace's rounds would divide its host time by the trace's tokens per round. The rates share
    that limit: they count the rounds that used an expert, scaled to top_k per token, which flattens them the more
    rows a round has, so a rarely used expert's rate is too high and a k = 0 engine's host path is priced high (the
    model errs toward the device)."""
    if not state.speculates:
        memo = state._replayed
        if "rates" not in memo:
            memo["rates"] = use_rates(state)
        return memo["rates"][layer][expert]
    return _round_blocks(state, layer).get(expert, 0) / state.route_sequence.tokens


def _per_token(state: PlacementState, layer: int, hosted: int, misses: int, host_blocks: float) -> tuple[float, float]:
    """(device misses, host blocks) per committed token from the rounds' misses and the host blocks per token; no
    misses where the layer's device-path experts fit its slots (`preloaded`)."""
    tokens = state.route_sequence.tokens
    return (0.0 if state.num_experts - hosted <= state.slots(layer) else misses / tokens), host_blocks


def layer_path_uses(state: PlacementState, layer: int, rates: Sequence[float], order: Sequence[int]) -> list[tuple[float, float]]:
    """Per h in 0..len(order): a layer's expected (device-path misses, host blocks) per token with order[:h] on the
    host path and every other expert on the device path (none missed where they fit in the slots: `preloaded`).

    With a `route_sequence`, from its rounds: an LRU of the layer's slots over them, round by round as the verify
    counts, warm and with its initial residents used last (`lru_misses_by_host`), and each host expert
    ceil(rows / row_bucket) blocks per round that used it (an upper bound: `RouteSequence.rows`), over the tokens
    the rounds committed, for an engine that speculates; for one that does not, a block per token that routes to it
    (`_host_blocks`). Real routing reuses
    experts from token to token, which an LRU cache turns into hits while a host expert is computed again each round;
    independent uses cannot show it. The answer for each host set order[:h] is kept on the state (`layer_host_uses`
    reads it). Without one, from `rates` as independent uses: Che's approximation (`expected_misses`) and one block
    per use."""
    if _replays(state, layer):
        memo = state._replayed
        if (layer, tuple(order)) not in memo:
            misses = lru_misses_by_host(state.route_sequence.used[layer], order, state.slots(layer),
                                        _residents(state, layer))
            memo.setdefault((layer, "lru off"), misses[0])  # h = 0 is exact: `off` for `layer_host_uses`
            if _hides(state, layer):
                scale = _waited_share(state, layer, misses[0])
                misses = [m * scale for m in misses]
            blocks = _prefix_sums([_host_blocks(state, layer, e) for e in order])  # fsum's, as `layer_host_uses`' sums
            memo[layer, tuple(order)] = [_per_token(state, layer, h, misses[h], blocks[h])
                                         for h in range(len(order) + 1)]
            memo.setdefault((layer, "orders"), []).append(tuple(order))  # `_prefix_uses` reads each host set order[:h]
        return list(memo[layer, tuple(order)])
    uses, host = [], 0.0
    hosted = set()
    for h in range(len(order) + 1):
        if h:
            hosted.add(order[h - 1])
            host += rates[order[h - 1]]
        uses.append((expected_misses(rates, [e for e in range(state.num_experts) if e not in hosted],
                                     state.slots(layer)), host))
    return uses


def layer_host_uses(state: PlacementState, layer: int, rates: Sequence[float], host: Iterable[int]) -> tuple[float, float]:
    """`layer_path_uses`' (device-path misses, host blocks) per token for the one host set `host`: from the state's
    rounds, what a pass over an order through that set kept, else one replay of that set alone (`lru_misses`); without
    them, Che's approximation over the device-path experts and the host experts' use rates."""
    host = sorted(set(host))
    if _replays(state, layer):
        memo, hosted = state._replayed, frozenset(host)
        kept = _prefix_uses(memo, layer, hosted)
        if kept is not None:
            return kept
        if (layer, hosted) not in memo:
            misses = lru_misses(state.route_sequence.used[layer], hosted, state.slots(layer), _residents(state, layer))
            if _hides(state, layer):
                misses *= _waited_share(state, layer, _lru_off(state, layer))
            memo[layer, hosted] = _per_token(state, layer, len(host), misses,
                                             math.fsum(_host_blocks(state, layer, e) for e in host))
        return memo[layer, hosted]
    hosted = set(host)
    return (expected_misses(rates, [e for e in range(state.num_experts) if e not in hosted], state.slots(layer)),
            sum(rates[e] for e in host))


def _prefix_uses(memo: dict, layer: int, hosted: frozenset) -> tuple[float, float] | None:
    """What `layer_path_uses` kept for the host set `hosted` at `layer`: the entry h = len(hosted) of the latest
    order it replayed whose first h experts are that set (None: no such order). The orders are kept whole, not one
    entry per prefix, which would hold O(E^2) experts per layer."""
    h = len(hosted)
    for order in reversed(memo.get((layer, "orders"), ())):
        if h <= len(order) and hosted.issuperset(order[:h]):  # h distinct experts, all in the set: the set itself
            return memo[layer, order][h]
    return None


def _prefix_sums(values: Sequence[float]) -> list[float]:
    """math.fsum(values[:h]) for each h in 0..len(values), in one pass: fsum is exactly rounded, and so is the exact
    running sum (integers over the values' common power-of-two denominator) divided once per prefix, as int / int is
    in Python, so each is bit for bit fsum's (both give 0.0 for a zero sum). A value that is not finite takes fsum
    itself for every prefix."""
    values = [float(v) for v in values]
    if not all(math.isfinite(v) for v in values):
        return [math.fsum(values[:h]) for h in range(len(values) + 1)]
    ratios = [v.as_integer_ratio() for v in values]
    scale = max((d for _, d in ratios), default=1)  # each d a power of two, so scale // d is exact
    total, sums = 0, [0.0]
    for numerator, denominator in ratios:
        total += numerator * (scale // denominator)
        sums.append(total / scale)
    return sums


def layer_host_jobs(state: PlacementState, layer: int, rates: Sequence[float], order: Sequence[int]) -> list[float]:
    """Per h in 0..len(order): a layer's expected host jobs per token with order[:h] on the host path (a job: a forward
    that uses any of them, paying `PlacementState.host_job_s` once). From the state's rounds where each is what the
    engine runs as one forward (it speculates, or they are k = 0 rounds of one token each): the rounds that used any
    of them, over the tokens the rounds committed. Otherwise each token is its own forward: 1 - P(none of its top_k is
    one of them), its top_k drawn one after another without replacement by the use rates (`_no_host_draws`), which is
    exact for uniform use (C(E - h, k) / C(E, k)); independent draws would miss that a token's experts are distinct and
    price the jobs low."""
    if _replays(state, layer) and (state.speculates or set(state.route_sequence.rows) == {1}):
        position = {e: index for index, e in enumerate(order)}
        first = [min((position[e] for e in used if e in position), default=len(order))
                 for used in state.route_sequence.used[layer]]
        counts = [0] * (len(order) + 1)
        for index in first:  # a round counts for every h past the first of order[:h] it used
            counts[index] += 1
        jobs, running = [0.0], 0
        for h in range(1, len(order) + 1):
            running += counts[h - 1]
            jobs.append(running / state.route_sequence.tokens)
        return jobs
    total = math.fsum(rates) or 1.0
    jobs, host_mass = [0.0], 0.0
    for h, e in enumerate(order, start=1):
        host_mass += max(0.0, rates[e]) / total
        jobs.append(1.0 - _no_host_draws(host_mass, h, state.num_experts, state.top_k))
    return jobs


def _no_host_draws(host_mass: float, hosted: int, experts: int, draws: int) -> float:
    """P(none of `draws` draws without replacement is a host expert) where the `hosted` host experts hold `host_mass`
    of the use and the others share the rest evenly: draw j picks a host expert with probability host_mass / (what
    the j device experts drawn before leave)."""
    device = experts - hosted
    if device < draws:
        return 0.0
    each = (1.0 - host_mass) / device if device else 0.0
    none = 1.0
    for j in range(draws):
        left = 1.0 - j * each
        none *= max(0.0, 1.0 - host_mass / left) if left > 0.0 else 0.0
    return none


def path_seconds(state: PlacementState, misses: float, host_blocks: float, hosts: bool, prefetch_discount: float = 0.0,
                 overlap: float = OVERLAP, host_jobs: float = 0.0) -> float | None:
    """A layer's expected seconds per token from its device misses, host blocks and host jobs per token:
    `overlapped`(misses x copy x (1 - prefetch_discount), host blocks x one host block + host jobs x a job's fixed
    part, overlap). None when a cost it needs is not measured (`hosts`: whether the layer has host-path experts at
    all)."""
    copy = copy_seconds(state)
    host_block = host_seconds(state, 1)
    if (misses > 0 and copy is None) or (hosts and host_block is None):
        return None
    host_s = host_blocks * (host_block or 0.0) + (host_jobs * (state.host_job_s or 0.0) if hosts else 0.0)
    return overlapped(misses * (copy or 0.0) * (1.0 - prefetch_discount), host_s, overlap)


def overlapped(device_s: float, host_s: float, overlap: float = OVERLAP) -> float:
    """A layer's time from its two paths' times: the longer, plus the part of the shorter not hidden under it
    (`overlap` of it hidden: 1 gives the longer, 0 the sum). On expectations, overlap 1 is a floor even for paths that
    do run fully at once: the longer path differs from token to token, and E[max] >= max(E)."""
    return max(device_s, host_s) + (1.0 - overlap) * min(device_s, host_s)


def layer_token_seconds(state: PlacementState, layer: int, rates: Sequence[float], host: Iterable[int],
                        prefetch_discount: float = 0.0, overlap: float = OVERLAP) -> float | None:
    """Expected seconds per token of layer `layer` whose host-path experts are `host` (`layer_host_uses`,
    `path_seconds`). None when a cost it needs is not measured."""
    host = set(host)
    misses, blocks = layer_host_uses(state, layer, rates, host)
    jobs = layer_host_jobs(state, layer, rates, sorted(host))[-1]
    return path_seconds(state, misses, blocks, bool(host), prefetch_discount, overlap, jobs)


def token_seconds(state: PlacementState, placement: Placement, prefetch_discount: float = 0.0,
                  overlap: float = OVERLAP) -> float | None:
    """Expected expert seconds per decoded token of `placement`, summed over layers: at one row per forward (k = 0)
    from use rates, or per token the profile's rounds committed where it has them in order (`layer_path_uses`); None
    when a cost it needs is not measured."""
    rates = use_rates(state)
    per_layer = [layer_token_seconds(state, layer, rates[layer], placement.host[layer], prefetch_discount, overlap)
                 for layer in range(state.num_layers)]
    return None if None in per_layer else sum(per_layer)


def routing_source(state: PlacementState) -> str:
    """What the cost model knows of the routing: 'sequence' (a trace's rounds in order: `layer_path_uses` replays
    them), 'profile' (use counts only) or 'uniform' (neither)."""
    return "sequence" if state.route_sequence is not None else "uniform" if state.route_counts is None else "profile"


def decision_record(state: PlacementState, placement: Placement, prefetch_discount: float = 0.0,
                    overlap: float = OVERLAP) -> dict:
    """What a placement was decided from and what the cost model predicts of it, in seconds, for the bench's results
    and the load's log: the calibration inputs as the model reads them (one expert's copy; one expert's host time by
    the rows it was measured at, a use of n rows costing ceil(n / row_bucket) of those blocks; the link, the host
    threads, the routing as `routing_source` names it, whether the engine speculates (`auto` places nothing for one
    without a trace: `Auto.prices_misses`), the overlap and prefetch discount weighed) and the expected
    expert seconds per decoded token of `off` and of `placement` (`token_seconds`; None where a cost is not measured).
    On the state the policy placed from, a trace's replays are those its pass kept (`layer_host_uses`)."""
    off = Placement.device_only(state.num_layers, state.num_experts)
    return {
        "host_experts": placement.total, "host_experts_per_layer": placement.counts(), "slots_per_layer": state.slots_per_layer,
        "layer_slots": list(state.layer_slots) or None,
        "copy_s_per_expert": copy_seconds(state), "host_s_per_expert_by_rows": {str(rows): seconds for rows, seconds in
                                                                                sorted(state.host_expert_s.items())},
        "row_bucket": state.row_bucket, "link_bytes_per_s": state.link_bytes_per_s, "host_threads": state.host_threads,
        "host_s_per_job": state.host_job_s, "host_kernel": state.host_kernel,
        "routing": routing_source(state), "speculates": state.speculates, "overlap": overlap,
        "prefetch_discount": prefetch_discount,
        "predicted_s_per_token": {"off": token_seconds(state, off, prefetch_discount, overlap),
                                  "placed": token_seconds(state, placement, prefetch_discount, overlap)},
    }
