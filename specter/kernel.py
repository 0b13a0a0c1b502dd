"""The microkernel: the event loop, and every point where a task can suspend on GPU work.

Code elsewhere never blocks on the device; it does `await kernel.wait(event)`.
"""

# Design principles (after curio's kernel.py):
#
#  1. This module holds every point where a task can suspend on GPU work: `Kernel.wait`. Grep for it to
#     find every host/device synchronisation of a decode round. Host compute a task awaits (the host expert
#     path) suspends here too, the same way: `Kernel.wait_host` on a job of a `HostThread`.
#  2. One door from other threads: `loop.call_soon_threadsafe`. Waiter threads, host threads and host callbacks
#     never touch a future, a task or a loop attribute; they only ask the loop to do it.
#  3. GPU work cannot be cancelled. A cancelled `wait` drops the completion when it arrives; the work
#     itself finishes, and the owner of what it wrote (the expert cache) decides what that means.
#  4. Cancellation cannot be swallowed: CancelledError is a BaseException, so `except Exception` in a
#     stage lets it through. Nothing here catches BaseException except to clean up and re-raise.
#  5. Structured concurrency: one asyncio.TaskGroup per unit of work (a decode round); no task outlives
#     the round that started it.
#  6. The loop thread never blocks on the device. The one exception is the spin budget: a bounded,
#     explicit poll of `event.query()` for waits known to be short (cheaper than two thread hops).
#  7. A parked wait completes through a waiter: one thread per stream blocking on a blocking-sync event with
#     the GIL released, which then knocks on the loop (a driver callback from the stream needed cupy and cost more
#     CPU per await).
#  8. Everything that waits is counted (`Kernel.stats`), and every stage is a structured event.

from __future__ import annotations

import asyncio
import collections
import queue
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from backends.base import Backend, Event, Stream
from specter.config import WaitTuning
from specter.daemons import Mark, settle_at_exit
from specter.log import debug_enabled, get_logger

log = get_logger(__name__)

T = TypeVar("T")
TaskGroup = asyncio.TaskGroup
"""One task group per unit of work (principle 5); re-exported so stages import it from here."""

_JOIN_TIMEOUT_S = 5.0
NOT_READY = object()
"""What a deferred work's step yields when it cannot progress yet (see Kernel.defer)."""


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A uvloop loop when uvloop is installed and the standard descriptors are open, else asyncio's default loop.

    libuv asserts that none of its own descriptors is 0, 1 or 2, and the lowest free one goes to the next it opens:
    in a process started with stdin or stdout closed (`<&-`), closing the loop aborted it (status 134, its output
    lost). The command-line tools reopen such descriptors on /dev/null first (`exits.standard_streams`); a program that
    closed its own gets asyncio's loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    from specter.exits import closed_standard_fds

    return asyncio.new_event_loop() if closed_standard_fds() else uvloop.new_event_loop()


def run(main: Awaitable[T], *, debug: bool = False) -> T:
    """Run `main` to completion on a fresh loop from `new_event_loop` (the CLI and benchmarks' entry)."""
    with asyncio.Runner(loop_factory=new_event_loop, debug=debug) as runner:
        return runner.run(main)


@dataclass
class WaitStats:
    """What `Kernel.wait` has done so far; feeds the metrics."""

    waits: int = 0
    already_done: int = 0
    """Events complete at the first query: no suspension at all."""
    spun: int = 0
    """Events that completed within the spin budget."""
    polled: int = 0
    """Events that completed within a wait's poll budget (cooperative polling)."""
    parked: int = 0
    """Events handed to the completion mechanism."""
    dropped: int = 0
    """Completions that arrived after their waiter was cancelled."""
    parked_s: float = 0.0
    """Total seconds tasks spent suspended on parked events."""
    idle_steps: int = 0
    """Steps of deferred host work run while a wait's event was pending (`Kernel.defer`)."""
    idle_completed: int = 0
    """Events that completed while deferred work ran: no spin, no suspension."""


class _StreamWaiter:
    """One thread per stream: blocks on each event in the order they were parked (head-of-line: a wait parked behind
    an event recorded later on the same stream is told only when that later event completes)."""

    def __init__(self, stream: Stream) -> None:
        self._pending: queue.SimpleQueue[tuple[Event, Callable[[], None]] | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=f"specter-waiter-{stream!r}", daemon=True)
        self.thread.start()
        settle_at_exit(self)

    def add(self, event: Event, notify: Callable[[], None]) -> None:
        self._pending.put((event, notify))

    def _run(self) -> None:
        while (item := self._pending.get()) is not None:
            event, notify = item
            event.wait()  # blocking-sync: the thread sleeps with the GIL released
            notify()

    def settle(self, timeout_s: float) -> bool:
        """Wait until every event parked so far has completed and been told (`specter.daemons`)."""
        if self.thread is threading.current_thread():
            return True
        mark = Mark()
        self._pending.put((_Completed(), mark))
        return mark.wait(self.thread, timeout_s)

    def stop(self) -> None:
        self._pending.put(None)
        self.thread.join(_JOIN_TIMEOUT_S)
        if self.thread.is_alive():
            log.warning("kernel.waiter_stuck", thread=self.thread.name, hint="an awaited event never completed")


class _Completed:
    """An event already complete: what a waiter's settle mark waits on."""

    def wait(self) -> None:
        pass


class HostJob(Generic[T]):
    """One piece of host work on a `HostThread` and its outcome; made by `Kernel.submit_host`."""

    def __init__(self, work: Callable[[], T], completion: asyncio.Future[None]) -> None:
        self.work, self.completion = work, completion
        self.notify: Callable[[], None] = lambda: None
        self.cancelled = False  # set on the loop thread, read on the host thread: at worst a late job runs, unread
        self.value: T | None = None
        self.error: BaseException | None = None
        self.seconds = 0.0
        """Host seconds the work ran (0 until it has)."""

    def cancel(self) -> None:
        self.cancelled = True

    def run(self) -> None:
        """On the host thread: the work, unless cancelled, then the one door to the loop."""
        if self.cancelled:
            return
        started = time.perf_counter()
        try:
            self.value = self.work()
        except BaseException as error:  # noqa: BLE001 - handed to the awaiting task, which raises it
            self.error = error
        self.seconds = time.perf_counter() - started
        self.notify()

    def fail(self, error: BaseException) -> None:
        """On the host thread, instead of `run`: the thread could not be set up, so the awaiting task gets `error`."""
        if not self.cancelled:
            self.error = error
            self.notify()


class HostThreadSetupError(RuntimeError):
    """A host job's thread could not be set up (its `setup` raised: the cause); no job of that thread can run."""


class HostThread:
    """One dedicated thread for host compute that tasks await (the host expert path): jobs run one at a time in the
    order submitted, after `setup` (e.g. the thread's own torch thread count) has run on it once."""

    def __init__(self, name: str, setup: Callable[[], None] | None = None) -> None:
        self._jobs: queue.SimpleQueue[HostJob[Any] | None] = queue.SimpleQueue()
        self._pending = 0  # submitted and not finished (skipped or run), for `idle`
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, args=(setup,), name=name, daemon=True)
        self.thread.start()
        settle_at_exit(self)

    def submit(self, job: HostJob[Any]) -> None:
        with self._lock:
            self._pending += 1
        self._jobs.put(job)

    @property
    def idle(self) -> bool:
        """No job queued or running."""
        with self._lock:
            return self._pending == 0

    def _run(self, setup: Callable[[], None] | None) -> None:
        # A setup that raises must not end the thread silently: every task awaiting one of its jobs would wait forever.
        # The thread stays, and each job fails with the setup's error, which its awaiting task raises.
        failed: BaseException | None = None
        if setup is not None:
            try:
                setup()
            except BaseException as error:  # noqa: BLE001 - handed to every job's awaiting task
                failed = error
        if failed is not None:
            try:  # a log sink that fails (a closed stream) must not end the thread either
                log.error("kernel.host_thread_setup_failed", thread=self.thread.name, error=repr(failed))
            except Exception:  # noqa: BLE001 - the jobs still get the set-up's error below
                pass
        while (job := self._jobs.get()) is not None:
            try:
                if failed is None:
                    job.run()
                else:  # a fresh error per job: one instance raised again and again would keep every raiser's frames
                    error = HostThreadSetupError(f"host thread {self.thread.name!r} could not be set up: {failed!r}")
                    error.__cause__ = failed
                    job.fail(error)
            finally:
                with self._lock:
                    self._pending -= 1

    def settle(self, timeout_s: float) -> bool:
        """Wait until the jobs submitted so far have run or been skipped (`specter.daemons`)."""
        if self.thread is threading.current_thread():
            return True
        mark = Mark()
        job: HostJob[None] = HostJob(mark, None)  # type: ignore[arg-type]  # no task awaits it
        job.notify = mark  # reached whether the thread runs the job or fails it (its setup failed)
        self.submit(job)
        return mark.wait(self.thread, timeout_s)

    def stop(self) -> None:
        """Finish the job running, skip none queued (they run, or are skipped when cancelled), then end the thread."""
        self._jobs.put(None)
        self.thread.join(_JOIN_TIMEOUT_S)
        if self.thread.is_alive():
            log.warning("kernel.host_thread_stuck", thread=self.thread.name, hint="a host job did not finish")


class Kernel:
    """Awaitable GPU events for one engine. Create it on any thread; use `wait` from the loop thread only."""

    def __init__(self, backend: Backend | None = None, settings: WaitTuning | None = None) -> None:
        self.settings = settings or WaitTuning()
        self.backend = backend
        self.stats = WaitStats()
        self._waiters: dict[Stream, _StreamWaiter] = {}  # one per stream
        self._deferred: collections.deque[Iterator[Any]] = collections.deque()
        self._in_deferred = False
        self._closed = False

    async def wait(self, event: Event, *, spin_s: float | None = None, poll_s: float = 0.0) -> None:
        """Suspend the calling task until `event` completes (the only GPU await point, principle 1).

        `spin_s` overrides the settings' spin budget for this wait. `poll_s`: after the spin, poll
        `event.query()` once per loop iteration for up to this long, yielding to the other tasks between
        polls (a wake-up within one iteration instead of a thread hop, at the price of a busy loop thread;
        for waits on the critical path that are known to be short; no deferred work runs in them, since a step
        there would delay the wake-up). If the task is cancelled while suspended, CancelledError propagates and the
        completion is dropped when it arrives.
        """
        self.stats.waits += 1
        if event.query():
            self.stats.already_done += 1
        elif self._deferred and poll_s <= 0 and self._idle(event):
            self.stats.idle_completed += 1
        elif self._spin(event, self.settings.spin_s if spin_s is None else spin_s):
            self.stats.spun += 1
        elif poll_s > 0 and await self._poll(event, poll_s):
            self.stats.polled += 1
        else:
            await self._park(event)
        failure = getattr(event, "failure", None)
        if failure is not None:  # the stream ran past work that failed: what the event marks is not done
            raise RuntimeError(f"work on the {event.stream} stream failed before this event: {failure!r}") from failure

    def defer(self, work: Iterator[Any]) -> None:
        """Queue host work that need not run now (bookkeeping that reads completed GPU events, say): an iterator
        advanced one step at a time while some `wait` finds its event still pending (at most `settings.idle_s` per
        wait), so it fills host time the loop thread would otherwise spend spinning or parked. A step that yields
        `NOT_READY` says the work cannot progress yet (it waits for the device itself): no more steps this wait.
        Keep each step short (it delays that wait's wake-up by at most one step). `run_deferred` finishes it all.
        A step that raises is logged and its work dropped: bookkeeping never fails the wait that hosts it."""
        self._deferred.append(work)

    @property
    def deferred(self) -> int:
        """Deferred works not finished yet."""
        return len(self._deferred)

    def run_deferred(self) -> None:
        """Finish every deferred work now (at the end of a request, before its statistics are read). Not from
        inside a deferred step (it returns at once there)."""
        if self._in_deferred:
            return
        while self._deferred:
            self._step(until_done=True)

    def _idle(self, event: Event) -> bool:
        """Advance deferred work while `event` is pending, for at most `settings.idle_s`; True when the event
        completed meanwhile."""
        if self._in_deferred:
            return False
        deadline = time.perf_counter() + self.settings.idle_s
        while self._deferred and time.perf_counter() < deadline:
            progressed = self._step(until_done=False)
            self.stats.idle_steps += 1
            if event.query():
                return True
            if not progressed:
                break
            time.sleep(0)  # drop the GIL between steps, as _spin does: the thread completing the event may need it
        return False

    def _step(self, until_done: bool) -> bool:
        """One step of the oldest work (all of it when until_done); False when it yielded NOT_READY."""
        work = self._deferred[0]
        self._in_deferred = True
        try:
            for value in work:
                if value is NOT_READY:
                    if not until_done:
                        return False
                    time.sleep(0)
                elif not until_done:
                    return True
        except Exception as error:  # noqa: BLE001 - see defer(): logged, dropped
            log.warning("kernel.deferred_failed", error=repr(error), hint="deferred bookkeeping raised; its result is lost")
        finally:
            self._in_deferred = False
        if self._deferred and self._deferred[0] is work:
            self._deferred.popleft()
        return True

    def _spin(self, event: Event, budget_s: float) -> bool:
        deadline = time.perf_counter() + budget_s
        while time.perf_counter() < deadline:
            if event.query():
                return True
            time.sleep(0)  # drop the GIL each poll: the thread completing the event may need it (cpu backend)
        return False

    async def _poll(self, event: Event, budget_s: float) -> bool:
        deadline = time.perf_counter() + budget_s
        while time.perf_counter() < deadline:
            await asyncio.sleep(0)
            if event.query():
                return True
        return False

    async def _park(self, event: Event) -> None:
        assert not self._closed, "Kernel.wait after Kernel.close"
        loop = asyncio.get_running_loop()
        completion = loop.create_future()
        notify = self._notifier(loop, completion)
        self._waiter_for(event.stream).add(event, notify)
        self.stats.parked += 1
        started = time.perf_counter()
        try:
            await completion
        finally:
            self.stats.parked_s += time.perf_counter() - started

    def _notifier(self, loop: asyncio.AbstractEventLoop, completion: asyncio.Future[None]) -> Callable[[], None]:
        """The callback other threads run: it only knocks on the one door (principle 2)."""

        def resolve() -> None:  # runs on the loop thread
            if completion.done():
                self.stats.dropped += 1
            else:
                completion.set_result(None)

        def notify() -> None:  # runs on a waiter or backend thread
            try:
                loop.call_soon_threadsafe(resolve)
            except RuntimeError:  # the loop is closed: nobody is left to tell
                pass

        return notify

    def _waiter_for(self, stream: Stream) -> _StreamWaiter:
        waiter = self._waiters.get(stream)
        if waiter is None:
            waiter = self._waiters[stream] = _StreamWaiter(stream)
        return waiter

    def submit_host(self, thread: HostThread, work: Callable[[], T]) -> HostJob[T]:
        """Queue `work` on `thread` now (from the loop thread); `wait_host` awaits its result. A job nobody will await
        (the caller failed or was cancelled in between) must be `cancel`led: it is then skipped if not started."""
        loop = asyncio.get_running_loop()
        job: HostJob[T] = HostJob(work, loop.create_future())
        job.notify = self._notifier(loop, job.completion)
        thread.submit(job)
        return job

    async def wait_host(self, job: HostJob[T]) -> T:
        """Suspend the calling task until `job` has run on its host thread; its value, or its error raised here. If the
        task is cancelled meanwhile, the job is cancelled (skipped if not started; a running one finishes, its result
        dropped, principle 3)."""
        try:
            await job.completion
        except BaseException:
            job.cancel()
            raise
        if job.error is not None:
            raise job.error
        return job.value  # type: ignore[return-value]

    @property
    def threads(self) -> list[threading.Thread]:
        """The waiter threads now alive (tests check none are left after close)."""
        return [waiter.thread for waiter in self._waiters.values() if waiter.thread.is_alive()]

    def close(self) -> None:
        """Stop and join the waiter threads. Pending waits must have completed or been cancelled."""
        self._closed = True
        for waiter in self._waiters.values():
            waiter.stop()
        self._waiters.clear()

    def __enter__(self) -> Kernel:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


@dataclass
class StageTotals:
    """Count and seconds of one stage name."""

    count: int = 0
    total_s: float = 0.0
    max_s: float = 0.0
    cancelled: int = 0
    failed: int = 0


@dataclass
class StageCounters:
    """Per-stage totals fed by `stage`; the metrics module reads them."""

    by_stage: dict[str, StageTotals] = field(default_factory=dict)

    def add(self, name: str, seconds: float, outcome: str) -> None:
        totals = self.by_stage.setdefault(name, StageTotals())
        totals.count += 1
        totals.total_s += seconds
        totals.max_s = max(totals.max_s, seconds)
        totals.cancelled += outcome == "cancelled"
        totals.failed += outcome == "error"


@asynccontextmanager
async def stage(name: str, *, counters: StageCounters | None = None, **fields: Any) -> AsyncIterator[None]:
    """Log `stage.start` / `stage.end` (with duration_s and outcome) around a block and count it.

    Host-side wall time: a stage that launches GPU work without awaiting it ends before the work does.
    """
    if debug_enabled():
        log.debug("stage.start", stage=name, **fields)
    started = time.perf_counter()
    outcome = "ok"
    try:
        yield
    except asyncio.CancelledError:
        outcome = "cancelled"
        raise
    except Exception:
        outcome = "error"
        raise
    finally:
        seconds = time.perf_counter() - started
        if debug_enabled():
            log.debug("stage.end", stage=name, duration_s=seconds, outcome=outcome, **fields)
        if counters is not None:
            counters.add(name, seconds, outcome)
