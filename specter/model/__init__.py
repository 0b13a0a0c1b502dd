"""Model families, checkpoint reading and the target forward."""

from __future__ import annotations

from specter.model.checkpoint import Checkpoint
from specter.model.kv import KVCache
from specter.model.spec import FAMILIES, ModelSpec, spec_from_config
from specter.model.transformer import Transformer

__all__ = ["FAMILIES", "Checkpoint", "KVCache", "ModelSpec", "Transformer", "spec_from_config"]
from specter.model import deepseek_v2, phimoe  # noqa: E402,F401  (registers the families)
