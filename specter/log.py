"""structlog set-up: human-readable on a terminal, JSON on request; events are dotted names."""

from __future__ import annotations

import logging
import sys

import structlog

_configured = False
_debug = False


class _Stderr:
    """sys.stderr as it is at each write, not as it was when logging was configured: a stream swapped in later (a
    test's capture, an application's redirect) gets the events, and one closed since is never written to."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure(json: bool = False, level: str = "WARNING") -> None:
    """Configure structlog once for the process; later calls reconfigure."""
    global _configured, _debug
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=_Stderr()),
        cache_logger_on_first_use=False,
    )
    _configured = True
    _debug = getattr(logging, level.upper()) <= logging.DEBUG


def debug_enabled() -> bool:
    """Whether debug events are emitted. Hot paths (per expert, per copy, per stage) test this first: a
    filtered-out call through structlog's lazy logger still binds one per call (about 2.4 us here)."""
    return _debug


def get_logger(name: str) -> structlog.typing.FilteringBoundLogger:
    """A logger bound to a module name; configures a quiet default on first use, unless the process has configured
    structlog already: an application that did (its renderer, its level, its output) keeps its configuration, and
    Specter's events go through it. (A library that replaced it at import hid the application's own info events and
    moved its JSON lines to Specter's console format on stderr.) The command-line tools configure it themselves."""
    if not _configured and not structlog.is_configured():
        configure()
    return structlog.get_logger(name)
