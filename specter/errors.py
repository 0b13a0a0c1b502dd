"""Every error a user can cause: one base class, one subclass per kind of mistake."""

from __future__ import annotations


class SpecterError(Exception):
    """Base of every error Specter raises on purpose; the message says what to do."""


class ConfigError(SpecterError, ValueError):
    """A configuration value is invalid (names the field, the value and what is allowed)."""


class CheckpointError(SpecterError):
    """A checkpoint directory or file cannot be used (names the file and tensor)."""


class BudgetError(SpecterError):
    """The GPU memory budget cannot hold the model's minimum (says the minimum)."""


class PromptError(SpecterError, ValueError):
    """A prompt or generation request is invalid (empty, too long, ids out of range)."""


class PluginError(SpecterError):
    """A plug-in is unknown, not allowed, malformed, or failed inside a decision."""


class RequestCancelled(SpecterError):
    """A generation request was cancelled before it finished."""


class OutputError(SpecterError, OSError):
    """An output the user named (stdout, a trace file) cannot be written: full disk, a closed device."""
