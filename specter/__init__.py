"""Specter: speculative expert prefetching for MoE inference on one GPU with offloaded experts."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Exported lazily (PEP 562): `import specter.plugins` or the replay tool must not pay for importing torch.
_EXPORTS = {
    "Engine": "specter.api", "GenerationStream": "specter.api", "Piece": "specter.api", "Result": "specter.api",
    "SyncEngine": "specter.sync", "Tokenizer": "specter.tokenizer",
    "EngineConfig": "specter.config", "GenerationConfig": "specter.config", "DraftConfig": "specter.config",
    "RequestStats": "specter.metrics",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from specter.api import Engine, GenerationStream, Piece, Result
    from specter.config import DraftConfig, EngineConfig, GenerationConfig
    from specter.metrics import RequestStats
    from specter.sync import SyncEngine
    from specter.tokenizer import Tokenizer


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'specter' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
