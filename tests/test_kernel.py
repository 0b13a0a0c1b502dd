"""The microkernel: awaiting backend events, cancellation, thread hygiene and stage events (cpu backend)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from backends.cpu import CPUBackend
from specter.errors import ConfigError
from specter.kernel import Kernel, KernelSettings, StageCounters, TaskGroup, new_event_loop, run, stage


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


@pytest.mark.parametrize("mechanism", ["waiter", "host_func"])
def test_wait_resumes_after_the_event_and_not_before(backend, mechanism):
    kernel = Kernel(backend, KernelSettings(mechanism=mechanism))

    async def main() -> float:
        event = delayed_event(backend, 0.05)
        started = time.perf_counter()
        await kernel.wait(event)
        assert event.query()
        return time.perf_counter() - started

    assert run(main()) >= 0.045
    assert kernel.stats.parked == 1
    kernel.close()


def test_completed_event_does_not_suspend_and_spin_catches_short_waits(backend):
    kernel = Kernel(backend, KernelSettings(spin_s=0.01))

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


def test_host_func_without_backend_is_a_config_error():
    with pytest.raises(ConfigError, match="host_func"):
        Kernel(None, KernelSettings(mechanism="host_func"))


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


def test_deferred_work_runs_while_a_wait_is_pending_and_stops_when_its_event_completes(backend):
    """Deferred steps fill a wait whose event is pending; once it completes the wait returns at the next step
    boundary and the rest waits for later waits or run_deferred; a completed event runs none."""
    kernel = Kernel(backend, KernelSettings(spin_s=0.0))
    steps: list[int] = []

    def work(name: int, count: int, pause_s: float):
        for index in range(count):
            time.sleep(pause_s)
            steps.append(name * 100 + index)
            yield

    async def main() -> None:
        kernel.defer(work(1, 3, 0.0))
        done = backend.record_event(backend.compute_stream)
        done.wait()
        await kernel.wait(done)
        assert steps == [] and kernel.deferred == 1  # nothing pending: no deferred step ran
        event = delayed_event(backend, 0.03)
        kernel.defer(work(2, 1000, 0.001))  # outlasts the event
        await kernel.wait(event)
        assert event.query()
        assert steps[:3] == [100, 101, 102] and 200 in steps and len(steps) < 3 + 1000
        assert kernel.deferred == 1  # the second work is not finished

    run(main())
    assert kernel.stats.idle_completed == 1 and kernel.stats.idle_steps == len(steps) + 1  # + the step ending work 1
    kernel.run_deferred()
    assert kernel.deferred == 0 and len(steps) == 3 + 1000 and steps[-1] == 200 + 999
    kernel.close()


def test_a_deferred_step_that_raises_is_logged_and_dropped_not_raised_into_the_wait(backend):
    kernel = Kernel(backend, KernelSettings(spin_s=0.0))
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
