"""A small C kernel for the mask-gated adapter's delta on CPU: work on the mask rows only, one call per layer.

Why: the torch form of the gated delta (``docs/gated_adapters.md``) runs ≈ 11 small products, 4 gate
multiplies, 7 adds and, for a bf16 model, their dtype round trips per decoder layer. Each is a full torch
op of a few to tens of µs, so on a 2-core CPU the adapter made a bf16 forward of a few rows cost
1.3–1.5× the base model's although its arithmetic is tiny. The kernel does the same arithmetic with one
C call per adapted layer, touching only the mask rows: the first (or only) layer of a group that reads one
input computes ``t = x[mask rows] Aᵀ`` for the whole group and its own ``y[mask rows] += t Bᵀ``; its
siblings (k and v after q, up after gate) add theirs from the kept ``t``. Real rows keep the base layer's
bits because they are never written.

Numerics: float32 and bfloat16 models accumulate in float32 (bfloat16 inputs are widened exactly, the sum
``y + delta`` is rounded once, to nearest-even, as ``(y.float() + delta).to(torch.bfloat16)`` rounds);
float64 models in float64. Summation order differs from torch's GEMM, so mask rows agree with the torch
form to round-off, not bit for bit.

The source is compiled once per machine with the system C compiler (``$CC``, else ``cc``), for this CPU
(``-march=native``), into ``$MARS_HF_HOME/kernels`` (default ``~/.cache/mars_hf/kernels``); the file
name hashes the source, the flags, the compiler and the CPU's flags, so a cache shared between machines
never loads a build for another CPU. ``MARS_HF_GATED_KERNEL``: ``auto`` (default: the kernel for bfloat16
models on CPU where it builds, else the torch form, with one warning naming the reason), ``c`` (float32,
bfloat16 and float64 models on CPU; an error where it cannot build) or ``torch`` (never).

This file ships verbatim in checkpoints (``custom_generate/gated_kernel.py``): standard library and torch only.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from .home import mars_hf_home

logger = logging.getLogger(__name__)

KERNEL_MODES = ("auto", "c", "torch")
KERNEL_ENV = "MARS_HF_GATED_KERNEL"
COMPILE_FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-std=gnu99")
OPENMP_FLAG = "-fopenmp"  # torch's thread count (same runtime); a compiler without OpenMP builds it single-threaded

_SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#else
static int omp_get_max_threads(void) { return 1; }
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

/* Register blocking: for 4 mask rows at a time, one vector of accumulators per row (GCC/Clang vector
   extensions: 64 bytes, 16 floats or 8 doubles) stays in registers while the inner loop runs over the
   reduced dimension, so each weight vector is loaded once per 4 rows and no accumulator goes through
   memory. Columns that do not fill a vector are zero-padded on load and not stored. Threads split the
   column blocks (one parallel region per call, over all mask rows). Missing rows of the last block of 4
   multiply zeros and are not stored. */
#define ROWS 4

#define LOAD_BLOCK(dst, src, count, LOADW, CT)                                              \
    do { CT lanes_[64 / sizeof(CT)] = {0};                                                  \
         for (int64_t l_ = 0; l_ < (count); ++l_) lanes_[l_] = LOADW((src)[l_]);            \
         memcpy(&(dst), lanes_, sizeof(lanes_)); } while (0)

/* Whole 64-byte blocks load as one vector (bf16: 16 halves widened by a shift), not lane by lane. */
typedef float f32x16 __attribute__((vector_size(64)));
typedef double f64x8 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
static inline f32x16 vload_f32(const float *p) { f32x16 v; memcpy(&v, p, 64); return v; }
static inline f64x8 vload_f64(const double *p) { f64x8 v; memcpy(&v, p, 64); return v; }
static inline f32x16 vload_bf16(const uint16_t *p) {
    u16x16 h; memcpy(&h, p, 32);
    u32x16 u = __builtin_convertvector(h, u32x16) << 16; f32x16 v; memcpy(&v, &u, 64); return v;
}
/* y += acc over one whole block, rounded once (bf16: to nearest-even, NaN kept quiet, as f32_to_bf16). */
static inline void vadd_f32(float *y, f32x16 acc) { f32x16 v = vload_f32(y) + acc; memcpy(y, &v, 64); }
static inline void vadd_f64(double *y, f64x8 acc) { f64x8 v = vload_f64(y) + acc; memcpy(y, &v, 64); }
static inline void vadd_bf16(uint16_t *y, f32x16 acc) {
    f32x16 f = vload_bf16(y) + acc;
    u32x16 u; memcpy(&u, &f, 64);
    u32x16 nan = (u32x16)((u & 0x7fffffffu) > 0x7f800000u);
    u32x16 bits = (((u >> 16) | 0x40u) & nan) | (((u + 0x7fffu + ((u >> 16) & 1u)) >> 16) & ~nan);
    u16x16 h = __builtin_convertvector(bits, u16x16); memcpy(y, &h, 32);
}
#define LOAD_VECTOR(dst, src, count, LOADW, VLOADW, CT, lanes)                               \
    do { if ((count) == (lanes)) (dst) = VLOADW(src); else LOAD_BLOCK(dst, src, count, LOADW, CT); } while (0)

/* Threads pay a fork and join per call (~µs, torch's workers are still spinning from the last layer): only
   products of at least this many multiply-adds split. The calls stream the adapter's matrices from memory,
   which two threads do faster: 2^12 beat 2^18 at 8-16 mask rows (SmolLM2 bf16: 4.8 -> 3.7 and 6.5 -> 4.7 ms
   per forward) and tied at 1-4. */
#define MIN_PARALLEL_WORK (1 << 12)

/* t[i, r] = sum_j x[idx[i], j] * at[j, r]   (x: rows x in, at: in x R row-major, t: n x R) */
#define XA(NAME, XT, WT, CT, LOADX, LOADW, VLOADW)                                          \
int NAME(const XT *x, int64_t in, const int64_t *idx, int64_t n, const WT *at, int64_t R, CT *t) { \
    typedef CT vec __attribute__((vector_size(64)));                                        \
    const int64_t lanes = 64 / sizeof(CT), blocks = (R + lanes - 1) / lanes;                \
    const int64_t padded = (n + ROWS - 1) / ROWS * ROWS;                                    \
    CT *rows = (CT *)calloc((size_t)(padded * in), sizeof(CT));  /* mask rows, widened */   \
    if (!rows) return 1;                                                                    \
    for (int64_t i = 0; i < n; ++i)                                                         \
        for (int64_t j = 0; j < in; ++j) rows[i * in + j] = LOADX(x[idx[i] * in + j]);      \
    int threads = omp_get_max_threads(); if (threads > MAX_THREADS) threads = MAX_THREADS;   \
    int split = n * in * R >= MIN_PARALLEL_WORK;                                            \
    _Pragma("omp parallel for num_threads(threads) schedule(static) if(split)")             \
    for (int64_t b = 0; b < blocks; ++b) {                                                  \
        int64_t r0 = b * lanes, width = R - r0 < lanes ? R - r0 : lanes;                    \
        for (int64_t i0 = 0; i0 < n; i0 += ROWS) {                                          \
            int64_t nb = n - i0 < ROWS ? n - i0 : ROWS;                                     \
            vec a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, w;                                  \
            const CT *x0 = rows + i0 * in, *x1 = x0 + in, *x2 = x1 + in, *x3 = x2 + in;     \
            for (int64_t j = 0; j < in; ++j) {                                              \
                LOAD_VECTOR(w, at + j * R + r0, width, LOADW, VLOADW, CT, lanes);          \
                a0 += x0[j] * w; a1 += x1[j] * w; a2 += x2[j] * w; a3 += x3[j] * w;         \
            }                                                                               \
            vec acc[ROWS] = {a0, a1, a2, a3};                                               \
            for (int64_t ii = 0; ii < nb; ++ii)                                             \
                memcpy(t + (i0 + ii) * R + r0, &acc[ii], sizeof(CT) * (size_t)width);      \
        }                                                                                   \
    }                                                                                       \
    free(rows);                                                                             \
    return 0;                                                                               \
}

/* y[idx[i], o] += sum_{r < rk} t[i, r0 + r] * bt[r, o]   (bt: rk x out row-major), rounded once */
#define ADD(NAME, YT, WT, CT, LOADY, LOADW, VLOADW, STORE, VADD)                            \
int NAME(YT *y, int64_t out, const int64_t *idx, int64_t n, const CT *t, int64_t R,         \
         int64_t r0, int64_t rk, const WT *bt) {                                            \
    typedef CT vec __attribute__((vector_size(64)));                                        \
    const int64_t lanes = 64 / sizeof(CT), blocks = (out + lanes - 1) / lanes;              \
    int threads = omp_get_max_threads(); if (threads > MAX_THREADS) threads = MAX_THREADS;   \
    int split = n * rk * out >= MIN_PARALLEL_WORK;                                          \
    _Pragma("omp parallel for num_threads(threads) schedule(static) if(split)")             \
    for (int64_t b = 0; b < blocks; ++b) {                                                  \
        int64_t o0 = b * lanes, width = out - o0 < lanes ? out - o0 : lanes;                \
        for (int64_t i0 = 0; i0 < n; i0 += ROWS) {                                          \
            int64_t nb = n - i0 < ROWS ? n - i0 : ROWS;                                     \
            vec a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, w;                                  \
            for (int64_t r = 0; r < rk; ++r) {                                              \
                LOAD_VECTOR(w, bt + r * out + o0, width, LOADW, VLOADW, CT, lanes);        \
                const CT *c = t + i0 * R + r0 + r;                                          \
                a0 += c[0] * w;                                                             \
                if (nb > 1) a1 += c[R] * w;                                                 \
                if (nb > 2) a2 += c[2 * R] * w;                                             \
                if (nb > 3) a3 += c[3 * R] * w;                                             \
            }                                                                               \
            vec acc[ROWS] = {a0, a1, a2, a3};                                               \
            for (int64_t ii = 0; ii < nb; ++ii) {                                           \
                YT *yi = y + idx[i0 + ii] * out + o0;                                       \
                if (width == lanes) { VADD(yi, acc[ii]); continue; }                        \
                CT sums[64 / sizeof(CT)]; memcpy(sums, &acc[ii], sizeof(sums));             \
                for (int64_t l = 0; l < width; ++l) yi[l] = STORE(LOADY(yi[l]) + sums[l]);  \
            }                                                                               \
        }                                                                                   \
    }                                                                                       \
    return 0;                                                                               \
}

/* The first (or only) sibling of a group: t = x[idx] at, then its own y[idx] += t[:, r0:r0+rk] bt, in one call. */
#define DELTA(NAME, XA_NAME, ADD_NAME, XT, WT, CT)                                          \
int NAME(XT *y, int64_t out, const XT *x, int64_t in, const int64_t *idx, int64_t n,       \
         const WT *at, int64_t R, CT *t, int64_t r0, int64_t rk, const WT *bt) {            \
    int status = XA_NAME(x, in, idx, n, at, R, t);                                          \
    return status ? status : ADD_NAME(y, out, idx, n, t, R, r0, rk, bt);                    \
}

#define SAME(v) (v)
/* name suffix: model dtype _ adapter matrices' dtype */
XA(mars_xa_f32_f32, float, float, float, SAME, SAME, vload_f32)
XA(mars_xa_bf16_bf16, uint16_t, uint16_t, float, bf16_to_f32, bf16_to_f32, vload_bf16)
XA(mars_xa_bf16_f32, uint16_t, float, float, bf16_to_f32, SAME, vload_f32)
XA(mars_xa_f64_f64, double, double, double, SAME, SAME, vload_f64)
ADD(mars_add_f32_f32, float, float, float, SAME, SAME, vload_f32, SAME, vadd_f32)
ADD(mars_add_bf16_bf16, uint16_t, uint16_t, float, bf16_to_f32, bf16_to_f32, vload_bf16, f32_to_bf16, vadd_bf16)
ADD(mars_add_bf16_f32, uint16_t, float, float, bf16_to_f32, SAME, vload_f32, f32_to_bf16, vadd_bf16)
ADD(mars_add_f64_f64, double, double, double, SAME, SAME, vload_f64, SAME, vadd_f64)
DELTA(mars_delta_f32_f32, mars_xa_f32_f32, mars_add_f32_f32, float, float, float)
DELTA(mars_delta_bf16_bf16, mars_xa_bf16_bf16, mars_add_bf16_bf16, uint16_t, uint16_t, float)
DELTA(mars_delta_bf16_f32, mars_xa_bf16_f32, mars_add_bf16_f32, uint16_t, float, float)
DELTA(mars_delta_f64_f64, mars_xa_f64_f64, mars_add_f64_f64, double, double, double)
"""

_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float64: "f64"}
# (model dtype, adapter matrices' dtype) pairs the kernel serves; the first per model dtype is its default.
SERVED = {
    torch.float32: (torch.float32,),
    torch.bfloat16: (torch.bfloat16, torch.float32),  # bf16 matrices: half the bytes; arithmetic is float32
    torch.float64: (torch.float64,),
}
# Model dtypes ``auto`` runs the kernel for. bfloat16: the torch form pays a float32 round trip per small
# product (its arithmetic is float32 for precision, its operands bf16), the kernel widens in registers.
# float32 (and float64) models get the kernel only on request (``c``): there the torch form is plain
# BLAS calls, and on a 2-vCPU AVX-512 EPYC the kernel measured no faster (slower at 1 and 16 mask rows,
# where BLAS's one-row and many-row paths beat its 4-row blocks; docs/gated_adapters.md).
AUTO_DTYPES = (torch.bfloat16,)
# Accumulator (t) dtype per model dtype.
_ACCUMULATOR = {torch.float32: torch.float32, torch.bfloat16: torch.float32, torch.float64: torch.float64}

_LIBRARY: ctypes.CDLL | None = None
_FUNCTIONS: dict = {}  # ("add" | "delta", model dtype, matrices' dtype) -> C function
_FAILURE: str | None = None
_WARNED = False


def kernel_mode(requested: str | None = None) -> str:
    """``requested``, else ``$MARS_HF_GATED_KERNEL``, else ``auto``; checked against :data:`KERNEL_MODES`."""
    mode = (requested or os.environ.get(KERNEL_ENV) or "auto").strip().lower()
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


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() + platform.machine()


def _cache_dir() -> Path:
    return mars_hf_home() / "kernels"


def _build() -> ctypes.CDLL:
    """Compile (once per source, flags, compiler and CPU) and load the kernel library."""
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise OSError(f"no C compiler {compiler!r} on PATH (install gcc, or set CC)")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    fields = [_SOURCE, *COMPILE_FLAGS, OPENMP_FLAG, version, _cpu_flags()]
    key = hashlib.sha256("\0".join(fields).encode()).hexdigest()[:16]
    target = _cache_dir() / f"mars_gated_{key}.so"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
            source = Path(scratch) / "mars_gated.c"
            source.write_text(_SOURCE)
            built = Path(scratch) / target.name
            for extra in ([OPENMP_FLAG], []):
                command = [compiler, *COMPILE_FLAGS, *extra, "-o", str(built), str(source)]
                result = subprocess.run(command, capture_output=True, text=True)
                if result.returncode == 0:
                    break
            else:
                raise OSError(f"{compiler} failed to build the gated kernel: {result.stderr.strip()[-400:]}")
            os.replace(built, target)  # atomic: a concurrent process loads a whole file or builds its own
    library = ctypes.CDLL(str(target))
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    for model_dtype, matrix_dtypes in SERVED.items():
        for matrices in matrix_dtypes:
            suffix = f"{_SUFFIX[model_dtype]}_{_SUFFIX[matrices]}"
            add = getattr(library, f"mars_add_{suffix}")
            add.argtypes = [pointer, size, pointer, size, pointer, size, size, size, pointer]
            add.restype = ctypes.c_int
            delta = getattr(library, f"mars_delta_{suffix}")
            delta.argtypes = [pointer, size, pointer, size, pointer, size, pointer, size, pointer, size, size, pointer]
            delta.restype = ctypes.c_int
            for kind, function in (("add", add), ("delta", delta)):
                _FUNCTIONS[kind, model_dtype, matrices] = function
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
            "The mask-gated adapter runs its torch form (slower on CPU): the C kernel did not build (%s). Install a C "
            "compiler to get it, or set %s=torch to silence this.",
            _FAILURE,
            KERNEL_ENV,
        )
    return False


def mask_rows_delta(
    x: torch.Tensor, index: torch.Tensor, at: torch.Tensor, y: torch.Tensor, start: int, rank: int, bt: torch.Tensor
) -> torch.Tensor:
    """``t = x[index] @ at`` over flattened rows of ``x`` (contiguous; ``at`` is ``in x R``), then
    :func:`add_mask_rows_delta` for its ``[start, start + rank)`` block, in one C call (the first or only
    member of a group); returns ``t`` (``(n, R)``) for the other members."""
    t = torch.empty(index.numel(), at.shape[1], dtype=_ACCUMULATOR[x.dtype])
    status = _FUNCTIONS["delta", y.dtype, bt.dtype](
        y.data_ptr(), y.shape[-1], x.data_ptr(), x.shape[-1], index.data_ptr(), index.numel(), at.data_ptr(),
        at.shape[1], t.data_ptr(), start, rank, bt.data_ptr()
    )
    if status:
        raise MemoryError("the gated kernel could not allocate its scratch row")
    return t


def add_mask_rows_delta(
    y: torch.Tensor, index: torch.Tensor, t: torch.Tensor, start: int, rank: int, bt: torch.Tensor
) -> None:
    """``y[index] += t[:, start:start + rank] @ bt`` in place (``bt`` is ``rank x out``), rounded once."""
    status = _FUNCTIONS["add", y.dtype, bt.dtype](
        y.data_ptr(), y.shape[-1], index.data_ptr(), index.numel(), t.data_ptr(), t.shape[1], start, rank, bt.data_ptr()
    )
    if status:
        raise MemoryError("the gated kernel could not allocate its accumulators")
