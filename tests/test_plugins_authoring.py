"""What a plug-in author meets following the README's "Plug-ins" section: name clashes with the reference plug-ins,
a plug-in that exits while loading, a constructor that needs arguments, the name a loaded plug-in answers to."""

from __future__ import annotations

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
'''


@pytest.fixture
def author_package(tmp_path, monkeypatch):
    """A third party's module on sys.path, and a way to make the installed entry points of `specter.eviction`."""
    (tmp_path / "author_policies.py").write_text(AUTHOR_MODULE)
    (tmp_path / "author_exits_at_import.py").write_text("import sys\nsys.exit('no GPU here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def install(*points: tuple[str, str]) -> None:
        listed = [EntryPoint(name, value, "specter.eviction") for name, value in points]
        monkeypatch.setattr(plugins, "entry_points", lambda group: listed if group == "specter.eviction" else [])
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
