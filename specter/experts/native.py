"""A native host kernel for routed experts (SwiGLU) on x86 CPUs: AMX where the CPU has it, else AVX512-BF16, else AVX2
with FMA: bf16 weights read once, as they lie in the pool, products summed in float32, one OpenMP team for the call.

Why: torch's bf16 `F.linear` on the CPU reformats the weights for oneDNN on each call or pays a fixed cost per product
that dominates at a verify's few rows (docs/BENCHMARKS.md, "Host expert path"); a host expert is a GEMV over bytes
that are read once, so its floor is memory bandwidth. With AMX (Sapphire Rapids and later) it computes C^T = W X^T:
the weights are the tiles' left operand as they lie, the few input rows are packed once per call into the right
operand's pairs, so even 16 rows cost what one does; with AVX512-BF16 (Cooper Lake, Sapphire Rapids, AMD Zen 4),
dot products in tiles of 4 weight rows by 4 input rows; on the rest (AVX2 and FMA: most desktop CPUs, Intel's since
Alder Lake among them), the weights widened exactly to float32 and FMAs in tiles of 4 weight rows by 2 input rows.
Each way each output is a float32 sum over K in one fixed order, whatever the rows beside it, their count or the
threads: a row's output does not depend on the rows beside it, as the host path's contract requires. Which path a
shape takes is fixed on a machine (`path_for`); the three round differently.

Built on first use with the system's C compiler (gcc or cc, `-O3 -march=native -fopenmp`) into the cache directory
(`SPECTER_CACHE`), keyed by the source and the CPU, holding the paths the CPU has (`paths`); `load()` is None where
there is no compiler, no AVX2 with FMA, or the build fails (`unavailable()` says which), and the host path keeps
torch's kernel. Which of the two runs is the load's calibration's choice, the faster on this machine
(`specter.experts.costs.host_kernels`, tuning.host.kernel).
"""

from __future__ import annotations

import array
import ctypes
import enum
import functools
import hashlib
import itertools
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

import torch

from specter.log import get_logger

log = get_logger(__name__)
Tensor = torch.Tensor

SOURCE = r"""
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#ifdef __AVX512BF16__
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
#endif

#if defined(__AVX2__) && defined(__FMA__)
/* The AVX2 path, for CPUs without AVX512-BF16 (most desktop CPUs before AMD's Zen 4, Intel's since Alder Lake): 8 bf16
   widened exactly to float32 (a 16-bit shift), float32 FMAs. */
static inline __m256 bf16x8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

static inline float sum8(__m256 v) {  /* the 8 lanes in one fixed order */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline __m256 bf16x8_tail(const uint16_t *p, int n) {  /* the last n < 8 of a row, zero-padded */
    uint16_t pad[8] = {0};
    for (int i = 0; i < n; i++) pad[i] = p[i];
    return bf16x8(pad);
}

/* One tile of NB weight rows by BB input rows (NB x BB <= 8 accumulators, 13 of the 16 registers at most), each
   output a float32 sum over K in 8-wide steps in the same order whatever the tile, then its lanes in a fixed order. */
static inline __attribute__((always_inline)) void tile8(const uint16_t *x, int k_len, const uint16_t *w, int n0, int b0,
                                                        float *y, int y_stride, const int NB, const int BB) {
    __m256 acc[2][4];
    for (int i = 0; i < BB; i++)
        for (int j = 0; j < NB; j++) acc[i][j] = _mm256_setzero_ps();
    int body = k_len & ~7;
    for (int k = 0; k < body; k += 8) {
        __m256 wv[4];
        for (int j = 0; j < NB; j++) wv[j] = bf16x8(w + (int64_t)(n0 + j) * k_len + k);
        for (int i = 0; i < BB; i++) {
            __m256 xv = bf16x8(x + (int64_t)(b0 + i) * k_len + k);
            for (int j = 0; j < NB; j++) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    if (body < k_len) {
        __m256 wv[4];
        for (int j = 0; j < NB; j++) wv[j] = bf16x8_tail(w + (int64_t)(n0 + j) * k_len + body, k_len - body);
        for (int i = 0; i < BB; i++) {
            __m256 xv = bf16x8_tail(x + (int64_t)(b0 + i) * k_len + body, k_len - body);
            for (int j = 0; j < NB; j++) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < BB; i++)
        for (int j = 0; j < NB; j++) y[(int64_t)(b0 + i) * y_stride + n0 + j] = sum8(acc[i][j]);
}

/* gemv_tile's product on the AVX2 path: tiles of 4 weight rows by 2 input rows. */
static void gemv8(const uint16_t *x, int rows, int k_len, const uint16_t *w, int n0, int n1, float *y, int y_stride) {
    for (int n = n0; n < n1; n += 4) {
        int nn = n1 - n < 4 ? n1 - n : 4;
        for (int b = 0; b < rows; b += 2) {
            int bb = rows - b < 2 ? rows - b : 2;
            if (nn == 4 && bb == 2) tile8(x, k_len, w, n, b, y, y_stride, 4, 2);
            else if (nn == 4 && bb == 1) tile8(x, k_len, w, n, b, y, y_stride, 4, 1);
            else
                for (int j = 0; j < nn; j++)
                    for (int i = 0; i < bb; i++) tile8(x, k_len, w, n + j, b + i, y, y_stride, 1, 1);
        }
    }
}
#endif

/* The paths this build holds, bit by bit (the Path enum's values): 1 AVX2, 2 AVX512-BF16, 4 AMX (its tiles still
   need amx_init's grant). */
int paths(void) {
    int built = 0;
#if defined(__AVX2__) && defined(__FMA__)
    built |= 1;
#endif
#ifdef __AVX512BF16__
    built |= 2;
#endif
#ifdef __AMX_BF16__
    built |= 4;
#endif
    return built;
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

/* One expert of a call: its rows x [rows, D] bf16, its weights W13 = [gate; up] [2I, D] and W2 [D, I], the caller's
   scratch (gate_up float32 [rows, 2I], act bf16 [rows, I], down float32 [rows, D], and with AMX packed: at least
   ceil(rows / 16) x max(D, I) x 32 bytes) and its output out bf16 [rows, D]. */
typedef struct {
    const uint16_t *x, *w13, *w2;
    float *gate_up, *down;
    uint16_t *act, *out;
    uint32_t *packed;
    int64_t rows;
} expert_job;

/* This thread's part of one product phase over every job: output blocks of `step` rows of the weights (W13's 2I or
   W2's D = n_len), numbered job by job, in runs of contiguous blocks (about 8 a thread) handed to whichever thread is
   free, not fixed shares: with fixed shares the team waits at the phase's barrier for its slowest thread, and a thread
   the OS placed on a busy core or woke late holds up all of them. A block is computed the same way whichever thread
   takes it and whatever job precedes it, so the split changes no bit. Ends without a barrier: the caller's. */
static void products(const expert_job *jobs, int count, int n_len, int k_len, int step, int path, int second,
                     int team) {
    int64_t units = (n_len + step - 1) / step, total = units * count;
    int64_t grain = total / ((int64_t)team * 8);
    if (grain < 1) grain = 1;
    int64_t runs = (total + grain - 1) / grain;
    #pragma omp for schedule(dynamic, 1) nowait
    for (int64_t run = 0; run < runs; run++) {
        int64_t lo = run * grain, hi = lo + grain < total ? lo + grain : total;
        for (int64_t u = lo; u < hi;) {
            const expert_job *job = jobs + u / units;
            int64_t first = u % units, last = units - first < hi - u ? units : first + (hi - u);
            int n0 = (int)(first * step), n1 = (int)(last * step) < n_len ? (int)(last * step) : n_len;
            const uint16_t *w = second ? job->w2 : job->w13;
            float *y = second ? job->down : job->gate_up;
            const uint16_t *x = second ? job->act : job->x;
#ifdef __AMX_BF16__
            if (path == 2) amx_product(job->packed, (int)job->rows, k_len, w, n0, n1, y, n_len);
#endif
#ifdef __AVX512BF16__
            if (path == 1) gemv_tile(x, (int)job->rows, k_len, w, n0, n1, y, n_len);
#endif
#if defined(__AVX2__) && defined(__FMA__)
            if (path == 0) gemv8(x, (int)job->rows, k_len, w, n0, n1, y, n_len);
#endif
            u += last - first;
        }
    }
}

/* This thread's share of an elementwise phase over every job's rows x `width` elements, numbered job by job:
   the activation (act = bf16(silu(gate) * up)) or the output's rounding (out = bf16(down)). */
static void elementwise(const expert_job *jobs, int count, int width, int inter, int activation, int team, int me) {
    int64_t total = 0;
    for (int j = 0; j < count; j++) total += jobs[j].rows * width;
    int64_t lo = total * me / team, hi = total * (me + 1) / team, base = 0;
    for (int j = 0; j < count && base < hi; base += jobs[j].rows * width, j++) {
        int64_t size = jobs[j].rows * width, from = lo > base ? lo - base : 0, to = hi - base < size ? hi - base : size;
        for (int64_t e = from; e < to; e++) {
            if (activation) {
                int64_t b = e / inter, i = e % inter;
                float g = jobs[j].gate_up[b * 2 * inter + i], u = jobs[j].gate_up[b * 2 * inter + inter + i];
                jobs[j].act[e] = to_bf16(g / (1.0f + expf(-g)) * u);
            } else {
                jobs[j].out[e] = to_bf16(jobs[j].down[e]);
            }
        }
    }
}

/* One team's share of `experts_swiglu` up to the down products (its last barrier and the outputs' rounding are the
   caller's). */
static void swiglu_team(const expert_job *jobs, int count, int hidden, int inter, int path, int team, int me) {
    int amx = path == 2, step = amx ? 32 : 4;
#ifdef __AMX_BF16__
    if (amx) {
        amx_configure();
        for (int j = 0; j < count; j++) amx_pack(jobs[j].x, (int)jobs[j].rows, hidden, jobs[j].packed, team, me);
    }
    #pragma omp barrier
#endif
    products(jobs, count, 2 * inter, hidden, step, path, 0, team);
    #pragma omp barrier
    elementwise(jobs, count, inter, inter, 1, team, me);
    #pragma omp barrier
#ifdef __AMX_BF16__
    if (amx) for (int j = 0; j < count; j++) amx_pack(jobs[j].act, (int)jobs[j].rows, inter, jobs[j].packed, team, me);
    #pragma omp barrier
#endif
    products(jobs, count, hidden, inter, step, path, 1, team);
#ifdef __AMX_BF16__
    if (amx) _tile_release();
#endif
}

/* out[b, :] = W2 (silu(W1 x_b) * (W3 x_b)) for every job's rows b (experts of one shape, hidden D and inter I, each
   with its own rows). `path` (one this build holds, `paths`): 2 AMX tiles (amx_init granted, D and I multiples of 32),
   1 AVX512-BF16, 0 AVX2; the caller fixes it for a shape on a machine, so a row's bits never depend on the call. One team of `threads` (the caller's torch count:
   torch's OpenMP runtime may not be this one, so its count is passed, not read) for the whole call, whatever the
   number of experts: every job's gate/up blocks split over it, a barrier, the activations, a barrier, the down
   blocks, a barrier, the outputs. A layer's host experts in one call pay the team's start and its barriers once. */
void experts_swiglu(const expert_job *jobs, int count, int hidden, int inter, int path, int threads) {
    #pragma omp parallel num_threads(threads)
    {
        int team = omp_get_num_threads(), me = omp_get_thread_num();
        swiglu_team(jobs, count, hidden, inter, path, team, me);
        #pragma omp barrier
        elementwise(jobs, count, hidden, inter, 0, team, me);
    }
}

static inline float bf16_value(uint16_t bits) {
    uint32_t wide = (uint32_t)bits << 16;
    float value;
    __builtin_memcpy(&value, &wide, 4);
    return value;
}

static inline int64_t aligned(int64_t bytes) { return (bytes + 63) & ~(int64_t)63; }

/* A layer's whole host job in one call, as the host path asks it (HostExperts.compute_layer): `n_experts` experts of
   one shape (their packed weights at `addresses`), expert j on `counts[j]` rows of hidden [t_rows, D] bf16, the
   rows' indices and top-A slots in `rows` and `slots` expert after expert; each output row is bf16(expert(x)) times
   bf16(its routing weight, weights [t_rows, width_a] float32), rounded to bf16: the bits torch's `mul` of the two bf16
   tensors gives. Outputs: `dense` 0, out [sum counts, D] in that order; 1, out [n_experts, t_rows, D] with expert j's
   rows in place in block j and every other row zero. The rows are gathered, computed (in pieces of at most `chunk`
   rows, calls of at most `call_rows`, as `experts_swiglu` takes them: a row's bits depend on neither), weighted and
   placed by one team of `threads`, started once. `scratch`: the caller's, `capacity` bytes; returns 0 when done, or
   (computing nothing) the bytes of scratch the job needs where `capacity` is less. */
int64_t layer_job(const uint16_t *hidden, int64_t t_rows, const float *weights, int64_t width_a, const int64_t *rows,
                  const int64_t *slots, const int64_t *counts, const int64_t *addresses, int n_experts, uint16_t *out,
                  int dense, int hidden_size, int inter, int path, int threads, uint8_t *scratch, int64_t capacity,
                  int chunk, int call_rows) {
    const int64_t D = hidden_size, I = inter;
    int64_t total = 0, n_pieces = 0;
    for (int j = 0; j < n_experts; j++) { total += counts[j]; n_pieces += (counts[j] + chunk - 1) / chunk; }
    expert_job *jobs = malloc(sizeof(expert_job) * (n_pieces + 1));
    int64_t *first_row = malloc(sizeof(int64_t) * (n_pieces + 2)), *dest = malloc(sizeof(int64_t) * (total + 1));
    int *first_job = malloc(sizeof(int) * (n_pieces + 2));
    if (!jobs || !first_row || !dest || !first_job) { free(jobs); free(first_row); free(dest); free(first_job); return -1; }
    /* The pieces, grouped into calls: call c holds jobs first_job[c] .. first_job[c + 1] - 1 and gathered rows
       first_row[c] .. first_row[c + 1] - 1; the scratch a call needs, the largest of any call's. */
    int calls = 0, piece = 0;
    int64_t need = 0, call_n = 0, packed_n = 0, g = 0;
    int amx = path == 2;
    first_job[0] = 0;
    first_row[0] = 0;
    for (int j = 0; j < n_experts; j++) {
        for (int64_t r = 0; r < counts[j]; r++) dest[g + r] = dense ? j * t_rows + rows[g + r] : g + r;
        for (int64_t start = 0; start < counts[j]; start += chunk) {
            int64_t n = counts[j] - start < chunk ? counts[j] - start : chunk;
            if (call_n > 0 && call_n + n > call_rows) {
                calls++;
                first_job[calls] = piece;
                first_row[calls] = first_row[calls - 1] + call_n;
                call_n = packed_n = 0;
            }
            expert_job *job = jobs + piece++;
            job->w13 = (const uint16_t *)(uintptr_t)addresses[j];
            job->w2 = job->w13 + 2 * I * D;
            job->rows = n;
            /* Offsets into the scratch for now (its regions' bases once the call's rows are known); packed after
               them. */
            job->x = (const uint16_t *)(uintptr_t)call_n;
            job->packed = (uint32_t *)(uintptr_t)packed_n;
            packed_n += amx ? (n + 15) / 16 * (D > I ? D : I) * 32 : 0;
            call_n += n;
            int64_t bytes = aligned(call_n * D * 2) + aligned(call_n * 2 * I * 4) + aligned(call_n * I * 2)
                            + aligned(call_n * D * 4) + aligned(packed_n);
            if (bytes > need) need = bytes;
        }
        g += counts[j];
    }
    if (call_n > 0) calls++;
    first_job[calls] = piece;
    first_row[calls] = total;
    if (need > capacity) { free(jobs); free(first_row); free(dest); free(first_job); return need; }
    for (int c = 0; c < calls; c++) {  /* each call's regions: x, gate_up, act, down, packed */
        int64_t n = first_row[c + 1] - first_row[c];
        uint8_t *x = scratch, *gate_up = x + aligned(n * D * 2), *act = gate_up + aligned(n * 2 * I * 4);
        uint8_t *down = act + aligned(n * I * 2), *packed = down + aligned(n * D * 4);
        for (int p = first_job[c]; p < first_job[c + 1]; p++) {
            int64_t at = (int64_t)(uintptr_t)jobs[p].x;
            jobs[p].x = (const uint16_t *)x + at * D;
            jobs[p].gate_up = (float *)gate_up + at * 2 * I;
            jobs[p].act = (uint16_t *)act + at * I;
            jobs[p].down = (float *)down + at * D;
            jobs[p].packed = (uint32_t *)(packed + (int64_t)(uintptr_t)jobs[p].packed);
            jobs[p].out = NULL;
        }
    }
    #pragma omp parallel num_threads(threads)
    {
        int team = omp_get_num_threads(), me = omp_get_thread_num();
        if (dense) {  /* every row zero first; the experts' rows are written after a barrier below */
            int64_t size = (int64_t)n_experts * t_rows * D;
            int64_t lo = size * me / team, hi = size * (me + 1) / team;
            if (hi > lo) __builtin_memset(out + lo, 0, (size_t)(hi - lo) * 2);
        }
        for (int c = 0; c < calls; c++) {
            int64_t g0 = first_row[c], n = first_row[c + 1] - g0;
            const expert_job *call = jobs + first_job[c];
            uint16_t *x = (uint16_t *)call->x;
            const float *down = call->down;
            for (int64_t i = n * me / team; i < n * (me + 1) / team; i++)
                __builtin_memcpy(x + i * D, hidden + rows[g0 + i] * D, (size_t)D * 2);
            #pragma omp barrier
            swiglu_team(call, first_job[c + 1] - first_job[c], hidden_size, inter, path, team, me);
            #pragma omp barrier
            int64_t lo = n * D * me / team, hi = n * D * (me + 1) / team, row = -1;
            float w = 0.0f;
            uint16_t *target = NULL;
            for (int64_t e = lo; e < hi; e++) {
                int64_t i = e / D, d = e % D;
                if (i != row) {
                    row = i;
                    w = bf16_value(to_bf16(weights[rows[g0 + i] * width_a + slots[g0 + i]]));
                    target = out + dest[g0 + i] * D;
                }
                target[d] = to_bf16(bf16_value(to_bf16(down[e])) * w);
            }
            #pragma omp barrier  /* the next call reuses the scratch */
        }
    }
    free(jobs);
    free(first_row);
    free(dest);
    free(first_job);
    return 0;
}
"""


CHUNK = 64
"""Rows of one expert in one job (a multiple of AMX's 16): a longer prompt's rows are split into jobs of at most this
many, each row its own, so the split changes no bit."""

CALL_ROWS = 256
"""Rows of all jobs in one call of the kernel: its scratch is then at most 256 x ((2I + D) x 4 + (I + D) x 2) bytes
(43 MB at Mixtral's widths, 34 of it float32), however many experts a layer sends."""


class _Job(ctypes.Structure):
    """The C side's `expert_job`: one expert's rows, weights, scratch and output in one call."""

    _fields_ = [("x", ctypes.c_void_p), ("w13", ctypes.c_void_p), ("w2", ctypes.c_void_p), ("gate_up", ctypes.c_void_p),
                ("down", ctypes.c_void_p), ("act", ctypes.c_void_p), ("out", ctypes.c_void_p),
                ("packed", ctypes.c_void_p), ("rows", ctypes.c_int64)]


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
    """Why the native kernel cannot run here (neither AVX512-BF16 nor AVX2 with FMA, no compiler, a failed build), or
    None: it can."""
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


class CodePath(enum.IntEnum):
    """The kernel's code paths (the C side's `path`; bit 1 << path of its `paths()`)."""

    AVX2 = 0
    AVX512_BF16 = 1
    AMX = 2


@functools.cache
def _built() -> tuple[ctypes.CDLL | None, str | None]:
    from specter.builtin import cache_dir

    flags = _cpu_flags()
    if "avx512_bf16" not in flags and not {"avx2", "fma"} <= flags:
        return None, "the CPU has neither AVX512-BF16 nor AVX2 with FMA"
    return build("native", cache_dir() / f"host-expert-{digest()}.so")


def build(march: str, library: Path) -> tuple[ctypes.CDLL | None, str | None]:
    """The kernel compiled for `-march=MARCH` into `library` (reused where it exists) and loaded, or None and why.
    `load()` builds for the machine (native); another target builds the paths that CPU has (haswell: AVX2 only)."""
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        return None, "no C compiler (gcc or cc) on PATH"
    try:
        if not library.exists():
            library.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
                source = Path(scratch) / "host_expert.c"
                source.write_text("#include <omp.h>\n" + SOURCE)
                built = Path(scratch) / library.name
                command = [compiler, "-O3", f"-march={march}", "-fopenmp", "-shared", "-fPIC", str(source), "-o",
                           str(built), "-lm"]
                result = subprocess.run(command, capture_output=True, text=True, timeout=300)
                if result.returncode != 0:
                    log.warning("host_kernel.build_failed", command=" ".join(command), stderr=result.stderr[-2000:])
                    return None, f"its build failed ({compiler}: {result.stderr.strip().splitlines()[-1:] or ['?']})"
                os.replace(built, library)  # atomic: a concurrent build's reader sees a whole library or none
        kernel = ctypes.CDLL(str(library))
    except (OSError, subprocess.SubprocessError) as error:
        return None, f"it could not be built or loaded ({error})"
    kernel.experts_swiglu.restype = None
    kernel.experts_swiglu.argtypes = [ctypes.POINTER(_Job), ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                      ctypes.c_int]
    pointer, wide, small = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    kernel.layer_job.restype = wide
    kernel.layer_job.argtypes = [pointer, wide, pointer, wide, pointer, pointer, pointer, pointer, small, pointer, small,
                                 small, small, small, small, pointer, wide, small, small]
    built = kernel.paths()
    usable = [path for path in CodePath if built & (1 << path)]
    if CodePath.AMX in usable and not ("amx_bf16" in _cpu_flags() and kernel.amx_init()):
        usable.remove(CodePath.AMX)  # built, but Linux did not grant the tile state
    if not usable:
        return None, f"its build for {march} holds no path (neither AVX2 with FMA nor AVX512-BF16)"
    kernel.usable = usable
    log.info("host_kernel.loaded", library=str(library), paths=[path.name for path in usable])
    return kernel, None


def paths() -> list[CodePath]:
    """The paths the kernel can take on this machine (empty: no kernel)."""
    kernel = load()
    return list(kernel.usable) if kernel is not None else []


def shape_paths(hidden: int, inter: int) -> list[CodePath]:
    """The paths this machine can run a shape's experts on: its usable ones, AMX only where both widths are multiples
    of 32 (its tiles' pairs)."""
    return [path for path in paths() if path != CodePath.AMX or (hidden % 32 == 0 and inter % 32 == 0)]


def path_for(hidden: int, inter: int) -> CodePath:
    """The path this shape's experts take on this machine, the fastest it can run them on (AMX, else AVX512-BF16, else
    AVX2: CodePath's order). Fixed for a shape on a machine, so a row's bits never depend on the call. Requires
    `load()`."""
    usable = shape_paths(hidden, inter)
    assert usable, "path_for needs the native kernel (native.load())"
    return max(usable)


def native_swiglu(rows: Tensor, packed: Tensor, hidden: int, inter: int, path: CodePath | None = None) -> Tensor:
    """`weights.swiglu` with the native kernel: rows [B, D] bf16 (CPU), the packed bf16 expert -> [B, D] bf16. The
    OpenMP team has the calling thread's torch thread count (`torch.get_num_threads()`). Requires `load()`."""
    return native_swiglu_many([(rows, packed)], hidden, inter, path)[0]


def native_swiglu_many(jobs: Sequence[tuple[Tensor, Tensor]], hidden: int, inter: int,
                       path: CodePath | None = None) -> list[Tensor]:
    """`native_swiglu` of several experts of one shape, each on its own rows: [(rows [B_j, D] bf16, packed expert)] ->
    [[B_j, D] bf16], in calls of at most CALL_ROWS rows (of jobs of at most CHUNK rows) that each start the OpenMP
    team once for all their experts. Every output row has the bits `native_swiglu` gives it alone. `path`: the shape's
    (`path_for`) unless given (one of `paths()`: the tests run each path this machine has). The outputs are views of
    one [sum B_j, D] tensor, job after job. Requires `load()`."""
    kernel = load()
    assert kernel is not None, "native_swiglu needs the native kernel (native.load())"
    pieces: list[tuple[int, Tensor, Tensor]] = []  # (job, rows of at most CHUNK, packed)
    for index, (rows, packed) in enumerate(jobs):
        assert rows.dtype == packed.dtype == torch.bfloat16 and rows.device.type == packed.device.type == "cpu"
        assert rows.dim() == 2 and rows.shape[1] == hidden, f"rows {tuple(rows.shape)} for hidden {hidden}"
        assert packed.is_contiguous() and packed.numel() == 3 * hidden * inter, "packed: the expert's [W13; W2], flat"
        rows = rows.contiguous()
        if rows.shape[0] == 0:  # nothing to compute: its output is an empty slice of out
            continue
        if rows.shape[0] <= CHUNK:  # most jobs: no view to make
            pieces.append((index, rows, packed))
        else:
            pieces.extend((index, rows[start : start + CHUNK], packed) for start in range(0, rows.shape[0], CHUNK))
    out = torch.empty(sum(rows.shape[0] for _, rows, _ in pieces), hidden, dtype=torch.bfloat16)
    path = path_for(hidden, inter) if path is None else path
    if path not in shape_paths(hidden, inter):
        raise ValueError(f"path {path.name} cannot run {hidden} x {inter} experts here (this machine's paths for them: "
                         f"{[p.name for p in shape_paths(hidden, inter)]}"
                         + ("; AMX tiles need widths that are multiples of 32)" if path == CodePath.AMX else ")"))
    call: list[tuple[int, Tensor, Tensor]] = []
    call_rows = done = 0  # rows of the call being gathered; rows of the calls made
    for piece in pieces + [None]:
        if call and (piece is None or call_rows + piece[1].shape[0] > CALL_ROWS):
            _call(kernel, call, hidden, inter, path, out[done : done + call_rows])
            call, done, call_rows = [], done + call_rows, 0
        if piece is not None:
            call.append(piece)
            call_rows += piece[1].shape[0]
    starts = itertools.accumulate((rows.shape[0] for rows, _ in jobs), initial=0)  # each job's rows, consecutive in out
    return [out[start:end] for start, end in itertools.pairwise(starts)]


def native_layer_job(hidden: Tensor, weights: Tensor, rows: Sequence[int], slots: Sequence[int], counts: Sequence[int],
                     addresses: Sequence[int], out: Tensor, dense: bool, hidden_size: int, inter: int,
                     path: CodePath | None = None) -> None:
    """A layer's host job in one native call (`HostExperts.compute_layer` with this kernel): expert j (its packed bf16
    weights at host address `addresses[j]`, pinned pool memory that outlives the call) on `counts[j]` rows of
    `hidden` [T, D], their indices and top-A slots in `rows` and `slots` expert after expert (ascending within one);
    each output row `native_swiglu` of its input row times its routing weight (`weights` [T, A]) as torch weights it
    (both in bf16, the product rounded to bf16). Written to `out` (bf16, contiguous): [sum counts, D] in that order,
    or with `dense` [experts x T, D], expert j's rows in place in block j and every other row zero. The gather, the
    experts and the weighting are one call with one thread team: a job's cost beyond its experts is then that call's
    and a few Python lists', not a torch call's each, which on a host busy streaming expert weights costs tens of
    microseconds apiece (its code and data are cold). Every row has the bits `compute` gives it (a NaN stays a NaN,
    its payload not torch's). Requires `load()`."""
    kernel = load()
    assert kernel is not None, "native_layer_job needs the native kernel (native.load())"
    if hidden.dtype != torch.bfloat16 or not hidden.is_contiguous():
        hidden = hidden.to(torch.bfloat16).contiguous()  # elementwise: the same bits as gathering first
    if weights.dtype != torch.float32 or not weights.is_contiguous():
        weights = weights.to(torch.float32).contiguous()  # exact from bf16 and half; rounded to bf16 in the kernel
    total, t_rows = len(rows), hidden.shape[0]
    assert hidden.dim() == 2 and hidden.shape[1] == hidden_size and weights.shape[0] == t_rows
    assert len(slots) == total == sum(counts) and len(counts) == len(addresses)
    assert out.dtype == torch.bfloat16 and out.is_contiguous() and tuple(out.shape) == (
        (len(counts) * t_rows if dense else total), hidden_size), f"out {tuple(out.shape)} {out.dtype}"
    assert hidden.device.type == weights.device.type == out.device.type == "cpu", "the host path's tensors are on the CPU"
    # The C side indexes with them unchecked: an index out of range would read or write past the buffers, not raise.
    if total and not (0 <= min(rows) and max(rows) < t_rows and 0 <= min(slots) and max(slots) < weights.shape[1]) \
            or any(count < 0 for count in counts):
        raise ValueError(f"native_layer_job: row indices must lie in 0..{t_rows - 1}, top-k slots in "
                         f"0..{weights.shape[1] - 1} and counts be >= 0 (rows {min(rows, default=None)}.."
                         f"{max(rows, default=None)}, slots {min(slots, default=None)}..{max(slots, default=None)}, "
                         f"counts {list(counts)})")
    if path is None:
        path = path_for(hidden_size, inter)
    elif path not in shape_paths(hidden_size, inter):
        raise ValueError(f"path {path.name} cannot run {hidden_size} x {inter} experts here (this machine's paths for "
                         f"them: {[p.name for p in shape_paths(hidden_size, inter)]})")
    indices = array.array("q", rows)
    places = array.array("q", slots)
    sizes = array.array("q", counts)
    experts = array.array("q", addresses)
    while True:
        scratch = _SCRATCH.__dict__.get("bytes")
        capacity = 0 if scratch is None else scratch.numel()
        need = kernel.layer_job(hidden.data_ptr(), t_rows, weights.data_ptr(), weights.shape[1], indices.buffer_info()[0],
                                places.buffer_info()[0], sizes.buffer_info()[0], experts.buffer_info()[0], len(counts),
                                out.data_ptr(), int(dense), hidden_size, inter, int(path), torch.get_num_threads(),
                                0 if scratch is None else scratch.data_ptr(), capacity, CHUNK, CALL_ROWS)
        if need == 0:
            return
        if need < 0:
            raise MemoryError("the native host kernel could not allocate a layer job's index arrays")
        # Kept for the thread's later jobs (grown, never shrunk: at most one call's scratch, CALL_ROWS rows' worth)
        _SCRATCH.bytes = torch.empty(need + (need >> 3), dtype=torch.uint8)


_SCRATCH = threading.local()
"""Each calling thread's scratch for `native_layer_job` (a host path's thread makes one job at a time), kept between
jobs so that a job allocates nothing; freed with its thread."""


def _call(kernel: ctypes.CDLL, call: Sequence[tuple[int, Tensor, Tensor]], hidden: int, inter: int,
          path: CodePath, out: Tensor) -> None:
    """One call of the kernel on `call`'s pieces (each of at least one row), their outputs into `out` ([their rows, D]
    bf16, contiguous) piece after piece: the scratch of all of them in one allocation of each kind."""
    counts = [rows.shape[0] for _, rows, _ in call]
    total = sum(counts)
    gate_up = torch.empty(total, 2 * inter, dtype=torch.float32)
    act = torch.empty(total, inter, dtype=torch.bfloat16)
    down = torch.empty(total, hidden, dtype=torch.float32)
    amx = path == CodePath.AMX
    packed_bytes = [-(-count // 16) * max(hidden, inter) * 32 if amx else 0 for count in counts]
    scratch = torch.empty(max(1, sum(packed_bytes)), dtype=torch.uint8)
    jobs = (_Job * len(call))()
    # Each job's row pointers by arithmetic on the buffers' (contiguous, float32 or bf16) rows: no view a job.
    gate_up_at, act_at, down_at, out_at, scratch_at = (t.data_ptr() for t in (gate_up, act, down, out, scratch))
    row = offset = 0
    for job, (_, rows, packed), count, size in zip(jobs, call, counts, packed_bytes, strict=True):
        base = packed.data_ptr()
        job.x, job.w13, job.w2 = rows.data_ptr(), base, base + 2 * inter * hidden * 2
        job.gate_up, job.act, job.down = gate_up_at + row * 2 * inter * 4, act_at + row * inter * 2, down_at + row * hidden * 4
        job.out, job.packed, job.rows = out_at + row * hidden * 2, scratch_at + offset, count
        row, offset = row + count, offset + size
    kernel.experts_swiglu(jobs, len(call), hidden, inter, int(path), torch.get_num_threads())
