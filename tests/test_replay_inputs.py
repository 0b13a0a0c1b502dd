"""Bad input to `python -m specter.replay` is refused with exit 2 before any replay: links and host costs that are
no finite positive number, and plug-in names that do not load."""

from __future__ import annotations

import pytest

from specter.replay import main
from specter.trace import TraceWriter

from tests.test_replay import HEADER, reference_plugins, rotating_rounds  # noqa: F401  (the fixture, by name)


@pytest.fixture
def trace(tmp_path):
    path = tmp_path / "toy.jsonl"
    with TraceWriter(path, HEADER) as writer:
        for trace_round in rotating_rounds(4):
            writer.write_round(trace_round)
    return path


def exits_2(argv, capsys) -> str:
    """argparse's refusal: exit status 2, the reason on stderr, nothing on stdout; the stderr."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    captured = capsys.readouterr()
    assert exited.value.code == 2 and captured.out == "", captured
    return captured.err


@pytest.mark.parametrize("link", ["nan", "inf", "-inf", "0", "-1"])
def test_a_link_that_is_no_finite_positive_gbps_is_refused(trace, capsys, reference_plugins, link):
    err = exits_2([str(trace), f"--link={link}"], capsys)
    assert f"argument --link: {link!r}: expected a finite number above 0" in err, err


@pytest.mark.parametrize("option, value, expected", [
    ("--host-ms", "nan", "a finite number above 0"),
    ("--host-ms", "inf", "a finite number above 0"),
    ("--host-ms", "0", "a finite number above 0"),
    ("--host-job-ms", "nan", "a finite number of 0 or more"),
    ("--host-job-ms", "-1", "a finite number of 0 or more"),
])
def test_placement_host_costs_that_are_no_finite_numbers_are_refused(trace, capsys, option, value, expected):
    err = exits_2([str(trace), "--placement", "auto", "--host-ms", "10", f"{option}={value}"], capsys)
    assert f"argument {option}: {value!r}: expected {expected}" in err, err


def test_slots_below_one_are_refused(trace, capsys, reference_plugins):
    assert "--slots 0: expected 1 or more" in exits_2([str(trace), "--slots", "0"], capsys)


@pytest.mark.parametrize("argv, group", [
    (["--eviction", "nope"], "eviction"),
    (["--eviction", "lru,nope"], "eviction"),
    (["--prefetch", "nope"], "prefetch"),
])
def test_an_unknown_plugin_named_is_refused_listing_the_installed_ones(trace, capsys, reference_plugins, argv, group):
    """As `specter generate --eviction nope` is: exit 2 naming the installed plug-ins, no table with the rest."""
    assert main([str(trace), *argv]) == 2
    captured = capsys.readouterr()
    installed = {"eviction": "lru, plan-protect", "prefetch": "none, topm-frequency"}[group]
    assert captured.out == "" and captured.err.count("\n") == 1, captured
    assert captured.err.startswith(f"error: no {group} plug-in named 'nope'; installed: {installed}"), captured.err


@pytest.mark.parametrize("option", ["--eviction", "--prefetch", "--placement"])
def test_an_unknown_plugin_named_beside_placements_is_refused(trace, capsys, option):
    """With --placement only the first eviction and prefetch are used; every name given is still checked."""
    placements = "nope" if option == "--placement" else "off"
    extra = [] if option == "--placement" else [option, "lru,nope" if option == "--eviction" else "none,nope"]
    assert main([str(trace), "--placement", placements, "--host-ms", "10", *extra]) == 2
    captured = capsys.readouterr()
    group = option.removeprefix("--")
    assert captured.out == "" and captured.err.count("\n") == 1, captured
    assert captured.err.startswith(f"error: no {group} plug-in named 'nope'; installed: "), captured.err


def test_a_plugin_the_allow_list_leaves_out_is_refused_when_named(trace, capsys, reference_plugins, monkeypatch):
    monkeypatch.setenv("SPECTER_PLUGINS", "eviction:plan-protect")
    assert main([str(trace), "--eviction", "lru"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "eviction plug-in 'lru' is installed but SPECTER_PLUGINS" in captured.err, captured


def test_named_plugins_that_load_still_replay(trace, capsys, reference_plugins):
    assert main([str(trace), "--link", "0.5", "--eviction", "lru", "--prefetch", "none"]) == 0
    assert "link 0.5 GB/s" in capsys.readouterr().out
