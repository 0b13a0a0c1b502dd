"""The cpu backend: each stream is a worker thread running its work in FIFO order, like a GPU stream.

Copies are real tensor copies. An optional link model (GB/s plus a per-copy latency) makes H2D copies
take the time a PCIe link would, so overlap, ordering and cancellation are exercised without a GPU.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence

import torch

from specter.daemons import Mark, settle_at_exit
from specter.errors import ConfigError
from specter.log import get_logger

log = get_logger(__name__)

# Stream sleeps pay back time.sleep's overshoot on the next sleep, up to this much.
_MAX_SLEEP_DEBT_S = 0.002
# A copy whose worker started it later than this after its model begin was held up by the stream itself
# (a stream_wait, earlier work), not by a late wake-up; it then begins when it really started.
_WAKE_UP_TOLERANCE_S = 0.0005


class CPUEvent:
    """A threading-based completion: set by the stream's worker when it reaches the event."""

    def __init__(self, stream: CPUStream) -> None:
        self.stream = stream
        self.completed_at: float | None = None
        self.failure: BaseException | None = None
        """The first error of any stream's work before this event completed (backends/base.py, `Event`)."""
        self._done = threading.Event()

    def complete(self) -> None:
        self.completed_at = time.perf_counter()
        self.failure = self.stream.first_error()
        self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def wait(self) -> None:
        self._done.wait()

    def elapsed_since(self, start: CPUEvent) -> float:
        assert self.completed_at is not None and start.completed_at is not None, "elapsed_since needs two completed events"
        return self.completed_at - start.completed_at

    def __repr__(self) -> str:
        return f"CPUEvent({self.stream.name}, done={self.query()})"


class CPUStream:
    """A FIFO of work items run by one daemon thread, started on first use."""

    def __init__(self, name: str, errors: list[BaseException]) -> None:
        self.name = name
        self._work: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._errors = errors
        self._sleep_debt = 0.0
        self.modeled_until: float | None = None
        """The link-model time at which this stream's last copy landed, while nothing but event records ran
        after it; None once other work ran. Read by the copy after it."""
        self.previous_modeled_until: float | None = None

    def enqueue(self, work: Callable[[], None]) -> None:
        """Run `work` after everything enqueued before. From the stream's own thread (an item enqueuing more
        work) it runs at once, inside that item: ahead of items queued
        behind it, as on CUDA, where such work is enqueued at that point of the stream."""
        if self._thread is not None and threading.current_thread() is self._thread:
            if not getattr(work, "keeps_model_time", False):
                self.previous_modeled_until = self.modeled_until = None  # the enclosing item held the stream
            work()
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"specter-cpu-stream-{self.name}", daemon=True)
            self._thread.start()
            settle_at_exit(self)
        self._work.put(work)

    def _run(self) -> None:
        while (work := self._work.get()) is not None:
            if not getattr(work, "keeps_model_time", False):
                self.previous_modeled_until, self.modeled_until = self.modeled_until, None
            try:
                work()
            except Exception as error:  # a failing item must not kill the stream (its events would never complete);
                # every event completed after it carries the error, which Kernel.wait and synchronize() raise
                log.error("cpu_stream.work_failed", stream=self.name, error=repr(error))
                self._errors.append(error)

    def first_error(self) -> BaseException | None:
        """The backend's first failed work item on any stream, as CUDA's errors are the context's, not a stream's."""
        return self._errors[0] if self._errors else None

    def sleep(self, seconds: float) -> None:
        """Keep the stream busy for `seconds`; time.sleep's overshoot is paid back by the next sleep, so a
        run of pads (device-side link emulation) keeps its average rate."""
        wanted = seconds - self._sleep_debt
        if wanted <= 0:
            self._sleep_debt = -wanted
            return
        started = time.perf_counter()
        time.sleep(wanted)
        self._sleep_debt = min(time.perf_counter() - started - wanted, _MAX_SLEEP_DEBT_S)

    def settle(self, timeout_s: float) -> bool:
        """Wait until the work enqueued so far has run (`specter.daemons`); False if `timeout_s` passed first."""
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return True
        mark = Mark()
        mark.keeps_model_time = True  # type: ignore[attr-defined]  # like an event record, it does not hold the stream
        self._work.put(mark)
        return mark.wait(thread, timeout_s)

    def close(self) -> None:
        if self._thread is not None:
            self._work.put(None)
            self._thread.join()
            self._thread = None

    def __repr__(self) -> str:
        return f"CPUStream({self.name})"


class LinkModel:
    """One half-duplex link shared by all copy streams: a copy of n bytes occupies it latency + n/bandwidth."""

    def __init__(self, bandwidth_gbps: float, latency_s: float = 0.0) -> None:
        if bandwidth_gbps <= 0 or latency_s < 0:
            raise ConfigError(
                f"link model needs bandwidth > 0 GB/s and latency >= 0 s, got {bandwidth_gbps} GB/s, {latency_s} s"
            )
        self.bytes_per_s = bandwidth_gbps * 1e9
        self.latency_s = latency_s
        self._free_at = 0.0
        self._lock = threading.Lock()

    def occupy(self, nbytes: int, enqueued: float, started: float, held_until: float | None = None) -> float:
        """Sleep the calling worker until a copy of `nbytes` would have landed; return that model time.

        A queue model: the copy begins when it was enqueued or when the link frees, whichever is later,
        unless the stream held it longer. `held_until` is the model time at which the stream's previous
        copy landed when nothing else ran on the stream since: the stream was then free at that model time,
        however late its worker woke. Model times, not wake-up times, so late wake-ups of the worker (many
        milliseconds on a loaded machine) do not accumulate into lost bandwidth."""
        with self._lock:
            stream_free = held_until if held_until is not None else started - _WAKE_UP_TOLERANCE_S
            begin = max(enqueued, self._free_at, stream_free)
            self._free_at = begin + self.latency_s + nbytes / self.bytes_per_s
            deadline = self._free_at
        sleep_until(deadline)
        return deadline


def sleep_until(deadline: float) -> None:
    """Sleep to a perf_counter deadline. No spinning: a spinning worker would hold the GIL that the
    event loop needs; time.sleep's overshoot (~0.1 ms) does not accumulate (LinkModel uses model times)."""
    remaining = deadline - time.perf_counter()
    if remaining > 0:
        time.sleep(remaining)


class CPUBackend:
    """Streams as worker threads; `link_gbps` turns on the link model for H2D copies."""

    name = "cpu"

    def __init__(self, link_gbps: float | None = None, link_latency_s: float = 0.0) -> None:
        self.device = torch.device("cpu")
        self.link = LinkModel(link_gbps, link_latency_s) if link_gbps is not None else None
        self.errors: list[BaseException] = []
        self._streams: list[CPUStream] = []
        self.compute_stream = self.new_stream("compute")
        self.copy_stream = self.new_stream("copy")
        self._count_lock = threading.Lock()
        self.h2d_bytes = 0
        """Bytes actually copied host -> device by stream workers (tests check every byte is counted once)."""

    def alloc_host(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)

    def alloc_device(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=dtype)

    def new_stream(self, name: str) -> CPUStream:
        stream = CPUStream(name, self.errors)
        self._streams.append(stream)
        return stream

    def record_event(self, stream: CPUStream, timed: bool = False) -> CPUEvent:
        event = CPUEvent(stream)

        def complete() -> None:
            event.complete()

        complete.keeps_model_time = True  # type: ignore[attr-defined]  # a record does not hold the stream
        stream.enqueue(complete)
        return event

    def copy_h2d(self, dst: torch.Tensor, src: torch.Tensor, stream: CPUStream) -> CPUEvent:
        enqueued = time.perf_counter()

        def copy() -> None:
            started = time.perf_counter()
            dst.copy_(src)
            with self._count_lock:  # several copy streams may finish at once
                self.h2d_bytes += src.numel() * src.element_size()
            if self.link is not None:
                nbytes = src.numel() * src.element_size()
                stream.modeled_until = self.link.occupy(nbytes, enqueued, started, stream.previous_modeled_until)

        stream.enqueue(copy)
        return self.record_event(stream)

    def enqueue_h2d(self, dst: torch.Tensor, src: torch.Tensor, stream: CPUStream) -> None:
        """`copy_h2d`, its event dropped: looked up on the instance, so a test's replacement sees every chunk."""
        self.copy_h2d(dst, src, stream)

    def set_int32(self, flat: torch.Tensor, index: int, value: int, stream: CPUStream) -> None:
        assert flat.dtype == torch.int32 and value >= -1, "set_int32 writes int32 values >= -1"

        def write() -> None:
            flat[index] = value

        # The slot-table write after an expert's last chunk does not hold the link: the next copy may still
        # begin at the model time the last one landed.
        write.keeps_model_time = True  # type: ignore[attr-defined]
        stream.enqueue(write)

    def copy_d2h(self, dst: torch.Tensor, src: torch.Tensor, stream: CPUStream) -> CPUEvent:
        stream.enqueue(lambda: dst.copy_(src))
        return self.record_event(stream)

    def stream_wait(self, stream: CPUStream, event: CPUEvent) -> None:
        if event.stream is not stream:  # same-stream events are already ordered
            stream.enqueue(event.wait)

    def stream_sleep(self, stream: CPUStream, seconds: float) -> None:
        stream.enqueue(lambda: stream.sleep(seconds))

    def launch(self, stream: CPUStream, work: Callable[[], None]) -> None:
        stream.enqueue(work)

    def synchronize(self) -> None:
        for event in [self.record_event(stream) for stream in self._streams]:
            event.wait()
        if self.errors:
            raise RuntimeError(f"work on a cpu stream failed: {self.errors[0]!r}") from self.errors[0]

    def close(self) -> None:
        for stream in self._streams:
            stream.close()
