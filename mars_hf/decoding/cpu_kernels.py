"""Packed linear layers on CPU: an opt-in accelerator (off by default; docs/accelerators.md).

What: each ``nn.Linear``'s weight reordered once into oneDNN's blocked layout and run through oneDNN
(``torch.ops.mkldnn._reorder_linear_weight`` / ``_linear_pointwise``), the same packing Inductor emits when it
freezes a model for CPU. Why: on some CPUs the default float32 GEMM (MKL) repacks the whole weight on every
call with more than one input row, so a MARS step (2-16 columns per row) cost up to 1.8x a one-column step; a
bfloat16 linear already runs on oneDNN but reorders its weight on every call. Packed once, both are cheaper, in
MARS steps and in plain decoding of a batch (docs/verified_decoding.md).

The ops are private to torch, so they stay off ``generate``'s default path (``mars_cpu_kernels="stock"``),
live in this module only, and are guarded: any error while packing or running falls back to the stock
kernels for the rest of the model's life, with one warning. ``mars_cpu_kernels``: ``"stock"`` (default)
never packs; ``"auto"`` packs a float32 or bfloat16 model on a CPU with oneDNN where the copy fits in half the
memory this process may still take (its cgroup's limit included) and a measurement of the model's own linear
shapes finds the packed kernel faster (once per model and thread count); ``"packed"`` packs wherever it can
run and the copy fits, and is an error naming the fix otherwise.

Rounding: one-row inputs keep the stock kernel unless the pack rounds exactly like it (checked per layer when
it is packed: bfloat16 on oneDNN does, float32's MKL one-row kernel does not), so a one-token step rounds
exactly like a stock decoding step; ``packed_linears(model, all_rows=True)`` packs those too. Several rows
agree with the stock kernel to rounding (another summation order). The packs are a second copy of the
linear weights, kept while the model lives.

How: within a :func:`packed_linears` block each plain ``nn.Linear`` is replaced in its parent module by a
:class:`PackedLinear` that holds the same ``weight`` and ``bias`` parameters (module swapping, as quantization
does); the originals are put back on exit. A mask-gated adapter layer of ``gated_lora`` keeps its adapter and
has its base forward routed through the stand-in.
"""

from __future__ import annotations

import contextlib
import logging
import os
import statistics
import time
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

CPU_KERNEL_MODES = ("auto", "packed", "stock")
DEFAULT_CPU_KERNELS = "stock"  # generate's default path uses no private torch op
PACK_ROWS_HINT = 4  # oneDNN picks the packed layout for this many input rows (any count runs on it)
PROBE_ROWS = (2, 4)  # the input rows the "auto" measurement times, stock against packed
PROBE_ROUNDS = 5
PAYS_BELOW = 0.9  # "auto" packs when the packed kernels take less than this share of the stock time
PACKED_DTYPES = (torch.float32, torch.bfloat16)
AUTO_MEMORY_SHARE = 0.5  # "auto" packs when the copy takes at most this share of the memory left
# Where the memory limits of this process's control group are read (cgroup v2, else v1's memory controller).
CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
MEMINFO = Path("/proc/meminfo")
_NO_LIMIT = 1 << 60  # cgroup v1 writes "no limit" as a page-rounded 2^63 - 1

_PACKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # nn.Linear -> (weight identity, pack, exact)
_DECISIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {threads: bool}
# model -> [open blocks, _Route] of its outer block
_OPEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_FAILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> why its packed kernels failed
_LAST: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> _Route of its latest outer block


class _Route:
    """What one outer :func:`packed_linears` block runs a model's linears on; its stand-ins read ``failed`` on
    every call, so the first error sends the whole model back to the stock kernels."""

    __slots__ = ("model", "packed", "failed", "__weakref__")

    def __init__(self, model, packed: bool):
        self.model = weakref.ref(model)
        self.packed = packed
        self.failed: str | None = None

    def fail(self, error: BaseException) -> None:
        model = self.model()
        if self.failed is None and model is not None:
            self.failed = _record_failure(model, error)

    def describe(self) -> str:
        if self.failed is not None:
            return f"stock (packed oneDNN failed: {self.failed})"
        return "packed oneDNN" if self.packed else "stock"


def _record_failure(model, error: BaseException) -> str:
    """Send ``model`` to the stock kernels for good after an error of the packed ones, with one warning."""
    reason = f"{type(error).__name__}: {error}"
    _FAILED[model] = reason
    logger.warning(
        "Packed oneDNN linears failed (%s): this model runs on the stock kernels from now on. "
        "mars_cpu_kernels='stock' (the default) never packs.",
        reason,
    )
    return reason


class PackedLinear(torch.nn.Linear):
    """Stands in for one ``nn.Linear`` within a :func:`packed_linears` block: the same ``weight`` and ``bias``
    parameters, inputs of several rows (and of one row where ``one_row``) on the oneDNN pack, everything else
    (autograd, another dtype, a failure) on the stock kernel, ``stock`` if given (a gated layer's base forward)."""

    def __init__(self, linear: torch.nn.Linear, pack, one_row: bool, route: _Route, stock=None):
        torch.nn.Module.__init__(self)  # no weights of its own: it holds the original's parameters
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_parameter("weight", linear.weight)
        self.register_parameter("bias", linear.bias)
        self.pack, self.one_row, self.route, self.stock = pack, one_row, route, stock

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        width = x.shape[-1]
        rows = x.numel() // width if width else 0
        usable = (rows > 1 or (rows == 1 and self.one_row)) and x.dtype == self.weight.dtype
        if usable and self.route.failed is None and not torch.is_grad_enabled():
            try:
                y = packed_matmul(x.reshape(rows, width), self.pack, self.bias)
                return y.view(*x.shape[:-1], y.shape[-1])
            except Exception as error:  # a private op: whatever it raises, the stock kernel serves
                self.route.fail(error)
        return self.stock(x) if self.stock is not None else F.linear(x, self.weight, self.bias)


def unavailable_reason(model) -> str | None:
    """Why the packed kernels cannot serve ``model`` (None when they can)."""
    parameter = next(model.parameters())
    if parameter.device.type != "cpu":
        return f"the model is on {parameter.device.type}, not the CPU"
    if parameter.dtype not in PACKED_DTYPES:
        return f"the model is {parameter.dtype}, not float32 or bfloat16"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    if parameter.dtype == torch.bfloat16:
        try:
            native = torch.ops.mkldnn._is_mkldnn_bf16_supported()
        except Exception as error:  # a private op
            return f"oneDNN's bfloat16 check failed ({type(error).__name__}: {error})"
        if not native:
            return "this CPU has no native bfloat16 for oneDNN"
    failed = _FAILED.get(model)
    if failed is not None:
        return f"its packed kernels failed earlier ({failed})"
    return None


def _has_hooks(module: torch.nn.Module) -> bool:
    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
    )


def _routable_adapter(module) -> bool:
    """Whether ``module`` is a gated adapter's layer whose base output is the plain linear map of its own
    weight (``gated_lora``: a ``base_forward`` of None, or ``nn.Linear.forward`` itself)."""
    adapter = module.__dict__.get("_mars_adapter")
    if adapter is None:
        return False
    base = adapter.base_forward
    return base is None or getattr(base, "__func__", None) is torch.nn.Linear.forward


def _linears(model) -> dict:
    """``{linear: [(parent, name), ...]}`` for the float32 / bfloat16 linear layers that can be stood in for:
    plain ``nn.Linear`` layers, not those another library wraps (an instance ``forward``, e.g. offloading hooks)
    or hooks (a stand-in would not carry them); and gated adapters' layers, which stay in place and have their
    base forward routed instead."""
    found: dict = {}
    for parent in model.modules():
        for name, module in parent.named_children():
            if not isinstance(module, torch.nn.Linear) or module.weight.dtype not in PACKED_DTYPES:
                continue
            plain = (
                type(module) is torch.nn.Linear
                and "forward" not in module.__dict__
                and not _has_hooks(module)
            )
            if plain or _routable_adapter(module):
                found.setdefault(module, []).append((parent, name))
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
def packed_linears(model, mode: str = "packed", *, all_rows: bool = False):
    """Within the block, ``model``'s linear layers run on packed oneDNN kernels (``mode`` as
    ``mars_cpu_kernels``: ``"packed"``, ``"auto"`` or ``"stock"``); yields whether they do. Any decoding
    inside runs on them, plain ``generate`` too::

        with mars_hf.packed_linears(model):
            model.generate(**inputs, max_new_tokens=64)

    ``all_rows``: one-row inputs run packed too (a batch-1 decoding step), also where the pack rounds them
    differently from the stock kernel (float32). Restored on exit, so the model is untouched outside. A block
    inside another keeps the outer block's kernels, packed or not, and costs nothing (a decoder step inside
    a whole `generate` call)."""
    opened = _OPEN.get(model)
    if opened is not None:
        opened[0] += 1
        try:
            yield opened[1].packed and opened[1].failed is None
        finally:
            opened[0] -= 1
        return
    route = _Route(model, use_packed(model, mode))
    installed = []
    if route.packed:
        try:
            for linear, places in _linears(model).items():
                installed.append(_install(linear, places, route, all_rows))
        except Exception as error:  # packing runs private ops: whatever they raise, the stock kernels serve
            route.fail(error)
    if route.failed is not None:
        _undo(installed)
        installed = []
    _OPEN[model] = [1, route]
    _LAST[model] = route
    try:
        yield route.packed and route.failed is None
    finally:
        _OPEN.pop(model, None)
        _undo(installed)


def _undo(installed: list) -> None:
    for undo in reversed(installed):
        undo()


def _install(linear: torch.nn.Linear, places: list, route: _Route, all_rows: bool = False):
    """Put a :class:`PackedLinear` in ``linear``'s places (``(parent, name)`` pairs); returns the undo. A gated
    adapter's layer stays in place and has its *base* forward routed through the stand-in. (Its two small
    products stay on the stock GEMM: at a few rows and rank 32, oneDNN's ~40 µs per call costs more than the
    stock kernel's whole product.)"""
    pack, exact = _pack(linear)
    adapter = linear.__dict__.get("_mars_adapter")
    if adapter is not None:
        stock = adapter.base_forward
        adapter.base_forward = PackedLinear(linear, pack, exact or all_rows, route, stock=stock).forward

        def undo_adapter():
            adapter.base_forward = stock

        return undo_adapter
    stand_in = PackedLinear(linear, pack, exact or all_rows, route)
    for parent, name in places:
        setattr(parent, name, stand_in)

    def undo():
        for parent, name in places:
            setattr(parent, name, linear)

    return undo


def active(model) -> bool:
    """Whether ``model``'s linears run packed right now (part of what a measured cost curve depends on)."""
    for module in model.modules():
        if isinstance(module, PackedLinear):
            return module.route.failed is None
        adapter = module.__dict__.get("_mars_adapter")
        if adapter is not None and isinstance(getattr(adapter.base_forward, "__self__", None), PackedLinear):
            return adapter.base_forward.__self__.route.failed is None
    return False


def last_kernels(model) -> str | None:
    """What the latest :func:`packed_linears` block ran ``model``'s linears on: ``"packed oneDNN"``,
    ``"stock"``, or ``"stock (packed oneDNN failed: …)"`` (None: no block yet). ``mars-hf generate`` prints it."""
    route = _LAST.get(model)
    return None if route is None else route.describe()


def use_packed(model, mode: str = "auto") -> bool:
    """Whether ``model``'s linears run packed under ``mode`` (see the module docstring). ``"packed"`` raises,
    naming the fix, where the kernels cannot run or their copy does not fit in memory."""
    if mode not in CPU_KERNEL_MODES:
        raise ValueError(f"`mars_cpu_kernels` must be one of {CPU_KERNEL_MODES}, got {mode!r}.")
    if mode == "stock":
        return False
    reason = unavailable_reason(model)
    if reason is not None:
        if mode == "packed":
            if model in _FAILED:  # warned when it failed: the stock kernels serve, as promised
                return False
            raise ValueError(f"mars_cpu_kernels='packed' cannot run: {reason}. Use 'auto' or 'stock'.")
        return False
    if mode == "packed":
        copy_bytes, free = _copy_bytes(model), _free_memory_bytes()
        if free is not None and copy_bytes > free:
            raise MemoryError(
                f"mars_cpu_kernels='packed' needs a {copy_bytes / 1e9:.2f} GB copy of the linear weights, but this "
                f"process may take only {free / 1e9:.2f} GB more (free memory, within its cgroup's limit). Use "
                "'stock' (the default), or 'auto', which packs only where the copy fits."
            )
        return True
    decisions = _DECISIONS.setdefault(model, {})
    threads = torch.get_num_threads()
    if threads not in decisions:
        decisions[threads] = _decide(model)
    return decisions[threads]


def _copy_bytes(model) -> int:
    return sum(linear.weight.numel() * linear.weight.element_size() for linear in _linears(model))


def _decide(model) -> bool:
    """Mode "auto": pack when the copy fits in half the memory left and the packed kernels measure faster."""
    linears = list(_linears(model))
    if not linears:
        return False
    copy_bytes, free = _copy_bytes(model), _free_memory_bytes()
    if free is not None and copy_bytes > AUTO_MEMORY_SHARE * free:
        logger.info(
            "MARS: linear weights not packed for oneDNN (%.2f GB copy, %.2f GB memory left to this process).",
            copy_bytes / 1e9,
            free / 1e9,
        )
        return False
    try:
        stock, packed = _time_linear_shapes(linears)
    except Exception as error:  # the measurement runs the private ops
        _record_failure(model, error)
        return False
    pays = packed < PAYS_BELOW * stock
    logger.info(
        "MARS: multi-row linears on %s kernels (packed oneDNN took %.2fx the stock time on this model's shapes, "
        "%d threads).", "packed oneDNN" if pays else "stock", packed / stock, torch.get_num_threads(),
    )  # fmt: skip
    return pays


def _free_memory_bytes() -> int | None:
    """Memory this process may still take: the machine's available memory, or less where a control group
    (a container's or a job's limit) allows less; None where neither can be read."""
    found = [value for value in (_available_physical_bytes(), _cgroup_headroom_bytes()) if value is not None]
    return min(found) if found else None


def _available_physical_bytes() -> int | None:
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not a POSIX system that reports it
        return None


def _cgroup_folders() -> list[tuple[Path, bool]]:
    """``(folder, is v2)`` of this process's memory control group and each parent up to the root (a
    parent's limit binds too), from ``/proc/self/cgroup``."""
    try:
        lines = PROC_SELF_CGROUP.read_text().splitlines()
    except OSError:
        return []
    folders = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            root, v2 = CGROUP_ROOT, True
        elif "memory" in controllers.split(","):
            root, v2 = CGROUP_ROOT / "memory", False
        else:
            continue
        folder = root / path.strip("/")
        while True:
            if folder.is_dir():
                folders.append((folder, v2))
            if folder == root or root not in folder.parents:
                break
            folder = folder.parent
    return folders


def _cgroup_headroom_bytes() -> int | None:
    """The least room left under any memory limit of this process's control groups (usage counted without
    inactive file cache, which the kernel reclaims first); None where no limit is set or readable."""
    room = []
    for folder, v2 in _cgroup_folders():
        names = ("memory.max", "memory.current", "inactive_file") if v2 else (
            "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"
        )  # fmt: skip
        try:
            limit_text = (folder / names[0]).read_text().strip()
            if limit_text == "max" or int(limit_text) >= _NO_LIMIT:
                continue
            usage = int((folder / names[1]).read_text())
        except (OSError, ValueError):
            continue
        room.append(max(0, int(limit_text) - max(0, usage - _stat_field(folder / "memory.stat", names[2]))))
    return min(room) if room else None


def _stat_field(path: Path, name: str) -> int:
    try:
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == name:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


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
