"""The console scripts' targets (pyproject's [project.scripts]). Light on purpose: a script imports its target before
any code of ours runs, so the tool's own imports (torch, numpy, pydantic) must come after, under `run_entry`'s hold of
a Ctrl-C, as under `python -m specter`."""

from __future__ import annotations

from specter.exits import run_entry


def specter() -> int:
    """`specter`: `specter.cli.main`."""
    return run_entry("specter.cli")


def replay() -> int:
    """`specter-replay` and `python -m specter.replay`: `specter.replay.main`."""
    return run_entry("specter.replay")


def bench() -> None:
    """`specter-bench`: `specter.bench.cli.main`; exits, bounded after a stop as `python -m specter.bench` is."""
    status = run_entry("specter.bench.cli")
    from specter.bench.stopping import exit_bounded  # loaded already, by the bench's own imports

    exit_bounded(status)


def widen() -> int:
    """`python -m specter.bench.widen`: `specter.bench.widen.main`."""
    return run_entry("specter.bench.widen")


def realism() -> int:
    """`python -m specter.bench.realism`: `specter.bench.realism.main`."""
    return run_entry("specter.bench.realism")
