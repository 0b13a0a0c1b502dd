"""`python -m specter.bench --system NAME:KEY=VALUE,...`: a policy author's own plug-ins as a system of the matrix,
held to the same baseline as the built-in ones; a cell whose plug-in fails fails alone."""

from __future__ import annotations

import json

import pytest

from specter.bench import cli
from specter.bench.systems import SYSTEMS, custom_system
from specter.errors import ConfigError

RUN = ["--no-progress", "--no-plots", "--no-hf", "--device", "cpu", "--model", "tiny", "--residents", "6",
       "--max-new-tokens", "6", "--warmup-tokens", "4", "--link", "0.5"]


def test_a_custom_system_starts_from_its_like_and_takes_the_plug_ins_named():
    system = custom_system("mine:like=specter,eviction=dummy-random,k=3")
    specter = SYSTEMS["specter"]
    assert (system.name, system.eviction, system.k) == ("mine", "dummy-random", 3)
    assert (system.prefetch, system.lookahead, system.overlap) == (specter.prefetch, specter.lookahead, specter.overlap)
    plain = custom_system("plain:prefetch=topm-frequency")  # like ondemand: k = 0, LRU
    assert (plain.eviction, plain.prefetch, plain.k, dict(plain.prefetch_options)) == ("lru", "topm-frequency", 0, {})
    assert custom_system("d:like=specmoeoff,prefetch=topm-keep").prefetch_options == {}  # specmoeoff's are its prefetch's


@pytest.mark.parametrize("text, says", [
    ("mine", "expected NAME:KEY=VALUE"),
    ("ondemand:eviction=lru", "a built-in system has that name"),
    ("hf-accelerate:like=specter", "a built-in system has that name"),  # its rows are out of the exactness verdict
    ("mine:evict=lru", "'evict=lru' is not KEY=VALUE"),
    ("mine:eviction=", "is not KEY=VALUE"),
    ("mine:eviction=nope", "no eviction plug-in named 'nope' is installed; installed: "),
    ("mine:cpu-experts=nope", "no placement plug-in named 'nope'"),
    ("mine:like=resident", "like=resident is not a built-in offloaded system"),
    ("mine:like=exact-prefetch", "not a built-in offloaded system"),
    ("mine:k=two", "k='two' is not a whole number"),
    ("mine:k=-1", "k=-1 is below 0"),
    ("mine:k=1,k=2", "k given twice"),
])
def test_a_bad_custom_system_is_refused_before_anything_loads(text, says):
    with pytest.raises(ConfigError, match=None) as refused:
        custom_system(text)
    assert says in str(refused.value), str(refused.value)


def test_the_command_line_refuses_a_bad_one_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli, "run_matrix", lambda *a, **k: pytest.fail("the matrix ran"))
    assert cli.main([*RUN, "--system", "mine:eviction=nope", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --system mine: no eviction plug-in named 'nope'") and err.count("\n") == 1, err
    assert cli.main([*RUN, "--system", "a:k=1", "--system", "a:k=2", "--out", str(tmp_path / "o")]) == 2
    assert "--system a: given twice" in capsys.readouterr().err


def test_a_custom_system_runs_beside_the_built_in_ones_and_a_failing_one_fails_alone(tmp_path, capsys):
    """dummy-random (the test plug-in, an installed third-party eviction) decodes token for token as the baseline;
    dummy-broken cannot be loaded: its cell fails with the plug-in's message, the cells after it still run, and the
    exit status says some cells failed (4), not done (0)."""
    out = tmp_path / "out"
    code = cli.main([*RUN, "--systems", "ondemand", "--system", "broken:eviction=dummy-broken",
                     "--system", "mine:like=specter-fixed,eviction=dummy-random,k=2", "--out", str(out)])
    captured = capsys.readouterr()
    assert code == cli.CELLS_FAILED, captured.err
    payload = json.loads((out / "results.json").read_text())
    status = {cell["system"]: cell["status"] for cell in payload["cells"]}
    assert status["ondemand"] == "ok" and status["mine"] == "ok", status
    assert status["broken"].startswith("failed: ") and "dummy-broken" in status["broken"], status
    rows = {row["system"]: row for row in payload["summary"]}
    assert set(rows) == {"ondemand", "mine"} and rows["mine"]["tokens_equal"] is True
    assert rows["mine"]["acceptance"] is not None and rows["ondemand"]["acceptance"] is None  # it speculated (like specter-fixed, at k = 2)
    assert "1 cell(s) failed, the others ran" in captured.err and "broken" in captured.err
    assert any("broken" in note and "failed" in note for note in payload["notes"])


def test_a_custom_system_naming_a_plug_in_the_allow_list_hides_is_refused_saying_so(monkeypatch):
    """With SPECTER_PLUGINS set, an installed plug-in it leaves out read as not installed."""
    monkeypatch.setenv("SPECTER_PLUGINS", "lru,plan-protect,none,topm-keep,fixed,roofline,cpu")
    with pytest.raises(ConfigError) as refused:
        custom_system("mine:eviction=lfu")
    assert "the eviction plug-in 'lfu' is installed, but SPECTER_PLUGINS does not allow it" in str(refused.value)
