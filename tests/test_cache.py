"""The host pool and the device expert cache on the cpu backend: properties under random requests, and units."""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import Sequence, Set

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from backends.cpu import CPUBackend
from specter.config import CacheTuning
from specter.errors import BudgetError, CheckpointError, PluginError
from specter.experts import ExpertCache, ExpertPool, TransferEngine
from specter.experts.pool import experts_per_slab
from specter.experts.transfer import LinkEmulation
from specter.kernel import Kernel, run
from specter.verify import VerifyRecord, compute_hot_first
from specter.experts.cache import CacheSnapshot
from specter.experts.slots import lru_victims  # the default chooser: the least recently used unprotected residents

LAYERS, EXPERTS, SLOTS, NUMEL = 2, 6, 3, 2048  # 8 KiB float32 experts


def expert_value(layer: int, expert: int) -> float:
    return float(layer * 100 + expert + 1)


class Rig:
    """backend + kernel + pool + transfer engine + cache, with reader helpers that check what they read."""

    def __init__(self, slots: int | tuple[int, ...] = SLOTS, link_gbps: float = 0.05, chooser=lru_victims, tuning: CacheTuning | None = None) -> None:
        self.backend = CPUBackend(link_gbps=link_gbps)  # 8 KiB take ~0.16 ms: copies overlap readers
        self.kernel = Kernel(self.backend)
        self.pool = ExpertPool(self.backend, LAYERS, EXPERTS, NUMEL, torch.float32)
        self.pool.load((l, e, torch.full((NUMEL,), expert_value(l, e))) for l in range(LAYERS) for e in range(EXPERTS))
        self.transfer = TransferEngine(self.backend, self.kernel, chunk_bytes=NUMEL * 2)  # 2 chunks per expert
        self.cache = ExpertCache(self.backend, self.kernel, self.transfer, self.pool, slots, chooser, tuning)
        self.bad_reads: list[tuple[int, int, int]] = []

    async def load_residents(self, layer: int, experts: list[int]) -> None:
        """Make `experts` resident in `layer` and read each once (so each has a last use, and no pin is left)."""
        for expert, slot in (await self.cache.ensure(layer, experts)).items():
            self.read(layer, expert, slot)

    def read(self, layer: int, expert: int, slot: int, seconds: float = 0.0003, ready=None) -> None:
        """Launch a 'compute' that reads the slot a little later, then mark it used after it. With `ready`
        (iter_issued), the compute stream first waits for the copy, as a device reader does."""
        weights = self.cache.slot_weights(slot)
        if ready is not None:
            self.backend.stream_wait(self.backend.compute_stream, ready)

        def compute() -> None:
            time.sleep(seconds)  # a slow reader: an early overwrite of the slot would be seen below
            if not bool((weights == expert_value(layer, expert)).all()):
                self.bad_reads.append((layer, expert, slot))

        self.backend.launch(self.backend.compute_stream, compute)
        self.cache.mark_used(layer, expert, self.backend.record_event(self.backend.compute_stream))

    def launcher(self, layer: int, seconds: float = 0.0003):
        """`ExpertCache.lead`'s launch for `layer`: a checking read of the slot, returning the event after it."""
        def launch(expert: int, slot: int):
            weights = self.cache.slot_weights(slot)

            def compute() -> None:
                time.sleep(seconds)
                if not bool((weights == expert_value(layer, expert)).all()):
                    self.bad_reads.append((layer, expert, slot))

            self.backend.launch(self.backend.compute_stream, compute)
            return self.backend.record_event(self.backend.compute_stream)

        return launch

    async def close(self) -> None:
        await self.cache.aclose()
        await self.transfer.aclose()
        self.backend.synchronize()

    def shutdown(self) -> None:
        self.kernel.close()
        self.backend.close()

    def check_consistent(self) -> None:
        """After close(): every mapped expert is resident with the right bytes; the slot table agrees."""
        self.backend.synchronize()  # table writes enqueued since close() (evictions of `unprotect_all`'s balance)
        table = self.cache.slot_table
        counts, own = self.cache.slot_counts(), self.cache.layer_slots
        assert sum(counts) == sum(own), counts
        for layer in range(LAYERS):
            mapped = self.cache.lru_order(layer)
            assert len(mapped) <= counts[layer] and abs(counts[layer] - own[layer]) <= 1, counts
            for expert in range(EXPERTS):
                slot = self.cache.lookup(layer, expert)
                assert (slot is not None) == (expert in mapped), (layer, expert)
                assert int(table[layer, expert]) == (-1 if slot is None else slot), (layer, expert, slot)
                if slot is not None:
                    assert bool((self.cache.slot_weights(slot) == expert_value(layer, expert)).all())


# -- property test -------------------------------------------------------------------------------------

experts_strategy = st.lists(st.integers(0, EXPERTS - 1), min_size=1, max_size=SLOTS, unique=True)
op_strategy = st.one_of(
    st.tuples(st.just("ensure"), st.integers(0, LAYERS - 1), experts_strategy),
    st.tuples(st.just("iter_ready"), st.integers(0, LAYERS - 1), st.lists(st.integers(0, EXPERTS - 1), min_size=1, max_size=EXPERTS, unique=True)),
    st.tuples(st.just("iter_issued"), st.integers(0, LAYERS - 1), st.lists(st.integers(0, EXPERTS - 1), min_size=1, max_size=EXPERTS, unique=True)),
    st.tuples(st.just("prefetch"), st.integers(0, LAYERS - 1), st.lists(st.integers(0, EXPERTS - 1), max_size=EXPERTS)),
    st.tuples(st.just("protect"), st.integers(0, LAYERS - 1), st.lists(st.integers(0, EXPERTS - 1), max_size=SLOTS - 1)),
    st.tuples(st.just("lead"), st.integers(0, LAYERS - 1), st.lists(st.integers(0, EXPERTS - 1), max_size=EXPERTS, unique=True),
              st.integers(1, SLOTS)),
    st.tuples(st.just("cancel_ensure"), st.integers(0, LAYERS - 1), experts_strategy, st.sampled_from([0.0, 0.0001, 0.0004, 0.001])),
    st.tuples(st.just("unprotect_all")),
    st.tuples(st.just("reset")),
)


async def apply(rig: Rig, op: tuple) -> set[tuple[int, int]] | None:
    """Run one op; return the (layer, expert) pairs whose protection it lifted (None: all of them)."""
    cache, kind = rig.cache, op[0]
    if kind == "ensure":
        _, layer, experts = op
        if len(set(experts) | cache.protected_experts(layer)) > SLOTS:
            cache.unprotect_all()  # keep the request satisfiable; the budget error has its own test
            return None
        for expert, slot in (await cache.ensure(layer, experts)).items():
            rig.read(layer, expert, slot)
        return {(layer, expert) for expert in experts}
    if kind == "iter_ready":
        _, layer, experts = op
        async for expert, slot in cache.iter_ready(layer, experts):
            rig.read(layer, expert, slot)
        return {(layer, expert) for expert in range(EXPERTS)}
    if kind == "iter_issued":
        _, layer, experts = op
        async for expert, slot, ready in cache.iter_issued(layer, experts):
            rig.read(layer, expert, slot, ready=ready)
        return {(layer, expert) for expert in range(EXPERTS)}
    if kind == "prefetch":
        issued = cache.prefetch(op[1], op[2])
        assert issued == [e for e in dict.fromkeys(op[2]) if e in issued] and len(issued) <= cache.layer_slots[op[1]]
        return set()
    if kind == "protect":
        cache.protect(op[1], op[2])
        return set()
    if kind == "lead":
        _, layer, predicted, count = op
        mapped = set(cache.lru_order(layer))
        computed, started = cache.lead(layer, predicted, count, rig.launcher(layer))
        assert set(started) <= set(predicted) - mapped and len(started) <= count
        assert set(computed) <= set(predicted) & mapped
        assert sum(1 for e in computed if e not in cache.lru_order(layer)) <= len(started), "evicted for no load"
        return {(layer, e) for e in computed}  # computed: their use for the round, which lifts protection
    if kind == "cancel_ensure":
        return await cancel_ensure(rig, *op[1:])
    cache.unprotect_all() if kind == "unprotect_all" else cache.reset()
    return None


async def cancel_ensure(rig: Rig, layer: int, experts: list[int], delay: float) -> set[tuple[int, int]] | None:
    if len(set(experts) | rig.cache.protected_experts(layer)) > SLOTS:
        rig.cache.unprotect_all()
        return None
    task = asyncio.get_running_loop().create_task(rig.cache.ensure(layer, experts))
    await asyncio.sleep(delay)
    task.cancel()
    outcome = (await asyncio.gather(task, return_exceptions=True))[0]
    if isinstance(outcome, dict):  # finished before the cancel arrived: a normal reader
        for expert, slot in outcome.items():
            rig.read(layer, expert, slot)
    else:
        assert isinstance(outcome, asyncio.CancelledError)
    assert rig.cache.pinned_experts(layer) == [], "a cancelled reader left a pinned slot"
    return {(layer, expert) for expert in experts}


def guarded(cache: ExpertCache) -> set[tuple[int, int]]:
    """Protected experts that are mapped: none of them may disappear until protection is lifted."""
    return {(l, e) for l in range(LAYERS) for e in cache.protected_experts(l) if e in cache.lru_order(l)}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op_strategy, min_size=1, max_size=14),
       slots=st.sampled_from([SLOTS, (SLOTS, SLOTS + 1), (SLOTS + 1, SLOTS)]))
@example(ops=[("ensure", 0, [0, 1, 2]), ("protect", 0, [0, 1]), ("prefetch", 0, [3, 4]), ("ensure", 0, [5])], slots=SLOTS)
@example(ops=[("prefetch", 1, [0, 1, 2]), ("cancel_ensure", 1, [3, 4], 0.0001), ("iter_ready", 1, [4, 5, 0, 1])], slots=SLOTS)
@example(ops=[("prefetch", 0, [0, 1]), ("iter_issued", 0, [1, 2, 3, 4, 5, 0]), ("iter_issued", 0, [0, 5, 4])], slots=SLOTS)
@example(ops=[("ensure", 0, [0, 1, 2]), ("protect", 0, [0, 1]), ("lead", 0, [0, 3, 1, 4], 2), ("iter_issued", 0, [1, 3, 4, 5])], slots=SLOTS)
@example(ops=[("ensure", 0, [0, 1, 2]), ("ensure", 1, [0, 1, 2]), ("protect", 1, [0, 1]), ("lead", 1, [0, 1, 2, 3, 4], 2),
              ("iter_issued", 1, [0, 3, 4]), ("ensure", 0, [0, 1, 5])], slots=SLOTS)
@example(ops=[("ensure", 1, [0, 1, 2]), ("prefetch", 1, [3, 4, 5]), ("protect", 0, [0, 1]), ("lead", 0, [0, 1, 2, 3], 2),
              ("unprotect_all",)], slots=(SLOTS, SLOTS + 1))
def test_cache_invariants_hold_under_random_requests(ops, slots):
    """Also with a layer of one slot more (`MemoryPlan.layer_slots`): each layer keeps its own count but for loans."""
    rig = Rig(slots)
    own = list(rig.cache.layer_slots)
    evicted_while_protected: list[tuple[int, int]] = []

    async def scenario() -> None:
        for op in ops:
            before = guarded(rig.cache)
            lifted = await apply(rig, op)
            if lifted is not None:
                after = {(l, e) for l in range(LAYERS) for e in rig.cache.lru_order(l)}
                evicted_while_protected.extend(sorted((before - lifted) - after))
            counts = rig.cache.slot_counts()
            assert sum(counts) == sum(own) and all(abs(c - o) <= 1 for c, o in zip(counts, own)), counts
            for layer in range(LAYERS):
                owned = rig.cache._layer_slots(layer)
                assert all(slot.layer == layer for slot in owned)
                assert all(slot in owned for slot in rig.cache._residents[layer].values()), "a resident outside its layer's slots"
            for layer in range(LAYERS):
                assert len(rig.cache.lru_order(layer)) <= counts[layer]
        rig.cache.unprotect_all(rig.backend.record_event(rig.backend.compute_stream))
        await rig.close()
        rig.cache.unprotect_all()  # every load has landed: the slots a lead borrowed go back
        assert rig.cache.slot_counts() == own

    try:
        run(scenario())
        assert evicted_while_protected == []
        assert rig.bad_reads == [], "a slot was overwritten while its reader ran, or read before it landed"
        rig.check_consistent()
        total = rig.cache.stats.total()
        assert total.bytes_loaded == rig.transfer.stats.bytes_copied == rig.backend.h2d_bytes
        if not any(op[0] == "reset" for op in ops):  # without reset no load is cut short
            loads = total.misses + total.prefetched
            assert total.bytes_loaded == loads * rig.pool.expert_bytes
    finally:
        rig.shutdown()


# -- units ---------------------------------------------------------------------------------------------


@pytest.fixture
def rig():
    rig = Rig()
    yield rig
    rig.shutdown()


def roll_through(rig: Rig, residents: list[int], wanted: list[int]) -> list[int]:
    """Make `residents` resident in layer 0, read `wanted` through iter_ready, close; the order they came in."""
    async def main() -> list[int]:
        await rig.load_residents(0, residents)
        order = []
        async for expert, slot in rig.cache.iter_ready(0, wanted):
            order.append(expert)
            rig.read(0, expert, slot)
        await rig.close()
        return order

    return run(main())


def test_the_lead_leaves_a_readers_pinned_slot_alone_and_takes_unpredicted_slots_first(rig):
    """`ExpertCache.lead`: a slot a reader holds (pinned) is neither computed nor given to a miss; an unplanned
    resident the prediction does not name gives its slot before a predicted one, which gives it only once computed;
    with no slot left for it, a predicted miss (4) does not start; the reads check their bytes."""
    cache = rig.cache
    launched: list[int] = []

    def launch(expert: int, slot: int):
        launched.append(expert)
        return rig.launcher(0)(expert, slot)

    async def main() -> None:
        await rig.load_residents(0, [0, 1, 5])
        held = await cache.ensure(0, [1])  # a reader holds expert 1 (pinned until it marks it used)
        computed, started = cache.lead(0, [1, 2, 0, 3, 4], 3, launch)
        assert started == [2, 3] and computed == [0] and launched == [0]  # 1 is pinned: neither computed nor evicted
        assert cache.lookup(0, 1) == held[1]
        assert cache.lru_order(0)[-2:] == [2, 3] and 0 not in cache.lru_order(0) and 5 not in cache.lru_order(0)
        rig.read(0, 1, held[1])
        async for expert, slot, ready in cache.iter_issued(0, [2, 3]):
            rig.read(0, expert, slot, ready=ready)
        await rig.close()

    run(main())
    assert rig.bad_reads == []
    rig.check_consistent()


def test_the_lead_evicts_a_predicted_resident_only_after_computing_it_and_reports_the_loads_it_started(rig):
    cache = rig.cache
    launched: list[int] = []

    def launch(expert: int, slot: int):
        launched.append(expert)
        return rig.launcher(0, seconds=0.002)(expert, slot)  # a slow compute: an early copy would be seen

    async def main() -> None:
        await rig.load_residents(0, [0, 1, 2])
        cache.protect(0, [0, 1, 2])  # planned
        computed, started = cache.lead(0, [0, 1, 2, 4, 5], 1, launch)
        assert started == [4] and sorted(computed) == [0, 1, 2] and sorted(launched) == [0, 1, 2]
        assert len([e for e in computed if e in cache.lru_order(0)]) == 2  # one computed resident gave its slot
        assert cache.stats.layers[0].prefetched == 1
        async for expert, slot, ready in cache.iter_issued(0, [4]):
            rig.read(0, expert, slot, ready=ready)
        await rig.close()

    run(main())
    assert rig.bad_reads == [], "a copy overwrote a slot before the lead's compute read it"
    rig.check_consistent()


@pytest.mark.parametrize("relay", [True, False])
def test_the_lead_borrows_a_slot_of_the_layer_before_and_the_round_end_gives_it_back(rig, relay):
    """`CacheTuning.lead_relay`: with every slot of layer 1 predicted, its first predicted miss takes a slot layer 0 lends (the
    policy's victim there, after layer 0's slow compute of it: the copy must wait for that read), the second one a
    computed resident's; layer 1 then holds one slot more and layer 0 one fewer, until `unprotect_all` balances
    them. Off, both misses take computed residents' slots."""
    cache = rig.cache
    cache.tuning = CacheTuning(lead_relay=relay)

    async def main() -> None:
        await rig.load_residents(1, [0, 1, 2])
        for expert, slot in (await cache.ensure(0, [3, 4, 5])).items():
            rig.read(0, expert, slot, seconds=0.003)  # layer 0's compute, still running when the lead starts
        layer0_slots = {cache.lookup(0, e) for e in (3, 4, 5)}
        cache.protect(1, [0, 1, 2])
        computed, started = cache.lead(1, [0, 1, 2, 4, 5], 2, rig.launcher(1))
        assert started == [4, 5] and sorted(computed) == [0, 1, 2]
        if relay:
            assert cache.slot_counts() == [SLOTS - 1, SLOTS + 1]
            assert cache.lru_order(0) == [4, 5]  # the policy (LRU) chose expert 3 of layer 0
            assert cache._residents[1][4].index in layer0_slots  # the first miss took the lent slot
            assert len([e for e in computed if e in cache.lru_order(1)]) == 2  # the second took a computed one's
            assert cache.stats.layers[0].evictions == 1
        else:
            assert cache.slot_counts() == [SLOTS, SLOTS] and cache.lru_order(0) == [3, 4, 5]
            assert len([e for e in computed if e in cache.lru_order(1)]) == 1
        async for expert, slot, ready in cache.iter_issued(1, [4, 5]):
            rig.read(1, expert, slot, ready=ready)
        await rig.close()
        cache.unprotect_all()
        assert cache.slot_counts() == [SLOTS, SLOTS]
        assert len(cache.lru_order(1)) == SLOTS and len(cache.lru_order(0)) == (SLOTS - 1 if relay else SLOTS)

    run(main())
    assert rig.bad_reads == [], "a copy overwrote a lent slot before the layer before had read it"
    rig.check_consistent()


async def borrow_one(rig: Rig) -> None:
    """Both layers full (layer 1 planned), then layer 1's lead borrows layer 0's LRU slot for predicted miss 3."""
    await rig.load_residents(0, [0, 1, 2])
    await rig.load_residents(1, [0, 1, 2])
    rig.cache.protect(1, [0, 1, 2])
    _computed, started = rig.cache.lead(1, [0, 1, 2, 3], 1, rig.launcher(1))
    assert started == [3] and rig.cache.slot_counts() == [SLOTS - 1, SLOTS + 1]


def test_a_layer_short_of_a_lent_slot_gets_it_back_only_when_its_borrower_can_give_one(rig):
    """`_balance` at the round's end: a borrower whose slots are all loading keeps them until a later call."""
    cache = rig.cache

    async def main() -> None:
        await borrow_one(rig)
        held = await cache.ensure(1, [0, 1, 2, 3][:SLOTS])  # a reader pins three of layer 1's four slots
        cache.protect(1, [3])
        cache._balance()  # nothing layer 1 may give: all pinned or protected
        assert cache.slot_counts() == [SLOTS - 1, SLOTS + 1]
        for expert, slot in held.items():
            rig.read(1, expert, slot)
        await rig.close()
        cache.unprotect_all()
        assert cache.slot_counts() == [SLOTS, SLOTS]
        snapshot = cache.snapshot()
        cache.reset()
        assert cache.slot_counts() == [SLOTS, SLOTS]
        await cache.restore(snapshot)
        assert cache.snapshot() == snapshot
        await rig.close()

    run(main())
    assert rig.bad_reads == []
    rig.check_consistent()


def test_a_layer_short_of_its_lent_slot_waits_for_the_borrowers_load_and_takes_the_slot_back(rig):
    """A reader of the layer that lent a slot, asking for all `slots_per_layer` experts while every slot of the
    borrower is loading or protected, waits (no budget error) and is woken when the borrower's load lands; it then
    takes the slot back. A snapshot holding the borrower's extra expert restores its most recent ones."""
    cache = rig.cache

    async def main() -> None:
        await borrow_one(rig)
        extra = cache.snapshot()
        assert len(extra.layers[1]) == SLOTS + 1
        cache.protect(1, [0, 1, 2])  # computed by the lead (which lifted their protection), planned again
        assert cache.lru_order(0) == [1, 2] and cache._residents[1][3].state.value == "loading"
        # 1 and 2 pinned by this reader, so 5 needs the lent slot back: only the borrower's load can free it
        held = await asyncio.wait_for(cache.ensure(0, [1, 2, 5]), timeout=5)
        assert cache.slot_counts() == [SLOTS, SLOTS] and sorted(held) == [1, 2, 5]
        assert sorted(cache.lru_order(1)) == [0, 1, 2]  # the borrower gave its only unprotected one, the landed miss
        for expert, slot in held.items():
            rig.read(0, expert, slot)
        cache.unprotect_all()
        await cache.restore(extra)
        assert cache.lru_order(1) == list(extra.layers[1][-SLOTS:]) and cache.slot_counts() == [SLOTS, SLOTS]
        await rig.close()

    run(main())
    assert rig.bad_reads == []
    rig.check_consistent()


def test_a_policy_error_while_balancing_at_the_rounds_end_does_not_stop_the_cleanup():
    """`unprotect_all` lifts every pin and protection even when the policy fails while giving a lent slot back;
    the slot goes back once the policy answers again."""
    failing = {"on": False}

    def chooser(layer, residents, protected, count):
        if failing["on"]:  # as the engine's guard reports a failing plug-in
            raise PluginError("eviction policy 'flaky' raised RuntimeError: policy down")
        return lru_victims(layer, residents, protected, count)

    rig = Rig(chooser=chooser)
    cache = rig.cache
    try:
        async def main() -> None:
            await borrow_one(rig)
            await rig.close()
            failing["on"] = True
            with pytest.raises(PluginError):
                cache._balance()
            cache.unprotect_all()  # no raise
            assert cache.protected_experts(1) == set() and cache.slot_counts() == [SLOTS - 1, SLOTS + 1]
            failing["on"] = False
            cache.unprotect_all()
            assert cache.slot_counts() == [SLOTS, SLOTS]

        run(main())
        rig.check_consistent()
    finally:
        rig.shutdown()


@pytest.mark.parametrize("slots", [1, 2])
def test_the_relay_leaves_a_donor_at_least_one_slot(slots):
    """With one slot per layer no layer lends (it would be left with none); with two, a donor keeps one."""
    rig = Rig(slots=slots)
    cache = rig.cache
    try:
        async def main() -> None:
            await rig.load_residents(0, [0, 1][:slots])
            await rig.load_residents(1, [0, 1][:slots])
            _computed, started = cache.lead(1, [0, 1][:slots] + [4], 1, rig.launcher(1))
            assert started == [4]
            assert cache.slot_counts() == ([1, 1] if slots == 1 else [1, 3])
            async for expert, slot, ready in cache.iter_issued(1, [4]):
                rig.read(1, expert, slot, ready=ready)
            await rig.close()
            cache.unprotect_all()
            assert cache.slot_counts() == [slots, slots]

        run(main())
        assert rig.bad_reads == []
    finally:
        rig.shutdown()


def test_iter_ready_yields_residents_first_and_rolls_through_more_experts_than_slots(rig):
    order = roll_through(rig, [4, 5], [0, 1, 5, 2, 3, 4])
    assert set(order[:2]) == {4, 5} and sorted(order) == list(range(6))  # residents first (in the order they give way)
    assert rig.bad_reads == []
    assert rig.cache.stats.layers[0].hits == 2 and rig.cache.stats.layers[0].misses == 2 + 4


@pytest.mark.parametrize("window, hot", [(None, 0), (2, 1), (1, 2), (0, 2)])
def test_the_roll_window_keeps_the_hot_experts_the_policy_keeps(window, hot):
    """A layer that wants twice its slots: with no window every hot expert gives its slot to a miss; with a window
    the misses roll through that many slots (at least one) and the hot experts the policy prefers stay for the next
    round. Which misses stay is the last ones to come (their loads may finish in either order on a loaded host)."""
    def keep_four_and_five(layer, residents, protected, count):  # plan-protect-like: 4 and 5 are the planned ones
        free = [e for e in residents if e not in protected]
        return sorted(free, key=lambda e: e in (4, 5))[:count]

    rig = Rig(chooser=keep_four_and_five, tuning=CacheTuning(roll_hot_window=window))
    try:
        order = roll_through(rig, [3, 4, 5], [3, 4, 5, 0, 1, 2])
        assert sorted(order) == list(range(6)) and set(order[:3]) == {3, 4, 5}
        kept = set(rig.cache.lru_order(0))
        assert len(kept & {4, 5}) == hot and 3 not in kept  # the policy's planned experts, the unplanned one gone
        assert kept - {4, 5} == set(order[3:][-(3 - hot):] if hot < 3 else []), (order, kept)
        assert rig.bad_reads == []
        assert rig.cache.stats.layers[0].hits == 3 and rig.cache.stats.layers[0].misses == 3 + 3
    finally:
        rig.shutdown()


def test_room_comes_from_the_oldest_recycled_expert_before_the_policy():
    """The rolling window's later misses take the slot of the layer's miss handed out first (`recycle`), not the one
    the policy would choose, with no policy call; while the oldest is still held by the reader, the policy chooses."""
    def highest_id(layer, residents, protected, count):
        return sorted((e for e in residents if e not in protected), reverse=True)[:count]

    rig = Rig(chooser=highest_id)
    try:
        async def main() -> None:
            await rig.load_residents(0, [0, 1, 2])
            recycle = collections.deque([1, 2])
            assert len(rig.cache._make_room(0, 1, recycle)) == 1  # the policy alone would evict 2
            assert rig.cache.lru_order(0) == [0, 2] and list(recycle) == [2]
            rig.cache._residents[0][0].pins += 1  # the reader still holds expert 0
            recycle = collections.deque([0, 2])
            assert len(rig.cache._make_room(0, 2, recycle)) == 2  # the slot freed above, then the policy's choice
            assert rig.cache.lru_order(0) == [0] and list(recycle) == [0, 2]
            rig.cache._residents[0][0].pins -= 1
            await rig.close()

        run(main())
    finally:
        rig.shutdown()


def test_iter_ready_starts_the_misses_before_it_hands_out_the_residents(rig):
    async def main() -> list[int]:
        await rig.load_residents(0, [4, 5])
        await rig.close()
        transfers_before, chunks_before = rig.transfer.stats.transfers, rig.transfer.stats.chunks
        started_at_first_yield = None
        async for expert, slot in rig.cache.iter_ready(0, [0, 5, 4]):  # one free slot: 0 loads into it
            if started_at_first_yield is None:
                assert expert in (4, 5)
                started_at_first_yield = rig.transfer.stats.transfers - transfers_before
                assert rig.transfer.stats.chunks - chunks_before == 2, "the miss's two chunks must already be on the stream"
            rig.read(0, expert, slot)
        await rig.close()
        return started_at_first_yield

    assert run(main()) == 1, "the miss's copy must be on its way before the first resident is handed out"
    assert rig.bad_reads == []


@pytest.mark.parametrize("reader", ["iter_ready", "iter_issued"])
def test_a_waiting_miss_starts_in_a_residents_slot_as_soon_as_that_resident_is_launched(reader):
    """Every slot holds a wanted resident: the first miss cannot start before the reader has launched (and marked
    used) a resident; it must start right then, not after the reader has launched all of them."""
    rig = Rig()

    async def main() -> list[int]:
        await rig.load_residents(0, [0, 1, 2])
        await rig.close()
        before = rig.transfer.stats.transfers
        started = []  # loads started when each expert is handed out
        async for item in getattr(rig.cache, reader)(0, [0, 1, 2, 3]):
            expert, slot, ready = item if reader == "iter_issued" else (*item, None)
            started.append(rig.transfer.stats.transfers - before)
            rig.read(0, expert, slot, ready=ready)
        await rig.close()
        return started

    try:
        started = run(main())
        assert started[:3] == [0, 1, 1], f"the miss must start once the first resident is launched: {started}"
        assert rig.bad_reads == [], "the miss overwrote a resident before its compute read it"
    finally:
        rig.shutdown()


def test_the_residents_that_give_way_to_misses_are_chosen_in_one_policy_call_and_handed_out_first():
    """Three residents wanted, two misses, no free slot: one policy call picks two residents among those wanted; they
    come first, and each miss starts in the slot of one of them once it is launched (not one call per resident)."""
    calls = []

    def counting(layer, residents, protected, count):
        calls.append((sorted(e for e in residents if e not in protected), count))
        return [expert for expert in residents if expert not in protected][::-1][:count]  # most recent first

    rig = Rig(chooser=counting)

    async def main() -> list[tuple[int, int]]:
        await rig.load_residents(0, [0, 1, 2])
        await rig.close()
        calls.clear()
        before, seen = rig.transfer.stats.transfers, []
        async for expert, slot in rig.cache.iter_ready(0, [0, 1, 2, 3, 4]):
            seen.append((expert, rig.transfer.stats.transfers - before))
            rig.read(0, expert, slot)
        await rig.close()
        return seen

    try:
        seen = run(main())
        assert calls == [([0, 1, 2], 2)], calls
        assert [expert for expert, _ in seen[:3]] == [2, 1, 0], "the chosen residents must come first, in the policy's order"
        assert [started for _, started in seen[:3]] == [0, 1, 2], seen
        assert sorted(expert for expert, _ in seen) == [0, 1, 2, 3, 4] and rig.bad_reads == []
    finally:
        rig.shutdown()


def test_a_reader_that_marks_used_late_delays_the_misses_but_loses_nothing():
    """A reader that asks for the next expert before marking the last one used: the chosen resident's slot is not
    taken while the reader may still read it; the miss starts once it is marked, and every read is right."""
    rig = Rig()

    async def main() -> list[int]:
        await rig.load_residents(0, [0, 1, 2])
        await rig.close()
        before = rig.transfer.stats.transfers
        held, order, started = [], [], []
        async for expert, slot in rig.cache.iter_ready(0, [0, 1, 2, 3]):
            order.append(expert)
            started.append(rig.transfer.stats.transfers - before)
            held.append((expert, slot))
            if len(held) == 2 or expert == 3:  # marks the first two used only after taking the second
                for item in held:
                    rig.read(0, *item)
                held.clear()
        for item in held:
            rig.read(0, *item)
        await rig.close()
        return order, started

    try:
        order, started = run(main())
        assert sorted(order) == [0, 1, 2, 3] and rig.bad_reads == []
        assert started[:2] == [0, 0], f"no miss may start while the chosen resident is unmarked: {started}"
        assert rig.cache.pinned_experts(0) == []
    finally:
        rig.shutdown()


@pytest.mark.parametrize("reader", ["iter_ready", "iter_issued"])
def test_closing_a_reader_mid_roll_gives_its_pins_back_at_once(reader):
    """A reader that stops after one expert (closing the iterator) leaves no pin behind, before the loop runs again:
    a new reader may pin the same slots at once."""
    rig = Rig()

    async def main():
        await rig.load_residents(0, [0, 1, 2])
        await rig.close()
        items = getattr(rig.cache, reader)(0, [0, 1, 2, 3])
        first = await anext(items)
        rig.read(0, first[0], first[1], ready=first[2] if reader == "iter_issued" else None)
        await items.aclose()
        pinned = {slot.index: slot.pins for slot in rig.cache._layer_slots(0) if slot.pins}
        await rig.close()
        return pinned

    try:
        assert run(main()) == {}, "pins held after the reader was closed"
        assert rig.bad_reads == []
    finally:
        rig.shutdown()


def test_iter_issued_hands_out_misses_before_they_land_with_the_event_to_wait_for():
    rig = Rig(link_gbps=0.002)  # 8 KiB take ~4 ms: a miss is handed out long before it lands

    async def main() -> list[tuple[int, bool]]:
        seen = []
        await rig.load_residents(0, [4])
        async for expert, slot, ready in rig.cache.iter_issued(0, [0, 4, 1, 2, 3]):  # 4 misses through 2 free + 1 slot
            seen.append((expert, ready is None or ready.query()))
            rig.read(0, expert, slot, seconds=0.0, ready=ready)
        # every copy is on the stream, the last ones not landed yet: their bytes count already (the round's
        # accounting must not depend on the host seeing the landing)
        assert any(rig.cache.lookup(0, expert) is None for expert in (0, 1, 2, 3)), "a copy should still be on its way"
        assert rig.cache.stats.total().bytes_loaded == 5 * rig.pool.expert_bytes
        rig.cache.unprotect_all(rig.backend.record_event(rig.backend.compute_stream))
        await rig.close()
        return seen

    try:
        seen = run(main())
        assert seen[0] == (4, True), "the resident expert comes first, with nothing to wait for"
        assert sorted(expert for expert, _ in seen) == [0, 1, 2, 3, 4]
        assert any(not landed for _, landed in seen[1:]), "a miss must be handed out before its copy landed"
        assert rig.bad_reads == [], "a reader ran before the copy it waited for, or a slot was overwritten under it"
        rig.check_consistent()
    finally:
        rig.shutdown()


@pytest.mark.parametrize("host_paced", [False, True])
def test_compute_hot_first_on_device_orders_misses_on_the_compute_stream_and_measures_the_stall_there(host_paced):
    rig = Rig(link_gbps=0.004)  # 8 KiB take ~2 ms
    if host_paced:  # the emulated link holds copies back on the host: the device could not see that delay
        rig.transfer.link = LinkEmulation(1.0, mode="host")
    record = VerifyRecord()
    early: list[int] = []

    async def main() -> list[int]:
        await rig.load_residents(0, [5])
        await rig.close()

        def compute(expert: int, weights: torch.Tensor) -> None:  # a reader on the compute stream
            if rig.cache.lookup(0, expert) is None:
                early.append(expert)  # launched while its copy was still on the way

            def work() -> None:
                if not bool((weights == expert_value(0, expert)).all()):
                    rig.bad_reads.append((0, expert, -1))

            rig.backend.launch(rig.backend.compute_stream, work)

        order = await compute_hot_first(rig.cache, rig.kernel, 0, [0, 1, 5, 2], compute, record, on_device=True)
        rig.cache.unprotect_all(rig.backend.record_event(rig.backend.compute_stream))
        await rig.close()
        rig.backend.synchronize()
        record.settle()
        return order

    try:
        order = run(main())
        assert order[0] == 5 and sorted(order) == [0, 1, 2, 5]
        assert (record.hits, record.misses) == (1, 3)
        assert rig.bad_reads == []
        if host_paced:
            assert early == [] and record.stall_s > 0, "host-paced: each miss is computed once it landed, as before"
        else:
            assert early, "no miss was launched before its copy landed: the device-side ordering is not used"
            assert record.device_waits == [], "settle() folds every completed pair into stall_s"
            assert record.stall_s > 0.002, f"the compute stream waited for three ~2 ms copies: {record.stall_s * 1e3:.2f} ms"
        rig.check_consistent()
    finally:
        rig.shutdown()


def test_on_device_a_waited_miss_costs_one_event_more_than_a_hit_its_wait_timed_from_the_last_use_mark():
    """Each computed expert records one use mark on the compute stream; a miss the stream must wait for adds one
    timed event after the wait, and the wait's start is the previous expert's mark (the same stream position),
    not an event of its own."""
    rig = Rig(link_gbps=0.004)  # 8 KiB take ~2 ms: the misses are handed out before they land
    record = VerifyRecord()
    compute_events: list[object] = []
    marks: list[object] = []

    async def main() -> list[int]:
        await rig.load_residents(0, [4, 5])
        await rig.close()
        record_event, mark_used = rig.backend.record_event, rig.cache.mark_used

        def counting(stream, timed=False):
            event = record_event(stream, timed)
            if stream is rig.backend.compute_stream:
                compute_events.append(event)
            return event

        def marking(layer, expert, event):
            marks.append(event)
            mark_used(layer, expert, event)

        rig.backend.record_event, rig.cache.mark_used = counting, marking
        try:
            return await compute_hot_first(rig.cache, rig.kernel, 0, [0, 5, 1, 4], lambda expert, weights: None, record,
                                           on_device=True)
        finally:
            rig.backend.record_event, rig.cache.mark_used = record_event, mark_used
            rig.cache.unprotect_all(rig.backend.record_event(rig.backend.compute_stream))
            await rig.close()

    try:
        order = run(main())
        waits = list(record.device_waits)
        assert sorted(order[:2]) == [4, 5] and sorted(order) == [0, 1, 4, 5]
        assert waits, "no miss was waited for on the device: the link is too fast for this test"
        assert len(compute_events) == len(order) + len(waits), "a waited miss recorded more than one extra event"
        for before, after in waits:
            assert any(before is mark for mark in marks[:-1]), "a wait was timed from an event of its own"
            assert not any(after is mark for mark in marks)
        record.settle()
        assert record.stall_s > 0.001
        rig.check_consistent()
    finally:
        rig.shutdown()


def test_one_victim_choice_per_batch_of_misses_never_asks_for_more_than_can_be_evicted():
    calls = []

    def strict(layer, residents, protected, count):  # a guarded policy must return exactly `count` victims
        evictable = [expert for expert in residents if expert not in protected]
        assert count <= len(evictable), f"asked for {count} victims among {evictable}"
        calls.append(count)
        return evictable[:count]

    rig = Rig(chooser=strict)

    async def main() -> list[int]:
        await rig.load_residents(0, [0, 1, 2])
        await rig.close()
        calls.clear()
        order = []
        async for expert, slot in rig.cache.iter_ready(0, [0, 3, 4, 5]):  # 0 resident and pinned, 3 misses, 2 evictable
            order.append(expert)
            rig.read(0, expert, slot)
        await rig.close()
        return order

    try:
        order = run(main())
        assert sorted(order) == [0, 3, 4, 5] and rig.bad_reads == []
        assert calls[0] == 2, f"the first batch asks once for the two evictable slots, not per miss: {calls}"
    finally:
        rig.shutdown()


@pytest.mark.parametrize("reader", ["iter_ready", "iter_issued"])
def test_a_copy_that_cannot_be_issued_surfaces_as_its_own_error_and_strands_no_slot(reader):
    rig = Rig()
    real_copy = rig.backend.copy_h2d
    copies = []

    def failing_copy(dst, src, stream):
        copies.append(1)
        if len(copies) == 3:
            raise RuntimeError("injected copy failure")
        return real_copy(dst, src, stream)

    rig.backend.copy_h2d = failing_copy

    async def main() -> None:
        with pytest.raises(RuntimeError, match="injected copy failure"):
            async for item in getattr(rig.cache, reader)(0, [0, 1, 2]):  # 2 chunks each: the second expert fails
                expert, slot = item[0], item[1]
                rig.read(0, expert, slot, ready=item[2] if reader == "iter_issued" else None)
        rig.cache.unprotect_all(rig.backend.record_event(rig.backend.compute_stream))
        await asyncio.wait_for(rig.cache.aclose(), 5)  # nothing left waiting on a copy that never comes

    try:
        run(main())
        states = {slot.state.value for slot in rig.cache._layer_slots(0)}
        assert "loading" not in states, f"a slot was stranded: {states}"
        assert rig.cache.pinned_experts(0) == []
    finally:
        rig.shutdown()


def test_settle_keeps_the_waits_not_completed_yet():
    backend = CPUBackend()
    stream = backend.compute_stream
    try:
        first = backend.record_event(stream)
        backend.stream_sleep(stream, 0.003)
        second = backend.record_event(stream)
        second.wait()
        backend.stream_sleep(stream, 0.2)
        late = backend.record_event(stream)
        record = VerifyRecord(device_waits=[(first, second), (second, late)])
        record.settle()
        assert 0.002 < record.stall_s < 0.1 and record.device_waits == [(second, late)]
        late.wait()
        record.settle()
        assert record.stall_s > 0.2 and record.device_waits == []
    finally:
        backend.close()


def test_settle_queries_only_the_last_mark_once_it_has_completed():
    """Marks of one stream complete in order: a completed last mark settles every pair without querying the
    others (the CUDA calls at a round's end hold the GPU idle), and the stall is the same sum."""

    class Mark:
        queries = 0

        def __init__(self, t: float) -> None:
            self.t = t

        def query(self) -> bool:
            Mark.queries += 1
            return True

        def elapsed_since(self, other: "Mark") -> float:
            return self.t - other.t

    marks = [Mark(t) for t in (0.0, 0.5, 1.0, 1.25, 2.0, 2.0)]
    record = VerifyRecord(device_waits=[(marks[0], marks[1]), (marks[2], marks[3]), (marks[4], marks[5])])
    record.settle()
    assert record.stall_s == 0.75 and record.device_waits == [] and Mark.queries == 1


def test_a_protected_expert_survives_and_too_many_protections_are_a_budget_error(rig):
    async def main() -> None:
        await rig.load_residents(1, [0, 1, 2])
        rig.cache.protect(1, [0, 1, 2])
        assert rig.cache.prefetch(1, [3, 4]) == []
        with pytest.raises(BudgetError, match="protected"):
            await rig.cache.ensure(1, [3])
        rig.cache.unprotect_all()
        assert rig.cache.prefetch(1, [3]) == [3]
        await rig.close()

    run(main())
    assert rig.cache.lru_order(1) == [1, 2, 3]  # 0 was least recently used


def test_a_later_plan_replaces_the_protection_of_an_earlier_one(rig):
    async def main() -> None:
        await rig.load_residents(1, [0, 1, 2])
        rig.cache.protect(1, [0, 1, 2])  # the first checkpoint's plan
        assert rig.cache.prefetch(1, [3]) == []
        rig.cache.protect(1, [3, 1], replace=True)  # a later plan of the same round no longer wants 0 and 2
        assert rig.cache.protected_experts(1) == {1, 3}
        assert rig.cache.prefetch(1, [3]) == [3]
        await rig.close()

    run(main())
    assert 1 in rig.cache.lru_order(1) and 3 in rig.cache.lru_order(1)


def test_asking_for_more_experts_than_slots_is_a_budget_error(rig):
    with pytest.raises(BudgetError, match="3 slots"):
        run(rig.cache.ensure(0, [0, 1, 2, 3]))


def test_each_layer_holds_its_own_slot_count():
    """Slots of (2, 4): one device row each, consecutive per layer; a layer holds as many experts as its own slots
    and no more, and a snapshot restores each layer's most recent ones up to its own count."""
    rig = Rig((2, 4))
    cache = rig.cache
    try:
        async def main() -> None:
            assert cache.layer_slots == (2, 4) and cache.slots_per_layer == 2 and cache.weights.shape[0] == 6
            assert cache.slot_counts() == [2, 4]
            await rig.load_residents(1, [0, 1, 2, 3])  # all four of layer 1's slots at once
            await rig.load_residents(0, [4, 5])
            with pytest.raises(BudgetError, match="layer 0 needs 3 experts at once but has 2 slots"):
                await cache.ensure(0, [0, 1, 2])
            assert cache.prefetch(0, [0, 1, 2]) == [0, 1]  # two slots: the policy's victims, then no room left
            await cache.restore(CacheSnapshot(((3, 4, 5), (5, 4, 3, 2, 1))))
            assert cache.lru_order(0) == [4, 5] and cache.lru_order(1) == [4, 3, 2, 1]
            await rig.close()

        run(main())
        assert rig.bad_reads == []
        rig.check_consistent()
    finally:
        rig.shutdown()
    with pytest.raises(BudgetError, match="slots in each of 2 layers"):
        ExpertCache(rig.backend, rig.kernel, rig.transfer, rig.pool, (2, 0))


def test_a_policy_choosing_a_protected_expert_is_a_plugin_error():
    rig = Rig(chooser=lambda layer, residents, protected, count: list(residents)[:count])

    async def main() -> None:
        await rig.load_residents(0, [0, 1, 2])
        rig.cache.protect(0, [0])
        with pytest.raises(PluginError, match="unprotected"):
            rig.cache.prefetch(0, [5])
        await rig.close()

    try:
        run(main())
    finally:
        rig.shutdown()


def test_cancelled_reader_leaves_its_copy_resident_and_nothing_pinned(rig):
    async def main() -> None:
        task = asyncio.get_running_loop().create_task(rig.cache.ensure(0, [0, 1, 2]))
        await asyncio.sleep(0.0002)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert rig.cache.pinned_experts(0) == []
        await rig.close()

    run(main())
    assert rig.cache.lru_order(0) == [0, 1, 2]
    rig.check_consistent()


def test_snapshot_and_restore_bring_back_residents_and_lru_order(rig):
    async def main() -> None:
        for layer, experts in ((0, [3, 1]), (1, [5, 0, 2])):
            await rig.load_residents(layer, experts)
        snapshot = rig.cache.snapshot()
        rig.cache.reset()
        assert rig.cache.lookup(0, 3) is None
        await rig.cache.ensure(0, [4])
        rig.cache.unprotect_all()
        await rig.cache.restore(snapshot)
        assert rig.cache.snapshot() == snapshot
        await rig.close()

    run(main())
    assert rig.cache.lru_order(0) == [3, 1] and rig.cache.lru_order(1) == [5, 0, 2]
    rig.check_consistent()


def test_no_threads_are_left_after_shutdown():
    before = {t for t in threading.enumerate() if t.name.startswith("specter-")}
    rig = Rig()

    async def main() -> None:
        async for expert, slot in rig.cache.iter_ready(0, [0, 1, 2, 3]):
            rig.read(0, expert, slot)
        await rig.close()

    run(main())
    rig.shutdown()
    assert {t for t in threading.enumerate() if t.name.startswith("specter-")} <= before


def test_pool_rejects_wrong_shapes_duplicates_and_missing_experts():
    backend = CPUBackend()
    pool = ExpertPool(backend, 1, 2, 8, torch.float16)
    with pytest.raises(CheckpointError, match="expected 8 of torch.float16"):
        pool.write(0, 0, torch.zeros(8, dtype=torch.float32))
    with pytest.raises(CheckpointError, match="outside the model"):
        pool.write(1, 0, torch.zeros(8, dtype=torch.float16))
    pool.write(0, 1, torch.arange(8, dtype=torch.float16))
    with pytest.raises(CheckpointError, match="given twice"):
        pool.write(0, 1, torch.zeros(8, dtype=torch.float16))
    with pytest.raises(CheckpointError, match=r"1 of 2 experts .*\(layer 0, expert 0\)"):
        pool.check_complete()
    assert torch.equal(pool.host(0, 1), torch.arange(8, dtype=torch.float16))


def test_pool_packs_experts_into_power_of_two_slabs_with_little_waste():
    mixtral_expert = 3 * 14336 * 4096 * 2
    count = experts_per_slab(mixtral_expert, 256)
    slab = 1 << (count * mixtral_expert - 1).bit_length()
    assert count >= 2 and (slab - count * mixtral_expert) / slab < 0.10
    assert experts_per_slab(1 << 20, 3) == 1 and experts_per_slab(3 << 20, 64) == 21  # 64 MiB slab, 1.6 % waste
    assert experts_per_slab(1000, 3) == 1  # 1024 B wastes as little as any larger slab


def test_aclose_returns_while_a_finished_load_is_still_registered():
    """A load task that finished just before aclose is still in the cache's set until its done callback runs on
    the loop. aclose must not wait for that callback: Python 3.12's gather returns at once for finished tasks,
    without yielding, so such a loop spun forever on the GPU machine (property tests hung in Runtime.aclose)."""
    rig = Rig()

    async def main() -> None:
        async def finished() -> None:
            return None

        task = asyncio.get_running_loop().create_task(finished())
        await task
        rig.cache._loads.add(task)  # as if its discard callback had not run yet (here it never will)
        await asyncio.wait_for(rig.cache.aclose(), 2)
        assert not rig.cache._loads

    try:
        run(main())
    finally:
        rig.shutdown()


@pytest.mark.parametrize("first_reader", ["ensure", "iter_ready"])
def test_a_failed_readers_cleanup_leaves_the_next_readers_pin_alone(first_reader):
    """Reader 1's copy fails: its slot is freed, and reader 2, waiting for room, loads another expert into it and pins
    it before reader 1 wakes up. Reader 1's cleanup must not drop reader 2's pin (that slot could then be evicted
    and overwritten while reader 2 still reads it)."""
    rig = Rig(slots=3)
    failing, other = 3, 4
    host = rig.pool.host(0, failing)
    first, last = host.data_ptr(), host.data_ptr() + host.numel() * host.element_size()
    real_copy = rig.backend.copy_h2d

    def copy(dst, src, stream):
        if first <= src.data_ptr() < last:
            raise RuntimeError("injected copy failure")
        return real_copy(dst, src, stream)

    rig.backend.copy_h2d = copy

    async def main() -> None:
        await rig.cache.ensure(0, [0, 1])  # two slots held for the whole test; one left

        async def reader_1() -> None:
            with pytest.raises(RuntimeError, match="injected copy failure"):
                if first_reader == "ensure":
                    await rig.cache.ensure(0, [failing])
                else:
                    async for _expert, _slot in rig.cache.iter_ready(0, [failing]):
                        pass

        async def reader_2() -> dict[int, int]:
            return await rig.cache.ensure(0, [other])  # waits for room: the slot reader 1's load holds

        _, got = await asyncio.gather(reader_1(), reader_2())
        assert other in got
        assert other in rig.cache.pinned_experts(0), "reader 1's cleanup dropped reader 2's pin"
        assert rig.cache.is_protected(0, other)
        rig.cache.unprotect_all(rig.backend.record_event(rig.backend.compute_stream))
        await asyncio.wait_for(rig.cache.aclose(), 5)

    try:
        run(main())
    finally:
        rig.shutdown()


def test_the_victim_chooser_comes_from_the_constructor_or_a_later_assignment():
    """Without a chooser the cache evicts least recently used first; one passed to the constructor, or assigned to
    `choose_victims` later (the attribute is read at each choice), is the one asked."""
    rig = Rig(slots=2, chooser=None)
    asked: list[tuple[int, list[int], int]] = []

    def newest_first(layer: int, residents: Sequence[int], protected: Set[int], count: int) -> list[int]:
        asked.append((layer, list(residents), count))
        return [expert for expert in reversed(residents) if expert not in protected][:count]

    async def main() -> None:
        await rig.load_residents(0, [0, 1])
        await rig.load_residents(0, [2])  # the default evicts expert 0, the least recently used
        assert rig.cache.lru_order(0) == [1, 2] and asked == []
        rig.cache.choose_victims = newest_first
        await rig.load_residents(0, [3])
        assert asked == [(0, [1, 2], 1)] and rig.cache.lru_order(0) == [1, 3]
        await rig.close()

    try:
        run(main())
        assert rig.bad_reads == []
        rig.check_consistent()
    finally:
        rig.shutdown()


def test_host_path_experts_never_enter_the_cache(rig):
    """Invariant 10: after `place`, prefetch, protect, the lead and restore skip the host-path experts, and a reader
    asking for one is refused; the device-path ones behave as before."""
    cache = rig.cache

    async def main() -> None:
        cache.place([frozenset({1, 2})] + [frozenset()] * (LAYERS - 1))
        assert cache.device_path(0, [3, 2, 1, 0]) == [3, 0] and cache.device_path(1, [2, 1]) == [2, 1]
        assert cache.prefetch(0, [1, 2, 3]) == [3]
        cache.protect(0, [2, 0])
        assert cache.protected_experts(0) == {0}
        computed, started = cache.lead(0, [1, 4], 2, rig.launcher(0))
        assert 1 not in computed + started and started == [4]
        await cache.restore(CacheSnapshot(tuple((2, 5) if layer == 0 else () for layer in range(LAYERS))))
        assert cache.lru_order(0) == [5]
        with pytest.raises(AssertionError, match="host-path"):
            async for _ in cache.iter_ready(0, [5, 2]):
                pass
        await rig.close()
        assert cache.stats.layers[0].misses == 0 and not cache.pinned_experts(0)

    run(main())
    rig.check_consistent()


def test_a_prompt_placement_leaves_no_host_path_expert_behind(rig):
    """Invariant 10 around a prompt with its own placement: experts the prompt loaded while they were device path leave
    once `place` switches back (`drop_host_path`, each after its copy landed), and the preloaded ones they displaced
    are prefetched back."""
    cache = rig.cache

    async def main() -> None:
        await rig.load_residents(0, [0, 1])
        cache.place([frozenset()] * LAYERS)  # the prompt's placement: expert 2 on the device
        async for expert, slot in cache.iter_ready(0, [2]):
            rig.read(0, expert, slot)
        assert 2 in cache.lru_order(0)
        cache.place([frozenset({2, 3})] + [frozenset()] * (LAYERS - 1))  # decoding's again
        assert await cache.drop_host_path([[0, 1]] + [[]] * (LAYERS - 1)) == 1
        assert 2 not in cache.lru_order(0) and set(cache.lru_order(0)) == {0, 1}
        assert await cache.drop_host_path() == 0
        await rig.close()
        assert not cache.pinned_experts(0)

    run(main())
    rig.check_consistent()


# -- the target's use history (specter.victims) ----------------------------------------------------------


def test_the_use_clock_orders_uses_across_calls_and_layers_and_counts_them():
    from specter.victims import UseClock

    uses = UseClock(2)
    uses.used(0, [3, 1])
    uses.used(1, [3])
    uses.used(0, [2, 3])
    layer0, layer1 = uses.history(0), uses.history(1)
    assert layer0.last_use[1] < layer0.last_use[2] < layer0.last_use[3]  # 3 was used again last
    assert layer1.last_use[3] < layer0.last_use[2]  # one clock for every layer
    assert layer0.use_count == {3: 2, 1: 1, 2: 1} and layer1.use_count == {3: 1}
    assert layer0.clock == layer1.clock == max(layer0.last_use.values())
    assert len(set(layer0.last_use.values())) == 3  # each use its own tick, also within one call


def test_the_cache_evicts_what_the_targets_use_history_names_least_recent():
    """With `Victims` as the chooser (the engine's), LRU reads the target's history, not the cache's read order: the
    cache read 0, 1, 2 in that order, the history says 2 was used before 0 and 1, so the new expert takes 2's slot."""
    from policies.eviction import LRU
    from specter.victims import Victims

    chooser = Victims(LRU(), LAYERS)
    rig = Rig(chooser=chooser)

    async def main() -> set[int]:
        await rig.load_residents(0, [0, 1, 2])
        chooser.uses.used(0, [2])
        chooser.uses.used(0, [0, 1])
        await rig.load_residents(0, [3])
        resident = set(rig.cache.lru_order(0))
        await rig.close()
        return resident

    try:
        assert run(main()) == {0, 1, 3}
        assert rig.bad_reads == []
    finally:
        rig.shutdown()
