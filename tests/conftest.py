"""Fixtures shared by several test modules."""

from __future__ import annotations

import shutil
import sys
import tempfile
import tomllib
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

import pytest
import torch

DUMMY_PLUGIN = Path(__file__).resolve().parent / "dummy_plugin"
DUMMY_DIST = "specter-dummy-policy"


def dummy_dist_info(pyproject: Path, into: Path) -> Path:
    """Write the `*.dist-info` (METADATA, entry_points.txt) that `pip install` would write for `pyproject`.

    With it and the package's folder on sys.path, importlib.metadata finds the package's entry points as if it
    were installed, so the plug-in tests see a third-party plug-in without the quick start installing one into
    the user's environment (where `dummy-broken` would show in every error and replay).
    """
    project = tomllib.loads(pyproject.read_text())["project"]
    dist_info = into / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
    sections = [f"[{group}]\n" + "".join(f"{name} = {target}\n" for name, target in points.items())
                for group, points in project["entry-points"].items()]
    (dist_info / "entry_points.txt").write_text("\n".join(sections))
    return dist_info


def _installed(name: str) -> bool:
    try:
        distribution(name)
    except PackageNotFoundError:
        return False
    return True


_added_paths: list[str] = []
CHECKOUT_PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def missing_entry_points(pyproject: Path) -> dict[str, dict[str, str]]:
    """Entry points the checkout's pyproject declares that the installed `specter` metadata lacks: an editable
    install reads them when it is installed, so a group added since (e.g. `specter.placement`) is unknown to it
    until `pip install -e .` runs again."""
    from importlib.metadata import entry_points

    declared = tomllib.loads(pyproject.read_text())["project"].get("entry-points", {})
    missing: dict[str, dict[str, str]] = {}
    for group, points in declared.items():
        known = {point.name for point in entry_points(group=group)}
        absent = {name: target for name, target in points.items() if name not in known}
        if absent:
            missing[group] = absent
    return missing


def pytest_configure(config: pytest.Config) -> None:
    # Runs before any test module imports specter.plugins, whose entry-point scan is cached per process.
    metadata_root = Path(tempfile.mkdtemp(prefix="specter-test-plugins-"))
    missing = missing_entry_points(CHECKOUT_PYPROJECT)
    if missing:  # the checkout's own plug-ins, seen as the reinstalled package would see them
        shim = metadata_root / "shim.toml"
        shim.write_text(f'[project]\nname = "specter-checkout-plugins"\nversion = "0"\n'
                        + "".join(f'[project.entry-points."{group}"]\n' + "".join(f'{n} = "{t}"\n' for n, t in points.items())
                                  for group, points in missing.items()))
        dummy_dist_info(shim, metadata_root)
    _added_paths.append(str(metadata_root))
    if not _installed(DUMMY_DIST):  # unless someone installed the example package (pip install ./tests/dummy_plugin)
        dummy_dist_info(DUMMY_PLUGIN / "pyproject.toml", metadata_root)
        _added_paths.append(str(DUMMY_PLUGIN))
    sys.path[:0] = _added_paths


def pytest_unconfigure(config: pytest.Config) -> None:
    for path in _added_paths:
        if path in sys.path:
            sys.path.remove(path)
    if _added_paths:
        shutil.rmtree(_added_paths[0], ignore_errors=True)
    _added_paths.clear()


@pytest.fixture(autouse=True)
def placement_costs(monkeypatch, tmp_path):
    """Each test its own store of measured placement costs (specter.experts.costs.CostStore): a figure one test
    measured (or faked) must not decide another's placement. Returns the store."""
    from specter.experts import costs

    store = costs.CostStore(tmp_path / "placement-costs.json")
    monkeypatch.setattr(costs, "default_cost_store", lambda: store)
    monkeypatch.setattr("specter.build.default_cost_store", lambda: store)
    return store


@pytest.fixture(scope="session")
def initial_logging():
    """structlog's configuration as the session found it (`logging_as_found`)."""
    import structlog

    from specter import log

    return structlog.get_config(), (log._configured, log._debug)


@pytest.fixture(autouse=True)
def logging_as_found(initial_logging):
    """Each test ends with logging as the session began: a tool run in-process (a CLI's main, the bench, also from a
    module's fixture) configures structlog for the process, and the level of ERROR it left hid the warnings a later
    test captures (`capture_logs`)."""
    import structlog

    from specter import log

    yield
    config, state = initial_logging
    structlog.configure(**config)
    log._configured, log._debug = state


@pytest.fixture
def fresh_plugin_scan(monkeypatch):
    """Each test scans entry points afresh, with no allow-list unless it sets one (plug-in and backend tests)."""
    from specter import plugins

    monkeypatch.delenv(plugins.ALLOW_LIST_ENV, raising=False)
    plugins.refresh()
    yield
    plugins.refresh()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The built-in `tiny` checkpoint, written once under a test cache unless SPECTER_CACHE is set.
    Modules that need something else define their own `tiny`, which takes precedence."""
    import os

    from specter.builtin import builtin_path

    os.environ.setdefault("SPECTER_CACHE", str(tmp_path_factory.mktemp("cache")))
    return builtin_path("tiny")


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy CI machine they lose a lot to contention."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
