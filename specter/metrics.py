"""Per-request statistics and the running estimates the lookahead policy reads."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter, deque
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from specter.experts.transfer import ChunkTimes


@dataclasses.dataclass
class RequestStats:
    """What one generation did; `as_dict` is the stable JSON the CLI prints under `stats`.

    The speculation counts (`drafted`, `accepted`, `accepted_lengths`, `depths`) are the rounds' verdicts as the
    verify gave them: a stop (id or string) inside a round's accepted drafts ends the output there, and `new_tokens`
    and `token_times` count only what was emitted, but the drafts the target accepted past the stop stay counted, since
    they describe the draft's agreement with the target, not the output."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    ttft_s: float = 0.0
    token_times: list[float] = dataclasses.field(default_factory=list)  # wall time of each committed token
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    scouted: int = 0  # plain rounds that ran a one-step draft only for its routes (DraftConfig.scout)
    ahead_rounds: int = 0  # rounds that drafted ahead beside their verify (DraftConfig.overlap)
    ahead_steps: int = 0  # draft steps run beside verifies
    carried_rounds: int = 0  # rounds that started with steps a draft-ahead had taken
    carried_steps: int = 0  # draft steps taken over that way (not drafted again)
    accepted_lengths: Counter = dataclasses.field(default_factory=Counter)  # accepted drafts per speculative round
    depths: Counter = dataclasses.field(default_factory=Counter)  # the depth k each speculative round ran (probes too; cut to the tokens left)
    hits: int = 0
    misses: int = 0
    host_computed_experts: int = 0  # routed experts computed on the host CPU (placement), per (layer, expert) per forward
    host_compute_s: float = 0.0  # host seconds those took, on the host expert thread
    host_hidden_s: float = 0.0  # of those, the seconds that ran beside the device path (VerifyRecord.host_hidden_s)
    host_prefill_experts: int = 0  # of host_computed_experts, those of the prompt's forward (before the first token)
    host_prefill_s: float = 0.0  # of host_compute_s, the prompt's forward's
    h2d_bytes: int = 0  # copied host-to-device during this request
    h2d_bytes_at_start: int = 0  # the cache's running total when the request started
    h2d_prefill_bytes: int = 0  # of h2d_bytes, those copied before the first token (the prompt's forward)
    stall_s: float = 0.0
    stall_prefill_s: float = 0.0  # of stall_s, the prompt's forward's (decode's per token leaves it out, as TPOT does)
    routing_wait_s: float = 0.0  # the verify awaiting MoE layers' routing reads (VerifyRecord.routing_wait_s)
    host_wait_s: float = 0.0  # the verify awaiting host jobs after their layer's device path (VerifyRecord.host_wait_s)
    routing_wait_prefill_s: float = 0.0  # of routing_wait_s, the prompt's forward's
    host_wait_prefill_s: float = 0.0  # of host_wait_s, the prompt's forward's
    recall_hits: int = 0  # |draft-predicted ∩ target-used| summed over layers and rounds
    recall_total: int = 0  # |target-used| summed likewise
    recall_by_layer: dict[int, list[int]] = dataclasses.field(default_factory=dict)  # layer -> [hits, total]
    scout_recall_hits: int = 0  # the same for scouted plain rounds (one step ahead, the round's own token), kept apart
    scout_recall_total: int = 0
    copy_busy_s: float = 0.0  # copy stream busy inside transfer-bound verify windows (see copy_busy_fraction)
    copy_window_s: float = 0.0  # length of those windows
    copy_idle_s: dict[str, float] = dataclasses.field(default_factory=dict)  # their idle time by cause (idle_causes)
    pump_gaps: list[tuple[float, float | None]] = dataclasses.field(default_factory=list)  # (late, lag from room): pump_gaps

    @property
    def tpot_s(self) -> float:
        """(time of last committed token - time of first) / (N - 1)."""
        if len(self.token_times) < 2:
            return 0.0
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    @property
    def h2d_decode_bytes_per_token(self) -> float:
        """H2D bytes after the first token per token after it: the bytes that go with `tpot_s`."""
        return (self.h2d_bytes - self.h2d_prefill_bytes) / (self.new_tokens - 1) if self.new_tokens > 1 else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Committed tokens per speculative round (accepted drafts + the target's own token)."""
        rounds = sum(self.accepted_lengths.values())
        return sum((n + 1) * c for n, c in self.accepted_lengths.items()) / rounds if rounds else 0.0

    @property
    def hit_rate(self) -> float:
        """Share of expert requests served without an on-demand load; 1.0 with no cache (all resident)."""
        total = self.hits + self.misses
        return self.hits / total if total else 1.0

    @property
    def window_recall(self) -> float:
        return self.recall_hits / self.recall_total if self.recall_total else 0.0

    @property
    def scout_recall(self) -> float | None:
        """Share of a scouted round's used experts its one-step scout named; None without scouted rounds."""
        return self.scout_recall_hits / self.scout_recall_total if self.scout_recall_total else None

    @property
    def copy_busy_fraction(self) -> float | None:
        """Share of transfer-bound verify time the copy stream was busy; None when verify never waited on a copy.

        A window runs from a verify's start to the landing of the last chunk copied during it, for verifies
        that stalled on a miss; the copy stream is busy while any chunk is on it (the backend's events: GPU
        events on CUDA, the cpu streams' completion times elsewhere).
        """
        return self.copy_busy_s / self.copy_window_s if self.copy_window_s > 0 else None

    def add_recall(self, layer: int, predicted: set[int], used: list[int]) -> None:
        hit = len(predicted.intersection(used))
        self.recall_hits += hit
        self.recall_total += len(used)
        entry = self.recall_by_layer.setdefault(layer, [0, 0])
        entry[0] += hit
        entry[1] += len(used)

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens,
            "ttft_s": round(self.ttft_s, 6), "tpot_s": round(self.tpot_s, 6),
            "rounds": self.rounds, "scouted_rounds": self.scouted,
            "ahead_rounds": self.ahead_rounds, "ahead_steps": self.ahead_steps,
            "carried_rounds": self.carried_rounds, "carried_steps": self.carried_steps,
            "scout_recall": None if self.scout_recall is None else round(self.scout_recall, 4), "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "accepted_length_histogram": {str(n): c for n, c in sorted(self.accepted_lengths.items())},
            "depth_histogram": {str(k): c for k, c in sorted(self.depths.items())},
            "window_recall": round(self.window_recall, 4), "hits": self.hits, "misses": self.misses,
            "hit_rate": round(self.hit_rate, 4), "host_computed_experts": self.host_computed_experts,
            "host_compute_s": round(self.host_compute_s, 6), "host_hidden_s": round(self.host_hidden_s, 6),
            "host_prefill_experts": self.host_prefill_experts, "host_prefill_s": round(self.host_prefill_s, 6),
            "h2d_bytes": self.h2d_bytes,
            "h2d_bytes_per_token": round(self.h2d_bytes / self.new_tokens, 1) if self.new_tokens else 0.0,
            "h2d_prefill_bytes": self.h2d_prefill_bytes,
            "h2d_decode_bytes_per_token": round(self.h2d_decode_bytes_per_token, 1),
            "stall_s": round(self.stall_s, 6), "stall_prefill_s": round(self.stall_prefill_s, 6),
            "routing_wait_s": round(self.routing_wait_s, 6),
            "host_wait_s": round(self.host_wait_s, 6), "routing_wait_prefill_s": round(self.routing_wait_prefill_s, 6),
            "host_wait_prefill_s": round(self.host_wait_prefill_s, 6),
            "copy_busy_fraction": None if self.copy_busy_fraction is None else round(self.copy_busy_fraction, 4),
        }


def busy_within(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of [start, end] intervals inside [lo, hi] (overlaps counted once)."""
    clipped = sorted((max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi)
    total, reach = 0.0, lo
    for a, b in clipped:
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


IDLE_CAUSES = ("head", "handover", "issue", "pump", "plan", "slot")


def _gaps(chunks: Sequence[ChunkTimes], span: float) -> Iterator[tuple[ChunkTimes | None, float, bool, Any]]:
    """The copy stream's idle gaps inside [0, span]: (the chunk that ends the gap, where the gap began, whether a
    chunk ran before it, the layer of the chunk before it), in time order; a last item with chunk None for idle
    time after the last chunk."""
    ordered = sorted((c for c in chunks if c.start < span), key=lambda c: c.start)
    reach, layer, seen = 0.0, None, False
    for chunk in ordered:
        if chunk.start > reach:
            yield chunk, reach, seen, layer
        if chunk.end > 0:
            seen = True
        reach, layer = max(reach, chunk.end), chunk.layer
    if reach < span:
        yield None, reach, seen, layer


def idle_causes(chunks: Sequence[ChunkTimes], span: float) -> dict[str, float] | None:
    """The copy stream's idle time inside [0, span] split by what held up the chunk that ended each gap.

    For a gap [a, b] before chunk C: the part before C's issue mark was the host not having issued C yet,
    `head` when no chunk ran since the window began; when C is a prefetch chunk, `pump` for the part it waited
    in the transfer engine's queue (the pump issues prefetches as room on the stream appears) and `plan` for the
    rest (it was not submitted yet: its plan came after the stream ran dry); `handover` when C is an urgent chunk of another
    layer than the chunk before it (its misses were known only after its router ran), else `issue`; the rest of the gap
    (the mark reached, the copy not started) is `slot`: the copy waited on its slot's last reader. None when a
    chunk that ends a gap lacks its issue mark (`TransferTuning.issue_marks` off). Idle time after the last chunk
    (none in the engine's windows, which end at a chunk's end) counts as `head` if no chunk ran, else `issue`.
    """
    causes = dict.fromkeys(IDLE_CAUSES, 0.0)
    for chunk, reach, seen, layer in _gaps(chunks, span):
        if chunk is None:
            causes["issue" if seen else "head"] += span - reach
            continue
        if chunk.issued is None:
            return None
        end = min(chunk.start, span)
        issued = min(max(chunk.issued, reach), end)
        late = issued - reach
        if seen and not chunk.urgent and chunk.queued is not None:
            causes["pump"] += min(late, chunk.queued)
            causes["plan"] += late - min(late, chunk.queued)
        else:
            kind = "head" if not seen else "pump" if not chunk.urgent else ("handover" if chunk.layer != layer else "issue")
            causes[kind] += late
        causes["slot"] += end - issued
    return causes


def pump_gaps(chunks: Sequence[ChunkTimes], span: float) -> list[tuple[float, float | None]]:
    """For each gap inside [0, span] that a prefetch chunk ends late (the `pump` and `plan` causes of `idle_causes`):
    (seconds from the stream running dry to the chunk's issue, seconds from the room the pump last waited for to
    that issue, or None when the pump did not wait for room before it). A lag much longer than a gap says the pump
    had room long before it issued; None says it was not waiting for room at all."""
    gaps: list[tuple[float, float | None]] = []
    for chunk, reach, seen, _layer in _gaps(chunks, span):
        if chunk is not None and seen and not chunk.urgent and chunk.issued is not None and chunk.issued > reach:
            issued = min(chunk.issued, min(chunk.start, span))
            gaps.append((issued - reach, None if chunk.room is None else issued - chunk.room))
    return gaps


class Estimates:
    """EMAs and fits the engine keeps across rounds (acceptance per position, step and verify times)."""

    def __init__(self, k_max: int, alpha: float = 0.2) -> None:
        self.alpha = alpha
        self.acceptance: list[float] = [0.7] * max(k_max, 1)
        self.acceptance_seen = [False] * max(k_max, 1)
        self.draft_step_s: float | None = None
        self.draft_points: deque[tuple[int, float]] = deque(maxlen=64)  # (k, seconds of the whole draft)
        self.verify_points: deque[tuple[int, float]] = deque(maxlen=64)
        self.round_overhead_s: list[float | None] = [None, None]  # [plain, speculative]: round time outside draft and verify
        self.new_bytes_unit: float | None = None  # speculative rounds' bytes / rows ** union_exponent
        self.new_bytes_plain: float | None = None  # bytes moved per plain-decoding (k = 0) token
        self.scout_s: float | None = None  # a plain round's one-step scout draft (DraftConfig.scout), EMA
        self.union_exponent: float | None = None  # beta: experts a verify needs grow as rows ** beta (EMA)
        self._plain_window: deque[frozenset[tuple[int, int]]] = deque(maxlen=max(k_max + 1, 3))  # observe_plain_token

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.alpha) * old + self.alpha * new

    def observe_acceptance(self, k: int, accepted: int) -> None:
        """Positions 0..accepted-1 were accepted; position `accepted` (if < k) was rejected.

        A position reached for the first time starts from its predecessor's estimate (as this round has just
        updated it: the value the flat extrapolation of `measured_acceptance` gives it now), position 0 from the
        prior, and this one observation moves it by `alpha` like any later one. Replacing it instead made one
        rejection final: a position first reached by a round that stopped there read 0, every deeper draft then
        looked worthless to the governor, and only a probe (after `probe_every` rounds at one depth) would reach
        that position again; at position 0 that stopped speculation for the rest of a short request."""
        for position in range(min(k, accepted + 1)):
            value = 1.0 if position < accepted else 0.0
            if self.acceptance_seen[position] or not position:
                old = self.acceptance[position]
            else:
                old = self.acceptance[position - 1]
            self.acceptance[position] = self._ema(old, value)
            self.acceptance_seen[position] = True

    def measured_acceptance(self, k_max: int) -> list[float]:
        """The acceptance EMAs of the positions some round has reached (a prefix of 0..k_max-1).

        A governor that saw positions 0 and 1 accepted 95 % of the time must not read position 2 as the
        initial 0.7 it never updated: it would then never draft deep enough to measure it, and stay at a
        shallower k than a fixed depth that pays more."""
        seen = 0
        while seen < min(k_max, len(self.acceptance)) and self.acceptance_seen[seen]:
            seen += 1
        return list(self.acceptance[:seen])

    def observe_draft(self, k: int, seconds: float, steps: int | None = None) -> None:
        """A depth-k round's draft took `seconds` running `steps` draft steps (default k). With a draft-ahead
        a round runs k + 1 steps, or fewer when it took some over: the fit of a depth-k draft keeps what
        the round really paid, the per-step EMA only rounds that ran steps."""
        steps = k if steps is None else steps
        if k > 0:
            self.draft_points.append((k, seconds))
        if steps > 0:
            self.draft_step_s = self._ema(self.draft_step_s, seconds / steps)

    def draft_fit(self) -> tuple[float, float]:
        """Least-squares a + b*k over recent drafts: a is the per-draft cost (the checkpoints' plans, the
        task group), b the cost of a step. Until two depths were seen: (0, seconds per step), which charges
        the fixed part to every step and so never makes an unmeasured depth look cheaper than it is."""
        fit = _line_fit(self.draft_points) if self.draft_points else None
        return fit if fit is not None else (0.0, self.draft_step_s or 1e-3)

    def observe_scout(self, seconds: float) -> None:
        self.scout_s = self._ema(self.scout_s, seconds)

    def observe_round(self, k: int, round_s: float, draft_s: float, verify_s: float) -> None:
        """The round's time outside its draft and its verify (sampling and acceptance, commit, plans, host
        work the GPU marks do not cover), kept apart for plain and speculative rounds."""
        index = 1 if k else 0
        self.round_overhead_s[index] = self._ema(self.round_overhead_s[index], max(0.0, round_s - draft_s - verify_s))

    def overheads(self) -> tuple[float, float]:
        plain, speculative = self.round_overhead_s
        return (plain if plain is not None else speculative or 0.0, speculative if speculative is not None else plain or 0.0)

    @property
    def beta(self) -> float:
        """The union exponent in use: 1 (every row brings its own experts) until a speculative verify or a run of plain
        tokens (`observe_plain_token`) measured it."""
        return 1.0 if self.union_exponent is None else self.union_exponent

    def observe_union(self, rows: int, first_row_experts: int, union_experts: int) -> None:
        """A verify of `rows` rows needed `union_experts` distinct (layer, expert) pairs where its first row
        alone needed `first_row_experts`: beta = ln(union / first) / ln(rows), in [0, 1]. Trained routing
        with locality gives beta well below 1, random routing close to 1."""
        if rows < 2 or first_row_experts <= 0 or union_experts <= 0:
            return
        beta = math.log(max(union_experts, first_row_experts) / first_row_experts) / math.log(rows)
        self.union_exponent = self._ema(self.union_exponent, min(1.0, max(0.0, beta)))

    def observe_plain_token(self, routed: frozenset[tuple[int, int]]) -> None:
        """A plain (k = 0) round's (layer, expert) pairs. Consecutive plain tokens are the rows a verify would
        have checked together, so the union of the last k_max + 1 (at least 3) measures beta (`observe_union`) before any
        speculative round has: without it beta stays 1 (every row brings its own experts), by which no depth
        pays where the link dominates, and a link-bound engine that started plain would stay plain until a probe."""
        self._plain_window.append(routed)
        # From 3 rows on: two tokens alone that happen to route alike would set beta to 0 outright (the first
        # observation replaces the unmeasured 1), and every depth would then look free of new experts.
        if len(self._plain_window) >= 3 and routed:
            self.observe_union(len(self._plain_window), len(routed), len(frozenset().union(*self._plain_window)))

    def break_plain_run(self) -> None:
        """The next plain token does not follow the last one (a speculative round, or a new request)."""
        self._plain_window.clear()

    def observe_verify(self, rows: int, compute_s: float, new_bytes: int) -> None:
        """One round's verify: rows, compute time without transfer stalls, and every byte the round copied."""
        self.verify_points.append((rows, compute_s))
        if rows == 1:
            self.new_bytes_plain = self._ema(self.new_bytes_plain, float(new_bytes))
        else:
            self.new_bytes_unit = self._ema(self.new_bytes_unit, new_bytes / rows**self.beta)

    def predicted_new_bytes(self, k_max: int) -> list[float]:
        """Index k: bytes a round of depth k is expected to move (prefetches and misses alike).

        Depth k verifies k + 1 rows, whose experts grow as (k + 1) ** beta (`observe_union`), so the bytes
        of a depth-k round are unit * (k + 1) ** beta with `unit` fitted from the rounds seen so far; with
        beta = 1 that is a fixed cost per row. Measured rounds at one depth thereby predict the others
        without assuming that every row brings new experts.
        """
        unit = self.new_bytes_unit if self.new_bytes_unit is not None else (self.new_bytes_plain or 0.0)
        plain = self.new_bytes_plain if self.new_bytes_plain is not None else unit
        return [plain] + [unit * (k + 1) ** self.beta for k in range(1, k_max + 1)]

    def verify_fit(self) -> tuple[float, float]:
        """Least-squares a + b * rows ** beta over recent verify passes (b = 0 until two row counts were seen, or while
        beta is 0).

        Over rows ** beta, not rows: a verify's expert work follows the distinct experts its rows need (the weights
        a device expert reads once for all its rows, a host expert's blocks), which grow as rows ** beta. A line in
        rows through shallow verifies counts every further row's experts as new, so where rows share experts it
        over-predicts a deep verify (a host-bound one most), and deep rounds would look dearer than they are."""
        if not self.verify_points:
            return (0.0, 0.0)
        beta = self.beta
        fit = _line_fit([(rows**beta, s) for rows, s in self.verify_points])
        return fit if fit is not None else (sum(s for _, s in self.verify_points) / len(self.verify_points), 0.0)


def _line_fit(points: Iterable[tuple[float, float]]) -> tuple[float, float] | None:
    """Least-squares (a, b) of y = a + b*x with a, b >= 0; None when every x is the same."""
    points = list(points)
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    var = sum((x - mean_x) ** 2 for x, _ in points)
    if var == 0:
        return None
    slope = max(0.0, sum((x - mean_x) * (y - mean_y) for x, y in points) / var)
    return (max(0.0, mean_y - slope * mean_x), slope)
