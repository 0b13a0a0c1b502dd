"""Run a script under Triton's interpreter (TRITON_INTERPRET=1 must be set before triton is imported, hence a
subprocess) and return the JSON its last line prints.

Every script runs with the interpreter's `tl.dot` replaced by a fixed-order reduction (FIXED_ORDER_DOT). Triton's
own interpreter computes `tl.dot` with `numpy.matmul`, and numpy's BLAS picks its kernel by CPU and shape: an
output row can round differently depending on where it sits among the 16 rows of a tile (seen on AMD EPYC with
OpenBLAS, Triton 3.6 and 3.9: a token's row in a 16-row call differed from the same token alone). The interpreter
promises nothing about that rounding, so a test that compared rows across calls tested the CPU's BLAS, not our
kernels. The fixed-order dot sums each output element over k in ascending order in float64 (a product of two
float32 values is exact in float64) and rounds once: a row's result depends on that row's operands only, on
every CPU. What the tests then check is our part, the kernels' blocking, masking, grouping and rounding steps;
the GPU's own batch invariance is checked on the GPU (tests/test_gpu_graphed.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]

FIXED_ORDER_DOT = r'''
import numpy as _np
import triton.runtime.interpreter as _interp

_upstream_dot = _interp.InterpreterBuilder.create_dot


def _fixed_order_dot(self, a, b, d, *options):  # options (input precision, ...) vary by Triton version
    # Integer dots are exact whatever the order, and 8-bit floats need the interpreter's own conversion.
    narrow = any(t.dtype.primitive_bitwidth == 8 and t.dtype.is_floating() for t in (a, b))
    if narrow or not _np.issubdtype(d.data.dtype, _np.floating):
        return _upstream_dot(self, a, b, d, *options)
    lhs, rhs = a.data.astype(_np.float64), b.data.astype(_np.float64)
    total = d.data.astype(_np.float64)
    for k in range(lhs.shape[-1]):  # ascending k, elementwise: no BLAS, no dependence on the other rows
        total = total + lhs[..., :, k : k + 1] * rhs[..., k : k + 1, :]
    return _interp.TensorHandle(total.astype(d.data.dtype), d.dtype.scalar)


_interp.InterpreterBuilder.create_dot = _fixed_order_dot
'''


def run_interpreted(script: str, *args: str, timeout: float = 120, prelude: str = "") -> Any:
    """Run `script` (after `prelude`) in a fresh interpreter process with the fixed-order dot installed."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO_ROOT))
    program = "\n".join((FIXED_ORDER_DOT, prelude, script))
    completed = subprocess.run([sys.executable, "-c", program, *args], env=env, capture_output=True, text=True,
                               timeout=timeout, check=False, cwd=REPO_ROOT)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(completed.stdout.strip().splitlines()[-1])
