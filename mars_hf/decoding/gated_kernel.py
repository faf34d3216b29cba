"""A small C kernel for the mask-gated adapter's delta on CPU: work on the mask rows only, one call per group.

Why: the torch form of the gated delta (``docs/gated_adapters.md``) runs a few small products, gate
multiplies and adds (and, for a bf16 model, dtype round trips) per group of layers. Each is a full torch op
of a few to tens of µs, so on a 2-core CPU the adapter cost 1.1–1.2× (float32) and 1.3–1.5× (bf16) a
forward of the base model although its arithmetic is tiny. The kernel does the same arithmetic in one C call
per sibling group (layers that read one input: q/k/v, gate/up; or a layer alone), touching only the mask
rows: ``t = x[mask rows] Aᵀ`` for the group's stacked ``A``, then each member's ``y[mask rows] += t Bᵀ``.
Real rows keep the base layer's bits because they are never written. The matrices are read cold on every
forward (the base weights evict them), so ``x Aᵀ`` reads ``A`` front to back (once per block of four mask
rows) and the add reads ``Bᵀ`` a chunk of columns at a time across its rows. Both keep blocks of sums in registers
(four mask rows by four rows of ``A``; four mask rows by four vectors of outputs), so that each vector loaded
serves several multiply-adds.

Numerics: float32 and bfloat16 models accumulate in float32 (bfloat16 inputs are widened exactly, the sum
``y + delta`` is rounded once, to nearest-even, as ``(y.float() + delta).to(torch.bfloat16)`` rounds);
float64 models in float64. On a CPU with AVX512_BF16 a bfloat16 model's ``x Aᵀ`` (bf16 matrices) sums pairs of
bf16 products into float32 with one instruction (VDPBF16PS: exact products, float32 sums; it treats subnormal
inputs and results as zero): twice the multiply-adds per instruction, no widening (:func:`bf16_pair_products`).
Summation order differs from torch's GEMM, so mask rows agree with the torch form to round-off, not bit for bit; it
does not depend on the thread count, nor on how many mask rows a call has.

Opt-in: ``generate``'s default path runs the torch form and never compiles or loads native code (the kernel's
gain is small: a gated forward at 1.09-1.11x the base against the torch form's 1.14-1.21x on one 2-core CPU).
``MARS_HF_GATED_KERNEL`` (or ``kernel=`` where the adapter is attached): ``torch`` (default: never), ``auto``
(the kernel for float32 and bfloat16 models on CPU where it builds, else the torch form, with one warning
naming the reason) or ``c`` (float32, bfloat16 and float64 models on CPU; an error where it cannot build).

Build: the system C compiler (``$CC``, split like a shell does, so ``CC="ccache gcc"`` works; else ``cc``),
for this CPU (``-march=native``), into ``$MARS_HF_HOME/kernels`` (default ``~/.cache/mars_hf/kernels``). The
file name hashes the source, the flags, the compiler and the CPU's flags, so a cache shared between machines
never loads a build for another CPU. A build is written under a temporary name and renamed into place, with
a record of its size and SHA-256 beside it; a cached file is read whole and checked against its record
before it is loaded, and built again when they disagree (a truncated library mapped by the loader kills
the process with SIGBUS; a damaged one would otherwise never be replaced).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from .home import cpu_flags as _cpu_flags  # a module name of its own: tests stand in another CPU
from .home import mars_hf_home

logger = logging.getLogger(__name__)

KERNEL_MODES = ("auto", "c", "torch")
KERNEL_ENV = "MARS_HF_GATED_KERNEL"
DEFAULT_KERNEL_MODE = "torch"  # the default path needs no compiler (docs/accelerators.md)
# Forces the kernel's vector width in bytes (32 or 64; unset: the CPU's registers, 64 with AVX-512). Like torch's
# ATEN_CPU_CAPABILITY it exists so that both code paths can be tested on one machine: GCC runs 64-byte vectors on
# an AVX2 CPU too, correctly but slowly.
VECTOR_BYTES_ENV = "MARS_HF_KERNEL_VECTOR_BYTES"
VECTOR_BYTES = ("32", "64")
# "0" builds the kernel without AVX512_BF16's pair products, as on a CPU without them: so that a CPU with them tests
# the widened bf16 path too (unset: pair products where -march=native has them).
BF16_PAIRS_ENV = "MARS_HF_KERNEL_BF16_PAIRS"
COMPILE_FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-std=gnu99")
OPENMP_FLAG = "-fopenmp"  # torch's thread count (same runtime); a compiler without OpenMP builds it single-threaded
MAX_MEMBERS = 8  # the C struct's room for sibling layers (q/k/v: 3); the C source below is given this value
# A group's call splits over threads from this many multiply-adds (the C source is given this value). Whole gated
# forwards of embedded-mars, interleaved (examples/gated_kernel_ab.py; docs/lab/gated_adapters_passes.md, "Sixth pass", a 2-vCPU
# Zen 4 EPYC): one thread for every SmolLM2 group (a threshold of 2^21) measured within ±0.04 of a forward of this
# threshold, better at some row counts and worse at others from run to run, so it stays; the calls alone, timed
# between bare base products, had read 20-30 % faster on one thread. MIN_PARALLEL_WORK_ENV sets another threshold (a
# build of its own), to measure where a CPU's crossover lies.
DEFAULT_MIN_PARALLEL_WORK = 1 << 14
MIN_PARALLEL_WORK_ENV = "MARS_HF_KERNEL_MIN_PARALLEL_WORK"

_SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#else
static int omp_get_max_threads(void) { return 1; }
static int omp_get_num_threads(void) { return 1; }
static int omp_get_thread_num(void) { return 0; }
#endif

#define MAX_THREADS 64

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = ((uint32_t)h) << 16; float f; memcpy(&f, &u, 4); return f;
}
static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even; NaN stays a quiet NaN */
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Layout: x Aᵀ reads A (ranks x inputs) four rows at a time, sixteen dot products (four mask rows by four rows of A)
   with their partial sums in registers; the add reads Bᵀ (rank x outputs) in chunks of columns, its sums in
   registers too. Vectors are as
   wide as the CPU's registers (GCC/Clang vector extensions): a 64-byte vector on an AVX2 CPU goes through the
   stack, which made an earlier version of this kernel run at 1-5 GFMA/s there. bf16 halves widen by a shift. */
#ifndef VBYTES  /* -DVBYTES=32|64 (MARS_HF_KERNEL_VECTOR_BYTES) forces a width: tests run both on any x86 CPU */
#if defined(__AVX512F__)
#define VBYTES 64
#else
#define VBYTES 32
#endif
#endif
typedef float f32v __attribute__((vector_size(VBYTES)));
typedef double f64v __attribute__((vector_size(VBYTES)));
typedef uint16_t u16v __attribute__((vector_size(VBYTES / 2)));
typedef uint32_t u32v __attribute__((vector_size(VBYTES)));
static inline f32v vload_f32(const float *p) { f32v v; memcpy(&v, p, VBYTES); return v; }
static inline f64v vload_f64(const double *p) { f64v v; memcpy(&v, p, VBYTES); return v; }
static inline f32v vload_bf16(const uint16_t *p) {
    u16v h; memcpy(&h, p, VBYTES / 2);
    u32v u = __builtin_convertvector(h, u32v) << 16; f32v v; memcpy(&v, &u, VBYTES); return v;
}
/* y += acc over one whole vector, rounded once (bf16: to nearest-even, NaN kept quiet, as f32_to_bf16). */
static inline void vadd_f32(float *y, f32v acc) { f32v v = vload_f32(y) + acc; memcpy(y, &v, VBYTES); }
static inline void vadd_f64(double *y, f64v acc) { f64v v = vload_f64(y) + acc; memcpy(y, &v, VBYTES); }
static inline void vadd_bf16(uint16_t *y, f32v acc) {
    f32v f = vload_bf16(y) + acc;
    u32v u; memcpy(&u, &f, VBYTES);
    u32v nan = (u32v)((u & 0x7fffffffu) > 0x7f800000u);
    u32v bits = (((u >> 16) | 0x40u) & nan) | (((u + 0x7fffu + ((u >> 16) & 1u)) >> 16) & ~nan);
    u16v h = __builtin_convertvector(bits, u16v); memcpy(y, &h, VBYTES / 2);
}

/* Threads pay a fork and join per call: only groups of at least this many multiply-adds split
   (gated_kernel.DEFAULT_MIN_PARALLEL_WORK says why this many; -DMIN_PARALLEL_WORK=... sets another). */
#ifndef MIN_PARALLEL_WORK
#define MIN_PARALLEL_WORK @MIN_PARALLEL_WORK@LL
#endif
int64_t mars_min_parallel_work(void) { return MIN_PARALLEL_WORK; }
/* The threads a group's call of `work` multiply-adds runs on. */
int mars_threads_for(int64_t work) {
    int threads = omp_get_max_threads(); if (threads > MAX_THREADS) threads = MAX_THREADS;
    return work >= MIN_PARALLEL_WORK && threads > 1 ? threads : 1;
}
/* Sum of a vector's lanes, in lane order. */
#define HSUM(CT, v, out)                                                                     \
    do { CT l_[VBYTES / sizeof(CT)]; memcpy(l_, &(v), VBYTES); CT s_ = l_[0];                \
         for (size_t k_ = 1; k_ < VBYTES / sizeof(CT); ++k_) s_ += l_[k_]; (out) = s_; } while (0)

/* XA's register block: t[r0 + q, i0 + p] for NI mask rows p and NR rows q of `a` (NI, NR: 4 or 1), their NI * NR
   sums in registers while j runs over whole steps of STEP entries; each x vector is used NR times and each row of
   `a`'s vector NI times, so a 4 x 4 block loads one vector per two multiply-adds. XV/WV: the vector types loaded from
   x and `a` (LOADXV, LOADWV), MAC(s, x, w): s plus their products. Every sum has one order whatever the block: one
   running vector over j, then its lanes in order, then the tail one entry at a time. */
#define XA_BLOCK(RT, WT, CT, XV, WV, LOADXV, LOADWV, MAC, STEP, LOADX, LOADW, NI, NR)        \
    do { vec s_[NI][NR];                                                                    \
         for (int p_ = 0; p_ < NI; ++p_) for (int q_ = 0; q_ < NR; ++q_) s_[p_][q_] = (vec){0}; \
         for (int64_t j = 0; j < whole; j += STEP) {                                        \
             WV w_[NR]; XV x_[NI];                                                          \
             for (int q_ = 0; q_ < NR; ++q_) w_[q_] = LOADWV(a + (r0 + q_) * in + j);        \
             for (int p_ = 0; p_ < NI; ++p_) x_[p_] = LOADXV(rows + (i0 + p_) * in + j);     \
             for (int p_ = 0; p_ < NI; ++p_)                                                \
                 for (int q_ = 0; q_ < NR; ++q_) s_[p_][q_] = MAC(s_[p_][q_], x_[p_], w_[q_]); \
         }                                                                                  \
         for (int p_ = 0; p_ < NI; ++p_)                                                    \
             for (int q_ = 0; q_ < NR; ++q_) {                                              \
                 const RT *x0 = rows + (i0 + p_) * in; const WT *w = a + (r0 + q_) * in;    \
                 CT sum; HSUM(CT, s_[p_][q_], sum);                                         \
                 for (int64_t j = whole; j < in; ++j) sum += LOADX(x0[j]) * LOADW(w[j]);    \
                 t[(r0 + q_) * n + i0 + p_] = sum;                                          \
             }                                                                              \
    } while (0)

/* t[r, i] = sum_j rows[i, j] * a[r, j] for r in [r_lo, r_hi)   (rows: the n mask rows, RT; a: R x in row-major;
   t: R x n, rank-major, so that threads splitting a's rows write separate cache lines). Blocks of four mask rows by
   four rows of `a` (XA_BLOCK), then the remainders one row at a time on either side (no multiply-adds on padding:
   one mask row costs a quarter of four); a thread reads its rows of `a` once per block of four mask rows (from L2
   after the first). */
#define XA(NAME, RT, WT, CT, XV, WV, LOADXV, LOADWV, MAC, STEP, LOADX, LOADW)                \
static void NAME(const RT *rows, int64_t in, int64_t n, const WT *a, CT *t,                 \
                 int64_t r_lo, int64_t r_hi) {                                              \
    typedef CT vec __attribute__((vector_size(VBYTES)));                                    \
    const int64_t whole = in / (STEP) * (STEP);                                             \
    for (int64_t i0 = 0; i0 < n; i0 += n - i0 >= 4 ? 4 : 1) {                              \
        const int four_rows = n - i0 >= 4;                                                  \
        for (int64_t r0 = r_lo; r0 < r_hi; r0 += r_hi - r0 >= 4 ? 4 : 1) {                  \
            const int four_ranks = r_hi - r0 >= 4;                                          \
            if (four_rows && four_ranks)                                                    \
                XA_BLOCK(RT, WT, CT, XV, WV, LOADXV, LOADWV, MAC, STEP, LOADX, LOADW, 4, 4); \
            else if (four_rows)                                                             \
                XA_BLOCK(RT, WT, CT, XV, WV, LOADXV, LOADWV, MAC, STEP, LOADX, LOADW, 4, 1); \
            else if (four_ranks)                                                            \
                XA_BLOCK(RT, WT, CT, XV, WV, LOADXV, LOADWV, MAC, STEP, LOADX, LOADW, 1, 4); \
            else XA_BLOCK(RT, WT, CT, XV, WV, LOADXV, LOADWV, MAC, STEP, LOADX, LOADW, 1, 1); \
        }                                                                                   \
    }                                                                                       \
}
#define FMA_MAC(s, x, w) ((s) + (x) * (w))
/* bf16 rows and bf16 `a` on a CPU with AVX512_BF16: pairs of bf16 products summed into float32 lanes by one
   instruction (VDPBF16PS), twice the entries of a float32 vector per instruction and no widening. */
#if defined(__AVX512BF16__) && !defined(NO_BF16_PAIRS) && (VBYTES == 64 || defined(__AVX512VL__))
#include <immintrin.h>
#define BF16_DOT 1
#if VBYTES == 64
typedef __m512bh bf16pairs;
static inline bf16pairs vload_pairs(const uint16_t *p) { return (bf16pairs)_mm512_loadu_si512((const void *)p); }
static inline f32v dot_pairs(f32v s, bf16pairs x, bf16pairs w) { return (f32v)_mm512_dpbf16_ps((__m512)s, x, w); }
#else
typedef __m256bh bf16pairs;
static inline bf16pairs vload_pairs(const uint16_t *p) { return (bf16pairs)_mm256_loadu_si256((const void *)p); }
static inline f32v dot_pairs(f32v s, bf16pairs x, bf16pairs w) { return (f32v)_mm256_dpbf16_ps((__m256)s, x, w); }
#endif
#else
#define BF16_DOT 0
#endif
int mars_bf16_dot(void) { return BF16_DOT; }

/* y_i[o : o + width] += the two vectors a, b of sums, rounded once (a partial chunk lane by lane). */
#define STORE_ROW(YT, CT, LOADY, STORE, VADD, yi, a, b)                                     \
    do { if (width == 2 * lanes) { VADD((yi), (a)); VADD((yi) + lanes, (b)); break; }        \
         CT sums_[2 * VBYTES / sizeof(CT)];                                                 \
         memcpy(sums_, &(a), VBYTES); memcpy(sums_ + lanes, &(b), VBYTES);                  \
         for (int64_t l_ = 0; l_ < width; ++l_) (yi)[l_] = STORE(LOADY((yi)[l_]) + sums_[l_]); } while (0)

/* A vector of `count` entries of a matrix row (widened from WT), zero-padded to whole lanes. */
#define LOAD_PART(CT, LOADW, VLOADW, dst, src, count, lanes)                                \
    do { if ((count) >= (lanes)) (dst) = VLOADW(src);                                       \
         else { CT l_[VBYTES / sizeof(CT)] = {0};                                            \
                for (int64_t k_ = 0; k_ < (count); ++k_) l_[k_] = LOADW((src)[k_]);          \
                memcpy(&(dst), l_, VBYTES); } } while (0)

/* ADD's register block over whole vectors: y[idx[i0 + p], o : o + NV lanes] += sum_r t[r0 + r, i0 + p] bt[r, o : ...]
   for NI mask rows (4 or 1) and NV vectors of outputs (4: two chunks), their NI * NV sums in registers while r runs;
   each vector of bt is used NI times. */
#define ADD_BLOCK(CT, VLOADW, VADD, NI, NV)                                                   \
    do { vec s_[NI][NV];                                                                    \
         for (int p_ = 0; p_ < NI; ++p_) for (int v_ = 0; v_ < NV; ++v_) s_[p_][v_] = (vec){0}; \
         for (int64_t r = 0; r < rk; ++r) {                                                 \
             vec w_[NV];                                                                    \
             for (int v_ = 0; v_ < NV; ++v_) w_[v_] = VLOADW(bt + r * out + o + v_ * lanes); \
             for (int p_ = 0; p_ < NI; ++p_) {                                              \
                 const CT scale = t[(r0 + r) * n + i0 + p_];                                \
                 for (int v_ = 0; v_ < NV; ++v_) s_[p_][v_] += scale * w_[v_];              \
             }                                                                              \
         }                                                                                  \
         for (int p_ = 0; p_ < NI; ++p_)                                                    \
             for (int v_ = 0; v_ < NV; ++v_) VADD(y + idx[i0 + p_] * out + o + v_ * lanes, s_[p_][v_]); \
    } while (0)

/* y[idx[i], o] += sum_{r < rk} t[r0 + r, i] * bt[r, o] for the column chunks [c_lo, c_hi) of two vectors each
   (bt: rk x out row-major, read where the layer holds it: an in-place edit reaches the next call), rounded once.
   Register blocking: two whole chunks (four vectors) of outputs for four mask rows (sixteen sums) stay in registers
   while r runs (ADD_BLOCK), then the last n % 4 rows one at a time; a lone or partial chunk the same way with two
   vectors. Every output's sum runs r = 0, 1, ... in order, whoever computes it and whichever block its row and
   its chunk fall in. */
#define ADD(NAME, YT, WT, CT, LOADY, LOADW, VLOADW, STORE, VADD)                            \
static void NAME(YT *y, int64_t out, const int64_t *idx, int64_t n, const CT *t,           \
                 int64_t r0, int64_t rk, const WT *bt, int64_t c_lo, int64_t c_hi) {        \
    typedef CT vec __attribute__((vector_size(VBYTES)));                                    \
    const int64_t lanes = VBYTES / sizeof(CT);                                              \
    for (int64_t c = c_lo; c < c_hi;) {                                                     \
        const int64_t o = c * 2 * lanes;                                                    \
        if (c + 1 < c_hi && o + 4 * lanes <= out) {  /* two whole chunks */                 \
            int64_t i0 = 0;                                                                 \
            for (; i0 + 4 <= n; i0 += 4) ADD_BLOCK(CT, VLOADW, VADD, 4, 4);                   \
            for (; i0 < n; ++i0) ADD_BLOCK(CT, VLOADW, VADD, 1, 4);                           \
            c += 2;                                                                         \
            continue;                                                                       \
        }                                                                                   \
        const int64_t width = out - o < 2 * lanes ? out - o : 2 * lanes;                    \
        int64_t i0 = 0;                                                                     \
        for (; i0 + 4 <= n; i0 += 4) {                                                      \
            vec a[4] = {{0}}, b[4] = {{0}}, w0, w1;                                         \
            for (int64_t r = 0; r < rk; ++r) {                                              \
                const WT *row = bt + r * out + o;                                           \
                LOAD_PART(CT, LOADW, VLOADW, w0, row, width, lanes);                        \
                LOAD_PART(CT, LOADW, VLOADW, w1, row + lanes, width - lanes, lanes);        \
                for (int64_t k = 0; k < 4; ++k) {                                           \
                    const CT scale = t[(r0 + r) * n + i0 + k];                              \
                    a[k] += scale * w0; b[k] += scale * w1;                                 \
                }                                                                           \
            }                                                                               \
            for (int64_t k = 0; k < 4; ++k)                                                 \
                STORE_ROW(YT, CT, LOADY, STORE, VADD, y + idx[i0 + k] * out + o, a[k], b[k]); \
        }                                                                                   \
        for (; i0 < n; ++i0) {                                                              \
            vec a0 = {0}, b0 = {0}, w0, w1;                                                 \
            for (int64_t r = 0; r < rk; ++r) {                                              \
                const WT *row = bt + r * out + o;                                           \
                LOAD_PART(CT, LOADW, VLOADW, w0, row, width, lanes);                        \
                LOAD_PART(CT, LOADW, VLOADW, w1, row + lanes, width - lanes, lanes);        \
                const CT scale = t[(r0 + r) * n + i0];                                      \
                a0 += scale * w0; b0 += scale * w1;                                         \
            }                                                                               \
            STORE_ROW(YT, CT, LOADY, STORE, VADD, y + idx[i0] * out + o, a0, b0);           \
        }                                                                                   \
        c += 1;                                                                             \
    }                                                                                       \
}

/* One group's arguments, passed by address: Python fills only what changes between calls (x, idx, n, a, ys),
   which costs less than converting eleven arguments per call. */
#define MAX_MEMBERS @MAX_MEMBERS@
typedef struct {
    const void *x; int64_t in; const int64_t *idx; int64_t n; const void *a; int64_t R; int64_t members;
    void *ys[MAX_MEMBERS]; int64_t outs[MAX_MEMBERS]; int64_t ranks[MAX_MEMBERS]; const void *bts[MAX_MEMBERS];
} group_call;

/* A sibling group (layers that read one input: q/k/v, gate/up; or one layer alone) in one call and one parallel
   region: t = x[idx] aᵀ for the stacked A of all members (threads split a's rows), then, after a barrier, each
   member's y_m[idx] += t[:, its ranks] bt_m (threads split the output columns). */
#define GROUP(NAME, XA_NAME, ADD_NAME, XT, RT, WT, CT, LOADX)                               \
int NAME(const group_call *call) {                                                          \
    const XT *x = (const XT *)call->x; const WT *a = (const WT *)call->a;                   \
    const int64_t in = call->in, n = call->n, R = call->R, members = call->members;         \
    const int64_t *idx = call->idx, *outs = call->outs, *ranks = call->ranks;               \
    if (members > MAX_MEMBERS) return 2;                                                    \
    const int64_t lanes = VBYTES / sizeof(CT);                                              \
    RT *rows = (RT *)malloc(sizeof(RT) * (size_t)(n * in));  /* the mask rows (RT: as XA reads them) */ \
    CT *t = (CT *)malloc(sizeof(CT) * (size_t)(n * R));                                     \
    if (!rows || !t) { free(rows); free(t); return 1; }                                     \
    for (int64_t i = 0; i < n; ++i)                                                         \
        for (int64_t j = 0; j < in; ++j) rows[i * in + j] = LOADX(x[idx[i] * in + j]);      \
    int64_t work = n * in * R;                                                              \
    for (int64_t m = 0; m < members; ++m) work += n * ranks[m] * outs[m];                   \
    const int threads = mars_threads_for(work), split = threads > 1;                        \
    _Pragma("omp parallel num_threads(threads) if(split)")                                  \
    {                                                                                       \
        const int64_t parts = split ? omp_get_num_threads() : 1, me = split ? omp_get_thread_num() : 0; \
        XA_NAME(rows, in, n, a, t, R * me / parts, R * (me + 1) / parts);                   \
        _Pragma("omp barrier")                                                              \
        for (int64_t m = 0, r0 = 0; m < members; r0 += ranks[m++]) {                        \
            const int64_t chunks = (outs[m] + 2 * lanes - 1) / (2 * lanes);                 \
            ADD_NAME((XT *)call->ys[m], outs[m], idx, n, t, r0, ranks[m], (const WT *)call->bts[m],       \
                     chunks * me / parts, chunks * (me + 1) / parts);                       \
        }                                                                                   \
    }                                                                                       \
    free(rows); free(t);                                                                    \
    return 0;                                                                               \
}

#define SAME(v) (v)
/* XA name suffix: the matrices' dtype (rows are widened to the accumulator's first); the others: model dtype _
   adapter matrices' dtype */
XA(mars_xa_f32, float, float, float, f32v, f32v, vload_f32, vload_f32, FMA_MAC, VBYTES / 4, SAME, SAME)
XA(mars_xa_bf16, float, uint16_t, float, f32v, f32v, vload_f32, vload_bf16, FMA_MAC, VBYTES / 4, SAME, bf16_to_f32)
XA(mars_xa_f64, double, double, double, f64v, f64v, vload_f64, vload_f64, FMA_MAC, VBYTES / 8, SAME, SAME)
ADD(mars_add_f32_f32, float, float, float, SAME, SAME, vload_f32, SAME, vadd_f32)
ADD(mars_add_f32_bf16, float, uint16_t, float, SAME, bf16_to_f32, vload_bf16, SAME, vadd_f32)
ADD(mars_add_bf16_bf16, uint16_t, uint16_t, float, bf16_to_f32, bf16_to_f32, vload_bf16, f32_to_bf16, vadd_bf16)
ADD(mars_add_bf16_f32, uint16_t, float, float, bf16_to_f32, SAME, vload_f32, f32_to_bf16, vadd_bf16)
ADD(mars_add_f64_f64, double, double, double, SAME, SAME, vload_f64, SAME, vadd_f64)
GROUP(mars_group_f32_f32, mars_xa_f32, mars_add_f32_f32, float, float, float, float, SAME)
GROUP(mars_group_f32_bf16, mars_xa_bf16, mars_add_f32_bf16, float, float, uint16_t, float, SAME)
#if BF16_DOT
XA(mars_xa_bf16_pairs, uint16_t, uint16_t, float, bf16pairs, bf16pairs, vload_pairs, vload_pairs, dot_pairs,
   VBYTES / 2, bf16_to_f32, bf16_to_f32)
GROUP(mars_group_bf16_bf16, mars_xa_bf16_pairs, mars_add_bf16_bf16, uint16_t, uint16_t, uint16_t, float, SAME)
#else
GROUP(mars_group_bf16_bf16, mars_xa_bf16, mars_add_bf16_bf16, uint16_t, float, uint16_t, float, bf16_to_f32)
#endif
GROUP(mars_group_bf16_f32, mars_xa_f32, mars_add_bf16_f32, uint16_t, float, float, float, bf16_to_f32)
GROUP(mars_group_f64_f64, mars_xa_f64, mars_add_f64_f64, double, double, double, double, SAME)
int mars_vector_bytes(void) { return VBYTES; }
""".replace("@MAX_MEMBERS@", str(MAX_MEMBERS)).replace(
    "@MIN_PARALLEL_WORK@", str(DEFAULT_MIN_PARALLEL_WORK)
)

_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float64: "f64"}
# (model dtype, adapter matrices' dtype) pairs the kernel serves; the first per model dtype is its default.
SERVED = {
    torch.float32: (torch.float32, torch.bfloat16),  # bf16 matrices (lora_dtype=torch.bfloat16): half the bytes
    torch.bfloat16: (torch.bfloat16, torch.float32),  # bf16 matrices: half the bytes; arithmetic is float32
    torch.float64: (torch.float64,),
}
# Model dtypes ``auto`` runs the kernel for. bfloat16: the torch form pays a float32 round trip per small
# product (its arithmetic is float32 for precision, its operands bf16), the kernel widens in registers.
# float32: one C call per group instead of a dozen torch ops; on a 2-vCPU AVX2 EPYC with packed base
# kernels a gated forward measured 1.09-1.11x the base against the torch form's 1.14-1.21x
# (docs/lab/gated_adapters_passes.md, "Fifth pass"). float64 (the tests' exact models) keeps BLAS's torch form.
AUTO_DTYPES = (torch.bfloat16, torch.float32)

_LIBRARY: ctypes.CDLL | None = None
_FUNCTIONS: dict = {}  # (model dtype, matrices' dtype) -> the C function of a sibling group
_FAILURE: str | None = None
_WARNED = False


def kernel_mode(requested: str | None = None) -> str:
    """``requested``, else ``$MARS_HF_GATED_KERNEL``, else ``torch`` (the kernel is opt-in); checked against
    :data:`KERNEL_MODES`."""
    mode = (requested or os.environ.get(KERNEL_ENV) or DEFAULT_KERNEL_MODE).strip().lower()
    if mode not in KERNEL_MODES:
        raise ValueError(f"gated kernel mode {mode!r} is not one of {KERNEL_MODES} (set {KERNEL_ENV} or pass it).")
    return mode


def matrix_dtype(model_dtype: torch.dtype, requested: torch.dtype | None) -> torch.dtype | None:
    """The dtype the kernel keeps a ``model_dtype`` model's adapter matrices in: ``requested`` if it serves
    that pair, else its default for the model dtype (None: no such pair)."""
    served = SERVED.get(model_dtype, ())
    if requested is None:
        return served[0] if served else None
    return requested if requested in served else None


def _cache_dir() -> Path:
    return mars_hf_home() / "kernels"


def _compile_flags() -> list[str]:
    """:data:`COMPILE_FLAGS`, with what :data:`VECTOR_BYTES_ENV`, :data:`BF16_PAIRS_ENV` and
    :data:`MIN_PARALLEL_WORK_ENV` force, if set."""
    flags = list(COMPILE_FLAGS)
    forced = os.environ.get(VECTOR_BYTES_ENV, "").strip()
    if forced:
        if forced not in VECTOR_BYTES:
            raise ValueError(f"{VECTOR_BYTES_ENV} must be one of {', '.join(VECTOR_BYTES)} (or unset), got {forced!r}.")
        flags.append(f"-DVBYTES={forced}")
    pairs = os.environ.get(BF16_PAIRS_ENV, "").strip()
    if pairs not in ("", "0"):
        raise ValueError(f"{BF16_PAIRS_ENV} must be 0 (build without bf16 pair products) or unset, got {pairs!r}.")
    if pairs == "0":
        flags.append("-DNO_BF16_PAIRS")
    work = os.environ.get(MIN_PARALLEL_WORK_ENV, "").strip()
    if work:
        if not work.isdigit():
            raise ValueError(
                f"{MIN_PARALLEL_WORK_ENV} must be a whole number of multiply-adds (or unset), got {work!r}."
            )
        flags.append(f"-DMIN_PARALLEL_WORK={int(work)}LL")
    return flags


def _compiler() -> list[str]:
    """``$CC`` split into words as a shell would (``"ccache gcc"``, ``"gcc -std=gnu99"``), else ``cc``."""
    setting = os.environ.get("CC") or "cc"
    try:
        words = shlex.split(setting)
    except ValueError as error:
        raise OSError(f"CC={setting!r} is not a command line ({error}); set CC to a C compiler") from None
    if not words or shutil.which(words[0]) is None:
        raise OSError(f"no C compiler {setting!r} on PATH (install gcc, or set CC)")
    return words


def _digest(data: bytes) -> dict:
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _intact_build(record: Path) -> Path | None:
    """The library ``record`` names, if it is whole: read in full (a read of a short file returns less, where
    the loader's mapping of it would fault) and equal in size and SHA-256 to what the record says."""
    try:
        expected = json.loads(record.read_text())
        library = record.with_name(expected["file"])
        found = {"file": library.name, **_digest(library.read_bytes())}
    except (OSError, ValueError, TypeError, KeyError):
        return None
    return library if found == expected and library.parent == record.parent else None


def _compile(compiler: list[str], flags: list[str], record: Path) -> Path:
    """Build in a scratch folder beside ``record``; rename the library into place under a name that carries
    its checksum, then the record naming it (each rename is atomic, and a library's name changes with its
    bytes, so a record read at any moment names a whole file with the bytes it lists)."""
    record.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=record.parent) as scratch:
        source = Path(scratch) / "mars_gated.c"
        source.write_text(_SOURCE)
        built = Path(scratch) / "mars_gated.so"
        for extra in ([OPENMP_FLAG], []):
            command = [*compiler, *flags, *extra, "-o", str(built), str(source)]
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode == 0:
                break
        else:
            failed = result.stderr.strip()[-400:]
            raise OSError(f"{shlex.join(compiler)} failed to build the gated kernel: {failed}")
        digest = _digest(built.read_bytes())
        target = record.with_name(f"{record.stem}_{digest['sha256'][:16]}.so")
        fresh_record = Path(scratch) / record.name
        fresh_record.write_text(json.dumps({"file": target.name, **digest}))
        os.replace(built, target)
        os.replace(fresh_record, record)
    return target


def _build() -> ctypes.CDLL:
    """Compile (once per source, flags, compiler and CPU), check and load the kernel library."""
    compiler = _compiler()
    flags = _compile_flags()
    version = subprocess.run([*compiler, "--version"], capture_output=True, text=True, check=False).stdout
    fields = [_SOURCE, *flags, OPENMP_FLAG, shlex.join(compiler), version, _cpu_flags()]
    key = hashlib.sha256("\0".join(fields).encode()).hexdigest()[:16]
    record = _cache_dir() / f"mars_gated_{key}.json"
    target = _intact_build(record)
    if target is None:
        if record.exists():
            logger.warning("The cached gated kernel %s does not match its record: building it again.", record.stem)
        target = _compile(compiler, flags, record)
    library = ctypes.CDLL(str(target))
    library.mars_vector_bytes.restype = ctypes.c_int
    library.mars_bf16_dot.restype = ctypes.c_int
    library.mars_min_parallel_work.restype = ctypes.c_int64
    library.mars_threads_for.argtypes = [ctypes.c_int64]
    library.mars_threads_for.restype = ctypes.c_int
    for model_dtype, matrix_dtypes in SERVED.items():
        for matrices in matrix_dtypes:
            group = getattr(library, f"mars_group_{_SUFFIX[model_dtype]}_{_SUFFIX[matrices]}")
            group.argtypes = [ctypes.c_void_p]  # the address of a group_call struct
            group.restype = ctypes.c_int
            _FUNCTIONS[model_dtype, matrices] = group
    return library


def library() -> ctypes.CDLL | None:
    """The loaded kernel library, built on first use; None (and why: :func:`failure`) where it cannot be."""
    global _LIBRARY, _FAILURE
    if _LIBRARY is None and _FAILURE is None:
        try:
            _LIBRARY = _build()
        except (OSError, subprocess.SubprocessError, AttributeError) as error:
            _FAILURE = str(error)
    return _LIBRARY


def failure() -> str | None:
    return _FAILURE


def vector_bytes() -> int | None:
    """The loaded build's vector width in bytes (None: no build)."""
    return None if library() is None else int(_LIBRARY.mars_vector_bytes())


def bf16_pair_products() -> bool | None:
    """Whether the loaded build's bf16 ``x Aᵀ`` sums pairs of bf16 products per instruction (AVX512_BF16's
    VDPBF16PS, where ``-march=native`` has it and :data:`BF16_PAIRS_ENV` is not 0); False: widened to float32
    first; None: no build."""
    return None if library() is None else bool(_LIBRARY.mars_bf16_dot())


def min_parallel_work() -> int | None:
    """The loaded build's threshold: a group's call of this many multiply-adds or more splits over threads."""
    return None if library() is None else int(_LIBRARY.mars_min_parallel_work())


def threads_for(work: int) -> int | None:
    """The threads the loaded build runs a group's call of ``work`` multiply-adds on, at torch's current thread
    count (the kernel and torch share one OpenMP runtime); None: no build."""
    return None if library() is None else int(_LIBRARY.mars_threads_for(work))


def use_kernel(mode: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether an adapter on ``device`` in ``dtype`` runs the C kernel under ``mode`` (raises for ``c`` where it
    cannot; warns once for ``auto`` when the build fails)."""
    global _WARNED
    if mode == "torch" or (mode == "auto" and dtype not in AUTO_DTYPES):
        return False
    if device.type != "cpu" or dtype not in SERVED:
        if mode == "c":
            raise ValueError(
                f"The gated C kernel serves float32, bfloat16 and float64 models on CPU, not {dtype} on {device}; "
                f"use {KERNEL_ENV}=auto or torch."
            )
        return False
    if library() is not None:
        return True
    if mode == "c":
        raise RuntimeError(f"The gated C kernel is unavailable: {_FAILURE}. Use {KERNEL_ENV}=torch, or fix the build.")
    if not _WARNED:
        _WARNED = True
        logger.warning(
            "The mask-gated adapter runs its torch form: the C kernel that mode 'auto' asked for is unavailable "
            "(%s). Drop the mode (the torch form is the default) or set %s=torch to silence this.",
            _FAILURE,
            KERNEL_ENV,
        )
    return False


class _GroupCall(ctypes.Structure):
    """The C ``group_call`` struct: one group's arguments."""

    _fields_ = [
        ("x", ctypes.c_void_p),
        ("in_features", ctypes.c_int64),
        ("idx", ctypes.c_void_p),
        ("n", ctypes.c_int64),
        ("a", ctypes.c_void_p),
        ("R", ctypes.c_int64),
        ("members", ctypes.c_int64),
        ("ys", ctypes.c_void_p * MAX_MEMBERS),
        ("outs", ctypes.c_int64 * MAX_MEMBERS),
        ("ranks", ctypes.c_int64 * MAX_MEMBERS),
        ("bts", ctypes.c_void_p * MAX_MEMBERS),
    ]


class GroupPlan:
    """A sibling group's kernel call: the C function and its argument struct, with what stays the same from
    forward to forward filled once: the stacked ``A`` (``R x in``) and each member's output width, rank and ``Bᵀ``
    (``rank x out``), read where the layers hold them (an in-place edit reaches the next call).

    A plan is valid until its group drops it: the adapted layers (``gated_lora``) drop it when a member's matrix is
    replaced (``register_buffer``, which ``module.mars_lora_BT = t`` runs) or moved (``model.to``/``share_memory``/
    ``half``: ``nn.Module._apply``, which may move storage without replacing the tensor). Checking the matrices
    per call instead (identity, then also address and version) cost 0.3-1 ms of a 31 ms bf16 forward: the layers'
    buffers and the tensors' metadata are cold by then (docs/lab/gated_adapters_passes.md, "Sixth pass" and "Seventh pass").
    ``held`` keeps the matrices alive while the C struct points at them."""

    __slots__ = ("function", "call", "address", "held", "index")

    def __init__(self, model_dtype: torch.dtype, a: torch.Tensor, bts: list[torch.Tensor]):
        if len(bts) > MAX_MEMBERS:
            raise ValueError(f"the gated kernel adapts at most {MAX_MEMBERS} sibling layers in one call, not {len(bts)}")
        self.function = _FUNCTIONS[model_dtype, bts[0].dtype]
        self.held = (a, *bts)
        self.call = _GroupCall(a=a.data_ptr(), R=a.shape[0], in_features=a.shape[1], members=len(bts))
        for m, bt in enumerate(bts):
            self.call.outs[m], self.call.ranks[m], self.call.bts[m] = bt.shape[1], bt.shape[0], bt.data_ptr()
        self.address = ctypes.addressof(self.call)
        self.index = None  # the mask positions the struct holds (the same tensor for every group of a forward)

    def __deepcopy__(self, memo) -> None:
        """A copied model gets no plan (its group builds one from its own matrices at its first forward): the
        struct holds this model's addresses, and ctypes cannot copy it."""
        return None

    def __reduce__(self):
        """Pickled as None, for the same reason (``torch.save(model)``)."""
        return type(None), ()


def mask_rows_group_delta(plan: GroupPlan, x: torch.Tensor, index: torch.Tensor, outputs: list[torch.Tensor]) -> None:
    """``outputs[m][index] += (x[index] @ Aᵀ)[:, member m's ranks] @ Bᵀ_m`` in place for every member of ``plan``'s
    group, each sum rounded once, in one C call. Flattened rows; ``x`` (``in`` = ``A``'s columns) and ``outputs``
    contiguous, in the model dtype the plan was built for."""
    call = plan.call
    call.x = x.data_ptr()
    if index is not plan.index:
        plan.index, call.idx, call.n = index, index.data_ptr(), index.numel()
    ys = call.ys
    for m, y in enumerate(outputs):
        ys[m] = y.data_ptr()
    status = plan.function(plan.address)
    if status == 1:
        raise MemoryError("the gated kernel could not allocate its scratch rows")
    if status:
        raise RuntimeError(f"the gated kernel refused the call (status {status}: more than {MAX_MEMBERS} members)")
