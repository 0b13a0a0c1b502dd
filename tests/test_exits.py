"""The exit statuses every tool shares (specter.exits): a reader that leaves is 141 with nothing on stderr, a full
disk under stdout one `error:` line and 2, an engine field the bench cannot use 2 before any cell; never a traceback."""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import shlex
import signal
import subprocess
import sys
import textwrap
import threading
import time
import tomllib
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


# ---- Ctrl-C during the imports and after the tool ---------------------------------------------------------------
# A Ctrl-C that landed inside `import torch` was lost in its C code with numpy half-imported: the tool then failed with
# a false error (a plug-in's "module 'numpy' has no attribute 'nonzero'"), finished as if never interrupted, or aborted.
# These stand in for torch with a module that interrupts its own import midway.
INTERRUPTING_MODULE = """
import os, signal
os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C midway through this import
import time
time.sleep(0.05)  # (the signal's handler runs here at the latest)
WHOLE = True
"""


@pytest.fixture
def interrupting_module(tmp_path, monkeypatch):
    name = f"interrupts_its_import_{tmp_path.name}"
    (tmp_path / f"{name}.py").write_text(INTERRUPTING_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_a_ctrl_c_during_a_preloaded_import_waits_for_the_import_then_ends_the_tool(interrupting_module, capsys):
    from specter.exits import INTERRUPTED_STATUS, run_tool

    ran: list[bool] = []
    assert run_tool(lambda: ran.append(True) or 0, preload=(interrupting_module,)) == INTERRUPTED_STATUS
    assert sys.modules[interrupting_module].WHOLE and ran == []  # the import completed; the body never ran
    assert capsys.readouterr().err == "interrupted\n"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is given back


def test_a_ctrl_c_during_an_entry_points_imports_is_interrupted_not_a_traceback(interrupting_module, capsys):
    from specter.exits import INTERRUPTED_STATUS, load_tool

    with pytest.raises(SystemExit) as ended:
        load_tool(lambda: importlib.import_module(interrupting_module))
    assert ended.value.code == INTERRUPTED_STATUS and sys.modules[interrupting_module].WHOLE
    assert capsys.readouterr().err == "interrupted\n"
    assert load_tool(lambda: "the tool's main") == "the tool's main"  # no Ctrl-C: what load returns


def test_interrupt_held_raises_nothing_without_a_ctrl_c_and_runs_as_is_off_the_main_thread():
    from specter.exits import interrupt_held

    with interrupt_held():
        pass
    outcome: list[object] = []

    def off_main() -> None:
        with interrupt_held():
            outcome.append("ran")

    thread = threading.Thread(target=off_main)
    thread.start()
    thread.join(10)
    assert outcome == ["ran"]


@pytest.mark.parametrize("quiet", [True, False])
def test_a_ctrl_c_during_the_exit_handlers_after_the_tool_ends_quietly(quiet):
    """A late Ctrl-C (the tool done, the interpreter's exit handlers running) printed 'Exception ignored in atexit
    callback' with a KeyboardInterrupt traceback, and the process exited 0."""
    script = textwrap.dedent(f"""
        import atexit, os, signal, time
        from specter.exits import quiet_late_interrupt
        atexit.register(lambda: (os.kill(os.getpid(), signal.SIGINT), time.sleep(0.5)))
        print("done", flush=True)
        if {quiet}:
            quiet_late_interrupt()
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.stdout == "done\n"
    if quiet:
        assert done.returncode == -signal.SIGINT and "Traceback" not in done.stderr, done.stderr
    else:  # the control: what the entry points did before
        assert done.returncode == 0 and "Exception ignored" in done.stderr



# Every entry point a user starts, with the `tools` command it runs: the console scripts (run as pip's wrapper runs
# them, from pyproject's [project.scripts], so no reinstall is needed) and `python -m` (as runpy runs it).
ENTRY_POINTS = {"-m specter": "info", "-m specter.bench": "bench", "-m specter.replay": "replay",
                "-m specter.bench.widen": "widen", "specter": "info", "specter-bench": "bench",
                "specter-replay": "replay"}


def _console_scripts() -> dict[str, str]:
    with open(Path(__file__).resolve().parents[1] / "pyproject.toml", "rb") as file:
        return tomllib.load(file)["project"]["scripts"]


def _start(entry: str, argv: list[str], prelude: str) -> subprocess.CompletedProcess:
    """`entry` run with argv in a fresh interpreter, after `prelude`."""
    if entry.startswith("-m "):
        module = entry.removeprefix("-m ")
        start = (f"import runpy, sys\nsys.argv = {[module, *argv]!r}\n"
                 f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)\n")
    else:  # pip's wrapper
        module, function = _console_scripts()[entry].split(":")
        start = f"import sys\nfrom {module} import {function}\nsys.argv = {[entry, *argv]!r}\nsys.exit({function}())\n"
    return subprocess.run([sys.executable, "-c", textwrap.dedent(prelude) + start], capture_output=True, text=True,
                          timeout=180)


def test_each_console_script_is_a_light_entry_that_imports_its_tool_itself():
    """A console script imports its target before any code of ours runs: `specter.replay:main` and
    `specter.bench.cli:main` imported numpy, pydantic (the bench torch) with no Ctrl-C handling in place yet."""
    scripts = _console_scripts()
    assert set(scripts) == {entry for entry in ENTRY_POINTS if not entry.startswith("-m ")}
    for name, target in scripts.items():
        module, function = target.split(":")
        code = (f"import sys\nfrom {module} import {function}\nassert callable({function})\n"
                "print(*sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'pydantic')\n"
                "              or m in ('specter.cli', 'specter.replay') or m.startswith('specter.bench')))")
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and done.stdout == "\n", (name, target, done.stdout, done.stderr)


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_a_ctrl_c_while_an_entry_point_imports_is_interrupted_130(tools, entry):
    """A Ctrl-C as numpy or torch (whichever comes first) starts to import: through a console script or `python -m
    specter.replay` it was a KeyboardInterrupt traceback (status 1)."""
    prelude = """
        import os, signal, sys
        class CtrlC:
            @staticmethod
            def find_spec(name, path=None, target=None):
                if name in ("numpy", "torch"):
                    sys.meta_path.remove(CtrlC)
                    os.kill(os.getpid(), signal.SIGINT)
                return None
        sys.meta_path.insert(0, CtrlC)
    """
    done = _start(entry, tools[ENTRY_POINTS[entry]][1:], prelude)
    assert done.returncode == 130 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.splitlines()[-1:] == ["interrupted"] and done.stdout == "", done.stderr


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_a_ctrl_c_after_an_entry_points_tool_ended_is_quiet(tools, entry):
    """Through a console script or `python -m specter.replay`, a Ctrl-C during the exit handlers was 'Exception
    ignored in atexit callback' with a traceback, and status 0."""
    prelude = """
        import atexit, os, signal, time
        atexit.register(lambda: (os.kill(os.getpid(), signal.SIGINT), time.sleep(0.5)))  # registered first: runs last
    """
    done = _start(entry, tools[ENTRY_POINTS[entry]][1:], prelude)
    assert done.stdout and done.returncode == -signal.SIGINT, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr


@pytest.mark.parametrize("raised", ["KeyboardInterrupt", "SystemExit(2)"])
def test_run_entry_ends_a_ctrl_c_that_escaped_main_as_interrupted_and_quiets_the_exit(raised, tmp_path, monkeypatch,
                                                                                     capsys):
    """A Ctrl-C in a tool's argument parsing, before its `run_tool`, is 'interrupted' and 130 too; whatever ends main
    (argparse's SystemExit included), a later Ctrl-C is quieted."""
    from specter import exits

    name = f"a_tool_{tmp_path.name}"
    (tmp_path / f"{name}.py").write_text(f"def main():\n    raise {raised}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    quieted: list[bool] = []
    monkeypatch.setattr(exits, "quiet_late_interrupt", lambda: quieted.append(True))  # not this test process's SIGINT
    try:
        if raised == "KeyboardInterrupt":
            assert exits.run_entry(name) == exits.INTERRUPTED_STATUS and capsys.readouterr().err == "interrupted\n"
        else:
            with pytest.raises(SystemExit):
                exits.run_entry(name)
    finally:
        sys.modules.pop(name, None)
    assert quieted == [True]


def test_a_sync_engine_load_interrupted_in_the_callers_thread_unwinds_its_tasks(monkeypatch):
    """A Ctrl-C while a SyncEngine loaded left the load's copy tasks pending on a loop closed at once ("Task was
    destroyed but it is pending!" by the dozen): they are cancelled and unwound first now."""
    from specter import sync

    started, unwound = threading.Event(), []

    async def load(*args, **kwargs):
        async def copy() -> None:
            try:
                await asyncio.sleep(60)
            finally:
                unwound.append("copy")

        asyncio.get_running_loop().create_task(copy())
        started.set()
        try:
            await asyncio.sleep(60)
        finally:
            unwound.append("load")

    def interrupted(future, thread):  # the caller's wait for the load, cut by a Ctrl-C
        started.wait(10)
        raise KeyboardInterrupt

    monkeypatch.setattr(sync.Engine, "load", load)
    monkeypatch.setattr(sync, "_result", interrupted)
    with pytest.raises(KeyboardInterrupt):
        sync.SyncEngine("tiny")
    assert sorted(unwound) == ["copy", "load"]


# ---- standard descriptors closed at the start, and Ctrl-C under --json ---------------------------------------------
GENERATE = ["specter", "generate", "--prompt", "hi", "--residents", "6", "--max-new-tokens", "8"]


def _shell(argv: list[str], redirect: str) -> subprocess.CompletedProcess:
    """The tool as a shell starts it with `redirect` (`<&-`: stdin closed; `2>&-`: stderr closed), stdout and stderr
    kept where the redirect leaves them."""
    command = " ".join(["exec", sys.executable, "-m", *argv, redirect])
    return subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=180)


def test_a_tool_started_with_stdin_closed_runs():
    """uvloop's libuv asserts none of its descriptors is 0-2: with stdin closed it opened one there and aborted the
    process on closing it (status 134, the output lost)."""
    done = _shell(GENERATE, "<&-")
    assert done.returncode == 0 and done.stdout and "Assertion" not in done.stderr, (done.returncode, done.stderr)


@pytest.mark.parametrize("argv", [GENERATE, ["specter", "info", "tiny", "--no-measure"]])
def test_a_tool_started_with_stdout_closed_says_so_in_one_line(argv):
    """Python leaves sys.stdout None: `info` died with an AttributeError traceback, `generate` with libuv's abort."""
    done = _shell(argv, ">&-")
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2 and "Traceback" not in done.stderr, (done.returncode, done.stderr)
    assert last == "error: cannot write the output to stdout: stdout is closed; redirect it elsewhere", done.stderr


def test_a_tool_started_with_stderr_closed_writes_its_output():
    """The logging's set-up read sys.stderr.isatty() of None: every tool died before its first line (status 1)."""
    done = _shell(GENERATE, "2>&-")
    assert done.returncode == 0 and done.stdout, done.returncode


def test_a_ctrl_c_under_json_prints_what_was_committed():
    """Text mode keeps the streamed text of an interrupted request; --json printed nothing at all (status 130): it now
    prints the object with the committed tokens and finish_reason "cancelled"."""
    process = subprocess.Popen([sys.executable, "-m", "specter", "generate", "--prompt", "hi", "--residents", "6",
                                "--max-new-tokens", "4000", "--json", "--max-context", "4096",
                                "--stop", "a stop string that the text never holds " * 8],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert process.stderr is not None
    note = process.stderr.readline()  # the built-in model's note, printed as it loads
    assert "built-in model" in note, note
    time.sleep(5)  # decoding: tens of tokens a second even on a slow machine, 4000 would take minutes
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 130 and err.strip().endswith("interrupted"), (process.returncode, err)
    answer = json.loads(out)
    assert answer["finish_reason"] == "cancelled" and answer["tokens"], answer
    assert len(answer["tokens"]) == answer["stats"]["new_tokens"] < 4000
    from specter.builtin import builtin_path
    from specter.tokenizer import Tokenizer

    # the text the stream held back for the stop string is in: the committed tokens' text (it was "")
    assert answer["text"] and answer["text"] == Tokenizer.from_dir(builtin_path("tiny")).decode(answer["tokens"]), answer


def test_a_program_that_closed_stdin_gets_a_loop_that_closes():
    """The engine's loop in a library caller's process whose stdin is closed: asyncio's (uvloop's libuv aborts there)."""
    code = ("import asyncio; from specter.kernel import new_event_loop; loop = new_event_loop(); "
            "loop.run_until_complete(asyncio.sleep(0)); print(type(loop).__module__); loop.close()")
    done = subprocess.run(["bash", "-c", f"exec {sys.executable} -c {shlex.quote(code)} <&-"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip().startswith("asyncio"), (done.returncode, done.stdout, done.stderr)
