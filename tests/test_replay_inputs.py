"""Bad input to `python -m specter.replay` is refused with exit 2 before any replay: links the engine would refuse,
host costs that are no finite positive number, slots the engine would refuse, placement options without --placement,
and plug-in names that do not load."""

from __future__ import annotations

import json

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


@pytest.mark.parametrize("link", ["nan", "inf", "-inf", "0", "-1", "1e-300", "0.0009", "gen6"])
def test_a_link_the_engine_would_refuse_is_refused(trace, capsys, reference_plugins, link):
    """As `generate --link` (`parse_link`): 1e-300 GB/s printed a stall hundreds of digits long."""
    err = exits_2([str(trace), f"--link={link}"], capsys)
    assert f"argument --link: link {link!r} is not a link preset or a GB/s figure from 0.001" in err, err


@pytest.mark.parametrize(("link", "gbps"), [("gen3", 12.0), ("GEN4", 25.0), ("gen5", 55.0), ("ddr4-desktop", 20.0),
                                            ("0.001", 0.001)])
def test_the_engines_link_presets_are_taken(trace, capsys, reference_plugins, link, gbps):
    assert main([str(trace), "--link", link, "--json", "--eviction", "lru", "--prefetch", "none"]) == 0
    assert json.loads(capsys.readouterr().out)["link_gbps"] == gbps


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


@pytest.mark.parametrize("slots", ["1", "9"])
def test_slots_the_engine_would_refuse_are_refused(trace, capsys, reference_plugins, slots):
    """The toy trace's model has top_k 2 and 8 experts: the engine takes 2..8 slots per layer (memory._slots); 1 replayed
    a cache no engine can have. (With --placement: tests/test_replay_placement.py.)"""
    assert main([str(trace), "--slots", slots]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and f"error: --slots {slots}: expected 2..8 slots per MoE layer" in captured.err, captured
    assert main([str(trace), "--slots", "2", "--eviction", "lru", "--prefetch", "none"]) == 0


@pytest.mark.parametrize("argv, said", [
    (["--profile", "nonexist"], "--profile only applies"),
    (["--profile", "/tmp"], "--profile only applies"),
    (["--overlap", "7"], "--overlap only applies"),
    (["--row-bucket", "0"], "--row-bucket only applies"),
    (["--host-ms", "1"], "--host-ms only applies"),
    (["--host-job-ms", "1", "--overlap", "1"], "--host-job-ms, --overlap only apply"),
])
def test_placement_options_without_placement_are_refused(trace, capsys, reference_plugins, argv, said):
    """They changed nothing and were silently ignored."""
    err = exits_2([str(trace), *argv], capsys)
    assert f"error: {said} to placements: add --placement" in err, err


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
def test_an_unknown_plugin_named_beside_placements_is_refused(trace, capsys, reference_plugins, option):
    """With --placement every eviction x prefetch pair named is replayed; every name given is checked first."""
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


@pytest.mark.parametrize("entry, usage", [("specter-replay", "usage: specter-replay "),
                                          ("-m specter.replay", "usage: python -m specter.replay "),
                                          ("specter-bench", "usage: specter-bench "),
                                          ("-m specter.bench", "usage: python -m specter.bench ")])
def test_the_usage_names_the_tool_as_it_was_started(entry, usage):
    """`specter-replay --help` said `usage: python -m specter.replay` (`specter-bench` the same): the name was written
    in, not taken from the command the user ran."""
    from tests.test_exits import _start

    done = _start(entry, ["--help"], "")
    assert done.returncode == 0 and done.stdout.startswith(usage), (done.stdout[:200], done.stderr)


def test_log_level_and_json_logs_as_the_other_tools(trace, capsys, reference_plugins):
    """The replay had no --log-level: a plug-in's debug events could not be shown, nor its warnings quieted. It takes
    the other tools' logging options, with their choices."""
    argv = [str(trace), "--eviction", "lru", "--prefetch", "none"]
    assert main([*argv, "--log-level", "debug", "--log-json"]) == 0
    events = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{")]
    assert {(event["event"], event["name"]) for event in events} >= {("plugin.loaded", "lru"), ("plugin.loaded", "none")}
    assert main(argv) == 0
    assert "plugin.loaded" not in capsys.readouterr().err  # the default stays warning
    err = exits_2([*argv, "--log-level", "loud"], capsys)
    assert "argument --log-level: invalid choice" in err and "debug" in err and "error" in err, err
