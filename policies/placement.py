"""Reference placement policies: `off`, `all` and `auto` (entry points `specter.placement`).

A placement is made once per engine (specter/placement.py): no policy here looks at k, the draft or the cache's
state, so speculative output equals the same placement's k = 0 output (docs/ARCHITECTURE.md, "Contracts").
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from specter.placement import (
    OVERLAP,
    Placement,
    PlacementState,
    copy_seconds,
    fill_slots,
    has_rounds,
    host_seconds,
    layer_host_jobs,
    layer_path_uses,
    path_seconds,
    preloaded,
    use_rates,
)


class Off:
    """No host experts: every expert takes the device path (the engine without placements)."""

    def __init__(self) -> None:
        self.name = "off"

    def place(self, state: PlacementState) -> Placement:
        return Placement.device_only(state.num_layers, state.num_experts)


def kept_on_device(state: PlacementState, layer: int, rates: Sequence[float] | None = None) -> list[int]:
    """The experts a layer keeps on the device, one for each of its slots (`PlacementState.slots`): its initial
    residents (the most recent ones), and where they leave slots free (a cache that starts empty, at load, or
    part-filled) the most used others by `rates`, else the lowest other ids (`fill_slots`)."""
    initial = state.initial_residents[layer] if layer < len(state.initial_residents) else ()
    kept, fill = fill_slots(initial, state.slots(layer), state.num_experts, rates)
    return kept + fill


class All:
    """Every expert not resident on the device is computed on the host, so nothing is ever copied after load: the
    in-engine llama.cpp `--n-cpu-moe` / KTransformers style (the `cpu-experts` baseline).

    The device keeps each layer's initial residents (`PlacementState.initial_residents`, at most its slots,
    the most recently used), and fills the slots they leave free with the lowest other expert ids (all of them in a
    cache that starts empty, at load), which the builder loads once.
    """

    def __init__(self) -> None:
        self.name = "all"

    def place(self, state: PlacementState) -> Placement:
        host = []
        for layer in range(state.num_layers):
            kept = set(kept_on_device(state, layer))
            host.append([e for e in range(state.num_experts) if e not in kept])
        return Placement.of(host, state.num_layers, state.num_experts)


class Auto:
    """A calibrated cost model, decided once at load: per MoE layer, how many and which non-resident experts the host
    computes, so that the expected per-token layer time `overlapped`(device misses x copy, host uses x host block +
    host jobs x a job's fixed part, `overlap`) is least (specter/placement.py; `layer_host_jobs`).

    No choice is made per miss, every round, among copy, host, and "both, first wins":
    a choice that depends on the round (its k, the draft, the cache, the queues) would make the target's function, and
    with it the tokens, depend on speculation, since host and device round differently; "both, first wins" would make
    them depend on timing. The per-round choice becomes a per (layer, expert) choice fixed at load, calibrated by the
    cost model in specter/placement.py (`use_rates`, `layer_path_uses`, `path_seconds`) from the measured copy and host
    times and the routing profile (uniform routing without one).

    Per layer with S slots and E experts: the device keeps S experts (`kept_on_device`: its initial residents, the
    free slots filled with the most used, or the lowest ids without a profile); of the other E - S, the h least used go to the host, h from 0 to E - S, the h with the least expected
    time winning (ties: fewer on the host). Least used first: a rarely used device-path expert is the one most likely
    to have left the cache by its next use, so per second of host time it saves the most copies. With h < E - S the
    layer's D = E - h device-path experts do not all fit in its S slots and churn through them: each use misses with
    the probability Che's approximation gives an LRU cache (`expected_misses`; 1 - S/D under uniform use). Counting
    only the uses beyond the S most used, as if the cache kept those, would give the same (D - S) x r per token under
    uniform use, but under skewed use a floor well below what an LRU cache misses, which Che's approximation follows
    (tests/test_placement_auto.py simulates the LRU).

    Without a trace an engine that speculates is placed `off` (`prices_misses`, below); for the others, and as the
    rows' arithmetic for every engine, one row per forward (k = 0): a speculative verify of R <= row_bucket rows copies
    a missing expert once and computes a host expert on one block, so under independent uniform use both paths scale by the same
    q = 1 - (1 - r)^R per round, and one copy against one host block decides at every k. Routing with temporal
    locality favours the device, which use counts do not show: an LRU cache keeps the last rounds' working set while a
    host expert is computed again every round that uses it (the device misses fewer uses, and the host computes fewer,
    than independent use predicts, the device by more: docs/BENCHMARKS.md), so the model leans toward the host and
    needs its inputs right: the calibration times the host path as decoding runs it, on experts read from memory
    (`specter.experts.costs.time_host_expert`), and `decision_record` keeps what each placement was decided from.

    A profile that is a routing trace carries its rounds in order too (`PlacementState.route_sequence`, the first
    `specter.placement.SEQUENCE_TOKENS` tokens), and then the misses and the host blocks come from them instead
    (`specter.placement.layer_path_uses`): the layer's S slots replayed as an LRU cache over the rounds, round by round
    as the verify counts, the host-path experts never entering it, for every h in one pass (`lru_misses_by_host`), and
    each host expert ceil(rows / row_bucket) blocks per round that used it (one up to row_bucket rows; an upper bound
    on the host path's padding of the rows routed to it), both per token the rounds committed. That is the locality the counts lose, so with a trace the device is no longer over-counted; the use counts still order
    the candidates, and the trace is the same file for every k, so the placement stays a function of the profile, the
    calibration and the config. A trace recorded at k > 0 gives its rounds' misses and blocks per committed token,
    what an engine decoding as it did pays; the engine being placed may run another k.

    An engine that speculates (`PlacementState.speculates`, from its config: a draft depth above 0) does not wait for
    every device-path miss: its draft prefetches the experts it predicts while the round drafts. With a trace it
    counts, per layer, only what `specter.replay` models the engine waiting for: the verify's misses after the
    prefetch plus the prefetch the round's k draft steps do not hide (`specter.placement.prefetch_misses`, the
    replay's own cache walk over the trace's predictions, warm, with the engine's eviction and prefetch plug-ins),
    as a share of the LRU's misses in `off` that scales every h's (one replay per layer bounds the load's work;
    hosting the least used experts leaves the device the better predicted ones, so the share errs toward the
    device). Counting each miss's full copy instead would over-price the device path of an engine whose draft
    prefetches, and put experts on the host where the replay finds that slower than `off`. A k = 0 engine, or a
    profile without rounds, keeps the LRU's misses (or Che's) at full copy, except that a speculating engine
    without rounds (and without a `prefetch_discount`) is placed `off` (`prices_misses`). Whether an engine
    speculates is config, never the round: its placement is still one for its life, and its output still equals the
    same placement's k = 0 output.

    `overlap` (default 0.0, `specter.placement.OVERLAP`): the share of the shorter path's expected time per layer
    that hides under the longer one; a layer costs the longer path plus (1 - overlap) x the shorter, so 1 gives the
    longer alone and 0 the sum. At 0 the two costs add, and under uniform use a layer puts all its non-residents on
    the host or none. Toward 1 the model balances the two paths and splits a layer between them: from 0 that moves
    experts onto the host where a host expert costs more than its copy, and back onto the device path where it costs
    less. The default is the sum because the calibrated costs, added, predict the per-layer time of a measured hybrid
    run and pick the placement that ran fastest there (docs/BENCHMARKS.md, "Hybrid systems"); that run fits paths
    that overlap where they meet just as well (at one row per token they meet in few layers), so raise it only from
    a measurement of the hidden share (`specter.placement.OVERLAP` says how).

    `prefetch_discount` (default 0.0): the share of a miss's copy time that speculation's prefetch hides. 0 counts
    the copy in full because the placement also serves k = 0 (the `ondemand-hybrid` baseline), and a prefetched copy
    still occupies the link, so a link-bound round pays for it either way (its prefetches queue on the link, and the
    verify waits for them); a measured window recall times the share of the draft a copy overlaps is the value to put
    here for a speculative-only deployment (it moves experts back to the device path). Where the trace's replay
    already counts what the prefetch hides (above), leave it 0.

    `margin` (default 0.05): a layer takes host experts only where the model predicts at least this share of its time
    saved; else none (and a layer whose costs are not measured takes none), so `auto` is never slower than `off` by
    more than the model's error. On the CPU without `EngineConfig.link` the link is not measured: `auto` places
    nothing.

    `place_prefill`: a prompt of T rows computes each host expert on ceil(n / row_bucket) blocks of its n rows, while a
    copy is flat in T; per layer, the decode host experts the prompt is expected to use run on the host when that is
    predicted cheaper, else they are copied for the prompt (plus, where the layer's device experts were preloaded, the
    residents they evict, reloaded after the prompt). A function of T and the calibration only, so exact.
    """

    def __init__(self, prefetch_discount: float = 0.0, margin: float = 0.05, overlap: float = OVERLAP) -> None:
        if not 0.0 <= prefetch_discount < 1.0:
            raise ValueError(f"prefetch_discount={prefetch_discount}: expected 0 <= discount < 1")
        if not 0.0 <= margin < 1.0:
            raise ValueError(f"margin={margin}: expected 0 <= margin < 1")
        if not 0.0 <= overlap <= 1.0:
            raise ValueError(f"overlap={overlap}: expected 0 <= overlap <= 1")
        self.name = "auto"
        self.overlap = overlap
        self.prefetch_discount = prefetch_discount
        self.margin = margin

    def place(self, state: PlacementState) -> Placement:
        if not self.prices_misses(state):
            return Placement.device_only(state.num_layers, state.num_experts)
        rates = use_rates(state)
        return Placement.of([self.layer_host(state, layer, rates[layer]) for layer in range(state.num_layers)],
                            state.num_layers, state.num_experts)

    def prices_misses(self, state: PlacementState) -> bool:
        """Whether the model can price the device path's misses for this engine: always at k = 0; for an engine that
        speculates, only from a trace's rounds (its prefetch replay) or a `prefetch_discount` the deployment measured.
        Without either, the model charges every miss its full copy under independent use, while the engine's draft
        prefetches most of them ahead of the verify and its rounds reuse what the last ones loaded; so priced, it
        puts every non-resident on the host, which, where measured, decoded slower than placing nothing; so without
        a trace such an engine keeps every expert on the device path."""
        return not state.speculates or has_rounds(state) or self.prefetch_discount > 0.0

    def layer_host(self, state: PlacementState, layer: int, rates: Sequence[float]) -> list[int]:
        """The host-path experts of one layer (none when nothing is gained by at least `margin`)."""
        kept = set(kept_on_device(state, layer, rates if state.route_counts is not None else None))
        candidates = sorted((e for e in range(state.num_experts) if e not in kept), key=lambda e: (rates[e], e))
        uses = layer_path_uses(state, layer, rates, candidates)  # per h: (misses, host blocks) per token
        jobs = layer_host_jobs(state, layer, rates, candidates)  # per h: host jobs per token
        cost = lambda h: path_seconds(state, *uses[h], h > 0, self.prefetch_discount, self.overlap, jobs[h])  # noqa: E731
        off = cost(0)
        if not candidates or off is None or off <= 0.0:
            return []
        timed = [(seconds, h) for h in range(1, len(candidates) + 1) if (seconds := cost(h)) is not None]
        if not timed:
            return []
        best_s, best_h = min(timed)
        return candidates[:best_h] if off - best_s >= self.margin * off else []

    def place_prefill(self, state: PlacementState, decode: Placement, rows: int) -> Placement:
        rates = use_rates(state)
        slots = preloaded(decode, state.layer_slots or state.slots_per_layer)
        host = [decode.host[layer] if self.prompt_on_host(state, layer, rates[layer], decode.host[layer], bool(slots[layer]), rows)
                else frozenset() for layer in range(state.num_layers)]
        return Placement(tuple(host), state.num_experts)

    def prompt_on_host(self, state: PlacementState, layer: int, rates: Sequence[float], host: frozenset[int], preloaded_layer: bool,
                       rows: int) -> bool:
        """Whether a prompt of `rows` rows computes the layer's decode host experts on the host (True) or copies them
        (False: only where that is predicted at least `margin` cheaper)."""
        copy, block = copy_seconds(state), host_seconds(state, 1)
        if not host or copy is None or block is None:
            return True
        used = {e: 1.0 - (1.0 - rates[e]) ** rows for e in host}  # P(some row of the prompt routes to e)
        on_host = sum(p * math.ceil(max(1.0, rows * rates[e]) / state.row_bucket) * block for e, p in used.items())
        on_host += (1.0 - math.prod(1.0 - p for p in used.values())) * (state.host_job_s or 0.0)  # the prompt's one job
        copied = sum(used.values())
        evicted = min(float(state.slots(layer)), copied) if preloaded_layer else 0.0
        on_device = (copied + evicted) * copy
        return not on_device <= (1.0 - self.margin) * on_host
