"""The lead and the relay: a layer's predicted residents computed and its predicted misses started before its routing
reaches the host (`lead`), a slot lent by the layer before when it has none (`_lend`), and the loans given back at
the end of the round (`unprotect_all`, `_balance`).

A mix-in of `ExpertCache` over the slot state machine (experts/slots.py), whose invariants hold here too.
"""

# What the lead and the relay add:
#  1. `lead` is synchronous: nothing else runs between a resident's launch and the load that takes its slot.
#  2. Each predicted resident `lead` computes is marked used with the event its launch returned; the reader skips
#     it, so its output must stand whether or not the routing chooses it.
#  3. `lead` evicts a planned (protected) resident only after launching its compute, and the copy into its slot
#     waits on the device for that compute only. Pinned and loading slots are never taken.
#  4. Room for the predicted misses, in order: free slots, unplanned residents the prediction does not name, one
#     slot the layer before lends (`CacheTuning.lead_relay`), then computed residents the policy chooses.
#  5. A loan moves one slot of the layer before, free or emptied by the policy among its unprotected, unpinned
#     residents; the slot keeps its last-use event, so a copy into it waits for the donor's compute. A layer
#     borrows only while it holds at most its own slots (`layer_slots`) and its donor at least its own.
#  6. Loans go back: at the end of each round (`unprotect_all`) and whenever a layer short of a slot needs room,
#     each short layer takes one from a layer over its count; a layer whose slots are all loading or held keeps
#     them until the next call. A failing policy there is logged, never raised: cleanup must finish.
#  7. `unprotect_all` lifts every pin and protection; a slot still pinned (a cancelled reader) gets the round's
#     fence as its last use, so no copy overwrites it before the round's last compute.

from __future__ import annotations

from collections.abc import Callable, Sequence

from backends.base import Event
from specter.errors import PluginError
from specter.experts.slots import ExpertSlots, Slot, SlotState
from specter.log import get_logger

log = get_logger(__name__)


class LeadRelay(ExpertSlots):
    """`lead`, the relay's slot loans and the end of a round (`unprotect_all`)."""

    def lead(self, layer: int, predicted: Sequence[int], count: int,
             launch: Callable[[int, int], Event]) -> tuple[list[int], list[int]]:
        """Before a reader knows the layer's routing (`VerifyTuning.lead_misses`): compute the predicted residents and start
        up to `count` predicted misses.

        `predicted`: the experts the reader will likely need, likeliest first (the draft's routes). Every predicted
        resident not held by a reader is computed now, `launch(expert, slot)` (its output must stand whether or not
        the routing chooses it), and marked used with the event `launch` returns. Then those not mapped to a slot,
        the predicted misses, start: each in a free slot, else in the slot of an unplanned resident the prediction
        does not name, else (with `CacheTuning.lead_relay`, one) in a slot the layer before lends, else in the slot of
        a computed resident the policy chooses (those residents are computed first, each copy started right after its
        own compute, so it waits on the device for that compute only). So the copy stream need not wait for the router's choice to reach the host, nor the reader's
        later misses for its launches of the residents. Loads count as prefetches. A predicted miss the routing does
        not choose still takes its slot (and a resident's, perhaps): the rolling window's `roll_hot_window` counts
        only the misses the reader asks for, so a layer may give up to `count` more residents than it. Returns the residents computed
        and the experts whose loads started; the reader skips the former and finds the latter loading (its misses
        still count them). Synchronous: nothing else runs between a launch and its load.
        """
        predicted = list(dict.fromkeys(self.device_path(layer, predicted)))
        mapped = self._residents[layer]
        hot = [e for e in predicted if (slot := mapped.get(e)) is not None and slot.state is SlotState.RESIDENT and not slot.pins]
        misses = [e for e in predicted if e not in mapped][:count]
        named = set(predicted)
        spare = [e for e, slot in mapped.items()
                 if e not in named and slot.state is SlotState.RESIDENT and not slot.pins and e not in self._protected[layer]]
        room = [slot for slot in self._layer_slots(layer) if slot.state is SlotState.FREE][: len(misses)]
        if len(room) < len(misses) and spare:
            room += [self._evict(layer, e) for e in self._victims(layer, len(misses) - len(room), among=spare)]
        started: list[int] = []

        def load(miss: int, slot: Slot) -> None:
            self._start_load(layer, miss, slot, urgent=True)
            self.stats.layers[layer].prefetched += 1
            started.append(miss)

        for miss, slot in zip(misses, room):  # these copies start before the relay's policy call below
            load(miss, slot)
        donor = layer - 1
        if (len(room) < len(misses) and self.tuning.lead_relay and layer > 0 and self.layer_slots[donor] > 1
                and not self._over(layer) and not self._short(donor) and (lent := self._lend(donor, layer)) is not None):
            load(misses[len(room)], lent)
            room.append(lent)
        doomed = self._victims(layer, len(misses) - len(room), among=hot) if len(room) < len(misses) and hot else []
        takes = dict(zip(doomed, misses[len(room):]))  # computed resident -> the miss that takes its slot
        computed = doomed + [e for e in hot if e not in takes]  # victims first
        for expert in computed:
            self.mark_used(layer, expert, launch(expert, mapped[expert].index))
            if expert in takes:  # its copy waits for this compute only, not the later ones
                load(takes.pop(expert), self._evict(layer, expert))
        return computed, started

    def unprotect_all(self, fence: Event | None = None) -> None:
        """End of round: lift every protection and pin. `fence` (recorded on the compute stream after the
        round's last compute) becomes the last-use event of slots still pinned, e.g. by a cancelled reader. Then
        the slots the relay (`CacheTuning.lead_relay`) lent go back to their layers (`_balance`)."""
        for slot in self._slots:
            if slot.pins and fence is not None:
                slot.last_use = fence
            slot.pins = 0
        for layer in range(self.num_layers):
            self._protected[layer].clear()
            self._signal(layer)
        try:
            self._balance()
        except PluginError as error:  # cleanup must finish; a short layer retries when it next needs room
            log.warning("cache.balance_failed", error=str(error))

    # -- internals: loans --------------------------------------------------------------------------

    def _lend(self, donor: int, layer: int) -> Slot | None:
        """Move one of `donor`'s slots to `layer`, free: a free one, else the slot of a resident the policy evicts
        among the donor's unprotected, unpinned ones (its last use stays: a copy into it waits for that compute).
        None when the donor has neither."""
        slot = next((slot for slot in self._by_layer[donor] if slot.state is SlotState.FREE), None)
        if slot is None:
            victims = self._victims(donor, 1)
            if not victims:
                return None
            slot = self._evict(donor, victims[0])
        self._by_layer[donor].remove(slot)
        self._by_layer[layer].append(slot)
        slot.layer = layer
        self._signal(layer)
        return slot

    def _balance(self) -> None:
        """Give the slots the relay lent back: each layer short of its own (`layer_slots`) takes one from a layer over
        its own (free, or the policy's victim there). A layer over it whose slots are all loading or held keeps them
        until the next call."""
        for layer in range(self.num_layers):
            while self._short(layer):
                donors = [d for d in range(self.num_layers) if self._over(d)]
                if not any(self._lend(donor, layer) for donor in donors):
                    break
