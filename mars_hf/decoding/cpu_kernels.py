"""Multi-row linear layers on CPU through oneDNN with their weights packed once, during MARS steps.

Why: a MARS step is a forward of 2-16 columns per row, stock decoding one of 1. On some CPUs the default
float32 GEMM (MKL) repacks the whole weight matrix on every call with more than one input row, so a
SmolLM2 linear of 2 rows cost 2.4-3.5x one of 1 row and a 2-column forward of the shipped model 1.8x a
1-column one (an AVX2 AMD EPYC; docs/verified_decoding.md). With each weight packed once for oneDNN, the
same 2-column forward cost 1.14x. A bfloat16 linear already runs on oneDNN, but reorders its weight on every
call: packed once, a SmolLM2 linear took 0.5-0.65x the stock time at 1-16 rows (AVX-512 BF16, no AMX), with
the same bits. One-row inputs keep the stock kernel unless the pack rounds exactly like it (checked per layer
when it is packed: bfloat16 on oneDNN does, float32's MKL one-row kernel does not), so a one-token step rounds
exactly like a stock decoding step; the packs are a second copy of the linear weights, kept while the model
lives.

``mars_cpu_kernels``: ``"auto"`` (default) packs when the model is float32 or bfloat16 on a CPU with oneDNN
(bfloat16: where oneDNN computes it natively), the copy fits in half the free memory and a measurement of the
model's own linear shapes finds the packed kernel faster (once per model and thread count); ``"packed"``
always (an error where it cannot); ``"stock"`` never.
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
PACKED_DTYPES = (torch.float32, torch.bfloat16)

_PACKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # nn.Linear -> (weight identity, pack)
_DECISIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {threads: bool}
_OPEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> [open blocks, packed?] of its outer block


def unavailable_reason(model) -> str | None:
    """Why the packed kernels cannot serve ``model`` (None when they can)."""
    parameter = next(model.parameters())
    if parameter.device.type != "cpu":
        return f"the model is on {parameter.device.type}, not the CPU"
    if parameter.dtype not in PACKED_DTYPES:
        return f"the model is {parameter.dtype}, not float32 or bfloat16"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    if parameter.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "this CPU has no native bfloat16 for oneDNN"
    return None


def _linears(model) -> list[torch.nn.Linear]:
    """The float32 / bfloat16 linear layers whose plain forward can be replaced (not those with foreign
    wrappers)."""
    found = []
    for module in model.modules():
        if type(module) is not torch.nn.Linear or module.weight.dtype not in PACKED_DTYPES:
            continue
        if "forward" in module.__dict__ and "_mars_adapter" not in module.__dict__:
            continue  # another library's wrapper (e.g. offloading hooks): left alone
        found.append(module)
    return found


def _pack(linear: torch.nn.Linear) -> tuple:
    """``(pack, one_row_exact)``: ``linear``'s weight in oneDNN's packed layout, and whether it rounds one row
    exactly like the stock kernel; redone when the weight changed (an optimizer step, ``model.to``)."""
    weight = linear.weight
    identity = (weight.data_ptr(), weight._version)
    cached = _PACKS.get(linear)
    if cached is None or cached[0] != identity:
        with torch.no_grad():
            pack = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)
        cached = (identity, pack, _rounds_like_stock(linear, pack))
        _PACKS[linear] = cached
    return cached[1:]


class _PackedForward:
    """One linear's plain forward: the pack for several rows, and for one row where it rounds exactly like
    the stock kernel; the stock kernel otherwise (and with autograd on, or another input dtype)."""

    __slots__ = ("linear", "stock", "packed", "one_row_exact", "dtype")

    def __init__(self, linear, stock, packed: tuple):
        self.linear, self.stock = linear, stock
        self.packed, self.one_row_exact = packed
        self.dtype = linear.weight.dtype

    def __call__(self, x, *args, **kwargs):
        rows = x.numel() // x.shape[-1]
        if (rows == 1 and not self.one_row_exact) or x.dtype != self.dtype or torch.is_grad_enabled():
            return self.stock(x, *args, **kwargs)
        y = packed_matmul(x.reshape(rows, x.shape[-1]), self.packed, self.linear.bias)
        return y.view(*x.shape[:-1], y.shape[-1])


@torch.no_grad()
def _rounds_like_stock(linear: torch.nn.Linear, packed) -> bool:
    """Whether the pack gives the stock kernel's bits on one row (two fixed probe rows, not random: the
    caller's RNG state is theirs). The same kernel gives the same bits on every input; different kernels
    differ on almost any input, so a mismatch shows on these."""
    weight = linear.weight
    columns = torch.arange(weight.shape[1], dtype=torch.float32, device=weight.device)
    for probe in (torch.sin(columns * 0.37), torch.cos(columns * 1.3) / 3):
        row = probe.to(weight.dtype).unsqueeze(0)
        if not torch.equal(F.linear(row, weight, linear.bias), _onednn_linear(row, packed, linear.bias)):
            return False
    return True


def packed_matmul(x2: torch.Tensor, packed, bias: torch.Tensor | None) -> torch.Tensor:
    """``x2 @ W.T + bias`` for 2-D ``x2`` on the packed ``W`` (oneDNN): a packed layer's forward."""
    return _onednn_linear(x2, packed, bias)


def _onednn_linear(x2: torch.Tensor, packed, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x2, packed, bias, "none", [], "")


@contextlib.contextmanager
def packed_linears(model, mode: str = "auto"):
    """Within the block, ``model``'s linear layers run inputs of several rows on packed oneDNN kernels
    (``mode`` as ``mars_cpu_kernels``); yields whether they do. Restored on exit, so stock ``generate``
    outside the block is untouched. A block inside another keeps the outer block's kernels, packed or not,
    and costs nothing (a decoder step inside a whole `generate` call: routing 211 layers per step cost 1-2 ms
    a step, and deciding again that a small model stays on stock kernels ≈ 30 µs, 1 % of its step)."""
    opened = _OPEN.get(model)
    if opened is not None:
        opened[0] += 1
        try:
            yield opened[1]
        finally:
            opened[0] -= 1
        return
    packed = use_packed(model, mode)
    installed = [_install(linear) for linear in _linears(model)] if packed else []
    _OPEN[model] = [1, packed]
    try:
        yield packed
    finally:
        _OPEN.pop(model, None)
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
    copy_bytes = sum(linear.weight.numel() * linear.weight.element_size() for linear in linears)
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
        weight, (pack, _) = members[0].weight, _pack(members[0])
        for rows in PROBE_ROWS:
            # not random: the caller's RNG state is theirs
            x = torch.full((rows, shape[1]), 1.0 / shape[1], dtype=weight.dtype)
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
