"""Device backends (`specter.backends` entry points): `cpu` for tests and laptops, `cuda` for GPUs."""

from __future__ import annotations

from backends.base import Backend, Event, Stream

__all__ = ["Backend", "Event", "Stream"]
