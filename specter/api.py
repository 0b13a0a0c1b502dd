"""The public async API: `Engine.from_pretrained(...)`, `engine.generate(...)` streams, `engine.complete(...)`.

    async with Engine.from_pretrained("tiny", EngineConfig(residents=2)) as engine:
        async with engine.generate("hello", max_new_tokens=16) as stream:
            async for piece in stream:
                print(piece.text, end="")
        print(stream.result.stats.as_dict())
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import operator
import threading
import warnings
import weakref
from collections.abc import AsyncIterator, Generator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Union

from specter.config import EngineConfig, GenerationConfig, is_token_id
from specter.decode import check_prompt
from specter.engine import Runtime
from specter.errors import ConfigError, EngineLoopError, PromptError, RequestCancelled, StreamBusy
from specter.log import get_logger
from specter.metrics import RequestStats
from specter.model.spec import ModelSpec
from specter.paths import json_value
from specter.tokenizer import Detokenizer, Tokenizer

log = get_logger(__name__)

Message = Mapping[str, Any]
Prompt = Union[str, Sequence[int], Sequence[Message]]
"""Text (needs a tokenizer), token ids, or chat messages (needs a chat template)."""
FinishReason = Literal["length", "stop", "cancelled", "error"]


@dataclasses.dataclass(frozen=True)
class Piece:
    """What one decode round committed: its token ids and the text that became safe to show."""

    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: FinishReason | None = None
    """Set on the last piece: 'length' (max_new_tokens) or 'stop' (a stop token id or stop string)."""


@dataclasses.dataclass(frozen=True)
class Result:
    """A finished request: all its text and new token ids, why it ended, and its statistics."""

    text: str
    token_ids: list[int]
    stats: RequestStats
    finish_reason: FinishReason
    prompt_ids: list[int]


IDLE_HOLDER_WARN_S = 10.0
"""How long a request waits behind a stream nobody reads before the engine warns (`Engine._watch_idle_holder`)."""


class GenerationStream:
    """One request: an async iterator of `Piece`s, live `stats`, and `result` once finished.

    The request joins the engine's queue (first come, first served) when iteration starts and holds the
    engine until it finishes, is closed, or its task is cancelled. Leave a loop early inside `async with`
    (or `await aclose()`), so the engine is free at once. A bare `async for` left early keeps the engine
    until the stream is found abandoned: when the task that read it starts another request (it cannot read
    both; closed with a warning, `stream.abandoned`), when that task ends with an exception or cancelled
    between pieces (closed, with the warning), or when it ends otherwise and nothing references the stream
    any more. A request started from that task through `asyncio.wait_for` or `gather` runs in a task
    of its own (Python 3.11), which the engine cannot tell from another reader's: it waits until the first
    task ends. Reading a stream that was closed, cancelled or failed raises RequestCancelled.
    """

    def __init__(self, engine: Engine, prompt_ids: list[int], generation: GenerationConfig, stop_ids: frozenset[int],
                 continuation: bool = True) -> None:
        self.prompt_ids = prompt_ids
        self.generation = generation
        self.stats = RequestStats()
        self.token_ids: list[int] = []
        self.result: Result | None = None
        self.finish_reason: FinishReason | None = None
        self._engine = engine
        self._stop_ids = stop_ids
        self._detokenizer: Detokenizer | None = (engine.tokenizer.detokenizer(generation.stop_strings, prompt_ids if continuation else ())
                                                     if engine.tokenizer else None)
        self._text: list[str] = []
        self._pieces = self._run()
        self._consumer: asyncio.Task[Any] | None = None  # the task inside __anext__, if any
        self._reader: weakref.ref[asyncio.Task[Any]] | None = None  # the task that last read a piece
        self._abort_reason: str | None = None
        self._h2d_before = 0
        self._track_readers = True  # SyncEngine reads each piece in a task of its own and watches its iterator itself
        self._watched: tuple[asyncio.Task[Any], Any] | None = None  # the reading task and its done callback
        self._left: asyncio.Event | None = None  # set when the reader in __anext__ leaves it (aclose from another task)
        self._stranded = False  # its request's task was left on a loop that ended under it (`_strand`)

    @property
    def text(self) -> str:
        return "".join(self._text)

    def __aiter__(self) -> GenerationStream:
        return self

    async def __anext__(self) -> Piece:
        task = asyncio.current_task()
        if self._consumer is not None:  # before any state is touched: the running reader's stream stays whole
            raise StreamBusy("this stream is being read by another task; read a stream from one task at a time "
                             "(hand the pieces to others through a queue)")
        if self._abort_reason is not None and self.result is None:  # closed between pieces, unwound or not; stranded
            raise RequestCancelled(self._abort_reason)
        if task is not None and self._track_readers and (self._reader is None or self._reader() is not task):
            self._watch_reader(task)
        self._consumer = task
        self._reader = weakref.ref(task) if task is not None else None
        try:
            return await anext(self._pieces)
        except StopAsyncIteration:
            if self.result is None:  # it ended without its last piece: closed, cancelled or failed before
                raise RequestCancelled(self._abort_reason or self._unfinished()) from None
            raise
        except asyncio.CancelledError:
            self._mark_ended("cancelled")
            if self._abort_reason is not None and self._consumer is not None and self._consumer.uncancel() == 0:
                raise RequestCancelled(self._abort_reason) from None
            raise
        except Exception:
            self._mark_ended("error")
            raise
        finally:
            self._consumer = None
            if self._left is not None:
                self._left.set()

    async def __aenter__(self) -> GenerationStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop the request (if it still runs) and give the engine to the next one. Idempotent. From a task other
        than the one reading it (a stop button, a hang-up handler), the reader's wait ends in RequestCancelled and
        this returns once the request has unwound."""
        if self._stranded:  # its generator is suspended on a loop that ended: it can be neither resumed nor closed
            return
        if self._consumer is not None and self._consumer is not asyncio.current_task():
            self._abort_reason = self._abort_reason or "this stream was closed by aclose() from another task"
            await self._stop_reader().wait()
        await self._pieces.aclose()
        self._mark_ended("cancelled")

    async def collect(self) -> Result:
        """Run the request to the end; the pieces' text and ids are gathered into the `Result`."""
        async for _ in self:
            pass
        if self.result is None:  # (__anext__ raises first; kept for a subclass that ends otherwise)
            raise RequestCancelled(self._unfinished())
        return self.result

    def _unfinished(self) -> str:
        if self.finish_reason == "error":
            return "this stream ended with the error it raised earlier; start a new request"
        return "this stream was closed or cancelled before it finished; start a new request"

    # ---- the request, as the engine's queue sees it ----------------------------------------------------
    async def _run(self) -> AsyncIterator[Piece]:
        """Hold the engine's turn for the whole request; the last piece is yielded after letting go of it."""
        final: Piece | None = None
        self._engine._enter_loop()
        await self._engine._reclaim_abandoned()
        watch = self._engine._watch_idle_holder(len(self.prompt_ids)) if self._engine._turn.locked() else None
        try:
            await self._engine._turn.acquire()
        finally:  # the turn taken, or the wait cancelled: either way no one waits any more
            if watch is not None:
                watch.cancel()
        try:
            self._engine._holder = weakref.ref(self)
            self._engine._check_open()
            self._h2d_before = self._engine._bytes_loaded()
            committed_rounds = self._engine.runtime.generate_ids(self.prompt_ids, self._runtime_generation(), self.stats)
            async with contextlib.aclosing(committed_rounds):
                async for committed in committed_rounds:
                    self._per_request_h2d()
                    piece = self._take(committed)
                    if piece.finished:
                        final = piece
                        break
                    yield piece
        finally:
            self._engine._turn.release()
        yield final or self._finish("length", [], "")

    def _per_request_h2d(self) -> None:
        # The runtime writes the cache's lifetime byte count into stats.h2d_bytes; a request's share is the delta.
        self.stats.h2d_bytes = self._engine._bytes_loaded() - self._h2d_before

    def _runtime_generation(self) -> GenerationConfig:
        """The request's settings with every stop id (the checkpoint's eos too), so the runtime stops there."""
        return self.generation.model_copy(update={"stop_token_ids": tuple(sorted(self._stop_ids))})

    def _take(self, committed: list[int]) -> Piece:
        """Account the round's tokens one by one, so a stop (id or string) drops the tokens after it."""
        taken: list[int] = []
        text: list[str] = []
        for token in committed:
            taken.append(token)
            self.token_ids.append(token)
            if token in self._stop_ids:  # like transformers and vLLM: the stop token's text is not shown
                return self._finish("stop", taken, "".join(text))
            if self._detokenizer is not None:
                text.append(self._detokenizer.push([token]))
                if self._detokenizer.stopped:
                    return self._finish("stop", taken, "".join(text))
            if len(self.token_ids) >= self.generation.max_new_tokens:
                return self._finish("length", taken, "".join(text))
        self._text.extend(text)
        return Piece("".join(text), taken)

    def _finish(self, reason: FinishReason, taken: list[int], text: str) -> Piece:
        if self._detokenizer is not None:
            text += self._detokenizer.finish()
            if self._detokenizer.stopped:  # the last character, complete only now (or a stop string holding U+FFFD),
                reason = "stop"  # completed a stop string: the text was cut there, whatever ended the tokens
        self._text.append(text)
        self.stats.new_tokens = len(self.token_ids)
        del self.stats.token_times[len(self.token_ids):]  # tokens cut by a stop string take their timestamps along
        self.finish_reason = reason
        self.result = Result(self.text, list(self.token_ids), self.stats, reason, list(self.prompt_ids))
        self._unwatch_reader()
        return Piece(text, taken, finished=True, finish_reason=reason)

    def _mark_ended(self, reason: FinishReason) -> None:
        if self.finish_reason is None:
            self.finish_reason = reason
            self.stats.new_tokens = len(self.token_ids)
            if self._detokenizer is not None:
                # The text held back while a stop string might still complete (and a last character's first bytes):
                # none can now, so `text` is the committed tokens' text, as a finished request's is
                self._text.append(self._detokenizer.finish())
        self._unwatch_reader()

    def _watch_reader(self, task: asyncio.Task[Any]) -> None:
        """Watch only the latest reading task, and none once the stream ended: a long-lived worker task reading
        request after request must not gather one callback per request."""
        self._unwatch_reader()
        callback = self._engine._when_reader_ends(self)
        task.add_done_callback(callback)
        self._watched = (task, callback)

    def _unwatch_reader(self) -> None:
        if self._watched is not None:
            task, callback = self._watched
            self._watched = None
            task.remove_done_callback(callback)

    def _abandoned_by(self, task: asyncio.Task[Any] | None) -> bool:
        """Between pieces, and last read by `task` (which is now busy elsewhere, so it cannot read this one)."""
        return self._consumer is None and self.finish_reason is None and self._reader is not None and self._reader() is task

    def _reader_ended(self) -> bool:
        reader = self._reader() if self._reader is not None else None
        return self._consumer is None and (reader is None or reader.done())

    async def _abort(self, reason: str) -> None:
        """Engine shutdown: end this request whether it runs in another task or sits between pieces."""
        self._abort_reason = reason
        if self._consumer is not None and self._consumer is not asyncio.current_task():
            self._stop_reader()
        elif self._consumer is None:
            await self.aclose()

    def _strand(self, reason: str) -> None:
        """Engine shutdown after the loop this request ran on ended under it: that loop will never run its task again,
        so end it here, without the task (reading it raises RequestCancelled)."""
        if self.finish_reason is None:
            self._abort_reason, self._consumer, self._stranded = reason, None, True
            self._mark_ended("cancelled")

    def _stop_reader(self) -> asyncio.Event:
        """Cancel the task reading this stream, once, and return what is set when it has left `__anext__`: a second
        cancel (a second aclose, or the engine's close beside one) would leave the reader's uncancel count above 0, so
        CancelledError, not RequestCancelled, would end its whole task, and the first closer would wait for good."""
        if self._left is None or self._left.is_set():
            assert self._consumer is not None, "a reader to stop"
            self._left = asyncio.Event()
            self._consumer.cancel()
        return self._left


class EngineLoader:
    """What `Engine.from_pretrained` returns: `await` it for an engine, or use it as `async with`."""

    def __init__(self, path: str | Path, config: EngineConfig | None, tokenizer: Tokenizer | None) -> None:
        self._path, self._config, self._tokenizer = path, config, tokenizer
        self._engine: Engine | None = None

    def __await__(self) -> Generator[Any, None, Engine]:
        return Engine.load(self._path, self._config, tokenizer=self._tokenizer).__await__()

    async def __aenter__(self) -> Engine:
        self._engine = await Engine.load(self._path, self._config, tokenizer=self._tokenizer)
        return self._engine

    async def __aexit__(self, *exc_info: object) -> None:
        if self._engine is not None:
            await self._engine.aclose()

    if not TYPE_CHECKING:  # a type checker keeps flagging `Engine.from_pretrained(...).complete(...)` itself

        def __getattr__(self, name: str) -> Any:
            # Only for names the loader lacks: an Engine's (complete, generate, tokenizer, ...) used on the loader means
            # a missing await, which otherwise read as "'EngineLoader' object has no attribute 'complete'".
            if not name.startswith("_") and (hasattr(Engine, name) or name in ENGINE_ATTRIBUTES):
                raise AttributeError(f"Engine.from_pretrained(...) returns a loader, not an Engine, so it has no {name!r}: "
                                     "await it (engine = await Engine.from_pretrained(...)) or use `async with "
                                     "Engine.from_pretrained(...) as engine:`")
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


ENGINE_ATTRIBUTES = frozenset({"runtime", "tokenizer", "eos_token_ids"})
"""An Engine's public instance attributes (its methods and properties are its class's), for `EngineLoader`'s advice."""


def _release_unclosed(runtime: Runtime) -> None:
    """An `Engine` collected without aclose(): stop its runtime's threads, then say so."""
    runtime.release_threads()
    try:
        warnings.warn("an Engine was garbage-collected without being closed; its threads are stopped now. Close it "
                      "with `async with Engine.from_pretrained(...)` or `await engine.aclose()`", ResourceWarning)
    except Exception:  # noqa: BLE001 (warnings turned into errors: a finalizer has no caller to raise to)
        pass


class Engine:
    """One model, loaded once, serving requests one at a time in arrival order.

    An engine serves one event loop at a time: the one it was loaded on, or a later one once that has ended
    (`asyncio.run` after `asyncio.run`). Other threads use `SyncEngine`, or hand their calls to the engine's
    loop (`asyncio.run_coroutine_threadsafe`); a request from another running loop is an `EngineLoopError`.

    The engine `load` made owns its runtime: garbage-collected without `aclose`, it stops the runtime's threads. One
    made on a runtime (`Engine(runtime, tokenizer)`) does not, and must not outlive the engine that owns it.
    """

    def __init__(self, runtime: Runtime, tokenizer: Tokenizer | None = None, eos_token_ids: Sequence[int] = ()) -> None:
        self.runtime = runtime
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(int(token) for token in eos_token_ids)
        self._turn = asyncio.Lock()  # FIFO: asyncio wakes waiters in order and lets no newcomer jump the queue
        self._streams: weakref.WeakSet[GenerationStream] = weakref.WeakSet()
        self._holder: weakref.ref[GenerationStream] | None = None  # the stream that last took the turn
        self._closed = False
        self._closing: asyncio.Task[None] | None = None
        self._stranded = False  # closed from a later loop than one that ended mid-request (`_enter_loop(closing=True)`)
        self._loop = _running_loop()  # the loop it serves (None until a request runs, when made outside one)
        self._loop_guard = threading.Lock()  # two threads' loops may ask at once
        self._closers: set[asyncio.Task[None]] = set()  # streams being closed for a reader that failed (_closer)
        self._finalizer: weakref.finalize | None = None  # set by `load`, whose engine owns the runtime it loaded
        self._collected_for: weakref.ref[GenerationStream] | None = None  # `_reclaim_abandoned`'s last collection

    @classmethod
    def from_pretrained(cls, path: str | Path, config: EngineConfig | None = None, *, tokenizer: Tokenizer | None = None) -> EngineLoader:
        """A checkpoint directory or a built-in model name ("tiny"); `async with` it or `await` it."""
        return EngineLoader(path, config, tokenizer)

    @classmethod
    async def load(cls, path: str | Path, config: EngineConfig | None = None, *, tokenizer: Tokenizer | None = None) -> Engine:
        from specter.builtin import resolve_model

        if isinstance(config, Mapping):  # as generate() takes a dict for its GenerationConfig
            config = EngineConfig.build(**config)
        elif config is not None and not isinstance(config, EngineConfig):
            raise ConfigError(f"config must be an EngineConfig or a dict of its fields, not {type(config).__name__}")
        if tokenizer is not None and not isinstance(tokenizer, Tokenizer):
            raise ConfigError(f"tokenizer must be a specter.Tokenizer (Tokenizer.from_dir(PATH)), not "
                              f"{type(tokenizer).__name__}; or leave it out to read the checkpoint's tokenizer.json")
        directory = resolve_model(path)
        tokenizer = tokenizer or Tokenizer.from_dir(directory)  # before the weights: a broken file fails fast
        runtime = await Runtime.load(directory, config)
        try:
            engine = cls(runtime, tokenizer, checkpoint_eos(directory, runtime.spec))
            # An engine dropped without aclose() (a notebook cell run again, a test) kept its runtime's threads alive
            # for the process's life, three more per engine: collected, it stops them and says so (ResourceWarning,
            # as asyncio's unclosed objects do). Only the engine that loaded the runtime, which owns it: another made
            # on the same runtime (`Engine(engine.runtime, tokenizer=...)`) and dropped leaves it running, and the
            # owner dropped stops it under that one too. Not at exit: daemon threads end with the process.
            engine._finalizer = weakref.finalize(engine, _release_unclosed, runtime)
            engine._finalizer.atexit = False
            return engine
        except BaseException:  # the device memory and threads the load took must not wait for the collector
            await runtime.aclose()
            raise

    @property
    def spec(self) -> ModelSpec:
        return self.runtime.spec

    @property
    def config(self) -> EngineConfig:
        return self.runtime.config

    async def __aenter__(self) -> Engine:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Refuse new requests, end the running and queued ones (RequestCancelled), release the device. Every call
        returns once the device is released, a second one too (an `async with` exit racing a signal's close). From a
        later loop than one that ended mid-request (closed without unwinding its tasks), the requests of that loop
        are ended where they stand and the device, memory and threads are released all the same."""
        if self._closing is None or (self._closing.done() and self._closing.cancelled()):  # (a close cut short)
            self._enter_loop(closing=True)
            self._closed = True
            self._closing = asyncio.get_running_loop().create_task(self._close(), name="specter-engine-close")
        await asyncio.shield(self._closing)

    async def _close(self) -> None:
        for stream in list(self._streams):
            if self._stranded:  # their tasks belong to a loop that will never run them again: none can be awaited
                stream._strand("the engine was closed after the event loop this request ran on ended under it")
                continue
            try:
                await stream._abort("the engine was closed while the request was running or queued")
            except Exception as error:  # one stream's misuse must not keep the device and threads held for good
                log.warning("engine.close_stream_failed", error=repr(error))
        async with self._turn:  # the aborted requests have unwound
            if self._finalizer is not None:
                self._finalizer.detach()
            await self.runtime.aclose()
        log.debug("engine.closed")

    def _enter_loop(self, closing: bool = False) -> None:
        """Serve the running loop: the one the engine serves, or a new one once that has ended, when nothing of
        the ended one is left in flight, or when `closing` (the engine only releases what it holds: its device state
        need not be trusted). Anything else is an EngineLoopError, not asyncio's own errors or a hang."""
        loop = asyncio.get_running_loop()
        with self._loop_guard:
            if loop is self._loop:
                return
            if self._loop is not None and not self._loop.is_closed() and self._loop.is_running():
                raise EngineLoopError(
                    "this Engine serves another event loop, which is running (in another thread); an Engine is not "
                    "thread-safe: from other threads use specter.SyncEngine, or hand the call to the engine's loop "
                    "with asyncio.run_coroutine_threadsafe")
            if self._turn.locked() or self.runtime.loads_in_flight():
                if not closing:
                    raise EngineLoopError(
                        "the event loop this Engine served ended while a request or an expert load was in flight, and "
                        "its tasks never unwound; the engine's device state cannot be trusted: close it (await "
                        "engine.aclose() from this loop releases its memory and threads) and load a new Engine")
                log.warning("engine.closed_after_loop_ended", requests_in_flight=self._turn.locked(),
                            hint="the loop the engine served was closed without cancelling its tasks (asyncio.run "
                                 "cancels them); its requests are ended, the engine's memory and threads released")
                self._stranded = True
            self._loop, self._turn = loop, asyncio.Lock()  # (a lock stays bound to the loop it first waited on)

    def stream_abandoned(self, stream: GenerationStream, reason: str,
                         advice: str = "leave a stream early inside `async with engine.generate(...) as stream:` or "
                                       "call aclose()") -> None:
        """Log that `stream` was left unfinished and will be closed for `reason` (RequestCancelled if read again)."""
        log.warning("stream.abandoned", prompt_tokens=len(stream.prompt_ids), new_tokens=len(stream.token_ids),
                    advice=advice)
        stream._abort_reason = reason

    def holds_turn_between_pieces(self, stream: GenerationStream) -> bool:
        """`stream` has been read, holds the engine's turn and is not being read now (its reader is elsewhere)."""
        return (self._holder is not None and self._holder() is stream and self._turn.locked()
                and stream.finish_reason is None and stream._consumer is None and stream._reader is not None)

    async def _reclaim_abandoned(self) -> None:
        """Before queueing: free the turn from a stream left early by a bare `async for` (see GenerationStream)."""
        holder = self._holder() if self._holder is not None else None
        if holder is None or not self._turn.locked():
            return
        if holder._abandoned_by(asyncio.current_task()):
            self.stream_abandoned(holder, "this stream was closed because its loop was left early and the same task "
                                          "started another request; use `async with engine.generate(...)` to stop a "
                                          "stream early")
            await holder.aclose()
        elif holder._reader_ended():
            del holder
            gc.collect()  # an unreferenced stream is in a cycle with its generator; collecting it gives the turn back
        elif self.holds_turn_between_pieces(holder) and not self._collected_behind(holder):
            # One left between pieces by a task that goes on (a loop left by `break` or an exception it caught, then a
            # `gather` of new requests) would hold the turn until the collector happened to run. Once per holder: a
            # full collection holds the loop (tens of ms, more on a large heap), and a live slow reader survives it;
            # one dropped later is collected by the idle watch (`_watch_idle_holder`).
            self._collected_for = weakref.ref(holder)
            del holder
            gc.collect()

    def _collected_behind(self, holder: GenerationStream) -> bool:
        """Whether a request queueing behind `holder` collected already."""
        return self._collected_for is not None and self._collected_for() is holder

    def _when_reader_ends(self, stream: GenerationStream) -> Any:
        """A done callback for a task that reads `stream`: if the task ends with the stream unfinished and nothing
        else references it, collecting it gives the turn back now, not when the next request happens to queue."""
        ref = weakref.ref(stream)

        def ended(task: asyncio.Task[Any]) -> None:
            left = ref()
            if left is None or left.finish_reason is not None or not left._reader_ended():
                return
            left._watched = None
            if task.cancelled() or task.exception() is not None:
                # The reader failed or was cancelled between pieces: a gather(..., return_exceptions=True) or a task
                # list keeps the task, its traceback the frame, the frame the stream, so no collection would free
                # the turn and every later request would wait for good.
                self.stream_abandoned(left, "this stream was closed because the task reading it ended with an "
                                            "exception or was cancelled between pieces")
                self._closer(left)
                return
            holds_a_waited_turn = self._holder is not None and self._holder() is left and bool(getattr(self._turn, "_waiters", None))
            del left
            if holds_a_waited_turn:  # a full collection costs milliseconds: only when a request waits for this turn
                asyncio.get_running_loop().call_soon(gc.collect)  # after the task's frame has let go of its locals

        return ended

    def _watch_idle_holder(self, prompt_tokens: int) -> asyncio.TimerHandle:
        """A timer, cancelled once a waiting request has the turn or stops waiting: if it still waits after
        IDLE_HOLDER_WARN_S behind a stream that nobody reads (between pieces: left by a thread or task that still holds
        it, which the engine cannot tell from a slow reader), say so, once, rather than wait in silence."""
        def check() -> None:
            holder = self._holder() if self._holder is not None else None
            if holder is not None and self.holds_turn_between_pieces(holder):
                del holder
                gc.collect()  # a holder that has become garbage since the request queued gives its turn back now
                holder = self._holder() if self._holder is not None else None
            if holder is not None and self.holds_turn_between_pieces(holder):
                log.warning("engine.waiting_on_idle_stream", waited_s=IDLE_HOLDER_WARN_S,
                            holder_new_tokens=len(holder.token_ids), waiting_prompt_tokens=prompt_tokens,
                            advice="a stream holds the engine between pieces and nobody reads it: read each stream to "
                                   "the end, or leave it in `async with` / call aclose() (SyncEngine: close() the "
                                   "iterator); one kept by a failed thread's traceback is never freed")

        return asyncio.get_running_loop().call_later(IDLE_HOLDER_WARN_S, check)

    def _closer(self, stream: GenerationStream) -> None:
        """Close `stream` in a task of its own (from a done callback, which cannot await), kept until it ends."""
        task = asyncio.get_running_loop().create_task(stream.aclose(), name="specter-stream-close")
        self._closers.add(task)
        task.add_done_callback(self._closers.discard)

    # ---- requests ------------------------------------------------------------------------------------
    def generate(self, prompt: Prompt, generation_config: GenerationConfig | Mapping[str, Any] | None = None, *,
                 continuation: bool | None = None, **overrides: Any) -> GenerationStream:
        """Start a request (validated now, queued when iterated); keyword overrides follow transformers' names.

        `continuation`: whether the text continues the prompt's, decoded after the prompt's last ids so that prompt +
        text reads as the whole sequence decodes (a SentencePiece decoder keeps the space between them), or is an
        answer decoded alone (a chat reply starts without that space, as Hugging Face and OpenAI give it). None: a
        continuation unless the prompt is chat messages; a server that applies the chat template itself says False."""
        self._check_open()
        generation = make_generation_config(generation_config, overrides)
        if generation.stop_strings and self.tokenizer is None:  # text is what they match: without it none ever would
            raise PromptError("stop strings need the checkpoint's tokenizer.json to read the generated text, and this "
                              "checkpoint has none; stop on token ids instead (stop_token_ids), or give "
                              "Engine.from_pretrained(..., tokenizer=...)")
        beyond = [token for token in generation.stop_token_ids if token >= self.spec.vocab_size]
        if beyond:  # never produced: the request would run to max_new_tokens where the caller meant it to stop
            raise PromptError(f"stop_token_ids {beyond[:4]} are beyond this model's vocabulary of {self.spec.vocab_size} "
                              f"ids, so it can never produce them; give ids below {self.spec.vocab_size}")
        prompt_ids = self.encode(prompt)
        check_prompt(prompt_ids, generation.max_new_tokens, self.spec.vocab_size, self.config.max_context, self.spec.max_position)
        if continuation is None:
            continuation = not _is_chat(prompt)
        stream = GenerationStream(self, prompt_ids, generation, self.eos_token_ids | set(generation.stop_token_ids),
                                  continuation)
        self._streams.add(stream)
        return stream

    async def complete(self, prompt: Prompt, generation_config: GenerationConfig | Mapping[str, Any] | None = None, *,
                       continuation: bool | None = None, **overrides: Any) -> Result:
        """Generate to the end and return the whole `Result` (`continuation`: as `generate`'s)."""
        async with self.generate(prompt, generation_config, continuation=continuation, **overrides) as stream:
            return await stream.collect()

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt: ids as they are, text through the tokenizer, messages through the chat template."""
        if isinstance(prompt, str):
            tokenizer = self._need_tokenizer("a text prompt")
            return tokenizer.within(tokenizer.encode(prompt), self.spec.vocab_size)
        if isinstance(prompt, (bytes, bytearray)):  # list() would make token ids of its bytes
            raise PromptError(f"a prompt is a str, token ids or chat messages, not {type(prompt).__name__}; "
                              "decode the bytes first (prompt.decode('utf-8'))")
        if isinstance(prompt, Mapping):
            raise PromptError("a prompt of chat messages is a list of them; wrap the one message: [message]")
        if callable(getattr(prompt, "tolist", None)) and getattr(prompt, "ndim", None) == 1:  # a numpy or torch vector
            prompt = prompt.tolist()
        if not isinstance(prompt, Sequence):  # a set has no order, a generator would be used up by a retry
            raise PromptError(f"a prompt is a str, a list of int token ids, or a list of chat messages, not "
                              f"{type(prompt).__name__}")
        items = list(prompt)
        if _is_chat(items):
            tokenizer = self._need_tokenizer("chat messages")
            return tokenizer.within(tokenizer.encode_chat(items), self.spec.vocab_size)
        if not all(is_token_id(item) for item in items):
            raise PromptError("a prompt is a str, a list of int token ids, or a list of chat messages "
                              f"({{'role': ..., 'content': ...}}); got a {type(prompt).__name__} of "
                              f"{sorted({type(i).__name__ for i in items})}")
        return [operator.index(item) for item in items]

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of `token_ids`, ids of this model (0 .. vocab_size - 1; the tokenizer drops one past it silently)."""
        tokenizer = self._need_tokenizer("decoding")
        if not isinstance(token_ids, (str, bytes)) and isinstance(token_ids, Sequence):
            beyond = [token for token in token_ids if is_token_id(token) and token >= self.spec.vocab_size]
            if beyond:
                raise PromptError(f"cannot decode token ids {beyond[:5]}: this model's ids are 0..{self.spec.vocab_size - 1}")
        return tokenizer.decode(token_ids)

    def _need_tokenizer(self, purpose: str) -> Tokenizer:
        if self.tokenizer is None:
            raise PromptError(f"{purpose} needs a tokenizer, and the checkpoint has no tokenizer.json; "
                              "pass the prompt as token ids or give Engine.from_pretrained(..., tokenizer=...)")
        return self.tokenizer

    def _bytes_loaded(self) -> int:
        cache = self.runtime.cache
        return cache.stats.total().bytes_loaded if cache is not None else 0

    def _check_open(self) -> None:
        if self._closed:
            raise RequestCancelled("the engine is closed; load a new one with Engine.from_pretrained")


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def make_generation_config(base: GenerationConfig | Mapping[str, Any] | None, overrides: Mapping[str, Any]) -> GenerationConfig:
    """A validated GenerationConfig from a config or a dict plus keyword overrides (ConfigError when invalid)."""
    if isinstance(base, GenerationConfig) and not overrides:
        return base
    if base is not None and not isinstance(base, (GenerationConfig, Mapping)):
        raise ConfigError(f"generation_config must be a GenerationConfig or a dict, got {type(base).__name__}")
    values = base.model_dump() if isinstance(base, GenerationConfig) else dict(base or {})
    return GenerationConfig.build(**(values | dict(overrides)))


def checkpoint_eos(directory: Path, spec: ModelSpec) -> tuple[int, ...]:
    """The checkpoint's end-of-sequence ids as transformers' generate reads them: generation_config.json's when it
    names any (a chat model's file often lists the turn's end beside config.json's id, or instead of it), else
    config.json's."""
    file = Path(directory) / "generation_config.json"
    eos = None
    if file.is_file():
        # generation_config.json is advisory: a broken one must not stop the model from loading, but the end-of-turn
        # ids it may hold are lost with it (the text then runs past the turn's end), so it is said
        try:
            eos = json_value(file.read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError) as error:  # ValueError: not JSON, not UTF-8, nested too deeply
            log.warning("checkpoint.generation_config_unreadable", file=str(file), error=str(error) or type(error).__name__,
                        hint="its eos_token_id is ignored (config.json's is used); fix the file or remove it")
    entries = eos if isinstance(eos, list) else [] if eos is None else [eos]
    ids = {token for token in entries if isinstance(token, int) and not isinstance(token, bool)}
    if len(ids) < len(entries):
        log.warning("checkpoint.eos_not_token_ids", file=str(file), eos_token_id=repr(eos)[:80],
                    hint="eos_token_id is an id or a list of ids (integers); the others are ignored")
    outside = sorted(token for token in ids if not 0 <= token < spec.vocab_size)
    if outside:  # never sampled: kept, they would replace config.json's ids and the text would never stop at one
        log.warning("checkpoint.eos_outside_vocabulary", file=str(file), ids=outside[:8], vocab_size=spec.vocab_size,
                    hint="those ids are ignored; set eos_token_id to the model's end-of-sequence id, or remove it")
        ids -= set(outside)
    return tuple(sorted(ids or set(spec.eos_token_ids)))


def _is_chat(prompt: Any) -> bool:
    """A prompt of chat messages (what `Engine.encode` sends through the chat template)."""
    return isinstance(prompt, Sequence) and not isinstance(prompt, (str, bytes, bytearray)) and bool(prompt) and all(
        isinstance(item, Mapping) for item in prompt)
