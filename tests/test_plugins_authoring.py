"""What a plug-in author meets following the README's "Plug-ins" section: name clashes with the reference plug-ins,
a plug-in that exits while loading, a constructor that needs arguments, the name a loaded plug-in answers to."""

from __future__ import annotations

import json
from importlib.metadata import EntryPoint

import pytest

from specter import plugins
from specter.errors import PluginError

pytestmark = pytest.mark.usefixtures("fresh_plugin_scan")

AUTHOR_MODULE = '''
import sys

class Evicts:
    def __init__(self):
        self.name = "evicts"

    def victims(self, layer, residents, protected, count, history, plan):
        return [e for e in residents if e not in protected][:count]

class NamedLikeLRU(Evicts):
    def __init__(self):
        self.name = "lru"  # copied from the reference policy and not renamed

class NeedsSeed(Evicts):
    def __init__(self, seed):
        super().__init__()

class ExitsOnConstruction(Evicts):
    def __init__(self):
        sys.exit(3)

class AssertsOnConstruction(Evicts):
    def __init__(self):
        assert False

class RenamedParameters(Evicts):
    def victims(self, layer_index, residents, protected, count, history, plan):
        return []

class AsyncVictims(Evicts):
    async def victims(self, layer, residents, protected, count, history, plan):
        return []

class AsyncPricesMisses:
    name = "async-prices"

    def place(self, state):
        raise AssertionError("not reached")

    async def prices_misses(self, state):
        return True

class RaisesInVictims(Evicts):
    def victims(self, layer, residents, protected, count, history, plan):
        raise ValueError("boom in the author's code")
'''


@pytest.fixture
def author_package(tmp_path, monkeypatch):
    """A third party's module on sys.path, and a way to make the installed entry points of `specter.eviction` (the other
    groups' as installed)."""
    (tmp_path / "author_policies.py").write_text(AUTHOR_MODULE)
    (tmp_path / "author_exits_at_import.py").write_text("import sys\nsys.exit('no GPU here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def install(*points: tuple[str, str]) -> None:
        listed, installed = [EntryPoint(name, value, "specter.eviction") for name, value in points], plugins.entry_points
        monkeypatch.setattr(plugins, "entry_points",
                            lambda group: listed if group == "specter.eviction" else installed(group=group))
        plugins.refresh()

    return install


@pytest.mark.parametrize("order", ["third party first", "reference first"])
def test_a_third_party_cannot_take_a_reference_plugins_name(author_package, order):
    """It took it when importlib.metadata listed it first: `lru` (the bench's ondemand baseline, an allow-list's `lru`)
    then ran the third party's code, with only a warning that the bench does not show."""
    points = [("lru", "author_policies:Evicts"), ("lru", "policies.eviction:LRU")]
    author_package(*(points if order == "third party first" else points[::-1]))
    assert plugins.installed("eviction")["lru"].value == "policies.eviction:LRU"
    assert type(plugins.load_policy("eviction", "lru").policy).__module__ == "policies.eviction"


def test_between_two_third_parties_the_first_listed_keeps_the_name(author_package):
    author_package(("mine", "author_policies:Evicts"), ("mine", "author_policies:NamedLikeLRU"))
    assert plugins.installed("eviction")["mine"].value == "author_policies:Evicts"


@pytest.mark.parametrize("value, says", [
    ("author_exits_at_import:Evicts", r"importing 'author_exits_at_import:Evicts' failed: SystemExit\('no GPU here'\); fix"),
    ("author_policies:ExitsOnConstruction", r"construction with options \{\} failed: it called exit\(3\); a plug-in must "
                                            r"raise"),
])
def test_a_plugin_that_exits_while_loading_is_a_plugin_error(author_package, value, says):
    """It ended the process (status 3, no message): `generate --eviction NAME`, and a replay over every installed
    plug-in because one of them exits."""
    author_package(("exits", value))
    with pytest.raises(PluginError, match=rf"eviction plug-in 'exits' \(dist unknown\): {says}"):
        plugins.load_policy("eviction", "exits")


def test_a_constructor_that_needs_arguments_says_what_to_do(author_package):
    author_package(("seeded", "author_policies:NeedsSeed"))
    with pytest.raises(PluginError, match=r"'seeded'.*missing 1 required positional argument: 'seed'; the engine calls a "
                                          r"plug-in's entry point with no arguments, so give every parameter"):
        plugins.load_policy("eviction", "seeded")


def test_a_loaded_plugin_answers_to_its_entry_points_name(author_package):
    """The replay labels its rows with the guarded policy's `name`: an object that calls itself `lru` showed as a
    second `lru` row beside the reference one."""
    author_package(("my-lru", "author_policies:NamedLikeLRU"), ("lru", "policies.eviction:LRU"))
    assert plugins.load_policy("eviction", "my-lru").name == "my-lru"
    assert plugins.load_policy("eviction", "my-lru", guard=False).name == "lru"  # the object itself is left alone
    assert plugins.guarded(plugins.load_policy("eviction", "lru", guard=False), "eviction").name == "lru"


@pytest.mark.parametrize("name", ["prefetch:none", "a,b", " spaced", ""])
def test_a_name_the_allow_list_cannot_select_as_written_is_skipped_with_a_warning(author_package, monkeypatch, name):
    """An eviction plug-in named `prefetch:none` passed `SPECTER_PLUGINS=...,prefetch:none` meant for the prefetch
    plug-in `none` (the replay then ran it); one named `a,b` could be used and never allow-listed."""
    from structlog.testing import capture_logs

    author_package((name, "author_policies:Evicts"), ("fine", "author_policies:Evicts"))
    with capture_logs() as logs:
        assert sorted(plugins.installed("eviction")) == ["fine"]
    assert [(entry["event"], entry["name"]) for entry in logs] == [("plugin.bad_name", name)]
    monkeypatch.setenv(plugins.ALLOW_LIST_ENV, "prefetch:none,fine")
    assert sorted(plugins.available("eviction")) == ["fine"]


def test_a_constructors_exception_is_named_with_its_type(author_package):
    """`assert False` in a constructor was 'construction with options {} failed: ' and nothing more."""
    author_package(("asserts", "author_policies:AssertsOnConstruction"))
    with pytest.raises(PluginError, match=r"construction with options \{\} failed: raised AssertionError\(\)$"):
        plugins.load_policy("eviction", "asserts")


@pytest.mark.parametrize("value, says", [
    ("author_policies:RenamedParameters", r"victims\(\) cannot take the engine's call victims\(layer=\.\.\., residents=.*"
                                          r"keep the protocol's parameter names"),
    ("author_policies:AsyncVictims", r"victims\(\) is async; the engine calls policies synchronously"),
])
def test_a_method_the_engine_cannot_call_is_refused_at_load(author_package, value, says):
    """They loaded, and failed at the first decision after the whole model had loaded (a TypeError on `layer=`; a
    coroutine that 'is not a list of ids' and a 'never awaited' warning)."""
    author_package(("wrong", value))
    with pytest.raises(PluginError, match=rf"eviction plug-in 'wrong' \(dist unknown\): {says}"):
        plugins.load_policy("eviction", "wrong")


def test_a_plugins_exception_reaches_the_user_as_the_cause_and_at_debug_as_a_traceback(author_package, tiny, capsys):
    """The engine's task group re-raised the PluginError `from None`, which erased its cause: the author's file and
    line were nowhere, not in the Python API's `__cause__`, not under `--log-level debug`."""
    from specter import EngineConfig, SyncEngine
    from specter.cli import main

    author_package(("raises", "author_policies:RaisesInVictims"))
    with SyncEngine(tiny, EngineConfig(residents=4, eviction="raises")) as engine:
        with pytest.raises(PluginError) as caught:
            engine.complete([1, 2, 3], max_new_tokens=8)
    assert isinstance(caught.value.__cause__, ValueError) and "boom" in str(caught.value.__cause__)
    capsys.readouterr()
    argv = ["generate", "--model", str(tiny), "--residents", "4", "--eviction", "raises", "--prompt-ids", "1,2,3",
            "--max-new-tokens", "8", "--json"]
    assert main([*argv, "--log-level", "debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and 'raise ValueError("boom in the author\'s code")' in err and "author_policies.py" in err
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert "Traceback" not in err and err.rstrip().endswith("victims() raised ValueError(\"boom in the author\'s code\")")
    # --json: what was committed before the failure is on stdout, as text mode streams it (it printed nothing)
    partial = json.loads(out)
    assert partial["finish_reason"] == "error" and partial["error"] in err and partial["tokens"]
    assert partial["stats"]["new_tokens"] == len(partial["tokens"])


def test_an_optional_method_that_is_async_is_refused_at_load(monkeypatch, tmp_path):
    """`async def prices_misses` passed the load and returned a coroutine (always true) at its first call."""
    (tmp_path / "author_placements.py").write_text(AUTHOR_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    listed = [EntryPoint("async-prices", "author_placements:AsyncPricesMisses", "specter.placement")]
    installed = plugins.entry_points
    monkeypatch.setattr(plugins, "entry_points",
                        lambda group: listed if group == "specter.placement" else installed(group=group))
    plugins.refresh()
    with pytest.raises(PluginError, match=r"prices_misses\(\) is async; the engine calls policies synchronously"):
        plugins.load_policy("placement", "async-prices")


def test_each_engine_makes_its_own_policy_objects_and_keeps_them(tiny):
    """What the README tells an author of a policy's lifetime: one object per engine, for its life (its requests share
    it), never shared between engines."""
    import asyncio

    from specter import EngineConfig
    from specter.engine import Runtime

    async def policies():
        async with await Runtime.load(tiny, EngineConfig(device="cpu", residents=4)) as runtime:
            first = (runtime.eviction.policy, runtime.prefetch.policy, runtime.lookahead.policy)
            await runtime.complete_ids([1, 2, 3], None)
            await runtime.complete_ids([4, 5], None)
            return first, (runtime.eviction.policy, runtime.prefetch.policy, runtime.lookahead.policy)

    (a, a_later), (b, _) = asyncio.run(policies()), asyncio.run(policies())
    assert all(x is y for x, y in zip(a, a_later)) and not any(x is y for x, y in zip(a, b))
