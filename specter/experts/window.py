"""The verify's rolling window: a layer's chosen experts handed to the reader hot first, misses loaded through the
layer's free and evictable slots as earlier experts are used (`iter_ready`, `iter_issued`).

A mix-in of `ExpertCache` over the slot state machine (experts/slots.py), whose invariants hold here too.
"""

# What the window adds (the tests in tests/test_cache.py check each):
#  1. The router has chosen: entering the window lifts plan protection of the layer's experts the reader does not
#     ask for; those it asks for stay protected until it marks each used.
#  2. Every resident asked for is pinned at once, before the first yield, so the reader's awaits cannot lose one
#     to eviction; each request counts once (hit, in-flight hit or miss).
#  3. Misses that fit in free or evictable slots start before the first resident is handed out (one victim
#     choice for all of them): the copy stream works while the host launches the residents' compute.
#  4. A resident may be "doomed" (chosen by the policy among the reader's own residents for a miss's slot) only
#     within this window: it is handed out first, and its slot takes a miss only once the reader has marked it
#     used; that copy waits on the device for its last use.
#  5. With `CacheTuning.roll_hot_window` = W, at most W misses are owned at once (one when none is), and a later
#     miss takes the slot of the miss handed out first, once it is used and unprotected (`_make_room`'s recycle).
#  6. Each expert is yielded once: by `iter_ready` after its copy landed; by `iter_issued` once its copy is fully
#     on the copy stream, with the ready event the reader's stream must wait on (None when landed).
#  7. Whatever the window pinned and has not handed out goes back when the iterator closes (break, error,
#     cancellation), each pin only if its slot still holds the assignment pinned (generation).
#  8. With no room and none that can appear (nothing loading, no other reader's pin), the window raises
#     BudgetError instead of waiting forever.

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator, Iterable

from backends.base import Event
from specter.errors import BudgetError
from specter.experts.slots import ExpertSlots, OwnedSlots, Slot, SlotState


class RollingWindow(ExpertSlots):
    """`iter_ready` and `iter_issued`: the reader's way in once a layer's routing is known."""

    async def iter_ready(self, layer: int, experts: Iterable[int]) -> AsyncIterator[tuple[int, int]]:
        """Yield (expert, slot) for `experts`: resident ones first, then in the order their copies land.

        This is verify's rolling window: the router has chosen, so plan protection of this layer's other
        experts is lifted; misses load into free or evictable slots as readers `mark_used` earlier ones
        (the first of them start before the resident ones are handed out). Each yielded slot is pinned
        until the reader calls `mark_used` (or `unprotect_all`).
        """
        async with contextlib.aclosing(self._rolling(layer, experts, on_issue=False)) as items:
            async for expert, slot, _ready in items:  # closed with this iterator: its pins go back at once
                yield expert, slot

    async def iter_issued(self, layer: int, experts: Iterable[int]) -> AsyncIterator[tuple[int, int, Event | None]]:
        """`iter_ready` for readers whose compute is ordered on a device stream: yield (expert, slot, ready)
        as soon as a miss's copy is on the copy stream, without waiting for it to land.

        `ready` is None for an expert whose copy has landed; otherwise the reader must make its compute
        stream wait on it (`backend.stream_wait`) before reading the slot. No host wake-up per miss: the
        reader can enqueue every expert of the layer at once and the device orders copy and compute.
        """
        async with contextlib.aclosing(self._rolling(layer, experts, on_issue=True)) as items:
            async for item in items:
                yield item

    async def _rolling(self, layer: int, experts: Iterable[int], on_issue: bool) -> AsyncIterator[tuple[int, int, Event | None]]:
        wanted = list(dict.fromkeys(experts))
        assert not self.host_path[layer].intersection(wanted), f"layer {layer}: host-path experts asked of the device cache"
        self._protected[layer] &= set(wanted)
        hot = [expert for expert in wanted if self.lookup(layer, expert) is not None]
        owned = OwnedSlots()  # pinned by this iterator, not yet handed to the reader
        landed: asyncio.Queue[int] = asyncio.Queue()
        try:
            for expert in hot:  # pinned all at once, so the reader's awaits cannot lose one to eviction
                owned.pin(self._residents[layer][expert], expert)
                self.stats.layers[layer].hits += 1
            # Misses that fit in free or evictable slots start now, before the reader launches the resident
            # experts' compute: the copy stream works while the host launches.
            absent = [e for e in wanted if e not in hot]
            waiting = self._start_what_fits(layer, absent, owned, landed, on_issue)
            doomed: set[int] = set()
            if waiting and hot:  # one victim choice among the residents for the misses left
                # A doomed resident's slot takes a miss as soon as the reader has launched it, not after every
                # resident's launch: the host's launches no longer hold the copy stream idle.
                count, window = len(waiting), self.tuning.roll_hot_window
                if window is not None:  # the misses already in slots count towards the window
                    count = min(count, max(0, window - (len(absent) - len(waiting))))
                chosen = self._victims(layer, count, among=hot) if count else []
                doomed = set(chosen)
                hot = chosen + [expert for expert in hot if expert not in doomed]  # handed out first
            for expert in hot:
                yield expert, owned.pop(expert).index, None
                if waiting and expert in doomed:  # the reader launched it and marked it used: its slot takes a miss
                    waiting = self._reuse(layer, expert, waiting, owned, landed, on_issue)
            async for expert, slot in self._landings(layer, waiting, owned, landed, on_issue):
                ready = self._pending_ready(slot, expert, layer) if on_issue else None  # may raise: the slot stays owned
                owned.pop(expert)
                yield expert, slot.index, ready
        finally:
            self._give_back(owned)

    # -- internals ---------------------------------------------------------------------------------

    async def _landings(self, layer: int, waiting: list[int], owned: OwnedSlots, landed: asyncio.Queue[int],
                        on_issue: bool) -> AsyncIterator[tuple[int, Slot]]:
        """Load `waiting` experts through the layer's free/evictable slots, yielding each (and those already in
        `owned` and started) as its copy lands, or with `on_issue` as its copy is fully on the copy stream."""
        window = self.tuning.roll_hot_window
        rolled: collections.deque[int] | None = None if window is None else collections.deque()
        while waiting or owned:
            limit = None if window is None else max(0 if owned else 1, window - len(owned))
            waiting = self._start_what_fits(layer, waiting, owned, landed, on_issue, limit, rolled)
            # An owned expert is always announced on `landed` (as it lands, or is issued): wait for it. Only with
            # none owned can the rest wait on room that may never come.
            if landed.empty() and waiting and not owned:
                if not self._room_can_appear(layer, ()):  # (nothing owned here)
                    raise BudgetError(f"layer {layer}: no slot can be freed for experts {waiting}; raise the budget")
                await self._capacity_changed(layer)
                continue
            expert = await landed.get()
            slot = owned[expert]
            if not on_issue:
                await self._until_landed(slot, expert, layer)
            if rolled is not None:  # a later miss of the layer takes the slot of the miss handed out first
                rolled.append(expert)
            yield expert, slot

    def _start_what_fits(self, layer: int, waiting: list[int], owned: OwnedSlots, landed: asyncio.Queue[int],
                         on_issue: bool = False, limit: int | None = None,
                         recycle: collections.deque[int] | None = None) -> list[int]:
        """Pin in-flight or start loads for as many waiting experts as slots allow (at most `limit` new loads,
        in slots of the experts in `recycle` first, see `_make_room`); return the rest."""
        absent = []
        for expert in waiting:  # first pin the ones already mapped, so that no victim is chosen among them
            slot = self._residents[layer].get(expert)
            if slot is None:
                absent.append(expert)
                continue
            if slot.state is SlotState.LOADING:
                self.stats.layers[layer].inflight_hits += 1
                if slot.transfer is not None:
                    slot.transfer.promote()
            else:  # landed while we were busy with earlier experts
                self.stats.layers[layer].hits += 1
            self._own(slot, expert, owned, landed, on_issue)
        wanted = len(absent) if limit is None else min(len(absent), limit)
        room = self._make_room(layer, wanted, recycle) if wanted else []  # one victim choice for all of them
        for expert, slot in zip(absent, room):
            self._start_load(layer, expert, slot, urgent=True)
            self.stats.layers[layer].misses += 1
            self._own(slot, expert, owned, landed, on_issue)
        return absent[len(room):]

    def _reuse(self, layer: int, victim: int, waiting: list[int], owned: OwnedSlots, landed: asyncio.Queue[int],
               on_issue: bool) -> list[int]:
        """Start the first waiting miss in `victim`'s slot (chosen by `_victims(among=...)`), if the reader has
        marked it used; the copy waits on the device for that last use. Returns the misses still waiting."""
        slot = self._residents[layer].get(victim)
        if slot is None or slot.pins or slot.state is not SlotState.RESIDENT or victim in self._protected[layer]:
            return waiting  # not marked used (or gone): the rolling window will find room later
        for index, expert in enumerate(waiting):
            if expert in self._residents[layer]:  # mapped since (a prefetch landed or is loading): pin it, go on
                self._start_what_fits(layer, [expert], owned, landed, on_issue)
                continue
            self._start_load(layer, expert, self._evict(layer, victim), urgent=True)
            self.stats.layers[layer].misses += 1
            self._own(self._residents[layer][expert], expert, owned, landed, on_issue)
            return waiting[index + 1 :]
        return []

    def _own(self, slot: Slot, expert: int, owned: OwnedSlots, landed: asyncio.Queue[int], on_issue: bool) -> None:
        owned.pin(slot, expert)
        self._notify(slot, expert, landed, on_issue)

    def _notify(self, slot: Slot, expert: int, queue: asyncio.Queue[int], on_issue: bool) -> None:
        """Put `expert` on `queue` when its copy has landed, or with `on_issue` when it is fully issued."""
        if slot.loading is None:
            queue.put_nowait(expert)
        elif on_issue and slot.transfer is not None:
            slot.transfer.when_issued(lambda: queue.put_nowait(expert))
        else:
            slot.loading.add_done_callback(lambda _task: queue.put_nowait(expert))

    def _pending_ready(self, slot: Slot, expert: int, layer: int) -> Event | None:
        """For `iter_issued`: None if the copy into `slot` has landed, else its ready event (fully issued)."""
        if slot.expert != expert or slot.layer != layer or slot.state is SlotState.FREE:
            self._lost(slot, expert)
        if slot.state is SlotState.RESIDENT:
            return None
        transfer = slot.transfer
        if transfer is not None and (error := transfer.error()) is not None:
            raise error
        assert transfer is not None and not transfer.cancelled, f"the copy of expert {expert} was dropped (reset during a round?)"
        ready = transfer.ready_event()
        assert ready is not None, f"expert {expert} handed out before its copy was issued"
        return ready
