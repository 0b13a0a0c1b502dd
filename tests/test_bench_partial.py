"""The bench's results survive a stop: written after every cell (valid JSON at every moment, marked partial until the
end), SIGTERM abandons the cell in progress and exits 143, merge says a part was partial. CPU, the built-in tiny model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specter.bench import cli, protocol, report
from specter.bench.stopping import exit_status

ROOT = Path(__file__).resolve().parents[1]
RUN = ["--max-new-tokens", "6", "--warmup-tokens", "2", "--link", "1", "--no-progress", "--no-plots", "--no-hf"]
SYSTEMS = ["--systems", "resident,ondemand,specter"]

CHILD = """
import asyncio, os, sys, time
from pathlib import Path
from specter.bench import cli, protocol, stopping, systems

mode = sys.argv[1]
request = protocol.ModelBench._request

async def slow(self, runtime, system, prompt, start_state, cell, warm=False):
    if len(self.cells) >= 2 and not warm:  # the third cell hangs in its second measured request (its first has ended)
        self.third_cell_requests = getattr(self, "third_cell_requests", 0) + 1
        if self.third_cell_requests == 2:
            Path(os.environ["HANG_MARKER"]).touch()
            if mode == "stuck":
                time.sleep(120)  # no await: the cancellation cannot reach it, the watchdog must end the process
            else:
                await asyncio.sleep(120)
    return await request(self, runtime, system, prompt, start_state, cell, warm)

aclose = systems.BenchRuntime.aclose

async def closing(self):
    await aclose(self)
    print("runtime closed", flush=True)

protocol.ModelBench._request = slow
systems.BenchRuntime.aclose = closing
stopping.STOP_GRACE_S = 2.0
code = cli.main(sys.argv[2:])
if mode == "embedded":  # a program that called the bench goes on after the stop, past the watchdog's grace
    print(f"bench returned {code}", flush=True)
    time.sleep(2 * stopping.STOP_GRACE_S)
    print("the caller went on", flush=True)
    sys.exit(0)
sys.exit(code)
"""


def stopped_run(out: Path, mode: str, signals: int = 1) -> tuple[subprocess.CompletedProcess, float]:
    """The bench in a child process on tiny, whose third cell hangs in its second measured request; SIGTERM once it
    hangs there and results.json, read as an observer would, holds two ended cells. Returns the process and the
    seconds from the signal to its exit."""
    marker = out.parent / f"{out.name}.hanging"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), HANG_MARKER=str(marker))
    child = subprocess.Popen([sys.executable, "-c", CHILD, mode, *RUN, *SYSTEMS, "--out", str(out)], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert child.poll() is None, child.communicate()
            assert time.monotonic() < deadline, "the bench did not reach its third cell"
            time.sleep(0.05)
        # the third cell has begun: the files must hold the first two already
        assert len(read_results(out).get("cells", [])) == 2, read_results(out)
        time.sleep(0.2)  # into the hang
        signalled = time.monotonic()
        child.send_signal(signal.SIGTERM)
        for _ in range(signals - 1):  # an impatient user's next ones
            time.sleep(0.3)
            child.send_signal(signal.SIGTERM)
        stdout, stderr = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    return subprocess.CompletedProcess(child.args, child.returncode, stdout, stderr), time.monotonic() - signalled


def read_results(out: Path) -> dict:
    """results.json as a reader sees it at any moment: absent, or whole (never torn)."""
    try:
        text = (out / "results.json").read_text()
    except FileNotFoundError:
        return {}
    return json.loads(text)


def test_sigterm_keeps_the_finished_cells_marked_partial_and_exits_143(tmp_path):
    out = tmp_path / "out"
    process, seconds = stopped_run(out, "await")
    assert process.returncode == exit_status(signal.SIGTERM) == 143, process.stderr
    assert seconds < 30  # the hung cell was abandoned, not waited for
    assert process.stdout.count("runtime closed") == 2, process.stdout  # the resident one, and the offloaded one stopped
    results = read_results(out)
    assert results["complete"] is False
    assert results["partial"]["reason"].startswith("stopped by SIGTERM")
    assert results["partial"]["remaining"] == [{"model": "tiny", "setting": "residents=6", "link": "1", "system": "specter"}]
    assert [(cell["system"], cell["status"]) for cell in results["cells"]] == [("resident", "ok"), ("ondemand", "ok")]
    # whole cells only: the abandoned specter cell had measured a request, not kept
    assert sorted(run["system"] for run in results["runs"]) == ["ondemand"] * 3 + ["resident"] * 3
    assert {row["system"] for row in results["summary"]} == {"resident", "ondemand"}
    assert all(row["tokens_equal"] for row in results["summary"])
    markdown = (out / "results.md").read_text()
    assert "**Partial results** (stopped by SIGTERM" in markdown and "- tiny residents=6 1 specter" in markdown
    assert sorted(path.name for path in out.iterdir()) == ["results.json", "results.md"]  # no temporary file left
    assert "SIGTERM" in process.stderr and "exit status 143" in process.stderr


def test_a_program_that_calls_the_bench_goes_on_after_a_stop(tmp_path):
    """The watchdog guards the stop's unwind only: once `cli.main` has returned 143, the caller is not ended by it."""
    process, _ = stopped_run(tmp_path / "out", "embedded")
    assert process.returncode == 0, process.stderr
    assert "bench returned 143" in process.stdout and "the caller went on" in process.stdout, process.stdout
    assert "ending the process" not in process.stderr


def test_a_cell_that_ignores_the_stop_is_ended_by_the_watchdog_with_the_files_kept(tmp_path):
    process, seconds = stopped_run(tmp_path / "out", "stuck")
    assert process.returncode == 143, process.stderr
    assert seconds < 30 and "did not end within 2 s" in process.stderr
    results = read_results(tmp_path / "out")
    assert results["complete"] is False and "did not end within 2 s" in results["partial"]["reason"]
    assert [cell["system"] for cell in results["cells"]] == ["resident", "ondemand"] and len(results["runs"]) == 6


def test_a_second_signal_ends_the_stop_at_once_and_says_so(tmp_path):
    """The reason said the grace had run out when a second signal had ended the stop 0.1 s after the first."""
    process, seconds = stopped_run(tmp_path / "out", "stuck", signals=2)
    assert process.returncode == 143 and seconds < 2, (seconds, process.stderr)  # not the 2 s grace
    reason = read_results(tmp_path / "out")["partial"]["reason"]
    assert "a second SIGTERM" in reason and "did not end within" not in reason, reason


def test_results_are_written_after_every_cell_and_marked_complete_at_the_end(tmp_path, monkeypatch):
    """Every write is a whole results file; until the last, partial with the cells not yet ended."""
    written = []
    write_json = report.write_json

    def keep(path, payload):
        write_json(path, payload)
        written.append(json.loads(Path(path).read_text()))

    monkeypatch.setattr(report, "write_json", keep)
    assert cli.main([*RUN, *SYSTEMS, "--link", "1,2", "--out", str(tmp_path)]) == 0
    planned = [("resident", "-"), ("ondemand", "1"), ("specter", "1"), ("ondemand", "2"), ("specter", "2")]
    assert len(written) == 1 + len(planned) + 1 + 1  # at the start, after each cell, after the model, at the end
    for index, payload in enumerate(written[:-1]):
        assert payload["complete"] is False and payload["partial"]["reason"].startswith("running")
        ended = [(cell["system"], cell["link"]) for cell in payload["cells"]]
        assert ended == planned[:len(ended)] and len(ended) == min(index, len(planned))
        assert [(cell["system"], cell["link"]) for cell in payload["partial"]["remaining"]] == planned[len(ended):]
        assert len(payload["runs"]) == 3 * len(ended)
    final = read_results(tmp_path)
    assert final == written[-1] and final["complete"] is True and "partial" not in final
    assert "Partial" not in (tmp_path / "results.md").read_text()


def test_a_write_cut_short_leaves_the_previous_file(tmp_path, monkeypatch):
    path = tmp_path / "results.json"
    report.write_json(path, {"cells": [1]})

    def killed(source, destination):
        raise KeyboardInterrupt  # as if the process died between writing the new file and renaming it

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        report.write_json(path, {"cells": [1, 2]})
    assert json.loads(path.read_text()) == {"cells": [1]} and [p.name for p in tmp_path.iterdir()] == ["results.json"]


def failing_third_cell(monkeypatch) -> None:
    """The bench's third cell raises in its second measured request (its first has ended)."""
    request = protocol.ModelBench._request

    async def failing(self, *args, **kwargs):
        if len(self.cells) >= 2 and not kwargs.get("warm", False):
            self.third_cell_requests = getattr(self, "third_cell_requests", 0) + 1
            if self.third_cell_requests == 2:
                raise ZeroDivisionError("a bug in the third cell")
        return await request(self, *args, **kwargs)

    monkeypatch.setattr(protocol.ModelBench, "_request", failing)


def test_an_unexpected_error_in_a_cell_leaves_the_finished_cells_marked_failed(tmp_path, monkeypatch):
    failing_third_cell(monkeypatch)
    with pytest.raises(ZeroDivisionError):
        cli.main([*RUN, *SYSTEMS, "--out", str(tmp_path)])
    results = read_results(tmp_path)
    assert results["complete"] is False
    assert results["partial"]["reason"].startswith("failed: ZeroDivisionError: a bug in the third cell")
    assert sorted(run["system"] for run in results["runs"]) == ["ondemand"] * 3 + ["resident"] * 3  # whole cells only
    assert results["partial"]["remaining"] == [{"model": "tiny", "setting": "residents=6", "link": "1", "system": "specter"}]


def test_merge_of_a_partial_part_says_so(tmp_path, monkeypatch, capsys):
    partial = tmp_path / "partial"
    with monkeypatch.context() as patch:
        failing_third_cell(patch)
        with pytest.raises(ZeroDivisionError):
            cli.main([*RUN, *SYSTEMS, "--out", str(partial)])
    rest = tmp_path / "rest"  # the partial run's missing cell, run on its own
    assert cli.main([*RUN, "--systems", "specter", "--out", str(rest)]) == 0
    other = tmp_path / "other"  # another link: the partial run's missing cell stays missing
    assert cli.main([*RUN, "--systems", "specter", "--link", "2", "--out", str(other)]) == 0
    capsys.readouterr()

    merged = tmp_path / "merged"
    assert cli.main(["--merge", str(partial), "--merge", str(other), "--no-plots", "--out", str(merged)]) == 0
    results = read_results(merged)
    note = f"merged part {partial} is partial (failed: ZeroDivisionError"
    assert any(n.startswith(note) and "1 of its planned cells had not ended" in n for n in results["notes"]), results["notes"]
    assert note in capsys.readouterr().err  # with the other notes, as a run prints them
    assert results["complete"] is False
    assert results["partial"]["remaining"] == [{"model": "tiny", "setting": "residents=6", "link": "1", "system": "specter"}]
    assert [part["complete"] for part in results["merged_from"]] == [False, True]
    assert "**Partial results**" in (merged / "results.md").read_text()

    whole = tmp_path / "whole"  # with the missing cell from another part, the merged matrix has every planned cell
    assert cli.main(["--merge", str(partial), "--merge", str(rest), "--no-plots", "--out", str(whole)]) == 0
    results = read_results(whole)
    assert results["complete"] is True and "partial" not in results
    assert any(n.startswith(note) for n in results["notes"])
    assert {row["system"] for row in results["summary"]} == {"resident", "ondemand", "specter"}


def test_merge_counts_an_hf_baseline_that_another_part_ran(tmp_path, capsys):
    """hf-accelerate keeps records and no cell: a partial part missing it, merged with a part whose records hold it,
    makes a complete matrix."""
    hf = {"model": "tiny", "setting": "residents=6", "link": "native", "system": "hf-accelerate"}
    part = tmp_path / "part"
    assert cli.main([*RUN, "--systems", "ondemand", "--out", str(part)]) == 0
    payload = read_results(part)
    payload["complete"], payload["partial"] = False, {"reason": "stopped by SIGTERM", "remaining": [hf]}
    (part / "results.json").write_text(json.dumps(payload))
    ran = tmp_path / "ran"
    assert cli.main([*RUN, "--systems", "ondemand", "--link", "2", "--out", str(ran)]) == 0
    payload = read_results(ran)
    payload["runs"].append(payload["runs"][0] | hf)  # an hf record, as run_hf keeps it (no cell)
    (ran / "results.json").write_text(json.dumps(payload))
    capsys.readouterr()
    merged = tmp_path / "merged"
    assert cli.main(["--merge", str(part), "--merge", str(ran), "--no-plots", "--out", str(merged)]) in (0, 1)
    results = read_results(merged)
    assert results["complete"] is True and "partial" not in results, results.get("partial")
