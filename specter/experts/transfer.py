"""The transfer engine: host-to-device expert copies on the copy stream, urgent misses ahead of prefetches.

Copies are split in chunks and issued by one pump task that keeps at most `max_chunks_in_flight` prefetch
chunks on the stream, so an urgent miss waits behind at most that many chunks of a long prefetch queue (a
chunk is `chunk_bytes`, or up to 1.25 times that when a copy's short tail rides with its last chunk).
Urgent chunks are not capped: a verify's misses are all wanted now. They are issued by `submit` itself (and
by `promote`), back to back, not by the pump: the copy stream starts on a miss before its caller goes on with
other work. Only a host-paced link emulation leaves them to the pump, which paces them.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from backends.base import Backend, Event
from specter.config import TransferTuning
from specter.errors import ConfigError
from specter.kernel import Kernel
from specter.log import debug_enabled, get_logger

from specter.config import LINK_PRESETS, parse_link  # noqa: F401  (part of this module's API)

log = get_logger(__name__)

@dataclass(frozen=True)
class LinkEmulation:
    """Throttle the copy stream to `gbps`.

    mode 'host': the pump delays each chunk's issue until the emulated link is about to be free, on a loop timer
    (works on every backend; a queue model times each chunk from when the link frees, so a timer's lateness costs
    no link time). mode 'device': after each chunk the copy stream sleeps
    (torch.cuda._sleep) for the emulated minus the estimated real copy time (no host timers). The estimate is the
    real-bandwidth EMA; what it got wrong on retired chunks is made up on the next pads while the emulated link stays
    busy (`TransferEngine._pad_error_s`), so a run of chunks keeps the asked rate even after a cold or disturbed
    warm-up. transfer_bench measures both.
    """

    gbps: float
    mode: Literal["host", "device"] = "host"


@dataclass
class TransferStats:
    """Counters of the engine; every byte is counted once, when its chunk is issued."""

    transfers: int = 0
    urgent_transfers: int = 0
    chunks: int = 0
    bytes_copied: int = 0
    cancelled: int = 0
    promoted: int = 0


class Transfer:
    """One flat host -> device copy. Created by `TransferEngine.submit`; await `landed()` for its data."""

    def __init__(
        self,
        engine: TransferEngine,
        dst: torch.Tensor,
        src: torch.Tensor,
        urgent: bool,
        wait_for: Sequence[Event],
        after_copy: Callable[[], None] | None,
        tag: Any,
    ) -> None:
        assert dst.numel() == src.numel() and dst.dtype == src.dtype, "transfer needs same-size, same-dtype flat tensors"
        self.dst, self.src = dst.view(-1), src.view(-1)
        self.urgent = urgent
        self.tag = tag
        self.nbytes = src.numel() * src.element_size()
        self.bytes_issued = 0
        self.cancelled = False
        self.submitted_at = time.perf_counter()
        self.issuable_since = self.submitted_at  # host time since its next chunk could go (submitted, or its last chunk issued)
        self.emulated_landing = 0.0
        """perf_counter time the emulated link delivers the last chunk (host-paced emulation only)."""
        self._engine = engine
        self._wait_for = [event for event in wait_for if event is not None]
        self._after_copy = after_copy
        self._next_element = 0
        self._ready: asyncio.Future[Event | None] = asyncio.get_running_loop().create_future()

    @property
    def fully_issued(self) -> bool:
        return self._ready.done()

    async def landed(self) -> Event | None:
        """Wait until every byte is on the device; returns the ready event (None if cancelled before any
        chunk was issued). Cancelling the caller does not cancel the copy (principle 3 of the kernel)."""
        ready = await asyncio.shield(self._ready)
        if ready is not None:
            await self._engine.kernel.wait(ready)
        # host-paced emulation: the emulated link may not have delivered the last chunk yet
        await sleep_until(self.emulated_landing)
        return ready

    def error(self) -> BaseException | None:
        """The failure that stopped this transfer (a copy that could not be issued), else None."""
        return self._ready.exception() if self._ready.done() and not self._ready.cancelled() else None

    def when_issued(self, callback: Callable[[], None]) -> None:
        """Call `callback` on the loop once the last chunk is on the stream (or the transfer was cancelled)."""
        self._ready.add_done_callback(lambda _future: callback())

    def ready_event(self) -> Event | None:
        """The ready event once the last chunk is issued, else None (device-side waits use it; also None when the
        pump failed: `landed()` raises that error)."""
        if not self._ready.done() or self._ready.cancelled() or self.error() is not None:
            return None
        return self._ready.result()

    def promote(self) -> None:
        """Make a queued prefetch urgent: its remaining chunks jump ahead of other prefetches."""
        self._engine._promote(self)

    def cancel(self) -> None:
        """Drop the chunks not issued yet. Issued chunks still land; `landed()` then waits for them."""
        self._engine._cancel(self)

    def _take_chunk(self, chunk_elements: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The next chunk; a tail of at most a quarter chunk rides with the chunk before it (one copy, one
        event fewer: a 17.3 MB Qwen expert is one 16 MiB-ish chunk, not 16 MiB + 0.5 MB)."""
        begin = self._next_element
        end = begin + chunk_elements
        if self.src.numel() - begin <= chunk_elements + chunk_elements // 4:
            end = self.src.numel()
        self._next_element = end
        self.bytes_issued += (end - begin) * self.src.element_size()
        return self.dst[begin:end], self.src[begin:end]

    @property
    def _remaining(self) -> int:
        return self.src.numel() - self._next_element

    def __repr__(self) -> str:
        return f"Transfer({self.tag}, {self.nbytes} B, urgent={self.urgent}, issued={self.bytes_issued})"


@dataclass(frozen=True)
class ChunkTimes:
    """One chunk on the copy stream's clock, in seconds after a reference event."""

    start: float
    end: float
    issued: float | None = None  # when the stream reached the chunk's issue mark (TransferTuning.issue_marks), before its waits
    layer: Any = None
    urgent: bool = True  # False: a prefetch chunk, issued by the pump
    queued: float | None = None  # host seconds it waited in the engine's queue before its issue (TransferTuning.issue_marks)
    room: float | None = None  # when the chunk the pump last waited on for room ended (TransferTuning.issue_marks; None: no wait)


@dataclass
class _Chunk:
    nbytes: int
    start: Event
    copied: Event
    end: Event
    issued: Event | None = None  # recorded before the copy's waits, with issue marks
    layer: Any = None  # the transfer tag's first item (the cache's MoE layer)
    urgent: bool = True  # the transfer was urgent when this chunk was issued
    queued: float | None = None  # host seconds between when it could have been issued and its issue (TransferTuning.issue_marks)
    room: Event | None = None  # the end of the chunk the pump last waited on for room before issuing it (TransferTuning.issue_marks)
    offset: float = 0.0
    """Host-paced emulation: seconds from its issue to when the emulated link began it (the queue model's start); > 0
    when the pump issued it ahead (`_emulated_link_free`), < 0 when late (the model began it on time all the same)."""
    emulated_s: float = 0.0
    """Device-paced emulation: the emulated link's time for the chunk (0 for a chunk not padded on the stream)."""
    real_estimate: float = 0.0
    """Device-paced emulation: the copy time its pad's planned part assumed (that part is `emulated_s` less this; the
    pad adds what it made up of earlier chunks' error)."""


class TransferEngine:
    """Issues `Transfer`s on `backend.copy_stream` from one pump task on the event loop.

    Use from the loop thread. The pump runs while transfers are queued: `submit` starts it, it ends once both
    queues are empty, and `aclose` stops one still running. A pump left waiting for work would outlive the work
    of its loop: a loop closed without cancelling its tasks (`run_until_complete`, then `close()`) left it
    pending, reported as destroyed when collected.
    """

    def __init__(
        self,
        backend: Backend,
        kernel: Kernel,
        *,
        chunk_bytes: int = 16 << 20,
        max_chunks_in_flight: int | None = None,
        link: LinkEmulation | None = None,
        ema_alpha: float = 0.2,
        tuning: TransferTuning | None = None,
    ) -> None:
        """`tuning`: the pump's knobs (EngineConfig.tuning.transfer); `max_chunks_in_flight` overrides its cap."""
        if chunk_bytes <= 0 or (max_chunks_in_flight is not None and max_chunks_in_flight < 1):
            raise ConfigError(
                f"transfer engine needs chunk_bytes > 0 and max_chunks_in_flight >= 1, got {chunk_bytes}, {max_chunks_in_flight}"
            )
        self.backend, self.kernel = backend, kernel
        self.stream = backend.copy_stream
        self.chunk_bytes = chunk_bytes
        self.tuning = tuning or TransferTuning()
        self._max_chunks_in_flight = max_chunks_in_flight
        self.link = link
        self.ema_alpha = ema_alpha
        self.stats = TransferStats()
        self._urgent: deque[Transfer] = deque()
        self._prefetch: deque[Transfer] = deque()
        self._in_flight: deque[_Chunk] = deque()
        self._raw_bytes_per_s: float | None = None
        self._effective_bytes_per_s: float | None = None
        self._link_free_at = 0.0
        """perf_counter time the emulated link frees: the host-paced queue model; in device mode the same model from
        each chunk's issue, which bounds how long the pads make up an error."""
        self._pad_error_s = 0.0
        """Device-paced emulation: seconds of stream time retired chunks were meant to take (copy and pad) beyond what
        they took, less what later pads already made up (> 0: the stream ran ahead of the emulated link)."""
        self._pump_task: asyncio.Task[None] | None = None
        self._room_waited: Event | None = None  # the event the pump last waited on for room (TransferTuning.issue_marks)
        self.chunk_log: list[_Chunk] | None = None  # when a list: every chunk issued is appended (busy measurement)

    @property
    def max_chunks_in_flight(self) -> int:
        """The cap given at construction, else the tuning's (which may change between requests: `Runtime.retune`)."""
        return self._max_chunks_in_flight if self._max_chunks_in_flight is not None else self.tuning.max_chunks_in_flight

    @property
    def issue_marks(self) -> bool:
        """Whether each chunk records an issue mark (TransferTuning.issue_marks), for the idle split by cause."""
        return self.tuning.issue_marks

    def start_chunk_log(self) -> list[_Chunk]:
        """Log every chunk from now on (`chunk_log`), starting with those still on the stream."""
        self._retire_completed()
        self.chunk_log = list(self._in_flight)
        return self.chunk_log

    def stop_chunk_log(self) -> None:
        """Stop logging chunks (the list `start_chunk_log` returned keeps those logged so far)."""
        self.chunk_log = None

    def forget_bandwidth(self) -> None:
        """Drop the measured effective bandwidth, to measure it afresh (the link just changed, or the engine's own
        decoding at load measured it), and the device-paced pads' error still to make up (it was the old link's). The
        chunks that completed before are retired first: retired later, they would be the new estimate's first figure."""
        self._retire_completed()
        self._effective_bytes_per_s = None
        self._pad_error_s = 0.0

    def busy_intervals(self, chunks: Sequence[_Chunk], reference: Event, open_end: float) -> list[tuple[float, float]]:
        """[start, end] in seconds after the completed `reference` event: the time each chunk held the (emulated) link.

        A chunk not yet started is left out; one started but not finished ends at `open_end`. Host-paced
        emulation holds the link for nbytes / rate from when the queue model began the chunk (its start moved by the
        chunk's `offset`: the pump issues a chunk somewhat ahead of, or late for, the model's start); device-mode
        emulation's sleep is inside `end`. Never waits.
        """
        return [(times.start, times.end) for times in self.chunk_times(chunks, reference, open_end)]

    def chunk_times(self, chunks: Sequence[_Chunk], reference: Event, open_end: float) -> list[ChunkTimes]:
        """`busy_intervals` with each chunk's issue mark (None without issue marks) and layer."""
        times = []
        for chunk in chunks:
            if not chunk.start.query():
                continue
            start = chunk.start.elapsed_since(reference)
            end = chunk.end.elapsed_since(reference) if chunk.end.query() else max(open_end, start)
            if self.link is not None and self.link.mode == "host":
                start += chunk.offset  # the model's start: issued ahead or late, the emulated link began it then
                end = max(end, start + chunk.nbytes / (self.link.gbps * 1e9))
            issued = chunk.issued.elapsed_since(reference) if chunk.issued is not None and chunk.issued.query() else None
            room = chunk.room.elapsed_since(reference) if chunk.room is not None and chunk.room.query() else None
            times.append(ChunkTimes(start, end, issued, chunk.layer, chunk.urgent, chunk.queued, room))
        return times

    # -- the API the cache uses ---------------------------------------------------------------------

    def submit(
        self,
        dst: torch.Tensor,
        src: torch.Tensor,
        *,
        urgent: bool = False,
        wait_for: Sequence[Event | None] = (),
        after_copy: Callable[[], None] | None = None,
        tag: Any = None,
    ) -> Transfer:
        """Queue a copy of `src` (host) into `dst` (device). Must be called on the loop thread.

        `wait_for`: events the copy stream must pass first (a slot's last reader). `after_copy` is called on the
        host right after the last chunk is enqueued and must itself enqueue its work on this engine's `stream` (the
        cache's slot-table write): it then runs in copy-stream order after the copy and before the ready event.
        """
        transfer = Transfer(self, dst, src, urgent, wait_for, after_copy, tag)
        (self._urgent if urgent else self._prefetch).append(transfer)
        self.stats.transfers += 1
        self.stats.urgent_transfers += urgent
        if urgent and not self.host_paced:  # issued whole from here: a pump started for it would find nothing
            self._flush_urgent()
        else:
            self._ensure_pump()
        return transfer

    def _flush_urgent(self) -> None:
        """Put every urgent chunk on the stream now, from the caller: the pump would issue them only when the
        caller next yields to the loop (a verify first launches its resident experts' compute). Not with a
        host-paced link emulation, whose pacing lives in the pump."""
        if self.host_paced:
            self._ensure_pump()
            return
        current = None
        try:
            self._retire_completed()
            while self._urgent:
                current = self._urgent[0]
                self._issue_chunk(current)
        except Exception as error:  # as in the pump: the owners' landed() raise it, the cache frees the slots
            log.error("transfer.issue_failed", error=repr(error))
            self._fail_queued(error, current)

    @property
    def host_paced(self) -> bool:
        """A host-paced link emulation holds copies back on the host: readers must wait for landings there."""
        return self.link is not None and self.link.mode == "host"

    @property
    def bandwidth_bytes_per_s(self) -> float | None:
        """EMA of the sustained copy bandwidth as the engine sees it (emulation included); None until measured."""
        self._retire_completed()
        return self._effective_bytes_per_s

    @property
    def raw_bandwidth_bytes_per_s(self) -> float | None:
        """EMA of the real link's bandwidth (copy time only, emulation excluded)."""
        self._retire_completed()
        return self._raw_bytes_per_s

    @property
    def queued(self) -> int:
        """Transfers not fully issued yet."""
        return len(self._urgent) + len(self._prefetch)

    async def drain(self) -> None:
        """Wait until every queued transfer has landed (start-up, benchmarks, tests)."""
        while self._urgent or self._prefetch or self._in_flight:
            pending = [*self._urgent, *self._prefetch]
            if pending:
                await pending[-1].landed()
            else:
                await self.kernel.wait(self._in_flight[-1].end)
                self._retire_completed()

    async def aclose(self) -> None:
        """Drop queued transfers, wait for issued chunks, stop the pump."""
        for transfer in [*self._urgent, *self._prefetch]:
            if transfer._ready.get_loop().is_closed():  # queued on a loop that ended under it: none can await it, and
                self._drop(transfer)                    # telling its owners would raise 'Event loop is closed'
            else:
                transfer.cancel()
        try:
            if self._in_flight:
                await self.kernel.wait(self._in_flight[-1].end)  # raises a stream's failed work: the pump stops anyway
        finally:
            pump, self._pump_task = self._pump_task, None
            # (a pump of a loop that has ended is done, or can never run again: only this loop's is awaited)
            if pump is not None and not pump.done() and pump.get_loop() is asyncio.get_running_loop():
                pump.cancel()
                await asyncio.gather(pump, return_exceptions=True)

    # -- the pump ------------------------------------------------------------------------------------

    def _ensure_pump(self) -> None:
        # (a loop that ended mid-copy without cancelling its tasks leaves its pump pending for good: this loop needs its own)
        if self._pump_task is None or self._pump_task.done() or self._pump_task.get_loop() is not asyncio.get_running_loop():
            self._pump_task = asyncio.get_running_loop().create_task(self._pump(), name="specter-transfer-pump")

    async def _pump(self) -> None:
        """The engine loop: wait for room on the stream, for the emulated link, then issue the next chunk; end
        when nothing is queued (the next `submit` starts another)."""
        transfer = None
        try:
            while True:
                self._retire_completed()  # urgent chunks skip the room check: retire here, or _in_flight only grows
                transfer = self._next_transfer()
                if transfer is None:
                    return
                if not transfer.urgent:  # a prefetch waits for room; an urgent miss is wanted now: no cap
                    await self._room_on_stream()
                await self._emulated_link_free()
                transfer = self._next_transfer()  # an urgent miss may have arrived while we waited
                if transfer is None or (not transfer.urgent and len(self._in_flight) >= self.max_chunks_in_flight):
                    self._room_waited = None
                    continue  # (a prefetch picked up here must still find room)
                self._issue_chunk(transfer, room=None if transfer.urgent else self._room_waited)  # (a room is a prefetch's)
                self._room_waited = None
                # Yield after every chunk: when copies finish faster than Python issues them the room check
                # never suspends, and an urgent miss submitted meanwhile would wait behind the whole queue.
                await asyncio.sleep(0)
        except Exception as error:
            log.error("transfer.pump_failed", error=repr(error))
            self._fail_queued(error, transfer)
            raise

    def _fail_queued(self, error: Exception, current: Transfer | None = None) -> None:
        """Every transfer not fully issued fails with `error` (their owners see it from `landed()`), and `current`,
        the one being issued when it failed, even if it already left its queue (`_finish` failing part way)."""
        for transfer in [*self._urgent, *self._prefetch, *([current] if current is not None else [])]:
            if not transfer._ready.done():
                transfer._ready.set_exception(error)
        self._urgent.clear()
        self._prefetch.clear()

    async def _room_on_stream(self) -> None:
        self._room_waited = None  # (only a wait for this chunk's room counts)
        self._retire_completed()
        while len(self._in_flight) >= self.max_chunks_in_flight:
            room = self._in_flight[0].end
            await self.kernel.wait(room)
            # (the pump trace: when room appeared, on the stream's clock; not with a host-paced emulation, whose
            # chunks end at their emulated time, not at their events)
            self._room_waited = room if self.issue_marks and not self.host_paced else None
            self._retire_completed()

    async def _emulated_link_free(self) -> None:
        """Host-paced emulation: sleep on a loop timer until the emulated link frees within TIMER_SLACK_S; never spin.

        The chunk issued then is timed by the queue model from when the link frees (`_emulate_link`), not from its
        issue, so issuing it early costs the link nothing (a real copy engine holds its next copies queued too, as the
        un-emulated pump keeps `max_chunks_in_flight` on the stream) and a timer that wakes late still issues it in
        time. `sleep_until`'s precision would cost a busy loop thread here: it spins for the last TIMER_SLACK_S before
        each deadline, and a 16 MiB chunk at Gen4 takes less (0.84 ms), so the loop thread would spin for as long as
        the link copies, taking a core and the GIL from the host expert path, which computes meanwhile (issue 29). Only
        a reader waiting for a landing (`Transfer.landed`) still spins, for at most TIMER_SLACK_S per landing."""
        if self.link is not None and self.link.mode == "host":
            delay = self._link_free_at - TIMER_SLACK_S - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)  # once: uvloop counts whole milliseconds, so this wakes up to ~2.5 ms early
                # (issued further ahead) or about a millisecond late, which the slack absorbs

    def _next_transfer(self) -> Transfer | None:
        queue = self._urgent or self._prefetch
        return queue[0] if queue else None

    def _issue_chunk(self, transfer: Transfer, room: Event | None = None) -> None:
        issued = queued = None
        if self.issue_marks:
            issued = self.backend.record_event(self.stream, timed=True)
            now = time.perf_counter()
            queued, transfer.issuable_since = now - transfer.issuable_since, now
        if transfer.bytes_issued == 0:
            for event in transfer._wait_for:
                if not event.query():
                    self.backend.stream_wait(self.stream, event)
        dst, src = transfer._take_chunk(self.chunk_bytes // transfer.src.element_size() or 1)
        nbytes = src.numel() * src.element_size()
        offset = self._emulated_offset(transfer)  # (before the start event: that cannot complete before it is recorded)
        start = self.backend.record_event(self.stream, timed=True)
        self._enqueue_h2d(dst, src)
        # Without a link emulation the last chunk's `copied` event is also the transfer's ready event, recorded after
        # `after_copy` (a 4-byte table write: the bandwidth estimate barely sees it): one event fewer per copy.
        last = transfer._remaining == 0 and self.link is None
        failed = None
        if last and transfer._after_copy is not None:
            try:
                transfer._after_copy()
            except Exception as error:  # the copy is on the stream: track its chunk, then fail the transfer
                failed = error
        copied = self.backend.record_event(self.stream, timed=True)
        padded, emulated_s, real_estimate = self._emulate_link(transfer, nbytes)
        chunk = _Chunk(nbytes, start, copied, padded or copied, issued,
                       transfer.tag[0] if isinstance(transfer.tag, tuple) else None, transfer.urgent, queued, room, offset,
                       emulated_s, real_estimate)
        self._in_flight.append(chunk)
        if self.chunk_log is not None:
            self.chunk_log.append(chunk)
        self.stats.chunks += 1
        self.stats.bytes_copied += nbytes
        if failed is not None:
            raise failed
        if transfer._remaining == 0:
            self._finish(transfer, copied if last else None)

    def _enqueue_h2d(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """The backend's copy without an event of its own (the engine records its own per chunk). Looked up per
        chunk: a test may replace the backend's method after the engine was built."""
        self.backend.enqueue_h2d(dst, src, self.stream)

    def _emulated_offset(self, transfer: Transfer) -> float:
        """Host-paced emulation: seconds from now to when the queue model begins the chunk issued now (`_Chunk.offset`;
        0 without a host-paced emulation)."""
        if not self.host_paced:
            return 0.0
        return max(transfer.submitted_at, self._link_free_at) - time.perf_counter()

    def _emulate_link(self, transfer: Transfer, nbytes: int) -> tuple[Event | None, float, float]:
        """Account the chunk on the emulated link; in device mode pad the stream and return the pad's end, the emulated
        time and the copy time the pad assumed (None, 0 and 0 otherwise)."""
        if self.link is None:
            return None, 0.0, 0.0
        emulated_s = nbytes / (self.link.gbps * 1e9)
        if self.link.mode == "host":
            # Queue model in emulated time: a chunk begins when its transfer was submitted or when the
            # emulated link frees, whichever is later; late timer wake-ups are made up, not lost.
            self._link_free_at = max(transfer.submitted_at, self._link_free_at) + emulated_s
            transfer.emulated_landing = self._link_free_at
            return None, 0.0, 0.0
        real_s = nbytes / self._raw_bytes_per_s if self._raw_bytes_per_s else 0.0
        now = time.perf_counter()
        if now >= self._link_free_at:
            # The emulated link would have gone idle by now: a real link does not make up for an earlier chunk that
            # landed early, and a miss after a pause must not wait for it. (Not the stream's own idleness: a fast
            # real copy empties it long before the emulated link frees.)
            self._pad_error_s = 0.0
        self._link_free_at = max(now, self._link_free_at) + emulated_s
        planned = max(0.0, emulated_s - real_s)
        # Make up the estimate's error on retired chunks, at most one emulated chunk time per pad (the rest waits
        # for the next pads); the in-flight pads already hold what earlier ones made up.
        pad = min(max(0.0, planned + self._pad_error_s), planned + emulated_s)
        self._pad_error_s -= pad - planned
        self.backend.stream_sleep(self.stream, pad)
        # (a copy estimated slower than the link: no pad, and the estimate counts as the emulated time)
        return self.backend.record_event(self.stream, timed=True), emulated_s, emulated_s - planned

    def _finish(self, transfer: Transfer, ready: Event | None = None) -> None:
        """The last chunk is on the stream: `ready` is its event when `after_copy` already ran before it."""
        (self._urgent if transfer in self._urgent else self._prefetch).remove(transfer)
        if ready is None:
            if transfer._after_copy is not None:
                transfer._after_copy()
            ready = self.backend.record_event(self.stream)
        transfer._ready.set_result(ready)
        if debug_enabled():
            log.debug("transfer.issued", tag=transfer.tag, nbytes=transfer.nbytes, urgent=transfer.urgent)

    def _retire_completed(self) -> None:
        while self._in_flight and self._in_flight[0].end.query():
            chunk = self._in_flight.popleft()
            raw_s = chunk.copied.elapsed_since(chunk.start)
            if chunk.emulated_s:
                # Device-paced: the pads hold the emulated time over a run, not per chunk (one makes up for another's
                # misestimated copy), so the chunk counts what the emulated link holds it for, as host-paced ones do.
                self._pad_error_s += chunk.real_estimate - raw_s
                effective_s = max(raw_s, chunk.emulated_s)
            else:
                # (unpadded, the chunk ends at its copy: one elapsed-time query fewer, a cost the loop thread pays)
                effective_s = raw_s if chunk.end is chunk.copied else chunk.end.elapsed_since(chunk.start)
                if self.link is not None and self.link.mode == "host":
                    effective_s = max(effective_s, chunk.nbytes / (self.link.gbps * 1e9))
            weight = self.ema_alpha * min(1.0, chunk.nbytes / self.chunk_bytes)
            self._raw_bytes_per_s = _ema(self._raw_bytes_per_s, chunk.nbytes / max(raw_s, 1e-9), weight)
            self._effective_bytes_per_s = _ema(self._effective_bytes_per_s, chunk.nbytes / max(effective_s, 1e-9), weight)

    def _promote(self, transfer: Transfer) -> None:
        if transfer in self._prefetch:
            self._prefetch.remove(transfer)
            self._urgent.append(transfer)
            transfer.urgent = True
            self.stats.promoted += 1
            self._flush_urgent()

    def _cancel(self, transfer: Transfer) -> None:
        if transfer.fully_issued or transfer.cancelled:
            return
        self._drop(transfer)
        # Chunks already on the stream still land; the event tells the owner when the slot is quiet.
        transfer._ready.set_result(self.backend.record_event(self.stream) if transfer.bytes_issued else None)

    def _drop(self, transfer: Transfer) -> None:
        """Take a queued transfer off its queue, its chunks not issued yet never to be."""
        (self._urgent if transfer in self._urgent else self._prefetch).remove(transfer)
        transfer.cancelled = True
        self.stats.cancelled += 1


TIMER_SLACK_S = 1e-3
"""Event-loop timers wake up to about a millisecond late (uvloop counts in whole milliseconds): `sleep_until`
sleeps on a timer only until this long before its deadline, then yields to the loop until the deadline; the
host-paced pump issues a chunk once the emulated link frees within this long (`_emulated_link_free`)."""


async def sleep_until(deadline: float) -> None:
    """Suspend until `time.perf_counter()` reaches `deadline`, within one loop iteration rather than a timer's
    granularity (a reader awaiting a host-paced emulated landing, `Transfer.landed`: a late wake-up would delay the
    verify by up to a millisecond per miss, which a real link does not). It busy-waits for the last TIMER_SLACK_S or
    so (the loop thread stays busy, holding a core and most of the GIL; other tasks run between its yields), so use
    it only where that precision is the point, never for a wait that repeats for as long as the link copies (the
    pump's: `TransferEngine._emulated_link_free`)."""
    while (delay := deadline - time.perf_counter()) > 0:
        await asyncio.sleep(delay - TIMER_SLACK_S if delay > TIMER_SLACK_S else 0)


def _ema(previous: float | None, sample: float, weight: float) -> float:
    return sample if previous is None else (1.0 - weight) * previous + weight * sample
