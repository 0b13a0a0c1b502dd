"""What `python -m specter.bench` does with its --out folder: an earlier run's files are kept, and a write that fails
is a one-line error naming the path. CPU, the built-in tiny model."""

from __future__ import annotations

import json

from specter.bench import cli
from specter.bench.plots import PLOT_FILES

RUN = ["--model", "tiny", "--systems", "resident", "--max-new-tokens", "2", "--warmup-tokens", "1", "--no-plots",
       "--no-progress", "--no-hf", "--device", "cpu"]


def test_a_second_run_into_one_out_moves_the_first_runs_files_to_previous(tmp_path, capsys):
    """The second run replaced results.json at its start: a crash or stop of it left a file of 0 runs."""
    out = tmp_path / "out"
    assert cli.main([*RUN, "--out", str(out)]) == 0
    first = json.loads((out / "results.json").read_text())
    (out / PLOT_FILES[0]).write_bytes(b"the first run's plot")
    capsys.readouterr()
    assert cli.main([*RUN, "--out", str(out)]) == 0
    err = capsys.readouterr().err
    (kept,) = (out / cli.PREVIOUS).iterdir()
    assert json.loads((kept / "results.json").read_text()) == first
    assert sorted(path.name for path in kept.iterdir()) == sorted(["results.json", "results.md", PLOT_FILES[0]])
    assert ":" not in kept.name and kept.name.startswith(first["machine"]["date"][:10]), kept.name
    assert f"moved to {kept}" in err, err
    assert json.loads((out / "results.json").read_text())["complete"] is True
    assert not (out / PLOT_FILES[0]).exists()


def test_runs_stamped_alike_each_keep_their_own_previous_folder(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    for text in ("first", "second"):
        (out / "results.md").write_text(text)
        cli.keep_previous(out)
    assert sorted((kept / "results.md").read_text() for kept in (out / cli.PREVIOUS).iterdir()) == ["first", "second"]
    assert not (out / "results.md").exists() and cli.keep_previous(out) is None
    (out / "results.json").write_text("[" * 100_000 + "]" * 100_000)  # was a RecursionError traceback
    assert cli.keep_previous(out) is not None and not (out / "results.json").exists()


def test_a_full_disk_is_a_one_line_error_naming_the_file(tmp_path, capsys, monkeypatch):
    """ENOSPC in report.write_text was a traceback and exit 1."""
    import errno

    from specter.bench import report

    def full(path, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(report, "write_text", full)
    code = cli.main([*RUN, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: --out: cannot write ") and err.count("\n") == 1, err
    assert str(tmp_path / "out" / "results.json") in err and "No space left on device" in err, err


def test_an_out_folder_that_cannot_be_made_is_a_one_line_error(tmp_path, capsys, monkeypatch):
    """A mkdir refused at the start (--out under /sys as root: PermissionError) was a traceback and exit 1."""
    from pathlib import Path

    def refused(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "mkdir", refused)
    code = cli.main([*RUN, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"error: --out: cannot write {tmp_path / 'out'} (Permission denied)"), err
    assert err.count("\n") == 1, err
