"""The engine's daemon threads are idle when the interpreter finalizes.

A daemon thread still inside torch (or any C++ code) when the interpreter finalizes is torn down inside it, and the
process aborts ("terminate called without an active exception", exit status 134) after the script's work is done. An
engine left open at exit with work in flight has such threads: its CPU streams' workers, its host threads and its
event waiters (a task cancelled mid-request when `asyncio.run` ended leaves its queued copies and host jobs behind).
Each registers here; at exit each is given until a shared deadline to run the work queued to it, so that it is
blocked on its empty queue, in the interpreter's own C code, when finalization starts.

Nothing is stopped or dropped: an exit handler that closes an engine after this one (a `SyncEngine`'s) finds its
threads as they were.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from typing import Protocol

from specter.log import get_logger

log = get_logger(__name__)

EXIT_SETTLE_S = 10.0
"""How long the exit waits, for all threads together, for the work queued to them. A thread still busy then is left
(the exit goes on, and may abort as described above): work that never ends must not hang the exit."""

_POLL_S = 0.05  # how often a wait for a mark checks that its thread still runs


class Settles(Protocol):
    """A daemon thread's owner that can wait for the work queued to it."""

    def settle(self, timeout_s: float) -> bool:
        """Wait until the work queued so far has run (or the thread is gone); False if `timeout_s` passed first."""
        ...


_threads: weakref.WeakSet[Settles] = weakref.WeakSet()


def settle_at_exit(owner: Settles) -> None:
    """Register `owner` (held weakly) to be settled before the interpreter finalizes."""
    _threads.add(owner)


def settle_all(timeout_s: float = EXIT_SETTLE_S) -> list[Settles]:
    """Settle every registered owner within `timeout_s` in all; the owners still busy at the deadline. Each gets at
    least `_POLL_S`, so an idle one is not called busy because one before it used up the time."""
    deadline = time.monotonic() + timeout_s
    return [owner for owner in list(_threads) if not owner.settle(max(_POLL_S, deadline - time.monotonic()))]


class Mark:
    """A marker queued behind a thread's work: `reached` is set when the thread gets to it."""

    def __init__(self) -> None:
        self.reached = threading.Event()

    def __call__(self) -> None:
        self.reached.set()

    def wait(self, thread: threading.Thread, timeout_s: float) -> bool:
        """Wait for `thread` to reach this mark, or to end (a thread told to stop before the mark was queued never
        reaches it); False if `timeout_s` passed first."""
        deadline = time.monotonic() + timeout_s
        while not self.reached.wait(min(_POLL_S, max(0.0, deadline - time.monotonic()))):
            if not thread.is_alive():
                return True
            if time.monotonic() >= deadline:
                return False
        return True


def _settle_at_exit() -> None:
    busy = settle_all()
    if busy:
        log.warning("daemons.busy_at_exit", threads=[repr(owner) for owner in busy], waited_s=EXIT_SETTLE_S,
                    hint="close the engine (async with / aclose) before the interpreter exits")


atexit.register(_settle_at_exit)
