"""benchmarks/reproduce.sh: every target it lists dispatches to a function it defines once, and the script parses.

A merge once swapped two function headers, leaving `gpu-widen` calling an undefined function and `qwen` defined twice
(the later definition silently won); only a GPU call found it."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "reproduce.sh"


def defined_functions(text: str) -> Counter:
    return Counter(re.findall(r"^([a-z_][a-z0-9_]*)\(\) \{", text, flags=re.MULTILINE))


def dispatch(text: str) -> dict[str, str]:
    """target -> the function its case branch calls."""
    body = text[text.index('case "$target" in'):]
    return {target: function for target, function in re.findall(r"^\s+([a-z0-9-]+)\) ([a-z_][a-z0-9_]*)\b", body, re.MULTILINE)}


def test_every_target_calls_a_function_defined_once() -> None:
    text = SCRIPT.read_text()
    functions = defined_functions(text)
    assert not [name for name, count in functions.items() if count > 1], functions
    targets = dispatch(text)
    assert len(targets) > 20  # the parse found the case branches
    assert not {target: function for target, function in targets.items() if function not in functions}


def test_the_header_lists_every_target() -> None:
    text = SCRIPT.read_text()
    header = " ".join(line for line in text.splitlines()[:12] if line.startswith("#"))
    assert not [target for target in dispatch(text) if target not in header.split()]


def test_every_helper_a_target_calls_is_defined() -> None:
    """Functions call each other (train_qwen, qwen_bench, gpu_setup): each name called at the start of a line is a
    function, a shell builtin or a command."""
    text = SCRIPT.read_text()
    functions = defined_functions(text)
    called = set(re.findall(r"^\s+([a-z_]+_[a-z0-9_]+)\b(?!=)", text, re.MULTILINE))
    assert not sorted(name for name in called if name not in functions and shutil.which(name) is None)


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_the_script_parses() -> None:
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0


@pytest.mark.parametrize("script, args, says", [
    ("threads_tpot.py", [], "usage: python benchmarks/threads_tpot.py ROUNDS NEW_TOKENS COUNTS"),  # an IndexError traceback
    ("threads_tpot.py", ["1", "4", "0"], "usage: python benchmarks/threads_tpot.py"),  # torch's RuntimeError
    ("serve_load.py", ["--concurrency", "0"], "argument --concurrency: must be 1 or more clients, got 0"),  # StatisticsError
])
def test_a_benchmark_scripts_bad_arguments_are_its_usage_not_a_traceback(script, args, says):
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, str(root / "benchmarks" / script), *args], capture_output=True, text=True,
                          timeout=120, cwd=root, env=os.environ | {"PYTHONPATH": str(root)})
    assert done.returncode == 2 and says in done.stderr and "Traceback" not in done.stderr, done.stderr
