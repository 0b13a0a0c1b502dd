"""The microkernel: awaiting backend events, cancellation, thread hygiene and stage events (cpu backend)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from backends.cpu import CPUBackend
from specter.config import WaitTuning
from specter.kernel import Kernel, StageCounters, TaskGroup, new_event_loop, run, stage


def specter_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name.startswith("specter-")]


def delayed_event(backend: CPUBackend, seconds: float):
    backend.stream_sleep(backend.compute_stream, seconds)
    return backend.record_event(backend.compute_stream)


@pytest.fixture
def backend():
    backend = CPUBackend()
    yield backend
    backend.close()


def test_wait_resumes_after_the_event_and_not_before(backend):
    kernel = Kernel(backend)

    async def main() -> float:
        event = delayed_event(backend, 0.05)
        started = time.perf_counter()
        await kernel.wait(event)
        assert event.query()
        return time.perf_counter() - started

    assert run(main()) >= 0.045
    assert kernel.stats.parked == 1
    kernel.close()


def test_a_wait_past_work_that_failed_on_a_stream_raises_it(backend):
    """A failed copy on a CPU stream thread was only logged: its event completed and the reader computed with a slot
    that was never filled. Every event completed after the failure, on any stream, carries it, and the wait raises."""
    kernel = Kernel(backend)

    def fail() -> None:
        raise OverflowError("timestamp out of range")

    async def main() -> None:
        assert (await kernel.wait(backend.record_event(backend.copy_stream))) is None  # before: nothing failed
        backend.stream_sleep(backend.copy_stream, 0.02)  # parked, not already done
        backend.copy_stream.enqueue(fail)
        with pytest.raises(RuntimeError, match="timestamp out of range") as failed:
            await kernel.wait(backend.record_event(backend.copy_stream))
        assert isinstance(failed.value.__cause__, OverflowError)
        with pytest.raises(RuntimeError):  # sticky, as CUDA's errors are: another stream's later event too
            await kernel.wait(backend.record_event(backend.compute_stream))

    run(main())
    kernel.close()


def test_completed_event_does_not_suspend_and_spin_catches_short_waits(backend):
    kernel = Kernel(backend, WaitTuning(spin_s=0.01))

    async def main() -> None:
        done = backend.record_event(backend.compute_stream)
        done.wait()
        await kernel.wait(done)
        await kernel.wait(delayed_event(backend, 0.001))
        await kernel.wait(delayed_event(backend, 0.05), spin_s=0.0)

    run(main())
    assert (kernel.stats.already_done, kernel.stats.spun, kernel.stats.parked) == (1, 1, 1)
    kernel.close()


def test_poll_wakes_within_loop_iterations_lets_other_tasks_run_and_falls_back_to_parking(backend):
    kernel = Kernel(backend)
    ticks = []

    async def ticker() -> None:
        while True:
            ticks.append(time.perf_counter())
            await asyncio.sleep(0)

    async def main() -> float:
        task = asyncio.get_running_loop().create_task(ticker())
        event = delayed_event(backend, 0.004)
        await kernel.wait(event, spin_s=0.0, poll_s=0.5)
        woke = time.perf_counter() - event.completed_at
        assert len(ticks) > 10, "the poll must yield to other tasks between polls"
        await kernel.wait(delayed_event(backend, 0.03), spin_s=0.0, poll_s=0.002)  # longer than the budget
        task.cancel()
        return woke

    woke = run(main())
    assert (kernel.stats.polled, kernel.stats.parked) == (1, 1)
    assert woke < 0.02, f"a polled wait woke {woke * 1e3:.1f} ms after its event"
    kernel.close()


def test_the_loop_keeps_running_while_a_task_waits(backend):
    kernel = Kernel(backend)
    ticks = []

    async def ticker() -> None:
        for _ in range(5):
            ticks.append(time.perf_counter())
            await asyncio.sleep(0.005)

    async def main() -> None:
        async with TaskGroup() as group:
            group.create_task(kernel.wait(delayed_event(backend, 0.08)))
            group.create_task(ticker())

    started = time.perf_counter()
    run(main())
    assert len(ticks) == 5 and ticks[-1] - started < 0.07
    kernel.close()


def test_a_wait_parked_behind_a_later_event_of_its_stream_is_told_late(backend):
    """A stream's waiter blocks on its events in the order they were parked: an early event parked after a later one
    is reported only when the later one completes (head-of-line)."""
    kernel = Kernel(backend)

    async def main() -> float:
        early = delayed_event(backend, 0.02)
        late = delayed_event(backend, 0.3)
        loop = asyncio.get_running_loop()
        behind = loop.create_task(kernel.wait(late))  # parked first
        await asyncio.sleep(0)
        started = time.perf_counter()
        await kernel.wait(early)
        elapsed = time.perf_counter() - started
        await behind
        return elapsed

    elapsed = run(main())
    kernel.close()
    assert elapsed > 0.25, "the shared lane reported the early event before the later one (the premise changed)"


def test_cancellation_is_not_swallowed_by_except_exception_and_completion_is_dropped(backend):
    kernel = Kernel(backend)
    swallowed = []

    async def careless_stage(event) -> None:
        try:
            await kernel.wait(event)
        except Exception as error:  # what a careless stage does; CancelledError must pass through
            swallowed.append(error)

    async def main() -> None:
        event = delayed_event(backend, 0.05)
        task = asyncio.get_running_loop().create_task(careless_stage(event))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.08)  # the event completes; its completion must be dropped, not crash
        assert event.query()

    run(main())
    assert swallowed == []
    assert kernel.stats.dropped == 1
    kernel.close()


def test_no_thread_is_left_after_close(backend):
    before = set(specter_threads())
    kernel = Kernel(backend)

    async def main() -> None:
        second = backend.new_stream("second")
        await kernel.wait(delayed_event(backend, 0.01))
        backend.stream_sleep(second, 0.01)
        await kernel.wait(backend.record_event(second))

    run(main())
    assert len(kernel.threads) == 2  # one waiter per stream
    kernel.close()
    backend.close()
    assert kernel.threads == []
    assert set(specter_threads()) <= before


def test_run_uses_uvloop_when_installed():
    uvloop = pytest.importorskip("uvloop")
    loop = new_event_loop()
    try:
        assert isinstance(loop, uvloop.Loop)
    finally:
        loop.close()


def test_stage_counts_outcomes_and_lets_cancellation_through():
    counters = StageCounters()

    async def main() -> None:
        async with stage("draft", counters=counters, round=1):
            await asyncio.sleep(0.01)
        with pytest.raises(ValueError):
            async with stage("verify", counters=counters):
                raise ValueError("boom")
        task = asyncio.get_running_loop().create_task(slow_stage(counters))
        await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(main())
    draft, verify, transfer = (counters.by_stage[name] for name in ("draft", "verify", "transfer"))
    assert draft.count == 1 and draft.total_s >= 0.009
    assert verify.failed == 1 and transfer.cancelled == 1


async def slow_stage(counters: StageCounters) -> None:
    async with stage("transfer", counters=counters):
        await asyncio.sleep(1.0)


def test_stage_events_are_logged_only_when_debug_is_on():
    """Hot paths check `debug_enabled()` before logging; with DEBUG on the events still arrive."""
    from structlog.testing import capture_logs

    from specter import log

    async def one_stage() -> None:
        async with stage("verify", rows=3):
            await asyncio.sleep(0)

    log.configure(level="DEBUG")
    try:
        assert log.debug_enabled()
        with capture_logs() as events:
            asyncio.run(one_stage())
        assert [(e["event"], e["stage"], e["rows"]) for e in events] == [("stage.start", "verify", 3), ("stage.end", "verify", 3)]
        assert events[1]["outcome"] == "ok" and events[1]["duration_s"] >= 0
    finally:
        log.configure()
    assert not log.debug_enabled()
    with capture_logs() as events:
        asyncio.run(one_stage())
    assert events == []


def test_deferred_work_fills_a_pending_wait_within_its_idle_budget_and_run_deferred_finishes_it(backend):
    """Deferred steps run only while a wait's event is pending, for at most idle_s per wait (then the wait parks
    as usual); a completed event runs none; run_deferred finishes the rest in order."""
    kernel = Kernel(backend, WaitTuning(spin_s=0.0, idle_s=0.005))
    steps: list[int] = []

    def work(name: int, count: int, pause_s: float):
        for index in range(count):
            time.sleep(pause_s)
            steps.append(name * 1000 + index)
            yield

    async def main() -> None:
        kernel.defer(work(1, 3, 0.0))
        kernel.defer(work(2, 200, 0.001))
        done = backend.record_event(backend.compute_stream)
        done.wait()
        await kernel.wait(done)
        assert steps == [] and kernel.deferred == 2  # nothing pending: no deferred step ran
        event = delayed_event(backend, 0.05)
        await kernel.wait(event)
        assert event.query()
        assert steps[:4] == [1000, 1001, 1002, 2000]
        assert 4 <= len(steps) <= 3 + 12, steps  # about 5 ms of 1 ms steps, not the 50 ms the event took

    run(main())
    assert kernel.stats.parked == 1 and kernel.stats.idle_completed == 0
    kernel.run_deferred()
    assert kernel.deferred == 0 and steps == [1000, 1001, 1002] + [2000 + i for i in range(200)]
    kernel.close()


def test_a_wait_whose_event_completes_during_deferred_work_returns_without_parking(backend):
    kernel = Kernel(backend, WaitTuning(spin_s=0.0, idle_s=0.01))
    steps: list[int] = []

    def work():
        for index in range(1000):
            time.sleep(0.0005)
            steps.append(index)
            yield

    async def main() -> None:
        kernel.defer(work())
        event = delayed_event(backend, 0.001)  # completes well inside the 10 ms idle budget
        await kernel.wait(event)
        assert event.query()

    run(main())
    assert kernel.stats.idle_completed == 1 and kernel.stats.parked == 0
    assert 1 <= len(steps) < 20 and kernel.deferred == 1
    kernel.run_deferred()
    assert len(steps) == 1000
    kernel.close()


def test_a_work_that_is_not_ready_is_stepped_once_per_wait_not_busy_polled(backend):
    from specter.kernel import NOT_READY

    kernel = Kernel(backend, WaitTuning(spin_s=0.0, idle_s=0.01))
    ready = threading.Event()
    polls: list[int] = []

    def work():
        while not ready.is_set():
            polls.append(1)
            yield NOT_READY
        yield

    async def main() -> None:
        kernel.defer(work())
        await kernel.wait(delayed_event(backend, 0.03))
        assert len(polls) == 1 and kernel.stats.parked == 1  # no busy poll of a work that cannot progress

    run(main())
    threading.Timer(0.02, ready.set).start()
    kernel.run_deferred()  # waits (dropping the GIL) until the work can finish
    assert kernel.deferred == 0 and ready.is_set()
    kernel.close()


def test_run_deferred_from_inside_a_deferred_step_returns_at_once(backend):
    kernel = Kernel(backend)
    order: list[str] = []

    def reentrant():
        order.append("a1")
        kernel.run_deferred()  # must neither recurse into this work nor pop another
        order.append("a2")
        yield

    def other():
        order.append("b")
        yield

    kernel.defer(reentrant())
    kernel.defer(other())
    kernel.run_deferred()
    assert order == ["a1", "a2", "b"] and kernel.deferred == 0
    kernel.close()


def test_a_deferred_step_that_raises_is_logged_and_dropped_not_raised_into_the_wait(backend):
    kernel = Kernel(backend, WaitTuning(spin_s=0.0, idle_s=0.01))
    after: list[str] = []

    def broken():
        yield
        raise ValueError("bookkeeping bug")

    def fine():
        after.append("ran")
        yield

    async def main() -> None:
        kernel.defer(broken())
        kernel.defer(fine())
        await kernel.wait(delayed_event(backend, 0.02))

    run(main())
    assert kernel.deferred == 0 and after == ["ran"]
    kernel.close()


def test_a_polled_wait_runs_no_deferred_work(backend):
    """A wait that polls is on the critical path (the verify's router choice): deferred steps must not delay its
    wake-up; the next plain wait runs them."""
    kernel = Kernel(backend, WaitTuning(spin_s=0.0, idle_s=0.005))
    steps: list[int] = []

    def work():
        for index in range(100):
            time.sleep(0.0005)
            steps.append(index)
            yield

    async def main() -> None:
        kernel.defer(work())
        await kernel.wait(delayed_event(backend, 0.01), poll_s=0.05)
        assert steps == [], "a polled wait ran deferred work"
        await kernel.wait(delayed_event(backend, 0.01))
        assert steps, "a plain wait with a pending event runs deferred work"

    run(main())
    kernel.run_deferred()
    assert len(steps) == 100
    kernel.close()
