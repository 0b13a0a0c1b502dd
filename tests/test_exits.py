"""The exit statuses every tool shares (specter.exits): a reader that leaves is 141 with nothing on stderr, a full
disk under stdout one `error:` line and 2, an engine field the bench cannot use 2 before any cell; never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from specter.trace import TraceWriter

from tests.test_replay import HEADER, rotating_rounds

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "cpu-2026-12-04" / "cpu-quick"


@pytest.fixture
def tools(tmp_path) -> dict[str, list[str]]:
    """A command line of each tool that prints to stdout within seconds, with nothing to measure."""
    trace = tmp_path / "toy.jsonl"
    with TraceWriter(trace, HEADER) as writer:
        for trace_round in rotating_rounds(4):
            writer.write_round(trace_round)
    return {
        "bench": ["specter.bench", "--merge", str(RESULTS), "--out", str(tmp_path / "merged"), "--no-plots"],
        "replay": ["specter.replay", str(trace), "--link", "25"],
        "widen": ["specter.bench.widen", "--table"],
        "info": ["specter", "info", "tiny", "--no-measure"],
    }


def _run(argv: list[str], stdout) -> subprocess.Popen:
    """The tool as a shell runs it: stdout block-buffered (PYTHONUNBUFFERED would hide an unflushed print's failure)."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONUNBUFFERED"}
    return subprocess.Popen([sys.executable, "-m", *argv], stdout=stdout, stderr=subprocess.PIPE, text=True, env=env)


@pytest.mark.parametrize("tool", ["bench", "replay", "widen", "info"])
def test_each_tool_runs_then_a_reader_that_left_is_141(tools, tool):
    done = subprocess.run([sys.executable, "-m", *tools[tool]], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0 and done.stdout, done.stderr  # the command itself works: the failures below are stdout's
    process = _run(tools[tool], subprocess.PIPE)
    assert process.stdout is not None
    process.stdout.close()  # before the tool (still importing) writes anything
    _, err = process.communicate(timeout=180)
    assert process.returncode == 141 and "Traceback" not in err and "error" not in err, err


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize("tool", ["bench", "replay", "widen", "info"])
def test_a_full_disk_under_stdout_is_one_error_line(tools, tool):
    with open("/dev/full", "w") as full:
        process = _run(tools[tool], full)
        _, err = process.communicate(timeout=180)
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert process.returncode == 2 and "Traceback" not in err and "Exception ignored" not in err, err
    assert len(lines) == 1 and "stdout" in lines[0] and "No space left on device" in lines[0], err


@pytest.mark.parametrize("device", ["foo", "cuda:x", ""])
def test_the_bench_refuses_a_device_before_any_cell(device, tmp_path, capsys):
    from specter.bench.cli import main

    assert main(["--device", device, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: invalid configuration: EngineConfig.device = ") and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()
