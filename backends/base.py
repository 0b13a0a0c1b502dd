"""The Backend protocol: device memory, streams, copies and events, as the engine and microkernel use them.

Two backends ship: `cpu` (threads stand in for streams; an optional link model makes copies take PCIe
time) and `cuda` (torch streams and blocking-sync events). Both register in `specter.backends`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

Stream = Any
"""A backend's stream: opaque to callers, hashable (waiter threads are keyed by it)."""


@runtime_checkable
class Event(Protocol):
    """A point recorded on a stream; complete once the stream has passed it.

    The microkernel awaits events (`Kernel.wait`); nothing else should block on them on the event-loop
    thread. Events of one stream complete in the order they were recorded.
    """

    stream: Stream
    """The stream the event was recorded on (the kernel keeps one waiter thread per stream and lane)."""

    # Optional: `failure`, the error of work the backend ran before the event completed, or None. `Kernel.wait`
    # raises it, so work that failed on a stream thread is never waited past as if done (a CUDA error is sticky the
    # same way: every later call returns it). An event without the attribute never failed.

    def query(self) -> bool:
        """True once complete. Never blocks; safe to call from any thread."""
        ...

    def wait(self) -> None:
        """Block the calling thread until complete. Releases the GIL; called only on waiter threads."""
        ...

    def elapsed_since(self, start: Event) -> float:
        """Seconds between `start` and this event; both timed (`record_event(timed=True)`) and complete."""
        ...


@runtime_checkable
class Backend(Protocol):
    """Memory, streams and copies for one device. Built once per engine, before any weight is loaded.

    Threading: every method is called from the event-loop thread, except `Event.wait` (waiter threads).
    """

    name: str
    """Entry-point name ('cpu', 'cuda')."""
    device: torch.device
    """Where the expert cache, the draft and the non-expert weights live."""
    compute_stream: Stream
    """The stream model kernels run on (verify, draft)."""
    copy_stream: Stream
    """The stream expert H2D copies run on (the transfer engine's)."""

    def alloc_host(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat host buffer (page-locked on cuda). Called by the expert pool while loading weights.

        Allocation may round the size up (torch's pinned allocator rounds to a power of two), so the
        pool allocates slabs and packs experts into them.
        """
        ...

    def alloc_device(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A device tensor, uninitialised. Called at start-up only: nothing is allocated while decoding."""
        ...

    def new_stream(self, name: str) -> Stream:
        """An extra stream (e.g. a second copy stream). Called at start-up."""
        ...

    def record_event(self, stream: Stream, timed: bool = False) -> Event:
        """Record an event at the current end of `stream`; `timed` makes `elapsed_since` usable."""
        ...

    def copy_h2d(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream) -> Event:
        """Enqueue `dst.copy_(src)` host -> device on `stream`; the event completes when the bytes landed.

        `src` must stay alive and untouched until then (pool buffers are never written after loading): the
        cuda backend may issue a raw cudaMemcpyAsync, which does not keep a temporary pinned tensor alive.
        """
        ...

    def copy_d2h(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream) -> Event:
        """Enqueue a device -> host copy (router choices, small); the caller awaits the event.

        `dst` must stay alive until then: the cuda backend may issue a raw cudaMemcpyAsync into it."""
        ...

    def stream_wait(self, stream: Stream, event: Event) -> None:
        """Make later work on `stream` wait for `event`, without blocking the host.

        The transfer engine calls it before overwriting a slot whose last reader may still run.
        """
        ...

    def stream_sleep(self, stream: Stream, seconds: float) -> None:
        """Keep `stream` busy for `seconds` without using the link (device-side link emulation)."""
        ...

    def launch(self, stream: Stream, work: Callable[[], None]) -> None:
        """Run `work` in `stream` order. On cuda it runs now, on the host, with `stream` current, so
        the kernels it launches are enqueued there; on cpu it runs on the stream's thread, in order."""
        ...

    def enqueue_h2d(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream) -> None:
        """`copy_h2d` without an event of its own: enqueue `dst.copy_(src)` host -> device on `stream`.

        Called by the transfer engine for every chunk of an expert copy, on the event-loop thread; the engine
        records its own timed events around each chunk, so an event per copy would be waste. What must hold is
        `copy_h2d`'s contract (`src` alive and untouched until the stream has passed the copy). A backend with
        no cheaper way may call its own `copy_h2d` and drop the event (the cpu backend does: a test that
        replaces `copy_h2d` on the instance then sees every chunk).
        """
        ...

    def set_int32(self, flat: torch.Tensor, index: int, value: int, stream: Stream) -> None:
        """Enqueue `flat[index] = value` in `stream` order, without a host sync.

        `flat` is a contiguous int32 device tensor and `value` >= -1. Called on the event-loop thread by the
        expert cache for its slot-table writes (on the copy stream, right after an expert's copy, so the table
        says "resident" only once the weights landed), and by the segmented step to set its expert graphs'
        input id (on the current compute stream, before a replay). The write must be ordered after earlier
        work on `stream` and before later work on it; the values the caller passes are not kept (cuda copies
        4 bytes from an immutable pinned table of values, so the call costs microseconds of host time).
        """
        ...

    def synchronize(self) -> None:
        """Block until every stream is idle. Start-up, shutdown and benchmarks only."""
        ...

    def close(self) -> None:
        """Finish queued work and stop backend threads; the backend is unusable afterwards."""
        ...
