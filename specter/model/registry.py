"""Which Transformer class runs which model family (families with their own attention or routing subclass it)."""

from __future__ import annotations

from specter.model.spec import ModelSpec
from specter.model.transformer import Transformer

TRANSFORMERS: dict[str, type[Transformer]] = {}


def register_transformer(family: str, cls: type[Transformer]) -> None:
    TRANSFORMERS[family] = cls


def transformer_for(spec: ModelSpec) -> type[Transformer]:
    return TRANSFORMERS.get(spec.family, Transformer)
