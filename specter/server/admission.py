"""The request queue: one request runs at a time, the others wait first come first served, at most `max_waiting`.

The engine queues by itself too, but it cannot say how many wait; the server keeps its own FIFO turn so that it
can refuse the request that would overflow the queue (429) before any response has started.
"""

from __future__ import annotations

import asyncio
import math
import time


class QueueFull(Exception):
    """The queue holds `max_waiting` requests already; `retry_after_s` is when a place is likely to free up."""

    def __init__(self, waiting: int, retry_after_s: int) -> None:
        super().__init__(f"{waiting} requests are already waiting")
        self.waiting, self.retry_after_s = waiting, retry_after_s


class AdmissionQueue:
    """Tickets for the engine's turn, handed out in arrival order (asyncio.Lock wakes waiters FIFO)."""

    def __init__(self, max_waiting: int) -> None:
        assert max_waiting >= 0, "max_waiting is validated by the CLI"
        self.max_waiting = max_waiting
        self.waiting = 0
        self.running = 0
        self._turn = asyncio.Lock()
        self._service_s = 1.0  # moving average of how long a request holds the turn, for Retry-After

    def admit(self) -> Ticket:
        """A place in the queue now, or QueueFull. Admission is synchronous so a refusal is a plain 429.

        One request runs and `max_waiting` wait: a ticket admitted to an idle engine counts as waiting until its task
        takes the turn (a streamed one only when its response starts), so the tickets held are what is bounded, not
        the waiting count alone, else a burst arriving at an idle server is refused one place early."""
        held = self.waiting + self.running
        if held > self.max_waiting:
            raise QueueFull(held - 1, self._retry_after())
        self.waiting += 1
        return Ticket(self)

    def _retry_after(self) -> int:
        # A place frees up when the running request ends and the head of the queue starts: about one service time.
        return max(1, min(60, math.ceil(self._service_s)))

    def _served(self, held_s: float) -> None:
        self._service_s = 0.8 * self._service_s + 0.2 * held_s


class Ticket:
    """One request's place: `async with ticket` waits for the turn and holds it; `close()` gives the place back.

    Idempotent and safe whether the turn was never taken, is being waited for, or is held.
    """

    def __init__(self, queue: AdmissionQueue) -> None:
        self._queue = queue
        self._state = "waiting"  # -> "running" -> "done", or "waiting" -> "done"
        self._started = 0.0

    async def __aenter__(self) -> Ticket:
        assert self._state == "waiting", f"ticket entered twice (state {self._state})"
        try:
            await self._queue._turn.acquire()
        except BaseException:
            self.close()  # cancelled while waiting: the place is given back, the turn was never taken
            raise
        self._queue.waiting -= 1
        self._queue.running += 1
        self._state, self._started = "running", time.monotonic()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        if self._state == "waiting":
            self._queue.waiting -= 1
        elif self._state == "running":
            self._queue.running -= 1
            self._queue._served(time.monotonic() - self._started)
            self._queue._turn.release()
        self._state = "done"
