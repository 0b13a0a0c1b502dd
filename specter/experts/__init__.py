"""Experts off the GPU: the host pool, the device cache and the transfer engine between them."""

from __future__ import annotations

from specter.experts.cache import CacheSnapshot, CacheStats, ExpertCache, LayerStats, VictimChooser
from specter.experts.pool import ExpertPool
from specter.experts.transfer import LINK_PRESETS, LinkEmulation, Transfer, TransferEngine, parse_link

__all__ = [
    "LINK_PRESETS",
    "CacheSnapshot",
    "CacheStats",
    "ExpertCache",
    "ExpertPool",
    "LayerStats",
    "LinkEmulation",
    "Transfer",
    "TransferEngine",
    "VictimChooser",
    "parse_link",
]
