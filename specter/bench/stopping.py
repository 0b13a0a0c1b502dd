"""A clean stop of the bench on SIGTERM (what `timeout` sends first) or SIGINT.

The signal cancels the bench's asyncio task: the cell in progress is abandoned, the runtimes' `finally` blocks close
them (threads, pinned memory), and the caller gets `BenchStopped` to write what finished and exit 128 + the signal's
number. A watchdog bounds the wait: when the task has not unwound within `grace_s` (a long call that never reaches an
`await`, a thread that does not stop), or at a second signal, it calls `on_force` (the CLI writes the results it last
had) and ends the process with `os._exit`. The watchdog is disarmed once `installed()`'s block has unwound, so a
program that calls the bench in-process goes on after a stop; `python -m specter.bench` bounds its own exit after a
stop (`exit_bounded`). The results the bench writes after every cell are valid throughout, so even a forced end leaves
the finished cells on disk.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

T = TypeVar("T")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
STOP_GRACE_S = 10.0
"""Seconds a stopped bench may take to abandon its cell and close its runtime before the watchdog ends the process.
On the GPU machine `timeout` runs the bench within a 10-minute call; leave it more than this before the call's end."""


def exit_status(signum: int) -> int:
    """The bench's exit status when a signal stopped it: 128 + the signal's number (143 for SIGTERM, 130 for SIGINT),
    what a shell reports for a process the signal ended; distinct from 1 (tokens differ), 2 (bad input or an --out it
    cannot write) and 3 (nothing measured)."""
    return 128 + signum


class BenchStopped(Exception):
    """The bench was stopped by a signal; what finished before it is kept."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")

    @property
    def status(self) -> int:
        return exit_status(self.signum)


class Stopper:
    """Turns a stop signal into the cancellation of the asyncio task `run` is running (or, outside one, BenchStopped
    at once), with the watchdog above. Install it with `installed()`; only the main thread can take signals."""

    def __init__(self, grace_s: float = STOP_GRACE_S, on_force: Callable[[int, str], None] | None = None) -> None:
        self.grace_s = grace_s
        self.on_force = on_force
        """Called (with the signal's number and why the stop was forced) just before the process is ended."""
        self.signum: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._done = threading.Event()

    @contextmanager
    def installed(self) -> Iterator[Stopper]:
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        # a signal the process ignores (SIGINT in a shell's background job) stays ignored; one whose handler Python
        # cannot restore (installed from C: None) is left alone
        previous = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
        previous = {signum: handler for signum, handler in previous.items() if handler not in (signal.SIG_IGN, None)}
        for signum in previous:
            signal.signal(signum, self._handle)
        try:
            yield self
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            self._done.set()  # unwound, stopped or not: nothing left for the watchdog to guard

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """asyncio.run(coroutine); a stop signal cancels it and raises BenchStopped here once it has unwound."""
        if self.signum is not None:
            coroutine.close()
            raise BenchStopped(self.signum)
        try:
            return asyncio.run(self._guard(coroutine))
        except BaseException as error:
            if self.signum is None:
                raise
            # stopped: whatever the unwind raised (a runtime's close failing, an exception group) is part of the stop
            raise BenchStopped(self.signum) from (None if isinstance(error, asyncio.CancelledError) else error)

    async def _guard(self, coroutine: Coroutine[Any, Any, T]) -> T:
        self._loop, self._task = asyncio.get_running_loop(), asyncio.current_task()
        try:
            return await coroutine
        finally:
            self._loop = self._task = None

    def _handle(self, signum: int, _frame: object) -> None:
        if self.signum is not None:  # a second signal: no more waiting
            self._force(signum, f"a second {signal.Signals(signum).name} came before the cell in progress had ended")
        self.signum = signum
        _say(f"\n{signal.Signals(signum).name}: stopping the bench (abandoning the cell in progress, keeping the finished ones)")
        threading.Thread(target=self._watchdog, args=(signum,), name="bench-stop-watchdog", daemon=True).start()
        loop, task = self._loop, self._task
        if loop is not None and task is not None and not task.done():
            loop.call_soon_threadsafe(task.cancel)  # the loop's own thread cancels it at its next step
        else:
            raise BenchStopped(signum)

    def _watchdog(self, signum: int) -> None:
        if not self._done.wait(self.grace_s):
            _say(f"the stopped bench did not end within {self.grace_s:g} s; ending the process")
            self._force(signum, f"the cell in progress did not end within {self.grace_s:g} s of the signal")

    def _force(self, signum: int, why: str) -> None:
        try:
            if self.on_force is not None:
                self.on_force(signum, why)
        finally:
            os._exit(exit_status(signum))


def exit_bounded(status: int, grace_s: float = STOP_GRACE_S) -> None:
    """sys.exit(status); after a stop (status 128 + a stop signal), the interpreter's exit is bounded by `grace_s` too
    (a thread that does not end would otherwise hold it)."""
    if status in {exit_status(signum) for signum in STOP_SIGNALS}:
        timer = threading.Timer(grace_s, os._exit, args=(status,))
        timer.daemon = True
        timer.start()
    sys.exit(status)


def _say(line: str) -> None:
    """One line on stderr without Python's buffered writer, which a signal handler may have interrupted mid-write."""
    try:
        os.write(sys.stderr.fileno(), (line + "\n").encode())
    except (OSError, ValueError, AttributeError):  # no usable stderr (closed, captured without a descriptor)
        pass


__all__ = ["STOP_GRACE_S", "BenchStopped", "Stopper", "exit_bounded", "exit_status"]
