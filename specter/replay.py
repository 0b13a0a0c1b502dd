"""Replay a routing trace on the CPU through eviction x prefetch policy pairs; compare hits, bytes and stall.

CLI: `python -m specter.replay TRACE [--link GBPS] [--slots S] [--eviction a,b] [--prefetch a,b] [--roll W|all]
[--json]`. The rolling window is modelled as on the engine's host-waiting path (`iter_ready`: later misses recycle
the oldest miss's slot); on CUDA the engine's policy picks most of those slots (see `CacheTuning.roll_hot_window`).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from types import MappingProxyType
from typing import Any

import numpy as np

from specter.config import CacheTuning
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

    def victims_among(self, layer: int, among: Sequence[int], count: int, plan: Plan | None) -> list[int]:
        """`count` victims the policy picks among `among` alone (every other resident protected)."""
        if count <= 0:
            return []
        others = frozenset(e for e in self.residents[layer] if e not in among)
        return list(self.eviction.victims(layer=layer, residents=tuple(self.residents[layer]), protected=others,
                                          count=count, history=self.history(layer), plan=plan))

    def replace(self, layer: int, victim: int, expert: int) -> None:
        """Load `expert` into `victim`'s slot."""
        self.residents[layer].remove(victim)
        self.residents[layer].append(expert)

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
    roll: int | str = "engine",
) -> ReplayResult:
    """Replay `rounds` through one policy pair (objects, or installed names) with a cache starting empty.

    Per round: at each checkpoint the recording engine planned at, plan from the counts it saw (a trace
    with `checkpoints`: the recording policy's schedule, not the replayed policy's, so policies that plan at
    other steps are not compared on their own schedules); else at each of prefetch's checkpoints, from the
    round's predicted counts scaled to the steps done. Load the plan layer by layer, protecting it;
    then each layer's verify uses its experts hot first, loading misses on demand through a rolling window
    (`roll`, see `_verify_round`; "engine": the engine's default window, `engine_roll()`).
    """
    roll = engine_roll() if roll == "engine" else roll
    eviction = _as_policy("eviction", eviction)
    prefetch = _as_policy("prefetch", prefetch)
    slots = slots_per_layer or header.slots_per_layer
    cache = CacheModel(header.num_layers, slots, eviction)
    bandwidth = link_gbps * 1e9
    tally = _Tally()
    for trace_round in rounds:
        timing = LinkTiming(bandwidth, trace_round.draft_step_s, header.expert_bytes)
        plan, prefetched = _prefetch_round(cache, trace_round, header, prefetch, timing)
        _verify_round(cache, trace_round, plan, prefetched, tally, roll)
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


def engine_roll(tuning: CacheTuning | None = None) -> int:
    """The engine's rolling window (`tuning.roll_hot_window`, default the engine's) as `_verify_round`'s `roll`
    (-1: no limit: the engine's all-at-once policy choice)."""
    window = (tuning or CacheTuning()).roll_hot_window
    return -1 if window is None else window


def _as_policy(group: str, policy: Any) -> Any:
    return load_policy(group, policy) if isinstance(policy, str) else guarded(policy, group)


def _prefetch_round(
    cache: CacheModel, trace_round: TraceRound, header: TraceHeader, prefetch: PrefetchPolicy, timing: LinkTiming
) -> tuple[Plan | None, set[tuple[int, int]]]:
    """Run the round's checkpoints; return the last plan and the (layer, expert) pairs it loaded."""
    k, plan, prefetched = trace_round.k, None, set()
    if k < 1:
        return None, prefetched
    if trace_round.checkpoints is not None:  # the recording engine's own plans' counts
        schedule = trace_round.checkpoint_counts(header.num_experts)
    else:
        round_counts = trace_round.predicted_counts(header.num_experts)  # [L, E]
        schedule = [(steps, round_counts * (steps / k)) for steps in prefetch.checkpoints(k=k, timing=timing)]
    for steps_done, counts in schedule:
        plan = prefetch.plan(
            route_counts=counts,
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
    cache: CacheModel,
    trace_round: TraceRound,
    plan: Plan | None,
    prefetched: set[tuple[int, int]],
    tally: _Tally,
    roll: int = -1,
) -> None:
    """Walk the target's used experts layer by layer: hits first (hot first), then misses on demand.

    As the engine's rolling window (`specter.experts.window`): the misses that fit in free slots or in the slots of
    residents the layer does not use start first; then hot experts give their slots to the waiting misses, chosen
    by the eviction policy among the hot ones, until the misses hold `roll` slots (`CacheTuning.roll_hot_window`); each miss
    left takes the slot of the layer's oldest miss. With `roll` -1 (no window) every waiting miss takes a hot
    expert's slot while any is left, and the rest take slots the policy frees.
    """
    tally.prefetched_experts += len(prefetched)
    for layer, routes in enumerate(trace_round.layers):
        used = list(dict.fromkeys(routes.used))  # one verify pass pays for each expert once
        hits = [expert for expert in used if cache.is_resident(layer, expert)]
        misses = [expert for expert in used if expert not in hits]
        fits = cache.slots_per_layer - len(hits)  # free slots and those of residents this layer does not use
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
    parser.add_argument("--roll", type=_roll, default="engine", metavar="W|all|engine",
                        help="the verify's rolling window: a layer's waiting misses hold at most W slots at once (hot "
                             "experts give theirs only up to it); all: no limit; engine: as the engine is set (the default)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    if args.link <= 0 or (args.slots is not None and args.slots < 1):
        parser.error("--link must be > 0 and --slots >= 1")
    try:
        header, rounds = read_trace(args.trace)
        evictions, prefetches = _names(args.eviction), _names(args.prefetch)
        results, skipped = replay_all(
            header, rounds, args.link, slots_per_layer=args.slots, evictions=evictions, prefetches=prefetches,
            roll=args.roll,
        )
    except SpecterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    _print_results(header, rounds, results, skipped, args)
    return 0 if results else 1


def _roll(text: str) -> int | str:
    named = {"all": -1, "engine": "engine"}
    if text in named:
        return named[text]
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: expected a window size >= 0, all or engine")
    return int(text)


def offline_bound(header: TraceHeader, rounds: Sequence[TraceRound], slots_per_layer: int | None = None) -> int:
    """The fewest expert loads a cache of `slots_per_layer` per layer could make on `rounds` (from empty), knowing
    the future: per layer and round, the resident experts the round uses are served first (a verify computes its
    hits first, and a hit never costs a load), then each other one is loaded, evicting the resident whose next use
    (the next round that uses it) is farthest: Belady's MIN with the order inside a round free. Prefetching cannot
    go below it (each load still fills one of the layer's slots), so it bounds what retention and prefetch together
    can save; no engine reaches it, since it knows which rounds come."""
    slots = slots_per_layer or header.slots_per_layer
    loads = 0
    never = len(rounds)
    for layer in range(header.num_layers):
        used = [list(dict.fromkeys(trace_round.layers[layer].used)) for trace_round in rounds]
        following: list[dict[int, int]] = [{} for _ in rounds]  # round -> expert -> the next round using it
        later: dict[int, int] = {}
        for index in range(len(rounds) - 1, -1, -1):
            following[index] = dict(later)
            later.update(dict.fromkeys(used[index], index))
        held: dict[int, int] = {}  # resident expert -> the next round using it
        for index, experts in enumerate(used):
            misses = [expert for expert in experts if expert not in held]
            for expert in experts:
                if expert in held:  # hits first: used now, so evictable by this round's misses
                    held[expert] = following[index].get(expert, never)
            for expert in misses:
                loads += 1
                if len(held) >= slots:
                    del held[max(held, key=held.__getitem__)]
                held[expert] = following[index].get(expert, never)
    return loads


def recorded_bytes(rounds: Sequence[TraceRound]) -> int | None:
    """What the recording engine moved over the rounds (their `loaded_bytes`); None unless every round says."""
    loaded = [trace_round.loaded_bytes for trace_round in rounds]
    return None if not loaded or None in loaded else sum(loaded)


def _names(csv: str | None) -> list[str] | None:
    return [name.strip() for name in csv.split(",") if name.strip()] if csv else None


def _print_results(
    header: TraceHeader, rounds: Sequence[TraceRound], results: list[ReplayResult], skipped: list[str],
    args: argparse.Namespace,
) -> None:
    recorded = recorded_bytes(rounds)
    roll = engine_roll() if args.roll == "engine" else args.roll
    bound = offline_bound(header, rounds, args.slots)
    if args.json:
        slots = args.slots or header.slots_per_layer
        report = {"model": header.model, "link_gbps": args.link, "slots_per_layer": slots, "roll": roll,
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
        print(f"offline bound (Belady's MIN on the verify's uses, knowing the future): {bound} loads, "
              f"{bound * header.expert_bytes / 1e9:.3f} GB")
        print(format_table(results))
    for reason in skipped:
        print(f"skipped {reason}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
