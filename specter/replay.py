"""Replay a routing trace on the CPU through eviction x prefetch policy pairs; compare hits, bytes and stall.

CLI: `python -m specter.replay TRACE [--link GBPS] [--slots S] [--eviction a,b] [--prefetch a,b] [--json]`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from types import MappingProxyType
from typing import Any

import numpy as np

from specter.errors import SpecterError
from specter.log import get_logger
from specter.plugins import available, guarded, load_policy
from specter.policy import EvictionPolicy, LinkTiming, Plan, PrefetchPolicy, UseHistory
from specter.trace import TraceHeader, TraceRound, read_trace

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

    @property
    def hit_rate(self) -> float:
        uses = self.hits + self.misses
        return self.hits / uses if uses else 1.0

    @property
    def h2d_bytes(self) -> int:
        return self.prefetched_bytes + self.miss_bytes

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "hit_rate": self.hit_rate, "h2d_bytes": self.h2d_bytes}


class CacheModel:
    """Per-layer expert slots and use history, as the engine's expert cache keeps them (no tensors)."""

    def __init__(self, num_layers: int, slots_per_layer: int, eviction: EvictionPolicy) -> None:
        assert slots_per_layer >= 1, "a layer needs at least one slot"
        self.slots_per_layer = slots_per_layer
        self.eviction = eviction
        self.residents: list[list[int]] = [[] for _ in range(num_layers)]
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
        # Read-only views: a policy must not mutate the cache's bookkeeping.
        return UseHistory(MappingProxyType(self.last_use[layer]), MappingProxyType(self.use_count[layer]), self.clock)

    def load(self, layer: int, expert: int, protected: frozenset[int], plan: Plan | None) -> bool:
        """Make `expert` resident, evicting one if the layer is full; False if it was resident or cannot be."""
        residents = self.residents[layer]
        if expert in residents:
            return False
        if len(residents) >= self.slots_per_layer:
            if not any(resident not in protected for resident in residents):
                return False  # every slot holds a protected expert: the plan cannot grow this layer
            history = self.history(layer)
            [victim] = self.eviction.victims(
                layer=layer, residents=tuple(residents), protected=protected, count=1, history=history, plan=plan
            )
            residents.remove(victim)
        residents.append(expert)
        return True

    def use(self, layer: int, expert: int) -> None:
        self.clock += 1
        self.last_use[layer][expert] = self.clock
        self.use_count[layer][expert] = self.use_count[layer].get(expert, 0) + 1


@dataclass
class _Tally:
    hits: int = 0
    misses: int = 0
    prefetched_experts: int = 0
    prefetched_used: int = 0
    stall_s: float = 0.0


def replay(
    header: TraceHeader,
    rounds: Sequence[TraceRound],
    eviction: EvictionPolicy | str,
    prefetch: PrefetchPolicy | str,
    link_gbps: float = DEFAULT_LINK_GBPS,
    *,
    slots_per_layer: int | None = None,
) -> ReplayResult:
    """Replay `rounds` through one policy pair (objects, or installed names) with a cache starting empty.

    Per round: at each of prefetch's checkpoints, plan from the round's predicted counts scaled to the
    steps done (the trace keeps only the round's totals) and load the plan layer by layer, protecting it;
    then each layer's verify uses its experts hot first, loading misses on demand.
    """
    eviction = _as_policy("eviction", eviction)
    prefetch = _as_policy("prefetch", prefetch)
    slots = slots_per_layer or header.slots_per_layer
    cache = CacheModel(header.num_layers, slots, eviction)
    bandwidth = link_gbps * 1e9
    tally = _Tally()
    for trace_round in rounds:
        timing = LinkTiming(bandwidth, trace_round.draft_step_s, header.expert_bytes)
        plan, prefetched = _prefetch_round(cache, trace_round, header, prefetch, timing)
        _verify_round(cache, trace_round, plan, prefetched, tally)
        hidden_bytes = trace_round.k * trace_round.draft_step_s * bandwidth
        tally.stall_s += max(0.0, len(prefetched) * header.expert_bytes - hidden_bytes) / bandwidth
    tally.stall_s += tally.misses * header.expert_bytes / bandwidth
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
    )


def _as_policy(group: str, policy: Any) -> Any:
    return load_policy(group, policy) if isinstance(policy, str) else guarded(policy, group)


def _prefetch_round(
    cache: CacheModel, trace_round: TraceRound, header: TraceHeader, prefetch: PrefetchPolicy, timing: LinkTiming
) -> tuple[Plan | None, set[tuple[int, int]]]:
    """Run the round's checkpoints; return the last plan and the (layer, expert) pairs it loaded."""
    k, plan, prefetched = trace_round.k, None, set()
    if k < 1:
        return None, prefetched
    round_counts = trace_round.predicted_counts(header.num_experts)  # [L, E]
    for steps_done in prefetch.checkpoints(k=k, timing=timing):
        plan = prefetch.plan(
            route_counts=round_counts * (steps_done / k),
            resident=cache.resident_mask(header.num_experts),
            steps_done=steps_done,
            k=k,
            timing=timing,
            slots_per_layer=cache.slots_per_layer,
        )
        for layer in sorted(plan.experts):
            planned = frozenset(plan.experts[layer])
            prefetched |= {(layer, e) for e in plan.experts[layer] if cache.load(layer, e, planned, plan)}
    return plan, prefetched


def _verify_round(
    cache: CacheModel, trace_round: TraceRound, plan: Plan | None, prefetched: set[tuple[int, int]], tally: _Tally
) -> None:
    """Walk the target's used experts layer by layer: hits first (hot first), then misses on demand."""
    tally.prefetched_experts += len(prefetched)
    for layer, routes in enumerate(trace_round.layers):
        used = list(dict.fromkeys(routes.used))  # one verify pass pays for each expert once
        hits = [expert for expert in used if cache.is_resident(layer, expert)]
        for expert in hits:
            cache.use(layer, expert)
            tally.prefetched_used += (layer, expert) in prefetched
        for expert in used:
            if expert not in hits:
                cache.load(layer, expert, frozenset(), plan)
                cache.use(layer, expert)
        tally.hits += len(hits)
        tally.misses += len(used) - len(hits)


def replay_all(
    header: TraceHeader,
    rounds: Sequence[TraceRound],
    link_gbps: float = DEFAULT_LINK_GBPS,
    *,
    slots_per_layer: int | None = None,
    evictions: Sequence[str] | None = None,
    prefetches: Sequence[str] | None = None,
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
                results.append(replay(header, rounds, eviction, prefetch, link_gbps, slots_per_layer=slots_per_layer))
            except SpecterError as exc:
                skipped.append(f"{eviction} x {prefetch}: {exc}")
    results.sort(key=lambda result: (result.stall_s, result.eviction, result.prefetch))
    return results, skipped


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
    parser = argparse.ArgumentParser(prog="python -m specter.replay", description=__doc__.splitlines()[0])
    parser.add_argument("trace", help="a specter-trace JSON-lines file")
    parser.add_argument("--link", type=float, default=DEFAULT_LINK_GBPS, metavar="GBPS", help="H2D GB/s (1e9 bytes/s)")
    parser.add_argument("--slots", type=int, default=None, help="cache slots per layer (default: the trace header's)")
    parser.add_argument("--eviction", default=None, help="comma-separated eviction plug-ins (default: all installed)")
    parser.add_argument("--prefetch", default=None, help="comma-separated prefetch plug-ins (default: all installed)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    if args.link <= 0 or (args.slots is not None and args.slots < 1):
        parser.error("--link must be > 0 and --slots >= 1")
    try:
        header, rounds = read_trace(args.trace)
        evictions, prefetches = _names(args.eviction), _names(args.prefetch)
        results, skipped = replay_all(
            header, rounds, args.link, slots_per_layer=args.slots, evictions=evictions, prefetches=prefetches
        )
    except SpecterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    _print_results(header, results, skipped, args)
    return 0 if results else 1


def _names(csv: str | None) -> list[str] | None:
    return [name.strip() for name in csv.split(",") if name.strip()] if csv else None


def _print_results(
    header: TraceHeader, results: list[ReplayResult], skipped: list[str], args: argparse.Namespace
) -> None:
    if args.json:
        slots = args.slots or header.slots_per_layer
        report = {"model": header.model, "link_gbps": args.link, "slots_per_layer": slots, "skipped": skipped}
        report["results"] = [result.to_json() for result in results]
        print(json.dumps(report, indent=1))
    else:
        print(f"{header.model}: {header.num_layers} layers x {header.num_experts} experts, link {args.link} GB/s")
        print(format_table(results))
    for reason in skipped:
        print(f"skipped {reason}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
