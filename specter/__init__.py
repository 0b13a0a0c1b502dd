"""Specter: speculative expert prefetching for MoE inference on one GPU with offloaded experts."""

from __future__ import annotations

__version__ = "0.1.0"
