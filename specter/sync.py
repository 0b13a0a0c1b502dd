"""A synchronous face for scripts and notebooks: the async `Engine` on its own event loop in a thread.

    with SyncEngine("tiny", EngineConfig(residents=2)) as engine:
        print(engine.complete("hello", max_new_tokens=16).text)

    SyncEngine("tiny").complete("hello").text   # also safe: closed when garbage-collected or at exit
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import weakref
from collections.abc import Coroutine, Iterator, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

from specter.api import Engine, GenerationStream, Piece, Prompt, Result
from specter.config import EngineConfig, GenerationConfig
from specter.errors import EngineLoopError, RequestCancelled
from specter.kernel import new_event_loop
from specter.tokenizer import Tokenizer

T = TypeVar("T")

LIVENESS_POLL_S = 0.5
"""How often a blocked call checks that the loop thread still runs (`_result`)."""
UNWIND_S = 10.0
"""How long closing waits for the loop's other tasks to unwind once cancelled (a task that ignores its cancellation
must not hang the close)."""


class SyncEngine:
    """Blocking `complete` and `generate` over an `Engine`; works where a loop already runs (Jupyter).

    The engine lives on a private event loop in a daemon thread, so the caller's thread never needs a loop.
    Close it (or use `with`) to release the device and stop the thread; an engine that is not closed is
    closed when it is garbage-collected or, at the latest, when the interpreter exits. A `generate` iterator
    left open when the same thread starts another request is closed with a warning (`stream.abandoned`),
    as the async API closes a stream its reading task left: that thread cannot read both.
    """

    def __init__(self, path: str | Path, config: EngineConfig | None = None, *, tokenizer: Tokenizer | None = None) -> None:
        self._open: dict[int, weakref.ref[GenerationStream]] = {}  # per thread: the stream it last read a piece of
        self._loop = new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="specter-sync-loop", daemon=True)
        self._thread.start()
        try:
            self.engine: Engine = self._call(Engine.load(path, config, tokenizer=tokenizer))
        except BaseException:
            _shutdown(self._loop, self._thread, None)
            raise
        # Holds the loop, the thread and the engine but not self, so that dropping the SyncEngine runs it.
        self._finalizer = weakref.finalize(self, _shutdown, self._loop, self._thread, self.engine)

    def __enter__(self) -> SyncEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Release the engine and stop the loop thread. Idempotent."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        """Closed by close(), by garbage collection or at the interpreter's exit."""
        finalizer = getattr(self, "_finalizer", None)  # (none yet while __init__ loads the engine)
        return finalizer is not None and not finalizer.alive

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt, as `Engine.encode` gives them (the tokenizer alone: no request, no loop)."""
        return self.engine.encode(prompt)

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of `token_ids`, as `Engine.decode` gives it."""
        return self.engine.decode(token_ids)

    def complete(self, prompt: Prompt, generation_config: GenerationConfig | Mapping[str, Any] | None = None,
                 **overrides: Any) -> Result:
        self._leave_open_iterator()
        return self._call(self.engine.complete(prompt, generation_config, **overrides))

    def generate(self, prompt: Prompt, generation_config: GenerationConfig | Mapping[str, Any] | None = None,
                 **overrides: Any) -> Iterator[Piece]:
        """Pieces as they are committed; closing the iterator early (or Ctrl-C) ends the request."""
        self._leave_open_iterator()
        stream = self._call(self._start(prompt, generation_config, overrides))
        return self._pieces(stream)

    def _leave_open_iterator(self, reading: GenerationStream | None = None) -> None:
        """The iterator this thread read last, if it holds the engine between pieces, would make this thread's new
        request wait for it forever (the thread cannot read both): close it first. That new request is a call, or the
        first read of another iterator (`reading`: two generate() iterators read in turn, a `zip` of them). An
        iterator not read yet holds nothing (it queues when read), and one another thread read last is that thread's."""
        ref = self._open.get(threading.get_ident())
        stream = ref() if ref is not None else None
        if reading is not None and stream is reading:
            return
        self._open.pop(threading.get_ident(), None)
        if stream is not None and stream.finish_reason is None:
            self._call(self._abandon(stream))

    async def _abandon(self, stream: GenerationStream) -> None:
        if self.engine.holds_turn_between_pieces(stream):
            self.engine.stream_abandoned(stream, "this iterator was closed because its thread started another request "
                                                 "(or read another iterator) before reading it to the end; the engine "
                                                 "serves one request at a time: close() an iterator to stop it early",
                                         advice="read a generate() iterator to the end or close() it before the "
                                                "thread's next request")
            await stream.aclose()

    async def _start(self, prompt: Prompt, generation_config: Any, overrides: dict[str, Any]) -> GenerationStream:
        stream = self.engine.generate(prompt, generation_config, **overrides)  # made on the loop: it owns the stream
        stream._track_readers = False  # each piece is read by a task of its own: _leave_open_iterator watches instead
        return stream

    def _pieces(self, stream: GenerationStream) -> Iterator[Piece]:
        step: list[asyncio.Task[Any] | None] = [None]  # the loop-side task of the piece being awaited
        pending: Future[Piece | None] | None = None
        try:
            while True:
                self._leave_open_iterator(reading=stream)
                pending = self._submit(self._next_piece(stream, step))
                piece = _result(pending, self._thread)
                self._open[threading.get_ident()] = weakref.ref(stream)
                if piece is None:
                    return
                yield piece
        finally:
            if pending is not None and not pending.done():
                pending.cancel()  # Ctrl-C or an abandoned iterator: the loop-side task is cancelled
            if threading.current_thread() is self._thread:  # finalized by a collection on the loop: cannot wait on it
                self._loop.create_task(self._end(stream, step[0]))
            elif not self.closed and self._thread.is_alive():  # (closing the engine ended the stream already)
                self._call(self._end(stream, step[0]))

    @staticmethod
    async def _next_piece(stream: GenerationStream, step: list[asyncio.Task[Any] | None]) -> Piece | None:
        step[0] = asyncio.current_task()
        return await anext(stream, None)

    @staticmethod
    async def _end(stream: GenerationStream, step: asyncio.Task[Any] | None) -> None:
        """Let a cancelled step unwind (its request's cleanup runs there), then close the stream."""
        if step is not None and not step.done():
            step.cancel()
            await asyncio.wait([step])
        await stream.aclose()

    def _submit(self, coroutine: Coroutine[Any, Any, T]) -> Future[T]:
        if self.closed or not self._thread.is_alive():
            coroutine.close()  # never scheduled: no loop would run it
            if self.closed:
                raise RequestCancelled("this SyncEngine is closed; load a new one")
            raise EngineLoopError(LOOP_ENDED)
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    def _call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        future = self._submit(coroutine)
        try:
            return _result(future, self._thread)
        except BaseException:
            future.cancel()  # Ctrl-C in the caller's thread: the request on the loop ends too (no-op once done)
            raise


LOOP_ENDED = ("the engine's event-loop thread has ended (a KeyboardInterrupt or SystemExit raised on it, by a plug-in "
              "say); this SyncEngine is unusable: close() it, which releases its memory and threads, and load a new one")


def _result(future: Future[T], thread: threading.Thread) -> T:
    """The future's result, or an error if the loop thread ends first: an exception that ends run_forever leaves the
    future pending forever."""
    while True:
        try:
            return future.result(timeout=LIVENESS_POLL_S)
        except TimeoutError:
            if not thread.is_alive():
                raise EngineLoopError(LOOP_ENDED) from None


def _shutdown(loop: asyncio.AbstractEventLoop, thread: threading.Thread, engine: Engine | None) -> None:
    """Close the engine on its loop, stop the loop and join its thread (close(), garbage collection or exit)."""
    if loop.is_closed():
        return
    if threading.current_thread() is thread:  # dropped on its own loop: it cannot wait for itself
        loop.call_soon(loop.stop)
        return
    restarted = False
    if engine is not None and not thread.is_alive():
        # A KeyboardInterrupt or SystemExit raised on the loop ended its thread, not the loop: run it again, as
        # asyncio.run does after Ctrl-C, so the engine's requests unwind and its memory and threads are released.
        thread = threading.Thread(target=loop.run_forever, name="specter-sync-close", daemon=True)
        try:
            thread.start()
        except RuntimeError:  # at interpreter shutdown no thread starts: the process's end releases what it holds
            return
        restarted = True  # (its loop may not run yet: what is handed to it below waits for it, not for is_running)
    try:
        if engine is not None and (restarted or loop.is_running()) and thread.is_alive():
            _result(asyncio.run_coroutine_threadsafe(engine.aclose(), loop), thread)
    finally:
        if (restarted or loop.is_running()) and thread.is_alive():  # as asyncio.run ends: what is left unwinds first
            with contextlib.suppress(Exception):  # (a load cut short leaves its copies' tasks, pending for good else)
                asyncio.run_coroutine_threadsafe(_cancel_the_rest(), loop).result(UNWIND_S)
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


async def _cancel_the_rest() -> None:
    """Cancel every other task of the running loop and wait for them to unwind."""
    rest = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in rest:
        task.cancel()
    await asyncio.gather(*rest, return_exceptions=True)
