"""Multi-row linear layers on CPU through oneDNN with their weights packed once, during MARS steps.

Why: a MARS step is a forward of 2-16 columns per row, stock decoding one of 1. On some CPUs the default
float32 GEMM (MKL) repacks the whole weight matrix on every call with more than one input row, so a
SmolLM2 linear of 2 rows cost 2.4-3.5x one of 1 row and a 2-column forward of the shipped model 1.8x a
1-column one (an AVX2 AMD EPYC; docs/verified_decoding.md). With each weight packed once for oneDNN, the
same 2-column forward cost 1.14x. One-row inputs keep the stock kernel, so a one-token step costs and rounds exactly
like a stock decoding step; the packs are a second copy of the linear weights, kept while the model lives.

``mars_cpu_kernels``: ``"auto"`` (default) packs when the model is float32 on a CPU with oneDNN, the copy
fits in half the free memory and a measurement of the model's own linear shapes finds the packed kernel
faster (once per model and thread count); ``"packed"`` always (an error where it cannot); ``"stock"`` never.
"""

from __future__ import annotations

import contextlib
import logging
import os
import statistics
import time
import weakref

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

CPU_KERNEL_MODES = ("auto", "packed", "stock")
PACK_ROWS_HINT = 4  # oneDNN picks the packed layout for this many input rows (any count runs on it)
PROBE_ROWS = (2, 4)  # the input rows the "auto" measurement times, stock against packed
PROBE_ROUNDS = 5
PAYS_BELOW = 0.9  # "auto" packs when the packed kernels take less than this share of the stock time

_PACKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # nn.Linear -> (weight identity, pack)
_DECISIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {threads: bool}


def unavailable_reason(model) -> str | None:
    """Why the packed kernels cannot serve ``model`` (None when they can)."""
    parameter = next(model.parameters())
    if parameter.device.type != "cpu":
        return f"the model is on {parameter.device.type}, not the CPU"
    if parameter.dtype != torch.float32:
        return f"the model is {parameter.dtype}, not float32"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    return None


def _linears(model) -> list[torch.nn.Linear]:
    """The float32 linear layers whose plain forward can be replaced (not those with foreign wrappers)."""
    found = []
    for module in model.modules():
        if type(module) is not torch.nn.Linear or module.weight.dtype != torch.float32:
            continue
        if "forward" in module.__dict__ and "_mars_adapter" not in module.__dict__:
            continue  # another library's wrapper (e.g. offloading hooks): left alone
        found.append(module)
    return found


def _pack(linear: torch.nn.Linear):
    """``linear``'s weight in oneDNN's packed layout; repacked when the weight changed (an optimizer step,
    ``model.to``)."""
    weight = linear.weight
    identity = (weight.data_ptr(), weight._version)
    cached = _PACKS.get(linear)
    if cached is None or cached[0] != identity:
        with torch.no_grad():
            cached = (identity, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT))
        _PACKS[linear] = cached
    return cached[1]


class _PackedForward:
    """One linear's plain forward: the stock kernel for one row (or with autograd on), else the pack."""

    __slots__ = ("linear", "stock", "packed")

    def __init__(self, linear, stock, packed):
        self.linear, self.stock, self.packed = linear, stock, packed

    def __call__(self, x, *args, **kwargs):
        rows = x.numel() // x.shape[-1]
        if rows == 1 or x.dtype != torch.float32 or torch.is_grad_enabled():
            return self.stock(x, *args, **kwargs)
        y = packed_matmul(x.reshape(rows, x.shape[-1]), self.packed, self.linear.bias)
        return y.view(*x.shape[:-1], y.shape[-1])


def packed_matmul(x2: torch.Tensor, packed, bias: torch.Tensor | None) -> torch.Tensor:
    """``x2 @ W.T + bias`` for 2-D ``x2`` on the packed ``W`` (oneDNN)."""
    return torch.ops.mkldnn._linear_pointwise(x2, packed, bias, "none", [], "")


@contextlib.contextmanager
def packed_linears(model, mode: str = "auto"):
    """Within the block, ``model``'s linear layers run inputs of several rows on packed oneDNN kernels
    (``mode`` as ``mars_cpu_kernels``); yields whether they do. Restored on exit, so stock ``generate``
    outside the block is untouched."""
    if not use_packed(model, mode):
        yield False
        return
    installed = [_install(linear) for linear in _linears(model)]
    try:
        yield True
    finally:
        for undo in reversed(installed):
            undo()


def _install(linear):
    """Route ``linear``'s plain forward through its pack; returns the undo. A gated adapter's layer keeps
    its adapter and has its *base* forward routed. (Its two small products stay on the stock GEMM: at a
    few rows and rank 32, oneDNN's ~40 µs per call costs more than the stock kernel's whole product.)"""
    adapter = linear.__dict__.get("_mars_adapter")
    if adapter is not None:
        stock = adapter.base_forward
        adapter.base_forward = _PackedForward(linear, stock, _pack(linear))

        def undo():
            adapter.base_forward = stock

        return undo
    linear.forward = _PackedForward(linear, linear.forward, _pack(linear))
    return lambda: linear.__dict__.pop("forward", None)


def active(model) -> bool:
    """Whether ``model``'s linears run packed right now (part of what a measured cost curve depends on)."""
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            adapter = module.__dict__.get("_mars_adapter")
            current = adapter.base_forward if adapter is not None else module.__dict__.get("forward")
            if isinstance(current, _PackedForward):
                return True
    return False


def use_packed(model, mode: str = "auto") -> bool:
    """Whether MARS steps of ``model`` run packed under ``mode`` (see the module docstring)."""
    if mode not in CPU_KERNEL_MODES:
        raise ValueError(f"`mars_cpu_kernels` must be one of {CPU_KERNEL_MODES}, got {mode!r}.")
    if mode == "stock":
        return False
    reason = unavailable_reason(model)
    if reason is not None:
        if mode == "packed":
            raise ValueError(f"mars_cpu_kernels='packed' cannot run: {reason}. Use 'auto' or 'stock'.")
        return False
    if mode == "packed":
        return True
    decisions = _DECISIONS.setdefault(model, {})
    threads = torch.get_num_threads()
    if threads not in decisions:
        decisions[threads] = _decide(model)
    return decisions[threads]


def _decide(model) -> bool:
    """Mode "auto": pack when the copy fits in half the free memory and the packed kernels measure faster."""
    linears = _linears(model)
    if not linears:
        return False
    copy_bytes = sum(linear.weight.numel() * 4 for linear in linears)
    free = _free_memory_bytes()
    if free is not None and copy_bytes > free / 2:
        logger.info(
            "MARS: linear weights not packed for oneDNN (%.1f GB copy, %.1f GB free).",
            copy_bytes / 1e9,
            free / 1e9,
        )
        return False
    stock, packed = _time_linear_shapes(linears)
    pays = packed < PAYS_BELOW * stock
    logger.info(
        "MARS: multi-row linears on %s kernels (packed oneDNN took %.2fx the stock time on this model's shapes, "
        "%d threads).", "packed oneDNN" if pays else "stock", packed / stock, torch.get_num_threads(),
    )  # fmt: skip
    return pays


def _free_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not a POSIX system that reports it
        return None


@torch.no_grad()
def _time_linear_shapes(linears) -> tuple[float, float]:
    """Seconds of one forward's linears at ``PROBE_ROWS`` rows, stock and packed (interleaved medians,
    each weight shape timed once and counted as often as the model has it)."""
    by_shape: dict[tuple, list] = {}
    for linear in linears:
        by_shape.setdefault(tuple(linear.weight.shape), []).append(linear)
    stock_total = packed_total = 0.0
    for shape, members in by_shape.items():
        weight, pack = members[0].weight, _pack(members[0])
        for rows in PROBE_ROWS:
            x = torch.full((rows, shape[1]), 1.0 / shape[1])  # not random: the caller's RNG state is theirs
            runs = {
                "stock": lambda x=x, weight=weight: F.linear(x, weight),
                "packed": lambda x=x, pack=pack: packed_matmul(x, pack, None),
            }
            times: dict[str, list[float]] = {name: [] for name in runs}
            for _ in range(PROBE_ROUNDS + 1):  # the first round warms up and is dropped
                for name, run in runs.items():
                    started = time.perf_counter()
                    run()
                    times[name].append(time.perf_counter() - started)
            stock_total += len(members) * statistics.median(times["stock"][1:])
            packed_total += len(members) * statistics.median(times["packed"][1:])
    return stock_total, packed_total
