"""Every error a user can cause: one base class, one subclass per kind of mistake."""

from __future__ import annotations

from pathlib import Path
from typing import Any


class SpecterError(Exception):
    """Base of every error Specter raises on purpose; the message says what to do."""


class ConfigError(SpecterError, ValueError):
    """A configuration value is invalid (names the field, the value and what is allowed)."""


class CheckpointError(SpecterError):
    """A checkpoint directory or file cannot be used (names the file and tensor)."""


class BudgetError(SpecterError):
    """The GPU memory budget cannot hold the model's minimum (says the minimum)."""


class MemoryShortError(BudgetError):
    """The machine's free memory cannot hold the plan. `shortfall` is what is short, without the engine command line's
    remedy, for a tool with other options (the bench) to give its own."""

    def __init__(self, shortfall: str, remedy: str) -> None:
        super().__init__(f"{shortfall}; {remedy}")
        self.shortfall = shortfall


class PromptError(SpecterError, ValueError):
    """A prompt or generation request is invalid (empty, too long, ids out of range)."""


class PluginError(SpecterError):
    """A plug-in is unknown, not allowed, malformed, or failed inside a decision."""


class RequestCancelled(SpecterError):
    """A generation request was cancelled before it finished."""


class StreamBusy(SpecterError, RuntimeError):
    """A stream read by a second task while another reads it (one stream has one reader at a time)."""


class EngineLoopError(SpecterError, RuntimeError):
    """An engine was used from an event loop (or thread) that does not own it, or its loop ended under it."""


class OutputError(SpecterError, OSError):
    """An output the user named (stdout, a trace file) cannot be written: full disk, a closed device."""


def unreadable(path: Path, error: OSError) -> CheckpointError:
    """The error for a checkpoint's file that exists but cannot be opened, saying why (most often its permissions)."""
    if isinstance(error, PermissionError):
        return CheckpointError(f"{path}: permission denied; make the checkpoint readable by this user "
                               f"(e.g. chmod -R a+rX {path.parent}) or run as a user who can read it")
    return CheckpointError(f"{path}: cannot be read ({error.strerror or error})")


def abbreviate(value: Any, limit: int = 200) -> str:
    """repr(value), cut to `limit` characters for a message: an answer of a million ids must not become the message."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
