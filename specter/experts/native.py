"""A native host kernel for one routed expert (SwiGLU) on x86 CPUs with AVX512-BF16: bf16 weights read once, as they
lie in the pool, products accumulated in float32, one OpenMP team for the whole expert.

Why: torch's bf16 `F.linear` on the CPU reformats the weights for oneDNN on each call or pays a fixed cost per product
that dominates at a verify's few rows (docs/BENCHMARKS.md, "Host expert path"); a host expert is a GEMV over bytes
that are read once, so its floor is memory bandwidth. The kernel computes each row on its own, in one fixed order (the
weight rows split over the team, each output a float32 sum over K in the same order whatever the rows or threads):
a row's output does not depend on the rows beside it, as the host path's contract requires.

Built on first use with the system's C compiler (gcc or cc, `-O3 -march=native -fopenmp`) into the cache directory
(`SPECTER_CACHE`), keyed by the source and the CPU; `load()` is None where there is no compiler, no AVX512-BF16, or the
build fails (`unavailable()` says which), and the host path keeps torch's kernel. Which of the two runs is the load's
calibration's choice, the faster on this machine (`specter.experts.costs.host_kernels`, tuning.host.kernel).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from specter.log import get_logger

log = get_logger(__name__)
Tensor = torch.Tensor

SOURCE = r"""
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

/* y[b, n] = sum_k x[b, k] * w[n, k] for b < rows, n < n_out: bf16 in, float32 out. Tiles of 4 weight rows by 4 input
   rows (16 accumulators); the 4 weight rows (4 x K bf16) stay in L1 while the input rows run over them. */
static void gemv_tile(const uint16_t *x, int rows, int k_len, const uint16_t *w, int n0, int n1, float *y, int y_stride) {
    for (int n = n0; n < n1; n += 4) {
        int nn = n1 - n < 4 ? n1 - n : 4;
        for (int b = 0; b < rows; b += 4) {
            int bb = rows - b < 4 ? rows - b : 4;
            __m512 acc[4][4];
            for (int i = 0; i < 4; i++)
                for (int j = 0; j < 4; j++) acc[i][j] = _mm512_setzero_ps();
            for (int k = 0; k < k_len; k += 32) {
                __mmask32 mask = k_len - k >= 32 ? 0xFFFFFFFFu : ((1u << (k_len - k)) - 1u);
                __m512bh wv[4];
                for (int j = 0; j < nn; j++)
                    wv[j] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + (int64_t)(n + j) * k_len + k);
                for (int i = 0; i < bb; i++) {
                    __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + (int64_t)(b + i) * k_len + k);
                    for (int j = 0; j < nn; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
                }
            }
            for (int i = 0; i < bb; i++)
                for (int j = 0; j < nn; j++) y[(int64_t)(b + i) * y_stride + n + j] = _mm512_reduce_add_ps(acc[i][j]);
        }
    }
}

static uint16_t to_bf16(float value) {  /* round to nearest even, as torch rounds float32 to bfloat16 */
    uint32_t bits;
    __builtin_memcpy(&bits, &value, 4);
    if ((bits & 0x7F800000u) == 0x7F800000u && (bits & 0x7FFFFFu)) return (uint16_t)((bits >> 16) | 0x40);  /* NaN */
    bits += 0x7FFFu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* out[b, :] = W2 (silu(W1 x_b) * (W3 x_b)) for b < rows, W13 = [gate; up] [2I, D], W2 [D, I]; gate_up float32
   [rows, 2I] and act bf16 [rows, I] are the caller's scratch; out bf16 [rows, D]. One team: the gate/up rows split
   over it, a barrier, the activation, a barrier, the down rows split over it. */
void expert_swiglu(const uint16_t *x, int rows, int hidden, int inter, const uint16_t *w13, const uint16_t *w2,
                   float *gate_up, uint16_t *act, float *down, uint16_t *out) {
    #pragma omp parallel
    {
        int team = omp_get_num_threads(), me = omp_get_thread_num();
        int units = (2 * inter + 3) / 4, lo = units * me / team * 4, hi = units * (me + 1) / team * 4;
        if (hi > 2 * inter) hi = 2 * inter;
        if (lo < hi) gemv_tile(x, rows, hidden, w13, lo, hi, gate_up, 2 * inter);
        #pragma omp barrier
        #pragma omp for schedule(static)
        for (int64_t e = 0; e < (int64_t)rows * inter; e++) {
            int64_t b = e / inter, i = e % inter;
            float g = gate_up[b * 2 * inter + i], u = gate_up[b * 2 * inter + inter + i];
            act[e] = to_bf16(g / (1.0f + expf(-g)) * u);
        }
        units = (hidden + 3) / 4;
        lo = units * me / team * 4;
        hi = units * (me + 1) / team * 4;
        if (hi > hidden) hi = hidden;
        if (lo < hi) gemv_tile(act, rows, inter, w2, lo, hi, down, hidden);
        #pragma omp barrier
        #pragma omp for schedule(static)
        for (int64_t e = 0; e < (int64_t)rows * hidden; e++) out[e] = to_bf16(down[e]);
    }
}
"""


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def unavailable() -> str | None:
    """Why the native kernel cannot run here (no AVX512-BF16, no compiler, a failed build), or None: it can."""
    return _built()[1]


def load() -> ctypes.CDLL | None:
    """The compiled kernel (built on first use, cached on disk by source and CPU), or None (`unavailable` says why)."""
    return _built()[0]


@functools.cache
def _built() -> tuple[ctypes.CDLL | None, str | None]:
    from specter.builtin import cache_dir
    from specter.experts.costs import cpu_name

    if "avx512_bf16" not in _cpu_flags():
        return None, "the CPU has no AVX512-BF16"
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        return None, "no C compiler (gcc or cc) on PATH"
    digest = hashlib.sha256((SOURCE + cpu_name()).encode()).hexdigest()[:16]
    library = cache_dir() / f"host-expert-{digest}.so"
    try:
        if not library.exists():
            library.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
                source = Path(scratch) / "host_expert.c"
                source.write_text("#include <omp.h>\n" + SOURCE)
                built = Path(scratch) / library.name
                command = [compiler, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", str(source), "-o", str(built),
                           "-lm"]
                result = subprocess.run(command, capture_output=True, text=True, timeout=300)
                if result.returncode != 0:
                    log.warning("host_kernel.build_failed", command=" ".join(command), stderr=result.stderr[-2000:])
                    return None, f"its build failed ({compiler}: {result.stderr.strip().splitlines()[-1:] or ['?']})"
                os.replace(built, library)  # atomic: a concurrent build's reader sees a whole library or none
        kernel = ctypes.CDLL(str(library))
    except (OSError, subprocess.SubprocessError) as error:
        return None, f"it could not be built or loaded ({error})"
    kernel.expert_swiglu.restype = None
    kernel.expert_swiglu.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                     ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    log.info("host_kernel.loaded", library=str(library))
    return kernel, None


def native_swiglu(rows: Tensor, packed: Tensor, hidden: int, inter: int) -> Tensor:
    """`weights.swiglu` with the native kernel: rows [B, D] bf16 (CPU), the packed bf16 expert -> [B, D] bf16. The
    OpenMP team is the calling thread's (`torch.set_num_threads` on it sets its size). Requires `load()`."""
    kernel = load()
    assert kernel is not None, "native_swiglu needs the native kernel (native.load())"
    assert rows.dtype == packed.dtype == torch.bfloat16 and rows.device.type == packed.device.type == "cpu"
    rows = rows.contiguous()
    count = rows.shape[0]
    gate_up = torch.empty(count, 2 * inter, dtype=torch.float32)
    act = torch.empty(count, inter, dtype=torch.bfloat16)
    down = torch.empty(count, hidden, dtype=torch.float32)
    out = torch.empty(count, hidden, dtype=torch.bfloat16)
    w2_offset = 2 * inter * hidden * packed.element_size()
    kernel.expert_swiglu(rows.data_ptr(), count, hidden, inter, packed.data_ptr(), packed.data_ptr() + w2_offset,
                         gate_up.data_ptr(), act.data_ptr(), down.data_ptr(), out.data_ptr())
    return out
