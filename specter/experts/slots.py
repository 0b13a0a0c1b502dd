"""The expert cache's slot state machine: per-layer slots in one device tensor, the residency map, the device slot
table, protection and pins, ready and last-use events, generations and the counters.

`ExpertCache` (experts/cache.py) adds the verify's rolling window (experts/window.py) and the lead and relay
(experts/lead.py) on top of this class; loads go through the transfer engine, eviction choices through an injected
`choose_victims`.
"""

# How a slot stays safe (the invariants the property tests check):
#  1. A slot is FREE, LOADING (a copy into it is queued or in flight) or RESIDENT (its copy landed). Every mapped
#     slot is in its layer's residency map (`_residents`) and in that layer's slot list (`_by_layer`).
#  2. A LOADING slot, a pinned slot (handed to a reader that has not called `mark_used`) and a protected expert
#     (planned for the coming verify) are never evicted (`_victims` offers the policy none of them, and refuses a
#     policy that chooses one). The two exceptions, a reader's own used residents, are the rolling window's and
#     the lead's (see their modules): their compute is launched before their slots take a copy.
#  3. A slot is never read before its copy lands: readers get a slot only from `ensure` / `iter_ready`, which
#     await the copy's ready event, or from `iter_issued`, which hands over that event for the reader's stream to
#     wait on (device-ordered readers; `mark_used` may then come while the slot is still LOADING, which is safe:
#     such a slot is a victim only after that reader's compute).
#  4. A slot is never overwritten while a reader may still touch it: the copy into a reused slot first makes the
#     copy stream wait on the slot's last-use event (device-side, no host sync).
#  5. The slot table says "expert e of layer l is in slot s" only after e's weights landed: the table write is
#     enqueued on the copy stream right after the copy (`after_copy`), and eviction writes -1 before the slot is
#     reused.
#  6. Each (re)assignment bumps the slot's generation, so a late completion of an older load (after `reset`)
#     cannot mark a slot resident for the wrong expert, and a reader whose load failed (its slot freed, maybe
#     taken by another reader since) gives back only the pin of the assignment it pinned.
#  7. A cancelled reader leaves nothing pinned: its copy still lands and the slot becomes resident (unpinned,
#     evictable), or free when the load was dropped by `reset`.
#  8. A load's outcome is recorded by a task the cache owns (`_complete_load`), not by the reader that started
#     it: a reader leaving never leaves a slot LOADING forever.
#  9. Counters are exact and host-side: each request counts once as a hit, an in-flight hit or a miss; bytes count
#     once per issued chunk.
# 10. An expert the placement puts on the host path (`place`, specter/placement.py) never enters the cache: `prefetch`,
#     `protect`, `lead` and `restore` skip it (`device_path`, the one filter), and readers never ask for it. A prompt
#     may run under its own placement (fewer host experts, `OffloadedExperts.prompt_placement`): the experts it then
#     loads leave again before decoding (`drop_host_path`).

from __future__ import annotations

import asyncio
import collections
import enum
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence, Set
from dataclasses import dataclass, field
from functools import partial

import torch

from backends.base import Backend, Event
from specter.config import CacheTuning
from specter.errors import BudgetError, PluginError
from specter.experts.pool import ExpertPool
from specter.experts.transfer import Transfer, TransferEngine
from specter.kernel import Kernel
from specter.placement import layer_counts
from specter.log import debug_enabled, get_logger

log = get_logger(__name__)

VictimChooser = Callable[[int, Sequence[int], Set[int], int], list[int]]
"""choose_victims(layer, residents (least recently used first), protected, count) -> experts to evict."""


def lru_victims(layer: int, residents: Sequence[int], protected: Set[int], count: int) -> list[int]:
    """The default `VictimChooser`: the least recently used unprotected residents."""
    return [expert for expert in residents if expert not in protected][:count]


class SlotState(enum.Enum):
    FREE = "free"
    LOADING = "loading"
    RESIDENT = "resident"


@dataclass
class Slot:
    """One row of the device weight tensor and what the host knows about it."""

    index: int
    layer: int
    expert: int | None = None
    state: SlotState = SlotState.FREE
    generation: int = 0
    pins: int = 0
    """Readers holding the slot (between ensure/iter_ready and mark_used)."""
    loading: asyncio.Task[None] | None = None
    """The task completing the current load; readers await it shielded."""
    transfer: Transfer | None = None
    ready: Event | None = None
    """Copy landed (and slot-table write done); None while loading or free."""
    last_use: Event | None = None
    """The last reader's compute; the next copy into this slot waits for it on the device."""


@dataclass
class LayerStats:
    """Counters of one layer (host side, exact)."""

    hits: int = 0
    """Requested by a reader and already resident."""
    inflight_hits: int = 0
    """Requested while a prefetch into it was in flight (waited for the rest of that copy)."""
    misses: int = 0
    """Loaded on demand."""
    evictions: int = 0
    prefetched: int = 0
    bytes_loaded: int = 0
    """Bytes copied into this layer's slots, counted once per issued chunk (cancelled loads included)."""


@dataclass
class CacheStats:
    """Per-layer counters; `total` sums them."""

    layers: list[LayerStats] = field(default_factory=list)

    def total(self) -> LayerStats:
        summed = LayerStats()
        for layer in self.layers:
            for name in vars(summed):
                setattr(summed, name, getattr(summed, name) + getattr(layer, name))
        return summed


@dataclass(frozen=True)
class CacheSnapshot:
    """The resident experts of every layer, least recently used first (what `restore` reloads)."""

    layers: tuple[tuple[int, ...], ...]


class OwnedSlots(dict[int, Slot]):
    """expert -> slot a reader pinned and has not handed on, with each slot's generation when pinned."""

    def __init__(self) -> None:
        super().__init__()
        self.generations: dict[int, int] = {}

    def add(self, slot: Slot, expert: int) -> None:
        """Own `slot` (already pinned) for `expert`, remembering which assignment was pinned."""
        self[expert] = slot
        self.generations[expert] = slot.generation

    def pin(self, slot: Slot, expert: int) -> None:
        slot.pins += 1
        self.add(slot, expert)


class ExpertSlots:
    """Device slots over an `ExpertPool` (`layer_slots[l]` allocated to MoE layer l), loaded through a
    `TransferEngine`: the state machine every reader of `ExpertCache` goes through. All methods run on the
    event-loop thread."""

    def __init__(
        self,
        backend: Backend,
        kernel: Kernel,
        transfer: TransferEngine,
        pool: ExpertPool,
        slots: int | Sequence[int],
        choose_victims: VictimChooser | None = None,
        tuning: CacheTuning | None = None,
    ) -> None:
        """`slots`: per MoE layer, one count for all or one each (`MemoryPlan.layer_slots`). `choose_victims`: the
        eviction policy (`lru_victims` when None); the `choose_victims` attribute may also be replaced later, it is
        read at each choice. `tuning`: the rolling window's and the lead's knobs (EngineConfig.tuning.cache); read at
        run time."""
        layer_slots = layer_counts(slots, pool.num_layers)
        if len(layer_slots) != pool.num_layers or not all(1 <= count <= pool.num_experts for count in layer_slots):
            raise BudgetError(
                f"the expert cache needs 1..{pool.num_experts} slots in each of {pool.num_layers} layers, got "
                f"{slots}; raise the memory budget or lower `residents`"
            )
        self.backend, self.kernel, self.transfer, self.pool = backend, kernel, transfer, pool
        self.num_layers, self.num_experts = pool.num_layers, pool.num_experts
        self.layer_slots = layer_slots
        """Each layer's own slots (its home count; the relay may lend one for a round)."""
        self.slots_per_layer = min(layer_slots)
        """The fewest slots a layer holds: what a planner may count on in every layer."""
        self.choose_victims: VictimChooser = choose_victims or lru_victims
        self.tuning = tuning or CacheTuning()
        # [sum of layer_slots, N] one flat expert per row, each layer's consecutive; [L, E] slot index or -1.
        # Allocated once, here.
        self.weights = backend.alloc_device((sum(layer_slots), pool.expert_numel), pool.dtype)
        self._slot_views = list(self.weights.unbind(0))  # slot_weights without an indexing op per call
        self.slot_table = backend.alloc_device((self.num_layers, self.num_experts), torch.int32)
        self.slot_table.fill_(-1)
        self._flat_table = self.slot_table.view(-1)
        self.stats = CacheStats([LayerStats() for _ in range(self.num_layers)])
        self._home = [layer for layer, count in enumerate(layer_slots) for _ in range(count)]  # each row's own layer
        self._slots = [Slot(index, layer) for index, layer in enumerate(self._home)]
        self._by_layer = self._home_slots()  # each layer's slots: its `layer_slots` but while the relay lends
        self._residents: list[OrderedDict[int, Slot]] = [OrderedDict() for _ in range(self.num_layers)]
        self._protected: list[set[int]] = [set() for _ in range(self.num_layers)]
        self._capacity_waiters: list[list[asyncio.Future[None]]] = [[] for _ in range(self.num_layers)]
        self._loads: set[asyncio.Task[None]] = set()  # completion tasks, including ones orphaned by reset
        self._load_error: Exception | None = None  # the last copy that failed (transfer engine error), for readers
        self.host_path: tuple[frozenset[int], ...] = tuple(frozenset() for _ in range(self.num_layers))
        """Per layer, the experts computed on the host (invariant 10); set once by `place`."""

    # -- placement ---------------------------------------------------------------------------------

    def place(self, host_path: Sequence[frozenset[int]]) -> None:
        """The experts of each layer the host computes (`Placement.host`): from now on never loaded, planned or
        protected here. Called by the builder before the first request (the bench: between requests)."""
        assert len(host_path) == self.num_layers, f"a placement of {len(host_path)} layers for a cache of {self.num_layers}"
        self.host_path = tuple(frozenset(experts) for experts in host_path)

    async def drop_host_path(self, keep: Sequence[Sequence[int]] = ()) -> int:
        """Evict the residents the placement now puts on the host path, each once its copy has landed (a prompt computed
        them on the device under its own placement, and `place` has switched back since), then prefetch the experts
        of `keep` (per layer) that are not resident. Between forwards (nothing of theirs pinned). Returns the count
        evicted."""
        dropped = 0
        for layer in range(self.num_layers):
            for expert in [e for e in self._residents[layer] if e in self.host_path[layer]]:
                slot = self._residents[layer][expert]
                if slot.loading is not None:
                    await asyncio.shield(slot.loading)
                if self._residents[layer].get(expert) is slot:  # not dropped by a failed load meanwhile
                    assert slot.pins == 0, f"layer {layer}: host-path expert {expert} is still pinned by a reader"
                    self._protected[layer].discard(expert)
                    self._evict(layer, expert)
                    dropped += 1
            self._signal(layer)
        for layer, experts in enumerate(keep):
            self.prefetch(layer, experts)
        return dropped

    def device_path(self, layer: int, experts: Iterable[int]) -> list[int]:
        """`experts` without the layer's host-path ones, in order (invariant 10's one filter)."""
        host = self.host_path[layer]
        return [expert for expert in experts if expert not in host] if host else list(experts)

    # -- reading -----------------------------------------------------------------------------------

    def lookup(self, layer: int, expert: int) -> int | None:
        """The slot holding `expert` with its copy landed, else None. Does not pin or count."""
        slot = self._residents[layer].get(expert)
        return slot.index if slot is not None and slot.state is SlotState.RESIDENT else None

    def slot_weights(self, slot: int) -> torch.Tensor:
        """The flat device weights in `slot` ([N] view of one row)."""
        return self._slot_views[slot]

    def ready_event(self, slot: int) -> Event | None:
        """The event after which `slot`'s data is on the device (for device-side waits)."""
        return self._slots[slot].ready

    def lru_order(self, layer: int) -> list[int]:
        """Experts mapped to the layer's slots (resident or loading), least recently used first."""
        return list(self._residents[layer])

    def pinned_experts(self, layer: int) -> list[int]:
        """Experts of `layer` held by readers that have not called `mark_used` yet."""
        return [expert for expert, slot in self._residents[layer].items() if slot.pins]

    def protected_experts(self, layer: int) -> set[int]:
        """Experts of `layer` under plan protection."""
        return set(self._protected[layer])

    def is_protected(self, layer: int, expert: int) -> bool:
        """Planned or pinned by a reader: not evictable."""
        slot = self._residents[layer].get(expert)
        return expert in self._protected[layer] or (slot is not None and slot.pins > 0)

    def slot_counts(self) -> list[int]:
        """How many slots each layer holds now (its `layer_slots`, but for the relay's loans in a round)."""
        return [len(slots) for slots in self._by_layer]

    async def ensure(self, layer: int, experts: Iterable[int], urgent: bool = True) -> dict[int, int]:
        """Make `experts` resident in `layer` and return expert -> slot, all pinned, all landed.

        Misses are loaded (urgent: ahead of queued prefetches); in-flight prefetches of requested
        experts are promoted when urgent. Raises BudgetError if more experts than slots are asked for.
        """
        wanted = self._distinct_within_budget(layer, experts)
        slots = OwnedSlots()
        succeeded = False
        try:
            for expert in wanted:
                slots.add(await self._claim(layer, expert, urgent, owned=list(slots.values())), expert)
            for expert, slot in slots.items():
                await self._until_landed(slot, expert, layer)
            succeeded = True
            return {expert: slot.index for expert, slot in slots.items()}
        finally:
            if not succeeded:  # cancelled or failed: give back every pin taken (loads still land)
                self._give_back(slots)

    def mark_used(self, layer: int, expert: int, event: Event) -> None:
        """The reader is done with `expert`: record its last-use event, unpin, lift plan protection."""
        slot = self._residents[layer].get(expert)
        assert slot is not None, f"mark_used({layer}, {expert}): the expert has no slot (used without ensure/iter_ready?)"
        slot.last_use = event
        self._protected[layer].discard(expert)
        self._residents[layer].move_to_end(expert)
        self._unpin(slot)  # no-op when unprotect_all already dropped the pin

    # -- planning ----------------------------------------------------------------------------------

    def prefetch(self, layer: int, experts: Iterable[int]) -> list[int]:
        """Issue loads for `experts` in order, without waiting; returns the experts actually issued.

        Skips experts already resident or loading; stops at the first one with no free or evictable
        slot. Call `protect` first for experts that must survive later prefetches.
        """
        issued: list[int] = []
        for expert in dict.fromkeys(self.device_path(layer, experts)):
            if expert in self._residents[layer]:
                continue
            room = self._make_room(layer, 1)
            if not room:
                break
            self._start_load(layer, expert, room[0], urgent=False)
            self.stats.layers[layer].prefetched += 1
            issued.append(expert)
        return issued

    def protect(self, layer: int, experts: Iterable[int], *, replace: bool = False) -> None:
        """Never evict these experts of `layer` until verified (`mark_used`, `iter_ready`) or `unprotect_all`.

        replace: the layer's protection becomes exactly `experts` (a later, better-informed plan of the same
        round drops what an earlier one protected; pins and loads in flight stay safe on their own).
        """
        experts = self.device_path(layer, experts)
        if replace:
            self._protected[layer] = set(experts)
        else:
            self._protected[layer].update(experts)

    # -- state -------------------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget every resident: all slots free, queued loads dropped (issued chunks still land)."""
        self._load_error = None
        for slot in self._slots:
            if slot.transfer is not None:
                slot.transfer.cancel()
            self._release(slot)
        self._by_layer = self._home_slots()
        for layer in range(self.num_layers):
            self._residents[layer].clear()
            self._protected[layer].clear()
            self._signal(layer)
        self.backend.launch(self.transfer.stream, partial(self.slot_table.fill_, -1))
        log.debug("cache.reset")

    def snapshot(self) -> CacheSnapshot:
        """The resident (and loading) experts of each layer in LRU order."""
        return CacheSnapshot(tuple(tuple(self._residents[layer]) for layer in range(self.num_layers)))

    async def restore(self, snapshot: CacheSnapshot) -> None:
        """`reset`, then load the snapshot's experts (LRU order kept) and wait until all landed."""
        assert len(snapshot.layers) == self.num_layers, "snapshot of a cache with another layer count"
        self.reset()
        for layer, experts in enumerate(snapshot.layers):
            own = self.layer_slots[layer]
            assert len(experts) <= own + 1, f"snapshot holds {len(experts)} experts of layer {layer} for {own} slots"
            for expert in self.device_path(layer, experts)[-own:]:  # the most recent (a round may lend a slot)
                self._start_load(layer, expert, self._make_room(layer, 1)[0], urgent=False)
        for slot in self._slots:
            if slot.loading is not None:
                await asyncio.shield(slot.loading)

    def loads_in_flight(self) -> int:
        """Loads whose completion has not run yet (none is left once they settle; a loop that ended without running
        its cancelled tasks leaves them for good)."""
        return sum(not task.done() for task in self._loads)

    async def aclose(self) -> None:
        """Wait for every load in flight to complete (shutdown, tests); one of a loop that ended under it never will,
        and is forgotten (its chunks on the stream land all the same: the transfer engine's close waits for them)."""
        loop = asyncio.get_running_loop()
        while self._loads:
            # Forget the gathered tasks here, not only in their done callbacks: those run from the loop, and on
            # Python 3.12 gathering tasks that are all done returns without yielding to it, so a loop that
            # waited for the callbacks to empty `_loads` would spin forever.
            tasks = list(self._loads)
            ours = [task for task in tasks if task.get_loop() is loop]
            await asyncio.gather(*[asyncio.shield(task) for task in ours], return_exceptions=True)
            self._loads.difference_update(tasks)

    # -- internals: claiming slots -----------------------------------------------------------------

    def _distinct_within_budget(self, layer: int, experts: Iterable[int]) -> list[int]:
        wanted = list(dict.fromkeys(experts))
        if len(wanted) > self.layer_slots[layer]:
            raise BudgetError(
                f"layer {layer} needs {len(wanted)} experts at once but has {self.layer_slots[layer]} slots; "
                "use iter_ready (rolling window) or raise the budget"
            )
        return wanted

    async def _claim(self, layer: int, expert: int, urgent: bool, owned: list[Slot]) -> Slot:
        """Pin the slot of `expert`, starting its load if needed (waits for room when none is evictable)."""
        slot = self._residents[layer].get(expert)
        if slot is None:
            slot = await self._room_or_wait(layer, owned)
            if expert in self._residents[layer]:  # another reader loaded it while we waited
                self._release(slot)
                return await self._claim(layer, expert, urgent, owned)
            self._start_load(layer, expert, slot, urgent)
            self.stats.layers[layer].misses += 1
        elif slot.state is SlotState.LOADING:
            self.stats.layers[layer].inflight_hits += 1
            if urgent and slot.transfer is not None:
                slot.transfer.promote()
        else:
            self.stats.layers[layer].hits += 1
            self._residents[layer].move_to_end(expert)
        self._pin(slot)
        return slot

    async def _room_or_wait(self, layer: int, owned: list[Slot]) -> Slot:
        while not (room := self._make_room(layer, 1)):
            if not self._room_can_appear(layer, owned):
                held, own = len(self._by_layer[layer]), self.layer_slots[layer]
                lent = (f" (it holds {held}: one is lent to a layer whose slots are all protected until the round "
                        "ends, `unprotect_all`)") if held < own else ""
                raise BudgetError(
                    f"layer {layer}: all {own} slots hold protected experts "
                    f"{sorted(self._protected[layer])} and none is loading or in use{lent}; plan at most "
                    f"{own - 1} experts in this layer or raise the budget"
                )
            await self._capacity_changed(layer)
        return room[0]

    def _room_can_appear(self, layer: int, owned: Sequence[Slot]) -> bool:
        """A slot may become evictable later: a load will land or a reader other than us will unpin."""
        ours = {slot.index for slot in owned}
        layers = [layer]
        if self._short(layer):  # short of a lent slot: the borrower's may free up
            layers += [d for d in range(self.num_layers) if self._over(d)]
        return any(
            slot.state is SlotState.LOADING or (slot.pins and slot.index not in ours)
            for donor in layers for slot in self._layer_slots(donor)
        )

    def _make_room(self, layer: int, count: int, recycle: collections.deque[int] | None = None) -> list[Slot]:
        """Up to `count` slots of `layer` ready for a new load: free ones first, then those of the experts in
        `recycle` (oldest first, while the oldest is used and unprotected), then victims the policy chooses."""
        room = [slot for slot in self._layer_slots(layer) if slot.state is SlotState.FREE][:count]
        while recycle and len(room) < count:
            slot = self._residents[layer].get(recycle[0])
            usable = slot is not None and slot.state is SlotState.RESIDENT
            if usable and (slot.pins or recycle[0] in self._protected[layer]):
                break  # the oldest is not used yet: the policy chooses instead
            expert = recycle.popleft()
            if usable:
                room.append(self._evict(layer, expert))
            # else dropped: gone, or still loading. A device-ordered reader (`iter_issued`) takes each miss as its
            # copy is issued, so on CUDA the miss handed out last is usually still loading here and the policy
            # chooses instead; the slots are recycled oldest first on the host-waiting path (`iter_ready`).
        if len(room) < count and self._short(layer):  # take back a lent slot first
            self._balance()
            room += [slot for slot in self._layer_slots(layer) if slot.state is SlotState.FREE and slot not in room][: count - len(room)]
        if len(room) < count:
            room += [self._evict(layer, expert) for expert in self._victims(layer, count - len(room))]
        return room

    def _victims(self, layer: int, count: int, among: Sequence[int] | None = None) -> list[int]:
        """`count` victims chosen by the policy among the unprotected, unpinned residents; or, given `among`
        (residents a reader holds and will mark used before their slots are reused), among those alone: the
        policy sees every other resident as protected."""
        residents = [e for e, slot in self._residents[layer].items() if slot.state is SlotState.RESIDENT]
        if among is None:
            protected = self._protected[layer] | {e for e, slot in self._residents[layer].items() if slot.pins}
        else:
            protected = set(residents).difference(among)
        count = min(count, sum(1 for expert in residents if expert not in protected))  # a policy must return exactly count
        if count == 0:
            return []
        victims = list(self.choose_victims(layer, residents, frozenset(protected), count))
        bad = [e for e in victims if e not in residents or e in protected]
        if bad or len(set(victims)) != len(victims) or len(victims) > count:
            raise PluginError(
                f"eviction policy chose {victims} in layer {layer} for {count} slot(s); it must choose distinct "
                f"unprotected residents (residents {residents}, protected {sorted(protected)})"
            )
        return victims

    def _evict(self, layer: int, expert: int) -> Slot:
        slot = self._residents[layer].pop(expert)
        self.stats.layers[layer].evictions += 1
        self._write_table(layer, expert, -1)
        if debug_enabled():
            log.debug("expert.evict", layer=layer, expert=expert, slot=slot.index)
        self._release(slot)
        return slot

    def _layer_slots(self, layer: int) -> list[Slot]:
        return self._by_layer[layer]

    def _home_slots(self) -> list[list[Slot]]:
        """Every slot in the layer it was allocated to (its `layer_slots` consecutive rows)."""
        by_layer: list[list[Slot]] = [[] for _ in range(self.num_layers)]
        for slot, home in zip(self._slots, self._home):
            slot.layer = home
            by_layer[home].append(slot)
        return by_layer

    def _short(self, layer: int) -> bool:
        """The layer holds fewer slots than its own (it lent one)."""
        return len(self._by_layer[layer]) < self.layer_slots[layer]

    def _over(self, layer: int) -> bool:
        """The layer holds more slots than its own (it borrowed one)."""
        return len(self._by_layer[layer]) > self.layer_slots[layer]

    def _balance(self) -> None:
        """Give the slots lent in this round back to their layers. Without the relay (`experts/lead.py`, which
        overrides this) no slot is ever lent, so there is nothing to give back."""

    # -- internals: loads --------------------------------------------------------------------------

    def _start_load(self, layer: int, expert: int, slot: Slot, urgent: bool) -> None:
        assert slot.state is SlotState.FREE and slot.pins == 0, f"load into busy slot {slot}"
        slot.generation += 1
        slot.expert, slot.state, slot.ready = expert, SlotState.LOADING, None
        self._residents[layer][expert] = slot
        slot.transfer = self.transfer.submit(
            self.weights[slot.index],
            self.pool.host(layer, expert),
            urgent=urgent,
            wait_for=[slot.last_use],
            after_copy=partial(self._write_table, layer, expert, slot.index),
            tag=(layer, expert, slot.index),
        )
        # Bytes count once the copy is fully on the stream (or cut short): a device-ordered reader may finish the
        # round before the host has seen the copy land.
        transfer = slot.transfer
        transfer.when_issued(lambda: self._count_bytes(layer, transfer))
        slot.loading = asyncio.get_running_loop().create_task(self._complete_load(slot, slot.generation, slot.transfer))
        self._loads.add(slot.loading)
        slot.loading.add_done_callback(self._loads.discard)
        slot.loading.add_done_callback(partial(self._load_cancelled, slot, slot.generation, transfer))
        if debug_enabled():
            log.debug("expert.load", layer=layer, expert=expert, slot=slot.index, urgent=urgent)

    async def _complete_load(self, slot: Slot, generation: int, transfer: Transfer) -> None:
        """Owned by the cache, not by any reader: the copy's outcome is recorded even if readers left."""
        try:
            ready = await transfer.landed()
        except Exception as error:
            self._load_error = error  # a reader that held this slot reports it (see _lost)
            self._settle_load(slot, generation, None)
            raise
        self._settle_load(slot, generation, None if transfer.cancelled else ready)

    def _load_cancelled(self, slot: Slot, generation: int, transfer: Transfer, task: asyncio.Task[None]) -> None:
        """Only the loop's end cancels a completion (asyncio.run cancels what is left when its main returns or
        raises), perhaps before it ever ran: drop what is not issued and free the slot, so that an engine used on a
        later loop finds no load that nothing will complete. Chunks on the stream still land; a later load into
        the slot is issued behind them on the same stream."""
        if task.cancelled():
            if slot.generation == generation and transfer.fully_issued and not transfer.cancelled:
                self._write_table(slot.layer, slot.expert, -1)  # its after_copy mapped the expert to the slot it frees
            transfer.cancel()
            self._settle_load(slot, generation, None)

    def _count_bytes(self, layer: int, transfer: Transfer) -> None:
        self.stats.layers[layer].bytes_loaded += transfer.bytes_issued

    def _settle_load(self, slot: Slot, generation: int, ready: Event | None) -> None:
        """Landed: resident. Dropped or failed: free. Unless the slot was reassigned since (generation)."""
        if slot.generation != generation:
            return
        if ready is None:
            self._residents[slot.layer].pop(slot.expert, None)
            self._release(slot)
        else:
            slot.loading, slot.transfer = None, None
            slot.state, slot.ready = SlotState.RESIDENT, ready
        self._signal(slot.layer)

    async def _until_landed(self, slot: Slot, expert: int, layer: int) -> None:
        if slot.loading is not None:
            await asyncio.shield(slot.loading)
        if slot.expert != expert or slot.layer != layer or slot.state is not SlotState.RESIDENT:
            self._lost(slot, expert)  # the layer too: a slot the relay lent may hold another layer's expert of that id

    def _lost(self, slot: Slot, expert: int) -> None:
        """A reader's slot no longer holds its expert: the copy failed (raise that error) or the cache was reset."""
        if self._load_error is not None:
            raise self._load_error
        raise AssertionError(f"slot {slot.index} lost expert {expert} while a reader held it (reset during a round?)")

    # -- internals: bookkeeping --------------------------------------------------------------------

    def _write_table(self, layer: int, expert: int, value: int) -> None:
        """Enqueue slot_table[layer, expert] = value on the copy stream (a 4-byte copy; no host sync)."""
        index = layer * self.num_experts + expert
        self.backend.set_int32(self._flat_table, index, value, self.transfer.stream)

    def _pin(self, slot: Slot) -> None:
        slot.pins += 1

    def _give_back(self, owned: OwnedSlots) -> None:
        """Unpin what a reader owns, each only if its slot still holds the assignment that was pinned."""
        for expert, slot in owned.items():
            self._unpin(slot, owned.generations[expert])

    def _unpin(self, slot: Slot, generation: int | None = None) -> None:
        """Drop one pin; with `generation`, only if the slot still holds the assignment that was pinned (a failed
        load frees its slot and drops its pins, and another reader may hold the slot anew since)."""
        if generation is not None and slot.generation != generation:
            return
        if slot.pins > 0:
            slot.pins -= 1
            self._signal(slot.layer)

    def _release(self, slot: Slot) -> None:
        """Back to FREE; the generation bump orphans any completion still pending for the old load."""
        slot.generation += 1
        slot.expert, slot.state, slot.pins = None, SlotState.FREE, 0
        slot.loading, slot.transfer, slot.ready = None, None, None

    async def _capacity_changed(self, layer: int) -> None:
        waiter = asyncio.get_running_loop().create_future()
        self._capacity_waiters[layer].append(waiter)
        await waiter

    def _signal(self, layer: int) -> None:
        if self._over(layer):  # a layer short of the slot it lent may take it back
            for short in range(self.num_layers):
                if short != layer and self._short(short):
                    self._signal(short)
        waiters, self._capacity_waiters[layer] = self._capacity_waiters[layer], []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
