"""`python -m specter.bench --merge` on what is not a bench output: a one-line error naming the file (exit 2), never a
traceback. CPU, the built-in tiny model."""

from __future__ import annotations

import json

import pytest

from specter.bench import cli

RUN = ["--model", "tiny", "--systems", "resident", "--max-new-tokens", "2", "--warmup-tokens", "1", "--no-plots",
       "--no-progress", "--no-hf", "--device", "cpu"]


@pytest.fixture(scope="module")
def part(tmp_path_factory):
    out = tmp_path_factory.mktemp("part") / "out"
    assert cli.main([*RUN, "--out", str(out)]) == 0
    return out


def test_a_results_json_given_for_its_folder_merges(part, tmp_path):
    """--merge DIR/results.json was a NotADirectoryError traceback."""
    out = tmp_path / "merged"
    assert cli.main(["--merge", str(part / "results.json"), "--no-plots", "--out", str(out)]) == 0
    assert len(json.loads((out / "results.json").read_text())["runs"]) == 3


@pytest.mark.parametrize("change, says", [
    (lambda payload: payload | {"runs": [{}]}, "runs[0] has no model"),
    (lambda payload: payload | {"runs": [1]}, "runs[0] is 1, not an object"),
    (lambda payload: payload | {"cells": [1]}, "cells[0] is 1, not an object"),
    (lambda payload: payload | {"runs": {"a": 1}}, "runs is a dict, not a list"),
    (lambda payload: [payload], "a JSON list, not an object"),
    (lambda payload: payload | {"runs": [{"model": "m", "setting": "s", "link": "l", "system": "x"}]}, "not a bench measurement"),
])
def test_entries_of_the_wrong_shape_are_one_line_errors_naming_the_file(change, says, part, tmp_path, capsys):
    """runs: [{}] was a KeyError traceback, runs: [1] a TypeError, cells: [1] an AttributeError."""
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "results.json").write_text(json.dumps(change(json.loads((part / "results.json").read_text()))))
    code = cli.main(["--merge", str(bad), "--no-plots", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: --merge: ") and err.count("\n") == 1 and says in err, err
    assert str(bad) in err, err
    assert not (tmp_path / "out").exists()


def test_a_results_json_that_is_a_folder_or_a_file_that_is_no_folder_is_a_one_line_error(tmp_path, capsys):
    """IsADirectoryError and NotADirectoryError tracebacks."""
    folder = tmp_path / "folder"
    (folder / "results.json").mkdir(parents=True)
    afile = tmp_path / "afile"
    afile.write_text("not a bench output")
    for given in (folder, afile):
        code = cli.main(["--merge", str(given), "--no-plots", "--out", str(tmp_path / "out")])
        err = capsys.readouterr().err
        assert code == 2 and err.startswith("error: --merge: ") and "cannot be read" in err and err.count("\n") == 1, err


@pytest.mark.parametrize("extra, named", [(["--systems", "foo"], "--systems"), (["--model", "/nonexist"], "--model"),
                                          (["--device", "cuda", "--max-new-tokens", "3"], "--max-new-tokens, --device")])
def test_run_options_beside_merge_are_refused_naming_them(extra, named, part, tmp_path, capsys):
    """--merge runs nothing: the options of a run beside it exited 0, unread, as if they had shaped the merged table."""
    out = tmp_path / "out"
    code = cli.main(["--merge", str(part), *extra, "--no-plots", "--no-progress", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and f"--merge runs nothing, so {named} would be ignored" in err and err.count("\n") == 1, err
    assert not out.exists()


@pytest.mark.parametrize("change, status", [
    (lambda payload: payload | {"runs": [run | {"tokens_equal": False} for run in payload["runs"]]}, 1),
    (lambda payload: payload | {"runs": [], "cells": []}, cli.NOTHING_MEASURED),
])
def test_a_merge_exits_as_its_parts_runs_would(change, status, part, tmp_path, capsys):
    """A merge exited 0 whatever it held: a part whose rows differ from their baseline (the bench's exit 1), or parts
    with no run at all (exit 3), read as a success."""
    changed = tmp_path / "changed"
    changed.mkdir()
    (changed / "results.json").write_text(json.dumps(change(json.loads((part / "results.json").read_text()))))
    assert cli.main(["--merge", str(changed), "--no-plots", "--out", str(tmp_path / "out")]) == status
    assert (tmp_path / "out" / "results.json").is_file()
    assert (status == cli.NOTHING_MEASURED) == ("nothing was measured: the merged parts hold no run" in capsys.readouterr().err)


def test_a_merge_compares_no_systems_of_different_parts(tmp_path, capsys):
    """Parts that ran different systems in the same cell are disjoint (a cell names its system), and the merged table's
    x columns compared one process's TPOT with another's, unsaid. They are left out now, with a note; the same pair
    run in one part keeps its ratio."""
    base = ["--model", "tiny", "--max-new-tokens", "3", "--warmup-tokens", "1", "--no-plots", "--no-progress", "--no-hf",
            "--device", "cpu", "--link", "0.1"]
    assert cli.main([*base, "--systems", "ondemand,specter", "--out", str(tmp_path / "a")]) == 0
    assert cli.main([*base, "--systems", "specmoeoff", "--out", str(tmp_path / "b")]) == 0
    out = tmp_path / "merged"
    assert cli.main(["--merge", str(tmp_path / "a"), "--merge", str(tmp_path / "b"), "--no-plots", "--out", str(out)]) == 0
    merged = json.loads((out / "results.json").read_text())
    rows = {row["system"]: row for row in merged["summary"]}
    assert rows["specter"]["x_ondemand"] is not None and rows["specter"]["part"] == rows["ondemand"]["part"] == 0
    assert rows["specter"]["x_specmoeoff"] is None and rows["specmoeoff"]["x_ondemand"] is None
    assert any("no x column compares systems run in different parts" in note and "specter and specmoeoff" in note
               for note in merged["notes"]), merged["notes"]


def test_a_merge_of_one_run_prints_what_the_run_printed(tmp_path, capsys):
    """The merge printed its short table alone: no host-path table, no reading, no flags, where the run printed them
    (the merged results.md had them)."""
    base = ["--model", "tiny", "--max-new-tokens", "3", "--warmup-tokens", "1", "--no-plots", "--no-progress", "--no-hf",
            "--device", "cpu", "--link", "0.1", "--systems", "ondemand,cpu-experts"]
    assert cli.main([*base, "--out", str(tmp_path / "a")]) == 0
    ran = capsys.readouterr()
    assert cli.main(["--merge", str(tmp_path / "a"), "--no-plots", "--out", str(tmp_path / "merged")]) == 0
    merged = capsys.readouterr()
    run_lines = [line for line in ran.out.splitlines() if " requests in " not in line]
    merge_lines = [line for line in merged.out.splitlines() if not line.startswith("merged 1 result sets")]
    assert any(line.startswith("Host path") for line in run_lines) and merge_lines == run_lines
