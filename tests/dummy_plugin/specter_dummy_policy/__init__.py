"""A dummy third-party eviction plug-in: a seeded random choice, and a broken one without victims()."""

from __future__ import annotations

import random
from collections.abc import Sequence, Set
from typing import Any


class DummyRandom:
    """Evicts unprotected residents chosen by a seeded RNG: the same calls give the same answers."""

    def __init__(self, *, seed: int = 0) -> None:
        self.name = "dummy-random"
        self._rng = random.Random(seed)

    def victims(
        self, layer: int, residents: Sequence[int], protected: Set[int], count: int, history: Any, plan: Any
    ) -> list[int]:
        candidates = sorted(expert for expert in residents if expert not in protected)
        return self._rng.sample(candidates, count)


class DummyBroken:
    """Deliberately broken: has a name but no victims(), so loading it must fail with a PluginError."""

    def __init__(self) -> None:
        self.name = "dummy-broken"


def returns_none() -> None:
    """A factory that forgot its return: the loader must say so (tests/test_plugins.py names it in a fake entry point)."""


def returns_class() -> type:
    """A factory that returns the class, not an instance (tests/test_plugins.py names it in a fake entry point)."""
    return DummyRandom
