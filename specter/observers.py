"""What watches the round without steering it: the round's clock and report, and the observers the runtime calls.

Each observer owns its state. The runtime calls every registered observer at the points `RoundObserver` names,
in registration order; an observer only records (into the request's stats, a trace, its own books) and never
changes what the round computes.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from specter.accept import Acceptance
from specter.experts.transfer import TransferEngine
from specter.kernel import NOT_READY, Kernel
from specter.metrics import RequestStats, busy_within, idle_causes, pump_gaps
from specter.trace import TraceRound, TraceWriter

Tensor = torch.Tensor
MAX_DEFERRED_ROUNDS = 64
"""Rounds of copy-busy measurement that may wait for the kernel's idle time before one is finished in line."""


class RoundClock:
    """A round's draft and verify times, and the verify's window on the copy stream's clock (for copy-busy).

    On CUDA the times come from timed events on the compute stream (host wall time misses work that graph replays
    leave queued); elsewhere from host wall time. The runtime calls the methods in the order they are written.
    """

    def __init__(self, gpu_mark: Callable[[], Any], stream_mark: Callable[[], Any]) -> None:
        self._gpu_mark, self._stream_mark = gpu_mark, stream_mark
        self.started = time.perf_counter()
        self.marks: list[Any] = []
        self.window: list[Any] = []  # the verify's start and end events (None entries without an expert cache)
        self.draft_s = self.verify_s = self.round_s = 0.0
        self._verify_started = 0.0

    def mark_start(self) -> None:
        self.marks.append(self._gpu_mark())

    def drafted(self) -> None:
        self.draft_s = time.perf_counter() - self.started
        self.marks.append(self._gpu_mark())
        self.window.append(self.marks[1] if self.marks[1] is not None else self._stream_mark())

    def verify_started(self) -> None:
        self._verify_started = time.perf_counter()

    def verified(self) -> None:
        self.marks.append(self._gpu_mark())
        self.window.append(self.marks[2] if self.marks[2] is not None else self._stream_mark())

    def accepted(self) -> None:
        """After the verdict was read: every mark has completed, so reading them does not stall."""
        self.verify_s = time.perf_counter() - self._verify_started
        if self.marks[0] is not None:
            self.draft_s, self.verify_s = self.marks[1].elapsed_since(self.marks[0]), self.marks[2].elapsed_since(self.marks[1])

    def ended(self) -> None:
        """After the commit: the round's wall time."""
        self.round_s = time.perf_counter() - self.started


@dataclasses.dataclass
class RoundReport:
    """One decode round as the observers see it, after the commit and before the adapt step."""

    index: int  # the request's round count, 1 for its first round
    k: int  # drafts verified (0: a plain round)
    drafted: int  # draft steps the round's prefetch plans were made for: k, or k + 1 where it drafted ahead (its guess)
    scouted: bool  # a plain round that ran a one-step scout first
    acceptance: Acceptance
    verify: Any  # the verify's VerifyRecord (offloaded experts only, else None): hits, misses, stall, experts used
    draft_counts: Tensor | None  # [L, E] the round's own route counters (device); None when it did not draft or scout
    moe_layers: Sequence[int]
    window: list[Any]  # RoundClock.window
    loaded_bytes: int  # H2D bytes the round loaded
    draft_step_s: float  # the draft-step estimate the round ran with
    stats: RequestStats

    @functools.cached_property
    def route_counts(self) -> np.ndarray:
        """The draft's route counters of the MoE layers [L_moe, E] on the host (read after the verify: no stall)."""
        return self.draft_counts[self.moe_layers].cpu().numpy()

    def predictions(self) -> Iterator[tuple[int, set[int], list[int]]]:
        """Per layer the verify used: (compact layer, experts the draft routed to, experts the target used)."""
        counts = self.route_counts
        index = {layer: i for i, layer in enumerate(self.moe_layers)}
        for layer, used in self.verify.used.items():
            yield index[layer], set(np.flatnonzero(counts[index[layer]]).tolist()), used


class RoundObserver:
    """Watches requests and rounds. Every method is a no-op here; an observer overrides those it needs.

    The runtime calls, for each request: `request_started` before its prefill, `prefilled` once the prompt is in
    the KV and the first token committed, then per round `round_started` (k chosen, before the draft), `planned`
    (each time the transfer stage plans, on the event loop, before the plan's copies are issued) and `round_done`
    (after the commit, before the adapt step); `request_ended` when the request ends, normally or not (first, before
    the runtime lifts its protections, resets its KV and finishes the deferred work). `close` when the runtime closes.
    """

    def request_started(self, stats: RequestStats) -> None: ...

    def prefilled(self, stats: RequestStats) -> None: ...

    def round_started(self) -> None: ...

    def planned(self, steps_done: int, counts: np.ndarray) -> None: ...

    def round_done(self, report: RoundReport) -> None: ...

    def request_ended(self) -> None: ...

    def close(self) -> None: ...


class CopyBusy(RoundObserver):
    """Copy-stream busy time inside each verify window that stalled on a copy (`RequestStats.copy_busy_fraction`).

    The window runs from the verify's start to the end of the last chunk that started before the verify ended
    (capped at the verify's end). Reading the chunks' events costs a few microseconds each, which at the round's end
    would leave the GPU idle between rounds, so the reading is deferred to the kernel's idle work
    (`Kernel.defer`: it runs while a later wait's event is pending) and finished when the request ends. Only the
    chunk list is taken at the round's end. Without a kernel the events are read then, and a round whose window
    marks have not completed is left out. With issue marks the idle rest of each window is split by cause.
    """

    def __init__(self, transfer: TransferEngine, kernel: Kernel | None) -> None:
        self.transfer, self.kernel = transfer, kernel
        self.chunks: list | None = None

    def round_started(self) -> None:
        self.chunks = self.transfer.start_chunk_log()

    def round_done(self, report: RoundReport) -> None:
        chunks, self.chunks = self.chunks, None
        self.transfer.stop_chunk_log()
        record = report.verify
        if record is None or record.stall_s <= 0 or not chunks:
            return
        if self.kernel is None:
            if all(mark.query() for mark in report.window):
                for _ in self._measure(chunks, report.window, report.stats, batch=len(chunks)):
                    pass
            return
        if self.kernel.deferred >= MAX_DEFERRED_ROUNDS:  # waits found no pending events for them: bound the backlog
            self.kernel.run_deferred()
        self.kernel.defer(self._measure(list(chunks), report.window, report.stats))

    def request_ended(self) -> None:
        self.chunks = None
        self.transfer.stop_chunk_log()

    def _measure(self, chunks: list, window: list, stats: RequestStats, batch: int = 8) -> Iterator[Any]:
        """The measurement, a few chunks per step (NOT_READY until the window's marks complete)."""
        while not all(mark.query() for mark in window):
            yield NOT_READY
        origin = window[0]
        verify_end = window[1].elapsed_since(origin)
        times = []
        for first in range(0, len(chunks), batch):
            times += self.transfer.chunk_times(chunks[first : first + batch], origin, open_end=verify_end)
            yield None
        span = min(max((t.end for t in times if t.start < verify_end), default=0.0), verify_end)
        if span > 0:
            stats.copy_busy_s += busy_within([(t.start, t.end) for t in times], 0.0, span)
            stats.copy_window_s += span
            if self.transfer.issue_marks:  # (without the marks there is nothing to split)
                causes = idle_causes(times, span)
                if causes is not None:  # (the pump trace covers the same windows as the split)
                    for cause, seconds in causes.items():
                        stats.copy_idle_s[cause] = stats.copy_idle_s.get(cause, 0.0) + seconds
                    stats.pump_gaps += pump_gaps(times, span)


class WindowRecall(RoundObserver):
    """The share of the target's experts the draft routed to: window recall for speculative rounds, scout recall
    (one step ahead of its own token) for scouted plain rounds, kept apart."""

    def round_done(self, report: RoundReport) -> None:
        if report.verify is None or report.draft_counts is None:
            return
        stats = report.stats
        for compact, predicted, used in report.predictions():
            if report.k:
                stats.add_recall(compact, predicted, used)
            elif report.scouted:
                stats.scout_recall_hits += len(predicted.intersection(used))
                stats.scout_recall_total += len(used)


class TraceRecorder(RoundObserver):
    """Writes every speculative round to a routing trace (specter.trace): the draft's counters at each plan and at
    the verify, the experts the verify used, the bytes loaded. Scouted rounds are not written."""

    def __init__(self, writer: TraceWriter) -> None:
        self.writer = writer
        self.checkpoints: list[tuple[int, np.ndarray]] = []

    def round_started(self) -> None:
        self.checkpoints = []

    def planned(self, steps_done: int, counts: np.ndarray) -> None:
        self.checkpoints.append((steps_done, counts.copy()))

    def round_done(self, report: RoundReport) -> None:
        if not report.k or report.verify is None or report.draft_counts is None:
            return
        verify = report.verify  # the experts the verify used: the device path's in use order, then the host path's
        used = [verify.used.get(layer, []) + [e for e in verify.host_used.get(layer, []) if e not in verify.used.get(layer, [])]
                for layer in report.moe_layers]
        self.writer.write_round(TraceRound.from_arrays(report.index, report.k, report.acceptance.n_accepted, report.draft_step_s,
                                                       report.route_counts, used, loaded_bytes=report.loaded_bytes,
                                                       checkpoints=self.checkpoints, drafted=report.drafted))

    def close(self) -> None:
        self.writer.close()
