"""The draft-ahead (DraftConfig.overlap): draft steps from a guess at the target's next token, run beside the verify,
and the carry that lets the next round start from them. The runtime owns one; its state lives for one request."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import torch

from specter.accept import Acceptance
from specter.draft import Draft
from specter.metrics import RequestStats
from specter.sampling import SamplingParams

Tensor = torch.Tensor

@dataclasses.dataclass(frozen=True)
class Carry:
    """A draft-ahead that can start the next round: its x0 (the guess) at `start`, and its proposals (device)."""

    start: int
    x0: int
    tokens: Tensor


class DraftAhead:
    """Draft steps beside each verify, and what the next round takes from them.

    Per speculative round, in the order the runtime calls them: `steps` (how many steps beside this verify; 0:
    none), `take` (this round's first draft steps from the last carry), `keep_counts` (after the draft, before the
    verify), `beside` (the verify and the draft-ahead as one task group), `join` (after the verdict, and when a
    request ends), `settle` (after the commit: keep a carry if the guess was right). `reset` ends a request.
    """

    max_steps = 33  # rows of its buffers: DraftConfig.k_max's bound + 1 (at most k + 1 steps ahead)

    def __init__(self, draft: Draft | None, depth: int, backend, device: torch.device, sampling: str) -> None:
        self.draft, self.depth, self.backend, self.device, self.sampling = draft, depth, backend, device, sampling
        self.carry: Carry | None = None  # the last verify's draft-ahead, if it can start the next round
        self.carried = 0  # draft steps this round took from a carry
        self.ran = False  # this round drafted a guess and ahead
        self.stream: Any = None  # the draft-ahead's CUDA stream, made on first use
        self.done: Any = None  # the end of the draft-ahead enqueued beside this round's verify
        self.tokens: Tensor | None = None  # [33] device buffer the draft-ahead writes its proposals into
        self.counts: Tensor | None = None  # [33, L, E] the route counters after each of its steps
        self.kept_counts: Tensor | None = None  # [L, E] the round's own route counters, kept before a draft-ahead resets them
        self.counts_kept = False  # this round's route counters are in kept_counts

    def steps(self, start: int, k: int, remaining: int, params: SamplingParams, kv_capacity: int) -> int:
        """Draft-ahead steps beside this round's verify: 0 when off, when the round does not speculate, for
        rejection sampling (the next round would need the steps' logits), for an eager draft on CUDA (no second
        stream for it), and when nothing would be left to draft after this round."""
        if not self.depth or not k or self.draft is None:
            return 0
        if self.tokens is None:  # the draft-ahead's buffers, made once (a few KiB)
            counts = self.draft.route_counts
            self.tokens = torch.zeros(self.max_steps, dtype=torch.long, device=self.device)
            self.counts = torch.zeros((self.max_steps, *counts.shape), dtype=counts.dtype, device=counts.device)
            self.kept_counts = torch.zeros_like(counts)
        if params.temperature > 0 and self.sampling == "rejection":
            return 0
        if self.device.type == "cuda" and not self.draft.static:
            return 0
        after = remaining - (k + 1)  # tokens left once this round commits all it can; the next round drafts after - 1
        room = kv_capacity - (start + k + 1)  # KV positions from the guess on
        return max(0, min(self.depth, k + 1, after - 1, room))

    def take(self, x0: int, start: int, steps: int) -> Tensor | None:
        """The last draft-ahead's proposals as this round's first draft steps, if it started from this very
        token and position (always dropped afterwards)."""
        self.counts_kept, self.carried = False, 0
        carry, self.carry = self.carry, None
        if carry is None or not steps or carry.x0 != x0 or carry.start != start:
            return None
        taken = self.carried = min(carry.tokens.shape[0], steps)
        if taken < carry.tokens.shape[0]:  # the counters hold every step it ran: keep the routes of those taken
            self.draft.route_counts.copy_(self.counts[taken - 1])
        return carry.tokens[:taken]

    def keep_counts(self) -> None:
        """Keep the round's route counters: the draft-ahead resets them; the window recall reads these."""
        self.kept_counts.copy_(self.draft.route_counts)
        self.counts_kept = True

    def round_counts(self) -> Tensor:
        """The route counters [L, E] of this round's own draft (device)."""
        return self.kept_counts if self.counts_kept else self.draft.route_counts

    async def beside(self, verify: Callable[[], Awaitable[Tensor]], guess: Tensor, position: int, steps: int, kv, params: SamplingParams) -> Tensor:
        """`verify()` and the draft-ahead as one task group: `steps` draft steps from the guess at `position` (beyond
        every position the verify writes), on a second stream on CUDA. Returns the verify's result."""
        cuda = self.device.type == "cuda" and self.draft.static
        if cuda and self.stream is None:
            self.stream = self.backend.new_stream("draft-ahead")
        after = self.backend.record_event(self.backend.compute_stream) if cuda else None
        try:
            with single_failure():
                async with asyncio.TaskGroup() as group:
                    verified = group.create_task(verify(), name="specter-verify")
                    group.create_task(self.draft.extend(guess, position, self.tokens[:steps], self.counts[:steps], kv, params,
                                                        self.stream if cuda else None, after, self.backend),
                                      name="specter-draft-ahead")
        finally:
            if cuda:  # whatever was enqueued there, the compute stream's later work comes after it
                self.done = self.backend.record_event(self.stream)
        return verified.result()

    def join(self) -> None:
        """Order the compute stream after the draft-ahead (no host wait): the next draft reuses its buffers."""
        if self.done is not None:
            self.backend.stream_wait(self.backend.compute_stream, self.done)
            self.done = None

    def settle(self, start: int, k: int, steps: int, acceptance: Acceptance, guessed: int | None, stats: RequestStats) -> None:
        """After the commit: count the round, and keep a carry when every draft and the guess were right."""
        if steps:
            stats.ahead_rounds += 1
            stats.ahead_steps += steps
            if acceptance.n_accepted == k and acceptance.tokens[-1] == guessed:  # the guess is the next round's x0
                self.carry = Carry(start=start + k + 1, x0=guessed, tokens=self.tokens[:steps])
        if self.carried:
            stats.carried_rounds += 1
            stats.carried_steps += self.carried
        self.ran = bool(steps)

    def steps_run(self, k: int) -> int:
        """Draft steps this round ran itself: k, one more with a draft-ahead (the guess), less those taken over."""
        if not k:
            return 0
        return k + (1 if self.ran else 0) - self.carried

    def reset(self) -> None:
        """A request ends (or a prefill starts): no carry survives it."""
        self.carry = None


@contextlib.contextmanager
def single_failure() -> Iterator[None]:
    """A task group's one failure surfaces as itself (e.g. a PluginError from a policy, as the user should see
    it), not wrapped in a group; several stay a group."""
    try:
        yield
    except BaseExceptionGroup as group:
        if len(group.exceptions) == 1:
            failure = group.exceptions[0]
            # the group hidden, the failure's own cause kept (`from None` would erase it: a plug-in's exception,
            # the file and line its author needs)
            raise failure from failure.__cause__
        raise
