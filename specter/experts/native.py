"""A native host kernel for one routed expert (SwiGLU) on x86 CPUs with AVX512-BF16, and AMX where the CPU has it:
bf16 weights read once, as they lie in the pool, products summed in float32, one OpenMP team for the whole expert.

Why: torch's bf16 `F.linear` on the CPU reformats the weights for oneDNN on each call or pays a fixed cost per product
that dominates at a verify's few rows (docs/BENCHMARKS.md, "Host expert path"); a host expert is a GEMV over bytes
that are read once, so its floor is memory bandwidth. With AMX (Sapphire Rapids and later) it computes C^T = W X^T:
the weights are the tiles' left operand as they lie, the few input rows are packed once per call into the right
operand's pairs, so even 16 rows cost what one does; without, AVX512-BF16 dot products in tiles of 4 weight rows by 4
input rows. Either way each output is a float32 sum over K in one fixed order, whatever the rows beside it, their
count or the threads: a row's output does not depend on the rows beside it, as the host path's contract requires.
Which of the two a shape takes is fixed on a machine (`uses_amx`).

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

/* One tile: y[b0 + i, n0 + j] for i < BB, j < NB, over the whole K: NB x BB float32 accumulators in registers (the
   bounds are constants where the caller passes them, so the loops unroll and nothing spills), each a sum over K in
   32-wide steps in the same order whatever the tile. */
static inline __attribute__((always_inline)) void tile(const uint16_t *x, int k_len, const uint16_t *w, int n0, int b0,
                                                       float *y, int y_stride, const int NB, const int BB) {
    __m512 acc[4][4];
    for (int i = 0; i < BB; i++)
        for (int j = 0; j < NB; j++) acc[i][j] = _mm512_setzero_ps();
    for (int k = 0; k < k_len; k += 32) {
        __mmask32 mask = k_len - k >= 32 ? 0xFFFFFFFFu : ((1u << (k_len - k)) - 1u);
        __m512bh wv[4];
        for (int j = 0; j < NB; j++) wv[j] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + (int64_t)(n0 + j) * k_len + k);
        for (int i = 0; i < BB; i++) {
            __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + (int64_t)(b0 + i) * k_len + k);
            for (int j = 0; j < NB; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
        }
    }
    for (int i = 0; i < BB; i++)
        for (int j = 0; j < NB; j++) y[(int64_t)(b0 + i) * y_stride + n0 + j] = _mm512_reduce_add_ps(acc[i][j]);
}

/* y[b, n] = sum_k x[b, k] * w[n, k] for b < rows, n0 <= n < n1: bf16 in, float32 out, in tiles of 4 weight rows by 4
   input rows; the 4 weight rows (4 x K bf16) stay in L1 while the input rows run over them. */
static void gemv_tile(const uint16_t *x, int rows, int k_len, const uint16_t *w, int n0, int n1, float *y, int y_stride) {
    for (int n = n0; n < n1; n += 4) {
        int nn = n1 - n < 4 ? n1 - n : 4;
        for (int b = 0; b < rows; b += 4) {
            int bb = rows - b < 4 ? rows - b : 4;
            if (nn == 4 && bb == 4) tile(x, k_len, w, n, b, y, y_stride, 4, 4);
            else if (nn == 4 && bb == 1) tile(x, k_len, w, n, b, y, y_stride, 4, 1);
            else if (nn == 4 && bb == 2) tile(x, k_len, w, n, b, y, y_stride, 4, 2);
            else if (nn == 4 && bb == 3) tile(x, k_len, w, n, b, y, y_stride, 4, 3);
            else
                for (int j = 0; j < nn; j++)
                    for (int i = 0; i < bb; i++) tile(x, k_len, w, n + j, b + i, y, y_stride, 1, 1);
        }
    }
}

static uint16_t to_bf16(float value) {  /* round to nearest even, as torch rounds a finite float32 to bfloat16 */
    uint32_t bits;
    __builtin_memcpy(&bits, &value, 4);
    if ((bits & 0x7F800000u) == 0x7F800000u && (bits & 0x7FFFFFu)) return (uint16_t)((bits >> 16) | 0x40);  /* NaN */
    bits += 0x7FFFu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

#ifdef __AMX_BF16__
#include <sys/syscall.h>
#include <unistd.h>

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Ask Linux for the AMX tile state (once per process; oneDNN asks the same). 1: granted. */
int amx_init(void) { return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0; }

static void amx_configure(void) {
    tile_config config = {0};
    config.palette_id = 1;
    for (int t = 0; t < 5; t++) { config.rows[t] = 16; config.colsb[t] = 64; }
    _tile_loadconfig(&config);
}

/* x [rows, K] bf16 -> packed [groups of 16 rows][K/2][16] uint32: the B operand (X^T in VNNI pairs along K), zero
   past `rows`. Its share of the k pairs on each thread of the team. */
static void amx_pack(const uint16_t *x, int rows, int k_len, uint32_t *packed, int team, int me) {
    int groups = (rows + 15) / 16, pairs = k_len / 2;
    for (int g = 0; g < groups; g++)
        for (int r = pairs * me / team; r < pairs * (me + 1) / team; r++)
            for (int b = 0; b < 16; b++) {
                int row = g * 16 + b;
                packed[((int64_t)g * pairs + r) * 16 + b] = row < rows
                    ? (uint32_t)x[(int64_t)row * k_len + 2 * r] | (uint32_t)x[(int64_t)row * k_len + 2 * r + 1] << 16 : 0u;
            }
}

/* y[b, n] = sum_k x[b, k] w[n, k] for n0 <= n < n1 (multiples of 32), from the packed x: C^T = W X^T in 16 x 16
   float32 tiles, W's rows read as they lie (A tiles of 16 rows x 32 k), each output a sum over K in 32-wide steps in
   one order whatever the rows. */
static void amx_product(const uint32_t *packed, int rows, int k_len, const uint16_t *w, int n0, int n1, float *y,
                        int y_stride) {
    float tile_out[2][16][16];
    int groups = (rows + 15) / 16, pairs = k_len / 2;
    for (int n = n0; n < n1; n += 32)
        for (int g = 0; g < groups; g++) {
            _tile_zero(0);
            _tile_zero(1);
            for (int k = 0; k < k_len; k += 32) {
                _tile_loadd(2, w + (int64_t)n * k_len + k, k_len * 2);
                _tile_loadd(3, w + (int64_t)(n + 16) * k_len + k, k_len * 2);
                _tile_loadd(4, packed + ((int64_t)g * pairs + k / 2) * 16, 64);
                _tile_dpbf16ps(0, 2, 4);
                _tile_dpbf16ps(1, 3, 4);
            }
            _tile_stored(0, tile_out[0], 64);
            _tile_stored(1, tile_out[1], 64);
            for (int b = 0; b < 16 && g * 16 + b < rows; b++)
                for (int h = 0; h < 2; h++)
                    for (int m = 0; m < 16; m++) y[(int64_t)(g * 16 + b) * y_stride + n + h * 16 + m] = tile_out[h][m][b];
        }
}
#else
int amx_init(void) { return 0; }
#endif

/* out[b, :] = W2 (silu(W1 x_b) * (W3 x_b)) for b < rows, W13 = [gate; up] [2I, D], W2 [D, I]; gate_up float32
   [rows, 2I], act bf16 [rows, I] and down float32 [rows, D] are the caller's scratch, and with `amx` packed (at least
   ceil(rows / 16) x max(D, I) x 32 bytes); out bf16 [rows, D]. `amx` (amx_init granted, D and I multiples of 32):
   AMX tiles, else AVX512-BF16; the caller fixes it for a shape, so a row's bits never depend on the path. One team of
   `threads` (the caller's torch count: torch's OpenMP runtime may not be this one, so its count is passed, not read):
   the gate/up rows split over it, a barrier, the activation, a barrier, the down rows split over it. */
void expert_swiglu(const uint16_t *x, int rows, int hidden, int inter, const uint16_t *w13, const uint16_t *w2,
                   float *gate_up, uint16_t *act, float *down, uint16_t *out, uint32_t *packed, int amx, int threads) {
    #pragma omp parallel num_threads(threads)
    {
        int team = omp_get_num_threads(), me = omp_get_thread_num();
        int step = amx ? 32 : 4;
#ifdef __AMX_BF16__
        if (amx) {
            amx_configure();
            amx_pack(x, rows, hidden, packed, team, me);
        }
        #pragma omp barrier
#endif
        int units = (2 * inter + step - 1) / step, lo = units * me / team * step, hi = units * (me + 1) / team * step;
        if (hi > 2 * inter) hi = 2 * inter;
#ifdef __AMX_BF16__
        if (amx && lo < hi) amx_product(packed, rows, hidden, w13, lo, hi, gate_up, 2 * inter);
#endif
        if (!amx && lo < hi) gemv_tile(x, rows, hidden, w13, lo, hi, gate_up, 2 * inter);
        #pragma omp barrier
        #pragma omp for schedule(static)
        for (int64_t e = 0; e < (int64_t)rows * inter; e++) {
            int64_t b = e / inter, i = e % inter;
            float g = gate_up[b * 2 * inter + i], u = gate_up[b * 2 * inter + inter + i];
            act[e] = to_bf16(g / (1.0f + expf(-g)) * u);
        }
#ifdef __AMX_BF16__
        if (amx) amx_pack(act, rows, inter, packed, team, me);
        #pragma omp barrier
#endif
        units = (hidden + step - 1) / step;
        lo = units * me / team * step;
        hi = units * (me + 1) / team * step;
        if (hi > hidden) hi = hidden;
#ifdef __AMX_BF16__
        if (amx && lo < hi) amx_product(packed, rows, inter, w2, lo, hi, down, hidden);
        if (amx) _tile_release();
#endif
        if (!amx && lo < hi) gemv_tile(act, rows, inter, w2, lo, hi, down, hidden);
        #pragma omp barrier
        #pragma omp for schedule(static)
        for (int64_t e = 0; e < (int64_t)rows * hidden; e++) out[e] = to_bf16(down[e]);
    }
}
"""


CHUNK = 64
"""Rows per call of the kernel (a multiple of AMX's 16): its float32 scratch is then at most 64 x 2I x 4 bytes."""


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
def digest() -> str:
    """The kernel's identity on this machine: its source, the CPU model and its flags (a library built with
    -march=native must never run on a CPU with fewer features; a stored choice of another source must not carry over)."""
    from specter.experts.costs import cpu_name

    return hashlib.sha256((SOURCE + cpu_name() + " ".join(sorted(_cpu_flags()))).encode()).hexdigest()[:16]


@functools.cache
def _built() -> tuple[ctypes.CDLL | None, str | None]:
    from specter.builtin import cache_dir

    if "avx512_bf16" not in _cpu_flags():
        return None, "the CPU has no AVX512-BF16"
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        return None, "no C compiler (gcc or cc) on PATH"
    library = cache_dir() / f"host-expert-{digest()}.so"
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
                                     ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                     ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    kernel.amx = "amx_bf16" in _cpu_flags() and bool(kernel.amx_init())
    log.info("host_kernel.loaded", library=str(library), amx=kernel.amx)
    return kernel, None


def native_swiglu(rows: Tensor, packed: Tensor, hidden: int, inter: int) -> Tensor:
    """`weights.swiglu` with the native kernel: rows [B, D] bf16 (CPU), the packed bf16 expert -> [B, D] bf16. The
    OpenMP team has the calling thread's torch thread count (`torch.get_num_threads()`). Requires `load()`."""
    kernel = load()
    assert kernel is not None, "native_swiglu needs the native kernel (native.load())"
    assert rows.dtype == packed.dtype == torch.bfloat16 and rows.device.type == packed.device.type == "cpu"
    assert rows.dim() == 2 and rows.shape[1] == hidden, f"rows {tuple(rows.shape)} for hidden {hidden}"
    assert packed.is_contiguous() and packed.numel() == 3 * hidden * inter, "packed: the expert's [W13; W2], flat"
    if rows.shape[0] > CHUNK:  # a long prompt's rows: bounded scratch; each row is its own, so chunks change no bit
        return torch.cat([native_swiglu(rows[start : start + CHUNK], packed, hidden, inter)
                          for start in range(0, rows.shape[0], CHUNK)])
    rows = rows.contiguous()
    count = rows.shape[0]
    gate_up = torch.empty(count, 2 * inter, dtype=torch.float32)
    act = torch.empty(count, inter, dtype=torch.bfloat16)
    down = torch.empty(count, hidden, dtype=torch.float32)
    out = torch.empty(count, hidden, dtype=torch.bfloat16)
    amx = uses_amx(hidden, inter)
    scratch = torch.empty(-(-count // 16) * max(hidden, inter) * 32 if amx else 1, dtype=torch.uint8)
    w2_offset = 2 * inter * hidden * packed.element_size()
    kernel.expert_swiglu(rows.data_ptr(), count, hidden, inter, packed.data_ptr(), packed.data_ptr() + w2_offset,
                         gate_up.data_ptr(), act.data_ptr(), down.data_ptr(), out.data_ptr(), scratch.data_ptr(), int(amx),
                         torch.get_num_threads())
    return out


def uses_amx(hidden: int, inter: int) -> bool:
    """Whether the kernel computes this shape's experts with AMX tiles (the CPU has them, Linux granted them, and both
    widths are multiples of 32), else with AVX512-BF16: fixed for a shape on a machine, so a row's bits never depend
    on the path."""
    kernel = load()
    return bool(kernel is not None and kernel.amx and hidden % 32 == 0 and inter % 32 == 0)
