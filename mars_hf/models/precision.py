"""Which precision the project's own commands load a model in: ``--dtype auto`` decided by measurement.

``generate`` never changes the dtype of a model it is given; only the commands that load one
(``mars-hf generate``, ``bench``, ``serve``, ``eval``, the quickstart's evaluation) choose, through
:func:`choose_dtype`. ``auto`` is bfloat16 only where the CPU computes bf16 natively (AVX-512 BF16 or
AMX; elsewhere it is emulated, several times slower) *and* a short probe at the model's own layer
shapes measures bf16 matmuls faster than float32; bfloat16 on a GPU that computes it (CUDA's
``is_bf16_supported``); float32 everywhere else. Lossless rows in bf16 are identical to stock greedy up to
near-ties (the bench counts the flips); the project's exactness guarantees are stated in float32. Every speed ratio is then measured against
stock ``generate`` on the same model, in the same dtype.
"""

from __future__ import annotations

import functools
import logging
import time

import torch

from mars_hf.decoding.cost_model import cpu_has_native_bf16

logger = logging.getLogger(__name__)

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16", "float64")
# A model narrower than this spends its forward on per-operation overhead, not arithmetic: the
# precision buys nothing there and float32 keeps outputs comparable (tiny test models stay float32).
MIN_AUTO_HIDDEN_SIZE = 256
# bf16 must beat float32 by this factor in the probe (noise margin).
BF16_MIN_SPEEDUP = 1.1
PROBE_ROWS = 8  # a MARS step's rows at batch 1-2: drafts and masks


def matmul_rate(dtype: torch.dtype, seconds: float, size: tuple[int, int, int] = (64, 576, 1536)) -> float:
    """Products per second of ``[m, k] @ [k, n]`` in ``dtype`` (first call untimed: kernel selection)."""
    m, k, n = size
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    a @ b
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        count += 1
    return count / (time.perf_counter() - start)


@functools.lru_cache(maxsize=8)
def bf16_speedup(hidden_size: int, intermediate_size: int, threads: int, seconds: float = 0.15) -> float:
    """bf16 ÷ float32 matmul rate at a decoding step's shape (measured once per shape and thread count)."""
    size = (PROBE_ROWS, hidden_size, intermediate_size)
    float32 = matmul_rate(torch.float32, seconds, size)
    bfloat16 = matmul_rate(torch.bfloat16, seconds, size)
    return bfloat16 / float32


def choose_dtype(
    requested: str | torch.dtype = "auto",
    *,
    hidden_size: int | None = None,
    intermediate_size: int | None = None,
    device: str = "cpu",
) -> tuple[torch.dtype, str]:
    """``(dtype, why)`` for loading a model; ``requested`` other than ``"auto"`` is returned as is."""
    if isinstance(requested, torch.dtype):
        return requested, "given"
    if requested != "auto":
        if requested not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {DTYPE_CHOICES}, got {requested!r}.")
        return getattr(torch, requested), f"--dtype {requested}"
    kind = str(device).split(":")[0]
    if kind == "cuda" and torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return torch.bfloat16, f"auto: bfloat16 (native on {device})"
    if kind != "cpu":
        return torch.float32, f"auto: float32 on {device} (no native bf16 known there)"
    if not cpu_has_native_bf16():
        return torch.float32, "auto: float32 (this CPU has no native bf16: no AVX-512 BF16 / AMX)"
    if not hidden_size or hidden_size < MIN_AUTO_HIDDEN_SIZE:
        return (
            torch.float32,
            f"auto: float32 (hidden size {hidden_size} < {MIN_AUTO_HIDDEN_SIZE}: too small to gain)",
        )
    intermediate_size = intermediate_size or 4 * hidden_size
    speedup = bf16_speedup(int(hidden_size), int(intermediate_size), torch.get_num_threads())
    if speedup >= BF16_MIN_SPEEDUP:
        return torch.bfloat16, f"auto: bfloat16 (native bf16; probe {speedup:.2f}× float32's matmul rate)"
    return torch.float32, f"auto: float32 (native bf16, but the probe measured only {speedup:.2f}× float32)"


def log_choice(dtype: torch.dtype, why: str, what: str = "model") -> None:
    logger.info("Loading the %s in %s (%s).", what, str(dtype).replace("torch.", ""), why)


def model_shapes(path: str) -> tuple[int | None, int | None]:
    """``(hidden_size, intermediate_size)`` from a model folder's config, an adapter's base, or a Hub id
    in the cache; ``(None, None)`` when none can be read (then ``auto`` stays float32)."""
    import json
    import os

    from mars_hf.models.embedded_model import resolve_adapter_base

    folder = path
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        adapter = os.path.join(path, "adapter_config.json")
        if os.path.isfile(adapter):
            with open(adapter, encoding="utf-8") as handle:
                folder = resolve_adapter_base(path, json.load(handle).get("base_model_name_or_path"))
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(folder)
    except (OSError, ValueError, TypeError):
        return None, None
    config = getattr(config, "get_text_config", lambda: config)()
    return getattr(config, "hidden_size", None), getattr(config, "intermediate_size", None)
