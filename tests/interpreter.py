"""Run a script under Triton's interpreter (TRITON_INTERPRET=1 must be set before triton is imported, hence a
subprocess) and return the JSON its last line prints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]


def run_interpreted(script: str, *args: str, timeout: float = 120) -> Any:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO_ROOT))
    completed = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True,
                               timeout=timeout, check=False, cwd=REPO_ROOT)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(completed.stdout.strip().splitlines()[-1])
