"""The device expert cache: per-layer slots in one device tensor, a residency map and a device slot table.

`ExpertCache` is its three parts together, each a module with its invariants at the top: the slot state machine
(experts/slots.py), the verify's rolling window (experts/window.py), the lead and the relay's slot loans
(experts/lead.py). Loads go through the transfer engine; eviction choices are delegated to `choose_victims`.
"""

from __future__ import annotations

from specter.experts.lead import LeadRelay
from specter.experts.slots import CacheSnapshot, CacheStats, LayerStats, VictimChooser
from specter.experts.window import RollingWindow

__all__ = ["CacheSnapshot", "CacheStats", "ExpertCache", "LayerStats", "VictimChooser"]


class ExpertCache(LeadRelay, RollingWindow):
    """L*S device slots (S per MoE layer) over an `ExpertPool`, loaded through a `TransferEngine`.

    All methods run on the event-loop thread. Readers follow one protocol: get slots from `ensure` or
    `iter_ready` / `iter_issued` (they come pinned), launch compute reading `slot_weights(slot)`, record an event
    after it on the compute stream and call `mark_used(layer, expert, event)`. Before a layer's routing is known a
    reader may `lead` it. At the end of a round (also on cancellation) the engine calls `unprotect_all(fence)`
    with an event recorded on the compute stream. The constructor is `ExpertSlots`'s.
    """
