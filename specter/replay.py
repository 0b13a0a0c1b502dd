"""Replay a routing trace on the CPU through eviction x prefetch policy pairs; compare hits, bytes and stall.

CLI: `python -m specter.replay TRACE [--link GBPS|PRESET] [--slots S] [--eviction a,b] [--prefetch a,b] [--roll W|all]
[--json]`. Each layer keeps the recording run's own slots (the header's `layer_slots`), or `--slots` in every layer
(top_k..num_experts, as the engine takes `--residents`); `--link` is parsed as the engine's (`parse_link`). A trace
without rounds (recorded from a resident or k = 0 engine) is refused: there is nothing to replay.
The rolling window is modelled as on the engine's host-waiting path (`iter_ready`: later misses recycle
the oldest miss's slot); on CUDA the engine's policy picks most of those slots (see `CacheTuning.roll_hot_window`).

With `--placement off,all,auto --host-ms MS` it compares placements instead (`replay_placements`): per placement and
eviction x prefetch pair named (default the engine's), the device path's misses and bytes over the link, the host
path's expert computations, and a modelled expert time per token from the link's and the host's costs (the device's
own compute left out, as in the placement cost model; per layer the two paths combine as
`specter.placement.overlapped` with `--overlap`, default the sum). The placement-only options (`--host-ms`,
`--host-job-ms`, `--row-bucket`, `--overlap`, `--profile`) are refused without `--placement`.
"""

from __future__ import annotations

if __name__ == "__main__":  # `python -m specter.replay`: as the console script, a Ctrl-C held over the imports below
    from specter.entry import replay

    raise SystemExit(replay())

import argparse
import bisect
import collections
import dataclasses
import json
import math
import os
import sys
from collections.abc import Sequence, Set
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from specter.cli import _add_logging
from specter.config import CacheTuning, parse_link, split_list
from specter.errors import ConfigError, PluginError, SpecterError
from specter.exits import prog_name, run_tool
from specter.log import configure as configure_logging
from specter.log import get_logger
from specter.placement import (
    OVERLAP,
    SEQUENCE_TOKENS,
    Placement,
    PlacementPolicy,
    PlacementState,
    RouteSequence,
    check_slot_count,
    layer_counts,
    overlapped,
    preloaded,
    token_seconds,
)
from specter.plugins import ALLOW_LIST_ENV, available, guarded, installed, load_policy
from specter.policy import EvictionPolicy, LinkTiming, Plan, PrefetchPolicy, UseHistory
from specter.trace import LayerRoutes, TraceHeader, TraceRound, read_trace, use_counts

log = get_logger(__name__)

DEFAULT_LINK_GBPS = 25.0
"""PCIe Gen4 x16 as measured in practice; pass --link for the machine the trace should model."""


@dataclass(frozen=True)
class ReplayResult:
    """What one eviction x prefetch pair did over a trace. Bytes are H2D; stall is modelled seconds."""

    eviction: str
    prefetch: str
    rounds: int
    hits: int
    """Target uses (distinct expert per layer per round) found resident."""
    misses: int
    """Target uses loaded on demand."""
    prefetched_experts: int
    prefetched_used: int
    """Prefetched experts the target then used in the same round."""
    prefetched_bytes: int
    miss_bytes: int
    stall_s: float
    """Miss transfers plus the part of each round's prefetch the draft time does not hide."""
    placement: str = "off"
    """The placement replayed (its host-path experts never enter the cache; `off`: none)."""
    tokens: int = 0
    """Tokens the rounds committed (accepted + 1 each)."""
    host_computed: int = 0
    """Host-path expert computations (one per layer and round that used a host expert)."""
    host_s: float = 0.0
    """Modelled host seconds of those computations (blocks of row_bucket rows at the given host cost)."""
    modelled_s: float = 0.0
    """Modelled expert seconds: per round, the unhidden prefetch plus, per layer, the longer of its misses' copies and
    its host computations (the two paths run at once). Equals `stall_s` with no host expert."""

    @property
    def hit_rate(self) -> float:
        uses = self.hits + self.misses
        return self.hits / uses if uses else 1.0

    @property
    def h2d_bytes(self) -> int:
        return self.prefetched_bytes + self.miss_bytes

    @property
    def per_token_s(self) -> float | None:
        """Modelled expert seconds per committed token."""
        return self.modelled_s / self.tokens if self.tokens else None

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "hit_rate": self.hit_rate, "h2d_bytes": self.h2d_bytes, "per_token_s": self.per_token_s}


class CacheModel:
    """Per-layer expert slots and use history, as the engine's expert cache keeps them (no tensors)."""

    def __init__(self, num_layers: int, slots: int | Sequence[int], eviction: EvictionPolicy,
                 residents: Sequence[Sequence[int]] | None = None) -> None:
        """`slots`: one count for every layer or one each (the recording cache's `layer_slots`)."""
        self.layer_slots = layer_counts(slots, num_layers)
        assert len(self.layer_slots) == num_layers and min(self.layer_slots) >= 1, "a layer needs at least one slot"
        self.slots_per_layer = min(self.layer_slots)
        self.eviction = eviction
        self.residents: list[list[int]] = [list(layer) for layer in residents] if residents else [[] for _ in range(num_layers)]
        self.last_use: list[dict[int, int]] = [{} for _ in range(num_layers)]
        self.use_count: list[dict[int, int]] = [{} for _ in range(num_layers)]
        self.clock = 0

    def is_resident(self, layer: int, expert: int) -> bool:
        return expert in self.residents[layer]

    def resident_mask(self, num_experts: int) -> np.ndarray:
        mask = np.zeros((len(self.residents), num_experts), dtype=bool)  # [L, E]
        for layer, experts in enumerate(self.residents):
            mask[layer, experts] = True
        return mask

    def history(self, layer: int) -> UseHistory:
        # Copies, as the engine's `UseClock.history` gives: what a policy does to them cannot reach the bookkeeping,
        # and a policy behaves in a replay as in the engine.
        return UseHistory(dict(self.last_use[layer]), dict(self.use_count[layer]), self.clock)

    def load(self, layer: int, expert: int, protected: frozenset[int], plan: Plan | None) -> bool:
        """Make `expert` resident, evicting one if the layer is full; False if it was resident or cannot be."""
        residents = self.residents[layer]
        if expert in residents:
            return False
        if len(residents) >= self.layer_slots[layer]:
            if not any(resident not in protected for resident in residents):
                return False  # every slot holds a protected expert: the plan cannot grow this layer
            history = self.history(layer)
            [victim] = self.eviction.victims(
                layer=layer, residents=list(residents), protected=protected, count=1, history=history, plan=plan
            )
            residents.remove(victim)
        residents.append(expert)
        return True

    def victims_among(self, layer: int, among: Sequence[int], count: int, plan: Plan | None) -> list[int]:
        """`count` victims the policy picks among `among` alone (every other resident protected)."""
        if count <= 0:
            return []
        others = frozenset(e for e in self.residents[layer] if e not in among)
        return list(self.eviction.victims(layer=layer, residents=list(self.residents[layer]), protected=others,
                                          count=count, history=self.history(layer), plan=plan))

    def replace(self, layer: int, victim: int, expert: int) -> None:
        """Load `expert` into `victim`'s slot."""
        self.residents[layer].remove(victim)
        self.residents[layer].append(expert)

    def use(self, layer: int, expert: int) -> None:
        self.clock += 1
        self.last_use[layer][expert] = self.clock
        residents = self.residents[layer]
        if expert in residents:  # least recently used first, as the engine's cache hands `residents` to the policy
            residents.remove(expert)
            residents.append(expert)
        self.use_count[layer][expert] = self.use_count[layer].get(expert, 0) + 1


@dataclass
class _Tally:
    hits: int = 0
    misses: int = 0
    prefetched_experts: int = 0
    prefetched_used: int = 0
    stall_s: float = 0.0
    host_computed: int = 0
    host_s: float = 0.0
    modelled_s: float = 0.0


def replay(
    header: TraceHeader,
    rounds: Sequence[TraceRound],
    eviction: EvictionPolicy | str,
    prefetch: PrefetchPolicy | str,
    link_gbps: float = DEFAULT_LINK_GBPS,
    *,
    slots_per_layer: int | None = None,
    roll: int | str = "engine",
    placement: Placement | None = None,
    placement_name: str = "off",
    host_block_s: float | None = None,
    row_bucket: int = 16,
    overlap: float = OVERLAP,
    host_job_s: float = 0.0,
) -> ReplayResult:
    """Replay `rounds` through one policy pair (objects, or installed names) with a cache starting empty.

    With a `placement`: its host-path experts never enter the cache (left out of the prefetch's counts and plans, the
    verify's misses), each layer's device-path experts that fit in its slots start resident (`preloaded`), and each
    round's host-path uses cost `host_block_s` per block of `row_bucket` rows (k + 1 rows at most per expert) and, where
    a layer used any, `host_job_s` once (the job's fixed part, `PlacementState.host_job_s`); a layer's
    modelled time is its misses' copies and its host blocks combined by `overlapped` with `overlap` (0: their sum).

    Per round: the policy that recorded the trace (`recorded_by`) plans at the checkpoints the engine planned at, from
    the counts it saw then (`checkpoints`); any other plans at its own checkpoints, from the counts the engine's draft
    had seen at that step where the trace recorded a plan there, else from the round's predicted counts scaled to the
    steps done; so each policy is compared on its own schedule, whichever policy recorded the trace. Load the plan layer by layer, protecting it;
    then each layer's verify uses its experts hot first, loading misses on demand through a rolling window
    (`roll`, see `_verify_round`; "engine": the engine's default window, `engine_roll()`).
    """
    roll = engine_roll() if roll == "engine" else roll
    eviction = _as_policy("eviction", eviction)
    prefetch = _as_policy("prefetch", prefetch)
    slots = slots_per_layer or header.slots()
    placement = placement or Placement.device_only(header.num_layers, header.num_experts)
    if placement.active and host_block_s is None:
        raise SpecterError(f"placement {placement_name!r} computes experts on the host: give the host's seconds per expert "
                           "block (--host-ms)")
    bandwidth = link_gbps * 1e9
    copy_s = header.expert_bytes / bandwidth
    tally = _Tally()
    walk = _walk(header, rounds, eviction, prefetch, bandwidth, slots, roll, placement, tally)
    for trace_round, routed, prefetched, layer_misses in walk:
        unhidden = max(0.0, len(prefetched) * header.expert_bytes - hidden_bytes(trace_round, bandwidth)) / bandwidth
        host_s = [len(used) * math.ceil((trace_round.k + 1) / row_bucket) * (host_block_s or 0.0)
                  + (host_job_s if used else 0.0) for used in routed.host]
        tally.stall_s += unhidden
        tally.host_computed += sum(map(len, routed.host))
        tally.host_s += sum(host_s)
        tally.modelled_s += unhidden + sum(overlapped(misses * copy_s, host, overlap) for misses, host in zip(layer_misses, host_s))
    tally.stall_s += tally.misses * copy_s
    return ReplayResult(
        eviction=eviction.name,
        prefetch=prefetch.name,
        rounds=len(rounds),
        hits=tally.hits,
        misses=tally.misses,
        prefetched_experts=tally.prefetched_experts,
        prefetched_used=tally.prefetched_used,
        prefetched_bytes=tally.prefetched_experts * header.expert_bytes,
        miss_bytes=tally.misses * header.expert_bytes,
        stall_s=tally.stall_s,
        placement=placement_name,
        tokens=sum(trace_round.accepted + 1 for trace_round in rounds),
        host_computed=tally.host_computed,
        host_s=tally.host_s,
        modelled_s=tally.modelled_s,
    )


def _walk(header: TraceHeader, rounds: Sequence[TraceRound], eviction: EvictionPolicy, prefetch: PrefetchPolicy,
          bandwidth: float, slots: int | Sequence[int], roll: int, placement: Placement, tally: _Tally):
    """The replay's rounds in order, each as (round, its paths under `placement`, the (layer, expert) pairs its
    prefetch loaded, each layer's verify misses), through one cache that starts with `placement`'s preloaded experts."""
    cache = CacheModel(header.num_layers, slots, eviction, preloaded(placement, slots))
    for trace_round in rounds:
        routed = _on_paths(trace_round, placement)
        timing = LinkTiming(bandwidth, trace_round.draft_step_s, header.expert_bytes)
        plan, prefetched = _prefetch_round(cache, routed.device, header, prefetch, timing, placement)
        yield trace_round, routed, prefetched, _verify_round(cache, routed.device, plan, prefetched, tally, roll)


def hidden_bytes(trace_round: TraceRound, bandwidth: float) -> float:
    """The bytes of a round's prefetch its drafting hides: what the link moves in the round's k draft steps. k, not
    `plan_k`: where the previous verify's draft-ahead carried steps into the round, its own draft stage ran fewer than
    its k + 1 (the trace does not say how many), so k is the estimate kept."""
    return trace_round.k * trace_round.draft_step_s * bandwidth


def layer_prefetch_costs(state: PlacementState, layer: int, host: frozenset[int], eviction: str, prefetch: str,
                         roll: int | str = "engine") -> list[tuple[int, int]]:
    """Per round of `state.route_sequence.rounds`, (experts the prefetch loaded, verify misses) at `layer` alone with
    `host` on the host path: `replay`'s cache walk restricted to the one layer (its prefetch plans, eviction and verify
    are per layer, so the layer's counts are those of the whole model's replay), started warm as the placement cost
    model's LRU starts (one uncounted pass over the rounds first)."""
    roll = engine_roll() if roll == "engine" else roll
    rounds = [dataclasses.replace(r, layers=[r.layers[layer]], checkpoints=None if r.checkpoints is None else tuple(
        (steps, (rows[layer],)) for steps, rows in r.checkpoints)) for r in state.route_sequence.rounds]
    recorder = state.route_sequence.recorded_prefetch
    header = TraceHeader("", 1, state.num_experts, state.expert_bytes, state.top_k, state.slots(layer),
                         extra={} if recorder is None else {"prefetch": recorder})
    placement = Placement.of([host], 1, state.num_experts)
    walk = _walk(header, rounds + rounds, load_policy("eviction", eviction), load_policy("prefetch", prefetch),
                 state.link_bytes_per_s, state.slots(layer), roll, placement, _Tally())
    counts = [(sum(1 for _ in prefetched), misses) for _, _, prefetched, [misses] in walk]
    return counts[len(rounds):]


@dataclass(frozen=True)
class _Paths:
    """One round split by a placement: the round with only its device-path experts, and each layer's host-path uses."""

    device: TraceRound
    host: list[list[int]]


def _on_paths(trace_round: TraceRound, placement: Placement) -> _Paths:
    if not placement.active:
        return _Paths(trace_round, [[] for _ in trace_round.layers])
    layers, host = [], []
    for layer, routes in enumerate(trace_round.layers):
        device_used, host_used = placement.split(layer, dict.fromkeys(routes.used))
        predicted = {e: c for e, c in routes.predicted.items() if not placement.is_host(layer, e)}
        layers.append(LayerRoutes(predicted, device_used))
        host.append(host_used)
    checkpoints = None if trace_round.checkpoints is None else tuple(
        (steps, tuple({e: c for e, c in counts.items() if not placement.is_host(layer, e)} for layer, counts in enumerate(rows)))
        for steps, rows in trace_round.checkpoints)
    return _Paths(dataclasses.replace(trace_round, layers=layers, checkpoints=checkpoints), host)


def engine_roll(tuning: CacheTuning | None = None) -> int:
    """The engine's rolling window (`tuning.roll_hot_window`, default the engine's) as `_verify_round`'s `roll`
    (-1: no limit: the engine's all-at-once policy choice)."""
    window = (tuning or CacheTuning()).roll_hot_window
    return -1 if window is None else window


def _as_policy(group: str, policy: Any) -> Any:
    return load_policy(group, policy) if isinstance(policy, str) else guarded(policy, group)


def recorded_by(header: TraceHeader, prefetch: PrefetchPolicy, trace_round: TraceRound) -> bool:
    """Whether `prefetch` is the policy whose plans the trace's checkpoints are: the header's `prefetch` (the recording
    engine's plug-in, by name) where the trace says; in an older trace that does not, any policy a schedule was
    recorded for, but none for a round whose recorded schedule is empty (a policy that plans nothing, `none`, recorded
    it: another policy is not held to it)."""
    if header.recorded_prefetch is not None:
        return header.recorded_prefetch == getattr(prefetch, "name", None)
    return bool(trace_round.checkpoints)


def _prefetch_round(
    cache: CacheModel, trace_round: TraceRound, header: TraceHeader, prefetch: PrefetchPolicy, timing: LinkTiming,
    placement: Placement | None = None,
) -> tuple[Plan | None, set[tuple[int, int]]]:
    """Run the round's checkpoints; return the last plan and the (layer, expert) pairs it loaded."""
    # The recording engine planned a round that drafted ahead for k + 1 steps (the last its guess): plan_k.
    k, plan, prefetched = trace_round.plan_k, None, set()
    if trace_round.k < 1:
        return None, prefetched
    if trace_round.checkpoints is not None and recorded_by(header, prefetch, trace_round):
        schedule = trace_round.checkpoint_counts(header.num_experts)  # the recording engine's own plans, as it made them
    else:
        # Another policy plans at its own checkpoints: at a step the recording engine also planned at, from the
        # counts its draft had seen then; at another, from the round's totals scaled to the steps done.
        recorded = dict(trace_round.checkpoint_counts(header.num_experts))
        round_counts = trace_round.predicted_counts(header.num_experts)  # [L, E]
        schedule = [(steps, recorded[steps] if steps in recorded else round_counts * (steps / k))
                    for steps in prefetch.checkpoints(k=k, timing=timing)]
    for steps_done, counts in schedule:
        plan = prefetch.plan(
            route_counts=counts,
            resident=cache.resident_mask(header.num_experts),
            steps_done=steps_done,
            k=k,
            timing=timing,
            slots_per_layer=cache.slots_per_layer,
            layer_slots=cache.layer_slots,
        )
        for layer in sorted(plan.experts):
            wanted = placement.split(layer, plan.experts[layer])[0] if placement is not None else plan.experts[layer]
            planned = frozenset(wanted)  # the cache skips host-path experts (the engine's `device_path`)
            prefetched |= {(layer, e) for e in wanted if cache.load(layer, e, planned, plan)}
    return plan, prefetched


def _verify_round(
    cache: CacheModel,
    trace_round: TraceRound,
    plan: Plan | None,
    prefetched: set[tuple[int, int]],
    tally: _Tally,
    roll: int = -1,
) -> list[int]:
    """Walk the target's used experts layer by layer: hits first (hot first), then misses on demand; returns each
    layer's misses.

    As the engine's rolling window (`specter.experts.window`): the misses that fit in free slots or in the slots of
    residents the layer does not use start first; then hot experts give their slots to the waiting misses, chosen
    by the eviction policy among the hot ones, until the misses hold `roll` slots (`CacheTuning.roll_hot_window`); each miss
    left takes the slot of the layer's oldest miss. With `roll` -1 (no window) every waiting miss takes a hot
    expert's slot while any is left, and the rest take slots the policy frees.
    """
    tally.prefetched_experts += len(prefetched)
    per_layer = []
    for layer, routes in enumerate(trace_round.layers):
        used = list(dict.fromkeys(routes.used))  # one verify pass pays for each expert once
        hits = [expert for expert in used if cache.is_resident(layer, expert)]
        misses = [expert for expert in used if expert not in hits]
        fits = cache.layer_slots[layer] - len(hits)  # free slots and those of residents this layer does not use
        doomed: list[int] = []
        if len(misses) > fits and hits:
            wanted = len(misses) - fits if roll < 0 else max(0, roll - fits)
            doomed = cache.victims_among(layer, hits, min(wanted, len(misses) - fits, len(hits)), plan)
        for expert in hits:
            cache.use(layer, expert)
            tally.prefetched_used += (layer, expert) in prefetched
        rolled = collections.deque(misses)  # the window's slots, oldest miss first
        for index, expert in enumerate(misses):
            if index < fits:  # the engine pins the misses it starts: they cannot take each other's slots
                cache.load(layer, expert, frozenset(hits + misses[:index]), plan)
            elif index - fits < len(doomed):
                cache.replace(layer, doomed[index - fits], expert)
            elif roll >= 0 and rolled and cache.is_resident(layer, rolled[0]):
                cache.replace(layer, rolled.popleft(), expert)
            else:
                cache.load(layer, expert, frozenset(), plan)
            cache.use(layer, expert)
        tally.hits += len(hits)
        tally.misses += len(misses)
        per_layer.append(len(misses))
    return per_layer


def replay_all(
    header: TraceHeader,
    rounds: Sequence[TraceRound],
    link_gbps: float = DEFAULT_LINK_GBPS,
    *,
    slots_per_layer: int | None = None,
    evictions: Sequence[str] | None = None,
    prefetches: Sequence[str] | None = None,
    roll: int | str = "engine",
) -> tuple[list[ReplayResult], list[str]]:
    """Replay every pair of the named (default: all allowed, installed) policies; results sorted by stall.

    A pair whose plug-in fails to load or fails mid-replay is skipped; the second list says why.
    """
    skipped: list[str] = []
    eviction_names = _loadable("eviction", evictions, skipped)
    prefetch_names = _loadable("prefetch", prefetches, skipped)
    results = []
    for eviction in eviction_names:
        for prefetch in prefetch_names:  # fresh policy objects per pair: policies may keep state
            try:
                results.append(replay(header, rounds, eviction, prefetch, link_gbps, slots_per_layer=slots_per_layer,
                                      roll=roll))
            except SpecterError as exc:
                skipped.append(f"{eviction} x {prefetch}: {exc}")
    results.sort(key=lambda result: (result.stall_s, result.eviction, result.prefetch))
    return results, skipped


@dataclass(frozen=True)
class PlacementReplay:
    """One placement replayed over a trace, with what the placement cost model predicted for it."""

    result: ReplayResult
    placement: Placement
    predicted_token_s: float | None
    """`specter.placement.token_seconds`: the expected expert seconds per committed token, from the rounds the state
    carries (by default the trace's own, at its k: `trace_placement_state`), else per one-row forward from use counts."""

    def to_json(self) -> dict[str, Any]:
        return {**self.result.to_json(), "host_experts": self.placement.total,
                "host_experts_per_layer": self.placement.counts(), "predicted_token_s": self.predicted_token_s}


def trace_placement_state(header: TraceHeader, rounds: Sequence[TraceRound], link_gbps: float, host_block_s: float | None,
                          *, slots_per_layer: int | None = None, row_bucket: int = 16,
                          profile: Sequence[Sequence[float]] | None = None,
                          sequence: RouteSequence | None = None, eviction: str = "plan-protect",
                          prefetch: str = "topm-keep", host_job_s: float | None = None,
                          uniform: bool = False) -> PlacementState:
    """What a placement policy would see of the engine that recorded the trace, placing at load (an empty cache):
    the link at `link_gbps`, the host at `host_block_s` per block and `host_job_s` per job, and the routing profile `profile` with its rounds
    in order `sequence` (None for both: the trace's own use counts and rounds, up to `SEQUENCE_TOKENS` tokens, which
    flatters a policy that reads them, since they are the future being replayed; with `uniform`, neither: the policy
    sees no profile, as the engine does given a profile without rounds). The engine speculates, with
    `eviction` and `prefetch`, where some replayed round drafted (k > 0), as the recording engine did."""
    if profile is None and sequence is None and not uniform:
        profile = use_counts(rounds, header.num_layers, header.num_experts)
        sequence = (RouteSequence.of_rounds(rounds, header.num_layers, SEQUENCE_TOKENS,
                                            recorded_prefetch=header.recorded_prefetch) if rounds else None)
    return PlacementState(num_layers=header.num_layers, num_experts=header.num_experts, top_k=header.top_k,
                          slots_per_layer=slots_per_layer or header.slots_per_layer,
                          layer_slots=() if slots_per_layer else header.layer_slots,
                          initial_residents=tuple(() for _ in range(header.num_layers)), expert_bytes=header.expert_bytes,
                          row_bucket=row_bucket, link_bytes_per_s=link_gbps * 1e9,
                          host_expert_s={row_bucket: host_block_s} if host_block_s is not None else {},
                          host_job_s=host_job_s, route_counts=profile, route_sequence=sequence,
                          speculates=any(trace_round.k > 0 for trace_round in rounds), eviction=eviction,
                          prefetch=prefetch)


def replay_placements(
    header: TraceHeader,
    rounds: Sequence[TraceRound],
    names: Sequence[str | PlacementPolicy],
    link_gbps: float = DEFAULT_LINK_GBPS,
    host_block_s: float | None = None,
    *,
    slots_per_layer: int | None = None,
    eviction: str = "plan-protect",
    prefetch: str = "topm-keep",
    row_bucket: int = 16,
    profile: Sequence[Sequence[float]] | None = None,
    roll: int | str = "engine",
    overlap: float = OVERLAP,
    sequence: RouteSequence | None = None,
    host_job_s: float | None = None,
    uniform: bool = False,
) -> list[PlacementReplay]:
    """Each `specter.placement` policy (an installed name, constructed with its defaults, or a policy object) placed
    once from `trace_placement_state`, then the trace replayed under it through one eviction x prefetch pair (the
    engine's defaults unless given), in the order given. `overlap`: how the replay and the prediction combine a layer's
    two paths (`specter.placement.overlapped`); a policy object brings its own for its choice. `uniform`: place without
    a routing profile (a given one without rounds), never from the trace's own."""
    state = trace_placement_state(header, rounds, link_gbps, host_block_s, slots_per_layer=slots_per_layer,
                                  row_bucket=row_bucket, profile=profile, sequence=sequence, eviction=eviction,
                                  prefetch=prefetch, host_job_s=host_job_s, uniform=uniform)
    replays = []
    for named in names:
        policy = _as_policy("placement", named)  # an object as a loaded plug-in: a wrong answer named, not a crash
        placement = policy.place(state=state)
        result = replay(header, rounds, eviction, prefetch, link_gbps, slots_per_layer=slots_per_layer, roll=roll,
                        placement=placement, placement_name=policy.name, host_block_s=host_block_s, row_bucket=row_bucket,
                        overlap=overlap, host_job_s=host_job_s or 0.0)
        replays.append(PlacementReplay(result, placement, token_seconds(state, placement, overlap=overlap)))
    return replays


def format_placements(replays: Sequence[PlacementReplay]) -> str:
    """A fixed-width table, one row per placement."""
    columns = (("host experts", 12), ("misses", 7), ("H2D GB", 9), ("host comps", 10), ("host s", 8), ("link+host ms/tok", 16),
               ("model ms/tok", 12))
    lines = [f"{'placement':<12} " + " ".join(f"{title:>{width}}" for title, width in columns)]
    for replayed in replays:
        r, predicted = replayed.result, replayed.predicted_token_s
        lines.append(f"{r.placement:<12} {replayed.placement.total:>12d} {r.misses:>7d} {r.h2d_bytes / 1e9:>9.3f} "
                     f"{r.host_computed:>10d} {r.host_s:>8.3f} {(r.per_token_s or 0.0) * 1e3:>16.3f} "
                     f"{'-' if predicted is None else f'{predicted * 1e3:.3f}':>12}")
    return "\n".join(lines)


def _loadable(group: str, names: Sequence[str] | None, skipped: list[str]) -> list[str]:
    """The names (default: every allowed, installed one) that load; the others are noted once in `skipped`."""
    loadable = []
    for name in names or sorted(available(group)):
        try:
            load_policy(group, name)
            loadable.append(name)
        except SpecterError as exc:
            skipped.append(f"{group} {name}: {exc}")
    return loadable


def format_table(results: Sequence[ReplayResult]) -> str:
    """A fixed-width table, one row per pair, in the given order."""
    columns = ("hit rate", 8), ("misses", 7), ("prefetched", 10), ("H2D GB", 9), ("stall s", 9)
    lines = [f"{'eviction':<18} {'prefetch':<16} " + " ".join(f"{title:>{width}}" for title, width in columns)]
    for r in results:
        lines.append(
            f"{r.eviction:<18} {r.prefetch:<16} {r.hit_rate:>8.3f} {r.misses:>7d} {r.prefetched_experts:>10d} "
            f"{r.h2d_bytes / 1e9:>9.3f} {r.stall_s:>9.4f}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """The CLI: replay a trace through every installed (allowed) eviction x prefetch pair."""
    parser = argparse.ArgumentParser(prog=prog_name("specter.replay"), description=__doc__.splitlines()[0])
    parser.add_argument("trace", help="a specter-trace JSON-lines file")
    parser.add_argument("--link", type=_link, default=DEFAULT_LINK_GBPS, metavar="GBPS|PRESET",
                        help="H2D GB/s (1e9 bytes/s) from the engine's slowest link up, or a preset (gen5, gen4, gen3, "
                             "ddr4-desktop), as `generate --link` takes it (default 25)")
    parser.add_argument("--slots", type=int, default=None,
                        help="cache slots in every layer, from the trace's top-k to its experts, as the engine takes "
                             "--residents (default: each layer's in the run that recorded the trace)")
    parser.add_argument("--eviction", default=None, help="comma-separated eviction plug-ins (default: all installed)")
    parser.add_argument("--prefetch", default=None, help="comma-separated prefetch plug-ins (default: all installed)")
    parser.add_argument("--roll", type=_roll, default="engine", metavar="W|all|engine",
                        help="the verify's rolling window: a layer's waiting misses hold at most W slots at once (hot "
                             "experts give theirs only up to it); all: no limit; engine: as the engine is set (the default)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    placing = parser.add_argument_group("placements (instead of policy pairs; the options below need --placement)")
    placing.add_argument("--placement", default=None, metavar="off,all,auto",
                         help="comma-separated placement plug-ins to compare, each placed as at load and replayed through "
                              "each eviction x prefetch pair named (--eviction, --prefetch; default the engine's)")
    placing.add_argument("--host-ms", type=_above_zero, default=None, metavar="MS",
                         help="host milliseconds per expert block of --row-bucket rows (`specter info` measures it)")
    placing.add_argument("--host-job-ms", type=_zero_or_more, default=None, metavar="MS",
                         help="host milliseconds each layer's host job costs beyond its experts' blocks, once per round "
                              "that uses any (`specter info` measures it; default none)")
    placing.add_argument("--row-bucket", type=int, default=None, metavar="B",
                         help="rows per host block (default EngineConfig.row_bucket's, 16)")
    placing.add_argument("--overlap", type=float, default=None, metavar="O",
                         help="share of the shorter of a layer's two paths hidden under the longer in the modelled time "
                              "and the prediction (1: the longer, 0: the sum, the default; specter.placement.OVERLAP); "
                              "the named policies choose with their own defaults")
    placing.add_argument("--profile", default=None, metavar="TRACE",
                         help="the routing profile the placements weigh, a trace of the same model (default: the "
                              "replayed trace's own use counts and rounds; one without rounds: uniform routing, as the "
                              "engine's --placement-profile)")
    _add_logging(parser)
    args = parser.parse_args(argv)
    configure_logging(json=args.log_json, level=args.log_level)
    if args.slots is not None and args.slots < 1:
        parser.error(f"--slots {args.slots}: expected 1 or more cache slots per layer")
    if args.placement is None:
        # Without --placement these options would change nothing: refused, so that a run never looks as if it had
        # weighed a profile or a host cost it ignored.
        given = [option for option, value in (("--host-ms", args.host_ms), ("--host-job-ms", args.host_job_ms),
                                              ("--row-bucket", args.row_bucket), ("--overlap", args.overlap),
                                              ("--profile", args.profile)) if value is not None]
        if given:
            applies, them = ("applies", "it") if len(given) == 1 else ("apply", "them")
            parser.error(f"{', '.join(given)} only {applies} to placements: add --placement (e.g. --placement "
                         f"off,all,auto --host-ms MS), or leave {them} out")
        return run_tool(lambda: _compare_policies(args))
    args.overlap = OVERLAP if args.overlap is None else args.overlap
    if args.row_bucket is not None and args.row_bucket < 1:
        parser.error(f"--row-bucket must be 1 or more rows, got {args.row_bucket}")
    if not 0 <= args.overlap <= 1:  # (NaN fails this too)
        parser.error(f"--overlap must be from 0 to 1, got {args.overlap}")
    return run_tool(lambda: _compare_placements(args))


def _compare_policies(args: argparse.Namespace) -> int:
    """Every eviction x prefetch pair: one row each."""
    evictions, prefetches = _named_plugins("eviction", args.eviction), _named_plugins("prefetch", args.prefetch)
    for group, names in (("eviction", evictions), ("prefetch", prefetches)):
        if names is None:
            _some_allowed(group)
    header, rounds = _replayed_trace(args.trace, args.slots)
    results, skipped = replay_all(
        header, rounds, args.link, slots_per_layer=args.slots, evictions=evictions, prefetches=prefetches,
        roll=args.roll,
    )
    _print_results(header, rounds, results, skipped, args)
    return 0 if results else 1


def _compare_placements(args: argparse.Namespace) -> int:
    """`--placement`: one row per placement and eviction x prefetch pair named (default: the engine's pair)."""
    from specter.config import EngineConfig

    engine = EngineConfig()
    for group, csv in (("eviction", args.eviction), ("prefetch", args.prefetch), ("placement", args.placement)):
        _named_plugins(group, csv)
    args.row_bucket = engine.row_bucket if args.row_bucket is None else args.row_bucket
    header, rounds = _replayed_trace(args.trace, args.slots)
    profile = sequence = None
    uniform = False
    if args.profile is not None:
        from specter.experts.costs import routing_profile

        # As the engine reads its --placement-profile: a trace without rounds is uniform routing, never replaced by
        # the replayed trace's own rounds (which `specter info` would not see).
        profile, sequence = routing_profile(args.profile, header.num_layers, header.num_experts)
        uniform = profile is None and sequence is None
    pairs = [(eviction, prefetch) for eviction in _names(args.eviction) or [engine.eviction]
             for prefetch in _names(args.prefetch) or [engine.prefetch]]
    tables = [((eviction, prefetch), replay_placements(
        header, rounds, _names(args.placement) or ["off"], args.link,
        args.host_ms / 1e3 if args.host_ms is not None else None, slots_per_layer=args.slots,
        eviction=eviction, prefetch=prefetch, row_bucket=args.row_bucket, profile=profile, roll=args.roll,
        overlap=args.overlap, sequence=sequence, uniform=uniform,
        host_job_s=args.host_job_ms / 1e3 if args.host_job_ms is not None else None)) for eviction, prefetch in pairs]
    replays = [replayed for _, table in tables for replayed in table]
    if args.json:
        print(json.dumps({"model": header.model, "link_gbps": args.link, "host_ms": args.host_ms,
                          "host_job_ms": args.host_job_ms, "overlap": args.overlap,
                          **_slots_json(header, args.slots), "row_bucket": args.row_bucket,
                          "profile": args.profile,
                          "routing": "uniform" if uniform else "profile" if args.profile else "replayed trace",
                          "results": [replayed.to_json() for replayed in replays]}, indent=1))
    else:
        host = (f"host {args.host_ms} ms per expert block" + (f" + {args.host_job_ms} ms per job" if args.host_job_ms else "")
                if args.host_ms is not None else "no host cost given (--host-ms)")
        only = pairs[0] if len(pairs) == 1 else None
        print(f"{header.model}: {header.num_layers} layers x {header.num_experts} experts, link {args.link} GB/s, {host}, "
              f"{len(rounds)} rounds" + (f" ({only[0]} x {only[1]})" if only else ""))
        for (eviction, prefetch), table in tables:  # one table per pair, each placed for it (its prefetch prices misses)
            if not only:
                print(f"{eviction} x {prefetch}:")
            print(format_placements(table))
        print(f"link+host: replayed (per round: unhidden prefetch + per layer both paths at overlap {args.overlap}); "
              "model: the cost model's expected time per committed token the placements were chosen by", file=sys.stderr)
    if uniform:
        print(f"note: the profile {args.profile} holds no rounds: the placements assume uniform routing, as the engine "
              "does with it as --placement-profile", file=sys.stderr)
    return 0


def _replayed_trace(path: str, slots: int | None) -> tuple[TraceHeader, list[TraceRound]]:
    """The trace to replay, refused where it has no rounds (every pair would "hit" all of nothing) or `slots` (--slots)
    is a count the engine would refuse for its model."""
    header, rounds = read_trace(path)
    if not rounds:
        raise SpecterError(
            f"{path} holds no speculative rounds (only its header), so there is nothing to replay: an engine writes a "
            "round only when it drafts with experts offloaded, so a trace recorded from a resident engine (every expert "
            "on the device) or with k = 0 (plain decoding) stays empty; record one with --residents or --budget below "
            "full residency and a draft depth k > 0")
    if slots is not None:
        check_slot_count("--slots", slots, header.top_k, header.num_experts, ", as the engine refuses other --residents")
    return header, rounds


def _some_allowed(group: str) -> None:
    """Refuse a run over every allowed plug-in of `group` where SPECTER_PLUGINS allows none: it would replay no pair."""
    if available(group):
        return
    names = sorted(installed(group))
    if not names:
        raise PluginError(f"no {group} plug-in is installed, so no pair can be replayed; reinstall specter (its reference "
                          "policies are entry points of its distribution) or install a package that provides one")
    raise PluginError(f"no {group} plug-in is allowed by {ALLOW_LIST_ENV}={os.environ.get(ALLOW_LIST_ENV)!r} (installed: "
                      f"{', '.join(names)}), so no pair can be replayed; add one, e.g. '{group}:{names[0]}', to "
                      f"{ALLOW_LIST_ENV}, or unset it")


def _link(text: str) -> float:
    """A link as the engine takes it (argparse type): a preset or GB/s from `MIN_LINK_GBPS` (`parse_link`); a slower
    one models copies of years and prints stalls of hundreds of digits."""
    try:
        return parse_link(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _above_zero(text: str) -> float:
    """A finite number above 0 (argparse type): NaN passes a `<= 0` check and infinity replays as nothing moved."""
    value = _float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a finite number above 0")
    return value


def _zero_or_more(text: str) -> float:
    """A finite number of 0 or more (argparse type)."""
    value = _float(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a finite number of 0 or more")
    return value


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number") from None


def _named_plugins(group: str, csv: str | None) -> list[str] | None:
    """The plug-ins of `group` named on the command line (None: none named), each loaded once here: a name that does
    not load is the user's mistake, refused before the replay (PluginError: it lists the installed names). Only the
    installed ones a default run tries are skipped with a note (`_loadable`)."""
    names = _names(csv)
    if csv is not None and not names:
        raise PluginError(f"--{group} {csv!r}: expected a comma-separated list of {group} plug-in names")
    for name in names or ():
        load_policy(group, name)
    return names


def _roll(text: str) -> int | str:
    named = {"all": -1, "engine": "engine"}
    if text in named:
        return named[text]
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: expected a window size >= 0, all or engine")
    return int(text)


def fewest_loads(rounds: Sequence[Set[int]], slots: int) -> int:
    """The fewest loads of one layer's experts that serve `rounds` (per round, the experts its verify used) with
    `slots` slots, from an empty cache: Belady on whole rounds (load what the round misses, then keep the `slots`
    experts used again soonest). A lower bound for any cache of `slots` per layer at every round boundary, whatever it
    does inside a round (a rolling window, the relay's loans, given back at the round's end) or ahead of it
    (prefetches only move loads earlier): what round r uses and the cache did not hold at the end of round r - 1 is
    loaded during round r, and a load that waits until it is needed costs no more than one made earlier."""
    uses: dict[int, list[int]] = {}
    for index, used in enumerate(rounds):
        for expert in used:
            uses.setdefault(expert, []).append(index)

    def next_use(expert: int, after: int) -> float:
        rounds_used = uses[expert]
        position = bisect.bisect_right(rounds_used, after)
        return rounds_used[position] if position < len(rounds_used) else math.inf

    held: set[int] = set()
    loads = 0
    for index, used in enumerate(rounds):
        loads += len(set(used) - held)
        held |= set(used)
        while len(held) > slots:
            held.remove(max(held, key=lambda expert: (next_use(expert, index), expert)))
    return loads


def offline_bound(header: TraceHeader, rounds: Sequence[TraceRound], slots_per_layer: int | None = None) -> int:
    """The fewest expert loads a cache of `slots_per_layer` per layer (default: the recording run's, `header.slots()`)
    could make on `rounds` (from empty), knowing
    the future, or fewer: a floor. Per layer, `fewest_loads` over the rounds' used experts: each round pays what it
    uses that the cache did not hold when it began (a verify computes its hits first, and a hit never costs a load),
    then the cache keeps the `slots` used again soonest: Belady's MIN over whole rounds. A real cache pays at least
    that (it also gives each load a slot as it comes, and may reload within a round, neither of which the floor
    charges), prefetching included (each load still fills one of the layer's slots), so it bounds what retention and
    prefetch together can save; no engine reaches it, since it knows which rounds come."""
    layer_slots = layer_counts(slots_per_layer or header.slots(), header.num_layers)
    return sum(fewest_loads([trace_round.layers[layer].used for trace_round in rounds], slots)
               for layer, slots in enumerate(layer_slots))


def recorded_bytes(rounds: Sequence[TraceRound]) -> int | None:
    """What the recording engine moved over the rounds (their `loaded_bytes`); None unless every round says."""
    loaded = [trace_round.loaded_bytes for trace_round in rounds]
    return None if not loaded or None in loaded else sum(loaded)


def _slots_json(header: TraceHeader, slots: int | None) -> dict[str, Any]:
    """The replayed slots for a JSON report: `--slots` in every layer, else the header's (with each layer's where
    they differ)."""
    if slots is not None:
        return {"slots_per_layer": slots}
    return {key: value for key, value in header.to_json().items() if key in ("slots_per_layer", "layer_slots")}


def _names(csv: str | None) -> list[str] | None:
    """The names of a comma-separated option (`split_list`: `lru,,lfu` is refused); None where it was not given."""
    return split_list(csv, "name") if csv else None


def _print_results(
    header: TraceHeader, rounds: Sequence[TraceRound], results: list[ReplayResult], skipped: list[str],
    args: argparse.Namespace,
) -> None:
    recorded = recorded_bytes(rounds)
    roll = engine_roll() if args.roll == "engine" else args.roll
    bound = offline_bound(header, rounds, args.slots)
    if args.json:
        report = {"model": header.model, "link_gbps": args.link, **_slots_json(header, args.slots), "roll": roll,
                  "recorded_with": {key: header.extra.get(key) for key in ("eviction", "prefetch")},
                  "recorded_h2d_bytes": recorded, "offline_bound_loads": bound,
                  "offline_bound_h2d_bytes": bound * header.expert_bytes, "skipped": skipped}
        report["results"] = [result.to_json() for result in results]
        print(json.dumps(report, indent=1))
    else:
        window = "no limit" if roll < 0 else roll
        print(f"{header.model}: {header.num_layers} layers x {header.num_experts} experts, link {args.link} GB/s, "
              f"rolling window {window}")
        if recorded is not None:
            print(f"the recording engine moved {recorded / 1e9:.3f} GB over these {len(rounds)} rounds")
        if (by := header.recorded_prefetch) is not None:
            print(f"recorded with eviction {header.extra.get('eviction')}, prefetch {by}: {by} replays the plans the "
                  "engine made; another prefetch plans at its own checkpoints")
        print(f"offline bound (a floor: Belady's MIN on the verify's uses, knowing the future): {bound} loads, "
              f"{bound * header.expert_bytes / 1e9:.3f} GB")
        print(format_table(results))
    for reason in skipped:
        print(f"skipped {reason}", file=sys.stderr)
