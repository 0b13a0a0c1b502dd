"""The API's lifecycle at its edges: an engine over several event loops and threads, Ctrl-C and close under a
SyncEngine, streams read after they ended, a stream abandoned by a task that then ends, and a second close."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from unittest import mock

import pytest

from specter import Engine, EngineConfig, SyncEngine, sync
from specter.errors import EngineLoopError, RequestCancelled

OFFLOADED = EngineConfig(device="cpu", residents=2)
PROMPT = [5, 17, 300, 42]


@pytest.fixture(scope="module")
def engine_and_reference(tiny):
    """One engine loaded on a loop that has ended (`asyncio.run`), and its tokens for PROMPT."""
    engine = asyncio.run(Engine.load(tiny, OFFLOADED))
    reference = asyncio.run(engine.complete(PROMPT, max_new_tokens=8)).token_ids
    yield engine, reference
    asyncio.run(engine.aclose())


@pytest.mark.parametrize("after_s", [0.0, 0.01, 0.05, 0.2])
def test_a_loop_that_ends_mid_request_leaves_the_engine_usable_on_the_next(engine_and_reference, after_s):
    """asyncio.run's main fails while two requests stream: the loop's end cancels them, perhaps before an expert
    load's completion ever ran; the next loop's requests must get the same tokens (they got 'Event loop is closed')."""
    engine, reference = engine_and_reference

    async def app():
        background = asyncio.create_task(engine.complete(PROMPT, max_new_tokens=400))  # noqa: F841
        asyncio.create_task(engine.complete([9, 8, 7], max_new_tokens=400))
        await asyncio.sleep(after_s)
        raise ValueError("the application failed")

    with pytest.raises(ValueError):
        asyncio.run(app())
    assert engine.runtime.loads_in_flight() == 0
    for _ in range(2):
        assert asyncio.run(asyncio.wait_for(engine.complete(PROMPT, max_new_tokens=8), 60)).token_ids == reference


def test_another_threads_running_loop_is_refused_by_name(engine_and_reference):
    engine, reference = engine_and_reference
    started, release, seen = threading.Event(), threading.Event(), {}

    async def own():  # the engine's loop, held running while the other thread asks
        seen["own"] = (await engine.complete(PROMPT, max_new_tokens=8)).token_ids
        started.set()
        await asyncio.get_running_loop().run_in_executor(None, release.wait, 60)

    owner = threading.Thread(target=lambda: asyncio.run(own()))
    owner.start()
    assert started.wait(60)
    try:
        with pytest.raises(EngineLoopError, match="serves another event loop.*SyncEngine"):
            asyncio.run(engine.complete(PROMPT, max_new_tokens=8))
    finally:
        release.set()
        owner.join(60)
    assert seen["own"] == reference
    assert asyncio.run(engine.complete(PROMPT, max_new_tokens=8)).token_ids == reference  # its loop ended: taken over


def test_a_stream_read_after_it_was_closed_or_cancelled_says_so(engine_and_reference):
    engine, reference = engine_and_reference

    async def main():
        async with engine.generate(PROMPT, max_new_tokens=8) as stream:
            pass  # left before reading: closed
        with pytest.raises(RequestCancelled, match="closed or cancelled before it finished"):
            await stream.collect()
        stream = engine.generate(PROMPT, max_new_tokens=50)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(anext(stream), 1e-4)  # cancels the read, and so the request
        with pytest.raises(RequestCancelled):
            [piece async for piece in stream]  # was: no piece, no error, then collect()'s AssertionError
        return (await engine.complete(PROMPT, max_new_tokens=8)).token_ids

    assert asyncio.run(main()) == reference


def test_a_stream_abandoned_by_a_task_that_ends_frees_the_engine_for_a_request_already_waiting(engine_and_reference):
    engine, reference = engine_and_reference

    async def main():
        async def leaves_early():
            async for _ in engine.generate(PROMPT, max_new_tokens=200):
                break  # a bare `async for` left early: the stream holds the engine
            await asyncio.sleep(0.3)  # still alive when the other request queues, then ends

        async def waits():
            await asyncio.sleep(0.1)
            return (await engine.complete(PROMPT, max_new_tokens=8)).token_ids

        first, second = asyncio.create_task(leaves_early()), asyncio.create_task(waits())
        await first
        return await asyncio.wait_for(second, 60)  # waited forever: the check ran only as it queued

    assert asyncio.run(main()) == reference


@pytest.mark.parametrize("leave", ["break", "caught"])
def test_a_stream_left_by_a_task_that_goes_on_frees_the_engine_for_requests_it_gathers(engine_and_reference, leave):
    """A loop left by `break` (or by an exception its task caught, as a websocket handler does) and then a gather of
    new requests from the same task: the unreferenced stream held the turn until the collector happened to run (with
    it off, as here, for good). A request queueing behind a stream left between pieces collects it."""
    engine, reference = engine_and_reference

    async def main():
        try:
            async for _ in engine.generate(PROMPT, max_new_tokens=200):
                if leave == "break":
                    break
                raise ConnectionResetError("the client went away")
        except ConnectionResetError:
            pass
        async with asyncio.timeout(60):
            return await asyncio.gather(engine.complete(PROMPT, max_new_tokens=8), engine.complete(PROMPT, max_new_tokens=8))

    gc.disable()
    try:
        first, second = asyncio.run(main())
    finally:
        gc.enable()
    assert first.token_ids == second.token_ids == reference


def test_requests_queueing_behind_a_live_slow_reader_collect_once(engine_and_reference):
    """A full collection holds the event loop (tens of ms, more on a large heap): requests queueing behind a stream
    whose reader is alive but slow (a client that reads slowly) collected once each, stalling the stream they wait
    for; they collect once per holder."""
    engine, reference = engine_and_reference
    collections: list[int] = []

    def count(phase, info):
        if phase == "start" and info["generation"] == 2:
            collections.append(1)

    async def main():
        first_piece = asyncio.Event()

        async def slow_reader():
            async with engine.generate(PROMPT, max_new_tokens=4) as stream:
                async for _ in stream:
                    first_piece.set()
                    await asyncio.sleep(0.5)  # a slow client: between pieces, alive

        async def queued(delay):
            await first_piece.wait()
            await asyncio.sleep(delay)  # all four queue within the reader's first wait
            return (await engine.complete(PROMPT, max_new_tokens=8)).token_ids

        reader = asyncio.create_task(slow_reader())
        results = await asyncio.gather(*(queued(0.02 * index) for index in range(4)))
        await reader
        return results

    gc.disable()
    gc.callbacks.append(count)
    try:
        results = asyncio.run(main())
    finally:
        gc.callbacks.remove(count)
        gc.enable()
    assert results == [reference] * 4
    assert len(collections) == 1, len(collections)


def test_a_second_close_returns_only_once_the_engine_is_closed(tiny):
    async def main():
        engine = await Engine.load(tiny, OFFLOADED)
        request = asyncio.create_task(engine.complete(PROMPT, max_new_tokens=2000))
        await asyncio.sleep(0.2)
        first = asyncio.create_task(engine.aclose())
        await asyncio.sleep(0)
        await engine.aclose()
        closed = engine.runtime._closed
        await first
        with pytest.raises(RequestCancelled):
            await request
        return closed

    assert asyncio.run(main())


def test_sync_engine_closes_an_iterator_its_thread_left_open_before_its_next_request(tiny, engine_and_reference):
    _, reference = engine_and_reference
    with SyncEngine(tiny, OFFLOADED) as engine:
        left_open = engine.generate(PROMPT, max_new_tokens=50)
        next(left_open)
        outcome: dict = {}
        worker = threading.Thread(target=lambda: outcome.setdefault("ids", engine.complete(PROMPT, max_new_tokens=8).token_ids))
        worker.start()  # another thread's request waits for the open iterator (its own thread could read it)
        time.sleep(0.2)
        assert "ids" not in outcome
        assert engine.complete(PROMPT, max_new_tokens=8).token_ids == reference  # this thread's: was a deadlock
        with pytest.raises(RequestCancelled, match="started another request"):
            next(left_open)
        worker.join(60)
        assert outcome["ids"] == reference


def test_sync_engine_reading_two_iterators_in_turn_closes_the_first_instead_of_waiting_forever(tiny, engine_and_reference):
    """`next(a)` then `next(b)` in one thread (a `zip` of two generate() iterators): b's first read waited for the turn
    a held, which only this thread could give back. b's read closes a (as a new request does), b runs to the end
    token for token, and a, read again, says why it ended."""
    _, reference = engine_and_reference
    with SyncEngine(tiny, OFFLOADED) as engine:
        first = engine.generate(PROMPT, max_new_tokens=50)
        second = engine.generate(PROMPT, max_new_tokens=8)
        outcome: dict = {}

        def reads_in_turn():
            next(first)
            outcome["second"] = [token for piece in second for token in piece.token_ids]
            with pytest.raises(RequestCancelled, match="read another iterator"):
                next(first)
            outcome["first"] = "closed"

        worker = threading.Thread(target=reads_in_turn, daemon=True)
        worker.start()
        worker.join(60)
        assert not worker.is_alive(), "the second iterator waited for the first one's turn"
        assert outcome == {"second": reference, "first": "closed"}


def test_sync_engine_interrupted_in_complete_ends_the_request(tiny, engine_and_reference, monkeypatch):
    """Ctrl-C in the caller's thread, as the wait for the loop's answer sees it: a KeyboardInterrupt out of the wait."""
    import specter.sync

    _, reference = engine_and_reference
    waited = specter.sync._result

    def interrupted(future, thread):
        try:
            future.result(timeout=0.3)
        except TimeoutError:
            raise KeyboardInterrupt from None
        return waited(future, thread)

    with SyncEngine(tiny, OFFLOADED) as engine:
        monkeypatch.setattr(specter.sync, "_result", interrupted)
        with pytest.raises(KeyboardInterrupt):
            engine.complete(PROMPT, max_new_tokens=2000)  # tens of seconds on the CPU if it ran on
        monkeypatch.setattr(specter.sync, "_result", waited)
        deadline = time.monotonic() + 30
        while engine.engine._turn.locked() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not engine.engine._turn.locked()  # the request was cancelled, not left running on the loop
        assert engine.complete(PROMPT, max_new_tokens=8).token_ids == reference


def test_a_closed_sync_engine_says_so(tiny):
    engine = SyncEngine(tiny, OFFLOADED)
    left_open = engine.generate(PROMPT, max_new_tokens=50)
    next(left_open)
    engine.close()
    with pytest.raises(RequestCancelled, match="SyncEngine is closed"):
        engine.complete(PROMPT, max_new_tokens=4)
    with pytest.raises(RequestCancelled):
        next(left_open)


def test_a_loop_closed_without_cancelling_its_tasks_leaves_a_pump_the_next_loop_replaces(engine_and_reference):
    """`run_until_complete` then `close()` leaves a transfer pump still copying (prefetches queued at the request's
    end) pending on the dead loop; the next loop's first prefetch must start a pump of its own (it woke the dead one:
    'Event loop is closed')."""
    engine, reference = engine_and_reference
    loop = asyncio.new_event_loop()
    try:
        assert loop.run_until_complete(engine.complete(PROMPT, max_new_tokens=8)).token_ids == reference
    finally:
        loop.close()
    assert asyncio.run(engine.complete(PROMPT, max_new_tokens=8)).token_ids == reference


def test_a_finished_stream_leaves_no_callback_on_its_reading_task(engine_and_reference):
    engine, reference = engine_and_reference

    async def worker():  # one long-lived task, request after request
        streams = []
        for _ in range(3):
            async with engine.generate(PROMPT, max_new_tokens=8) as stream:
                async for piece in stream:
                    if not piece.finished:  # (the last piece comes after the stream let go of its reader)
                        assert stream._watched is not None and stream._watched[0] is asyncio.current_task()
            streams.append(stream)
        return streams

    streams = asyncio.run(worker())
    assert all(stream._watched is None and stream.result.token_ids == reference for stream in streams)


def test_sync_engine_streams_made_before_they_are_read_each_run(tiny, engine_and_reference):
    """`[engine.generate(p) for p in prompts]`, then reading each: none was read when the next was made, so none
    holds the engine and none is closed (the check closed every stream but the last)."""
    _, reference = engine_and_reference
    with SyncEngine(tiny, OFFLOADED) as engine:
        first, second = engine.generate(PROMPT, max_new_tokens=8), engine.generate(PROMPT, max_new_tokens=8)
        assert [t for piece in first for t in piece.token_ids] == reference
        assert [t for piece in second for t in piece.token_ids] == reference


def test_sync_engine_reading_makes_no_full_collection_per_piece(tiny):
    import gc

    full = []

    def count(phase, info):
        if phase == "start" and info["generation"] == 2:
            full.append(1)

    with SyncEngine(tiny, EngineConfig(device="cpu", residents=2, draft={"k": 0, "k_max": 0})) as engine:
        gc.callbacks.append(count)
        try:
            pieces = list(engine.generate(PROMPT, max_new_tokens=24))
        finally:
            gc.callbacks.remove(count)
    assert len(pieces) >= 20 and len(full) <= 2, (len(pieces), len(full))  # was one a piece


def _started_threads(before: set[threading.Thread]) -> list[str]:
    return [thread.name for thread in threading.enumerate() if thread not in before and thread.name.startswith("specter-")]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the closed loop's coroutines, collected
def test_an_engine_whose_loop_was_closed_mid_request_is_still_released_by_aclose(tiny):
    """`run_until_complete`, then `close()` while a request runs: the engine refuses requests (its device state cannot be
    trusted), and its aclose from a later loop raised that same EngineLoopError, so nothing released its threads."""
    before = set(threading.enumerate())
    engine = asyncio.run(Engine.load(tiny, OFFLOADED))
    loop = asyncio.new_event_loop()
    try:
        request = loop.create_task(engine.complete(PROMPT, max_new_tokens=2000))
        loop.run_until_complete(asyncio.sleep(0.3))
        assert not request.done() and _started_threads(before)
    finally:
        loop.close()
    with pytest.raises(EngineLoopError) as refused:
        asyncio.run(engine.complete(PROMPT, max_new_tokens=8))
    asyncio.run(asyncio.wait_for(engine.aclose(), 60))
    assert engine.runtime._closed and _started_threads(before) == []
    assert "engine.aclose() from this loop releases" in str(refused.value)  # the refusal says how to release it
    with pytest.raises(RequestCancelled, match="closed"):
        asyncio.run(engine.complete(PROMPT, max_new_tokens=8))
    del request
    gc.collect()  # the closed loop's tasks are reported here (asyncio's log), not at the exit


def _loop_thread_interrupted_mid_request(tiny):
    """A SyncEngine mid-request whose loop thread a KeyboardInterrupt raised on the loop (a plug-in's, say) ended:
    (the engine, its request's iterator, the threads from before it loaded)."""
    before = set(threading.enumerate())
    engine = SyncEngine(tiny, OFFLOADED)
    pieces = engine.generate(PROMPT, max_new_tokens=2000)
    next(pieces)

    def interrupt() -> None:
        raise KeyboardInterrupt

    with mock.patch.object(threading, "excepthook"):  # (the interrupt's traceback on the loop thread)
        engine._loop.call_soon_threadsafe(interrupt)
        engine._thread.join(10)
    assert not engine._thread.is_alive() and _started_threads(before)
    return engine, pieces, before


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the ended loop's coroutines, collected
def test_a_sync_engine_whose_loop_thread_ended_mid_request_is_still_released_by_close(tiny):
    """The loop's thread ended while an iterator holds the engine: close() closed the loop and returned, leaving the
    engine's threads running with nothing left to stop them."""
    engine, pieces, before = _loop_thread_interrupted_mid_request(tiny)
    engine.close()
    assert engine.engine.runtime._closed and _started_threads(before) == []
    with pytest.raises(RequestCancelled):
        next(pieces)
    gc.collect()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_close_releases_a_sync_engine_whose_loop_thread_ended_even_when_the_new_loop_thread_starts_late(tiny):
    """close() runs the ended loop again on a new thread to release the engine; it asked whether the loop was running
    right after starting that thread, and where the thread had not entered the loop yet it closed nothing. At
    interpreter shutdown, where no thread starts, it returns (the process's end releases the engine)."""
    engine, pieces, before = _loop_thread_interrupted_mid_request(tiny)
    run_forever = engine._loop.run_forever

    def late_start() -> None:
        time.sleep(0.3)
        run_forever()

    with mock.patch.object(threading.Thread, "start", side_effect=RuntimeError("can't create new thread at "
                                                                              "interpreter shutdown")):
        sync._shutdown(engine._loop, engine._thread, engine.engine)
    assert not engine.engine.runtime._closed and not engine._loop.is_closed()
    with mock.patch.object(engine._loop, "run_forever", late_start):
        engine.close()
    assert engine.engine.runtime._closed and _started_threads(before) == []
    with pytest.raises(RequestCancelled):
        next(pieces)
    gc.collect()


def test_an_engine_dropped_without_close_stops_its_threads_and_says_so(tiny):
    """Each Engine loaded and dropped without aclose() (a notebook cell run again) left its CPU streams' and waiters'
    threads running for the process's life: three more per engine, and no word."""
    async def main():
        engine = await Engine.load(tiny, OFFLOADED)
        await engine.complete(PROMPT, max_new_tokens=2)

    asyncio.run(main())
    gc.collect()
    before = threading.active_count()
    with pytest.warns(ResourceWarning, match="garbage-collected without being closed"):
        for _ in range(3):
            asyncio.run(main())
            gc.collect()
    time.sleep(0.2)
    assert threading.active_count() <= before, [thread.name for thread in threading.enumerate()]
