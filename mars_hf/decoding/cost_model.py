"""What a cached forward of ``n`` new columns per sequence costs, relative to one column (docs/method.md §4).

Why measured, not assumed: the curve differs by machine, dtype and batch (SmolLM2-135M on one CPU,
float32: 4 columns cost 1.57× one column, bfloat16 1.10×; a GPU at small batch is nearly flat). A
constant tuned on one machine (``MIN_FORWARD_ROWS``, a per-device default layout) is wrong on the next,
so the decoder asks this module, which measures the curve where decoding runs:

- only where the caller asks for it (``mars_cost_probe=True``, or a ``memory.PlannerMemory`` the caller owns:
  without one, ``generate`` times nothing), at first use, for the model, device, dtype, thread count and batch
  bucket in use (the batch rounded up
  to a power of two), on a *scratch* cache: warm-up, a few interleaved rounds over the sizes, the fastest,
  about two seconds at most (fewer sizes, interpolated, when a forward is slow); a smaller bucket that a
  call reaches only as its rows finish is not measured there (``known_only``: the caller borrows the
  batch's own curve, see ``planner.StepPlanner.cost_table``);
- kept in the caller's ``PlannerMemory`` (under everything else the cost depends on), and on disk when
  the environment variable ``MARS_HF_COST_CACHE`` names a folder (the ``mars-hf`` commands that decode
  for a user default it to ``$MARS_HF_HOME/cost-curves``: :func:`disk_cache_by_default`);
- overridable: ``generate(..., mars_cost_table={1: 1.0, 2: 1.05, ...})`` uses the given curve
  (missing sizes interpolated); without a memory nothing is measured: on a CPU the planner assumes
  :data:`ASSUMED_CPU_COLUMN_COST` per extra column (``CostTable.assumed_cpu``), elsewhere a **flat** curve
  (every width costs what one column costs: the accelerator-at-small-batch assumption, under which
  ``mars_layout="auto"`` goes as wide as the window allows — the paper's fixed-window behaviour);
- corrected by decoding's own forwards on a CPU (:func:`observe`): the probe is short and runs on a
  scratch cache, and on a slow CPU its one or two rounds can misread a width by half (one 2-core AVX2
  machine: 2 columns read 1.75× at batch 4, 1.1–1.3× when timed at length). Each width the decoder
  really runs, once seen a few times, takes the median of its observed cost over decoding's own recent
  one-column forwards (never the probe's), for as long as the memory is kept; and when the planner has run only
  wider steps for a while, a plain step times that one column (:func:`unit_due`). Given, assumed and flat
  curves are never corrected.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import math
import numbers
import os
import stat
import statistics
import time

import torch

from .cpu_kernels import active as packed_linears_active
from .home import cpu_flags, cpu_name
from .layouts import position_limit
from .memory import PlannerMemory

logger = logging.getLogger(__name__)

CACHE_ENV = "MARS_HF_COST_CACHE"
PROBE_BUDGET_S = 2.0  # the whole probe, warm-up included
PROBE_ROUNDS = 5  # interleaved rounds at most (the fastest of each size counts)
PROBE_CONTEXT = 32  # cached tokens the probed forwards attend over
MAX_PROBED_WIDTH = 64  # wider steps are extrapolated (and never planned)
MAX_TABLE_WIDTH = 4096  # sizes a given curve may name (a step of W = 60 with every quadratic group: 3 721)
MAX_CURVE_FILE_BYTES = 65_536  # a curve on disk is < 2 KB; anything this large is not one (never read whole)
_EXACT_UP_TO = 10  # every width up to this is probed; wider ones on a geometric grid
# What the default feed assumes on a CPU, where nothing is measured: each column past the first costs this share
# of one. A CPU forward is compute-bound, so columns cost; assumed dear enough that the planner feeds masks only
# where the call's own acceptance says they clearly pay. On a 2-core Zen 4 (docs/lab/fast_path_log.md) it kept
# eager verify at 0.98× (float32) and 1.12× (bf16) MARS-off, where the fixed feed read 0.72× / 0.93×. A measured
# curve (``PlannerMemory``) or a given one replaces it.
ASSUMED_CPU_COLUMN_COST = 0.3


@dataclasses.dataclass(frozen=True)
class CostTable:
    """Relative cost of a forward of ``n`` columns per sequence (``cost(1) == 1``) at one batch size.

    Between measured sizes the cost is interpolated linearly; past the widest it is extrapolated with the
    last segment's slope (never decreasing).
    """

    sizes: tuple[int, ...]
    costs: tuple[float, ...]
    source: str  # "measured", "disk", "observed" (measured, then corrected by decoding), "given", "flat",
    # or "borrowed" (a larger batch's curve, for the tail of a call whose rows finish: planner.StepPlanner.cost_table)
    batch: int = 1
    unit_seconds: float | None = None  # what one column took when measured (None: not measured here)
    widest: int = MAX_PROBED_WIDTH  # padding never goes past this (``cost_table``: the window's widest plan)

    @classmethod
    def from_mapping(cls, mapping, source: str = "given", batch: int = 1) -> CostTable:
        """A table from ``{n: cost}``; costs are taken relative to ``n = 1`` (1.0 when 1 is absent).

        Sizes are whole numbers from 1 to :data:`MAX_TABLE_WIDTH` (or such numbers as strings: a
        ``GenerationConfig`` saved as JSON keeps its keys that way); a wider one is no step any window
        plans, and read as a curve it once padded steps to 10⁸ columns (issue 52, fault 8).
        """
        if isinstance(mapping, CostTable):
            return mapping
        if not isinstance(mapping, dict) or not mapping:
            raise ValueError(
                "`mars_cost_table` must be a non-empty dict {columns per sequence: relative cost}, e.g. "
                f"{{1: 1.0, 2: 1.05, 5: 1.3}}; got {_short(mapping)}."
            )
        items = {}
        for key, cost in mapping.items():
            n = _table_size(key)
            if not _positive_finite(cost):
                raise ValueError(
                    f"`mars_cost_table` key {_short(key)} has cost {_short(cost)}: every cost must be a positive "
                    "finite number (a forward's time relative to one column's), e.g. {1: 1.0, 2: 1.05}."
                )
            items[n] = float(cost)
        one = items.get(1, 1.0)
        items[1] = one
        sizes = tuple(sorted(items))
        costs = tuple(items[n] / one for n in sizes)
        if not all(math.isfinite(c) and c > 0 for c in costs):
            raise ValueError(
                f"`mars_cost_table` costs relative to one column's ({one!r}) overflow: give costs of a "
                "similar scale, e.g. relative ones, {1: 1.0, 2: 1.05}."
            )
        return cls(sizes, costs, source, batch)

    @classmethod
    def flat(cls, batch: int = 1) -> CostTable:
        return cls((1,), (1.0,), "flat", batch)

    @classmethod
    def assumed_cpu(cls) -> CostTable:
        """The default feed's curve on a CPU: :data:`ASSUMED_CPU_COLUMN_COST` per extra column, nothing timed."""
        widest = MAX_PROBED_WIDTH
        return cls((1, widest), (1.0, 1.0 + ASSUMED_CPU_COLUMN_COST * (widest - 1)), "assumed")

    @classmethod
    def static_steps(cls, step_width: int, full_cost: float, source: str = "assumed") -> CostTable:
        """A static cache's curve: its decode steps run at one column or at ``step_width`` (two compiled graphs,
        ``decoder.MARSBatchDecoder``), so every step that feeds a mask or a draft costs the full step's
        ``full_cost`` (a given curve's cost at ``step_width``; assumed: :func:`static_steps_curve`)."""
        if step_width <= 2:
            return cls((1, 2), (1.0, float(full_cost)), source, widest=2)
        return cls((1, 2, step_width), (1.0, float(full_cost), float(full_cost)), source, widest=step_width)

    def cost(self, n: int) -> float:
        """Relative cost of ``n`` columns per sequence."""
        sizes, costs = self.sizes, self.costs
        if n <= sizes[0]:
            return costs[0]
        i = bisect.bisect_left(sizes, n)
        if i < len(sizes) and sizes[i] == n:
            return costs[i]
        if i == len(sizes):  # past the widest measured size
            if len(sizes) == 1:
                return costs[-1]
            slope = max(0.0, (costs[-1] - costs[-2]) / (sizes[-1] - sizes[-2]))
            return costs[-1] + slope * (n - sizes[-1])
        low, high = sizes[i - 1], sizes[i]
        return costs[i - 1] + (costs[i] - costs[i - 1]) * (n - low) / (high - low)

    def padded_width(self, n: int) -> int:
        """The width to run ``n`` columns at: a wider measured size when it is cheaper (padding columns
        come after every real column, nothing real attends to them, so tokens do not change), never wider
        than :attr:`widest` (the widest step the window can plan): a curve that calls a huge size cheap
        must not make every step that wide."""
        best, best_cost = n, self.cost(n)
        for size, cost in zip(self.sizes, self.costs):
            if size > self.widest:
                break
            if size > n and cost < best_cost:
                best, best_cost = size, cost
        return best

    @functools.lru_cache(maxsize=4096)  # noqa: B019 (tables live for the process; the planner asks per step)
    def effective(self, n: int) -> float:
        """What ``n`` columns really cost (at their padded width)."""
        return self.cost(self.padded_width(n))

    def as_dict(self) -> dict[int, float]:
        return dict(zip(self.sizes, self.costs))


def cpu_has_native_bf16() -> bool:
    """AVX-512 BF16 or AMX tiles, as torch's CPU kernels see them."""
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in checks)


def columns_nearly_free(model) -> bool:
    """Whether a compiled step of a few columns costs about what one column costs, so the fixed feed pays: on an
    accelerator (small batches are memory-bound), and on a CPU in bf16 where the CPU computes bf16 natively
    (one Zen 4, compiled, 200 cached tokens: 2 and 3 columns 0.80× and 0.77× one column's time). Elsewhere (float32,
    or bf16 emulated) every column costs (float32 there: 3 columns 1.98× one), so masks are fed only where the
    call's acceptance says they pay (docs/lab/fast_path_log.md)."""
    if model.device.type != "cpu":
        return True
    return next(model.parameters()).dtype == torch.bfloat16 and cpu_has_native_bf16()


def static_steps_curve(model, step_width: int, given: CostTable | None = None) -> CostTable | None:
    """The planner's curve on a static cache, whose decode steps run at one column or at ``step_width``: a given
    curve read at those two widths; else, where columns cost (:func:`columns_nearly_free`), the assumed CPU
    curve's (:data:`ASSUMED_CPU_COLUMN_COST` per extra column); else None (the fixed feed)."""
    if given is not None:
        return CostTable.static_steps(step_width, given.cost(step_width), "given")  # relative: cost(1) == 1
    if columns_nearly_free(model):
        return None
    return CostTable.static_steps(step_width, 1.0 + ASSUMED_CPU_COLUMN_COST * (step_width - 1))


def _table_size(key) -> int:
    """A curve's size from a mapping key: a whole number in ``1 … MAX_TABLE_WIDTH`` (an int, a whole float
    or a string of digits), else a ValueError that names the key and the fix."""
    n = None
    if isinstance(key, str) and key.strip().isascii() and key.strip().isdigit() and len(key.strip()) <= 6:
        n = int(key.strip())
    elif (
        isinstance(key, numbers.Real) and not isinstance(key, bool) and math.isfinite(key) and key == int(key)
    ):
        n = int(key)
    if n is None or not 1 <= n <= MAX_TABLE_WIDTH:
        raise ValueError(
            f"`mars_cost_table` key {_short(key)} is not a step width: keys are columns per sequence, whole "
            f"numbers from 1 to {MAX_TABLE_WIDTH} (a MARS step is 1 + drafts + masks wide), e.g. "
            "{1: 1.0, 2: 1.05, 5: 1.3}; drop the key or give the width it was measured at."
        )
    return n


def _positive_finite(value) -> bool:
    return (
        isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    )


def _short(value, limit: int = 60) -> str:
    """``repr`` cut short: an error about a huge or deeply nested value must not print it whole."""
    try:
        text = repr(value)
    except (RecursionError, ValueError):  # nested past the interpreter's limit; int's digit limit
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def batch_bucket(rows: int) -> int:
    """Batch sizes share a curve per power of two (a server's batch changes every few steps)."""
    return 1 << max(0, int(rows) - 1).bit_length()


def candidate_widths(window: int) -> list[int]:
    """Columns per sequence the decoder may feed with window W: one fresh token, up to W drafts and
    up to W masks (``1 … 1 + 2W``), and the quadratic layout's ``1 + K + (K + 1)·m``; capped."""
    sizes = set(range(1, min(2 * window + 1, MAX_PROBED_WIDTH) + 1))
    for drafts in range(min(window, MAX_PROBED_WIDTH) + 1):
        for masks in range(1, window + 1):
            width = 1 + drafts + (drafts + 1) * masks
            if width > MAX_PROBED_WIDTH:
                break
            sizes.add(width)
    return sorted(sizes)


def probe_sizes(widths: list[int]) -> list[int]:
    """The widths actually timed: all small ones, then a geometric grid (the rest is interpolated)."""
    chosen = [n for n in widths if n <= _EXACT_UP_TO]
    last = chosen[-1] if chosen else 1
    for n in widths:
        if n > _EXACT_UP_TO and n >= last * 1.25:
            chosen.append(n)
            last = n
    if widths and widths[-1] not in chosen:
        chosen.append(widths[-1])
    return chosen


# --------------------------------------------------------------------------------------------------
# Keys: everything the cost depends on
# --------------------------------------------------------------------------------------------------

def _hook_count(model) -> int:
    """Hooks attached since the curve was measured change what a forward costs; cheap to count. (The gated
    adapter wraps its layers' forwards instead; it is attached before decoding, so its cost is in every curve.)"""
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def _device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's model name, core count and feature flags: a home folder may outlive the
    machine (a curve from an AVX2-only CPU would misplan one with AVX-512 BF16 and AMX of the same name)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_name()} x{os.cpu_count()} [{cpu_flags()}]"


def _key(model, device, batch: int, sizes: tuple[int, ...]) -> tuple:
    dtype = next(model.parameters()).dtype
    kernels = "packed" if packed_linears_active(model) else "stock"
    return (str(device), str(dtype), torch.get_num_threads(), batch, sizes, _hook_count(model), kernels)


def _disk_path(model, key: tuple) -> str | None:
    folder = os.environ.get(CACHE_ENV)
    if not folder:
        return None
    config = model.config
    identity = json.dumps(
        [
            type(model).__name__,
            getattr(config, "_name_or_path", ""),
            hashlib.sha256(config.to_json_string().encode()).hexdigest(),
            sum(p.numel() for p in model.parameters()),
            _device_name(model.device),
            torch.__version__,
            list(map(str, key)),
        ]
    )
    return os.path.join(folder, f"mars-cost-{hashlib.sha256(identity.encode()).hexdigest()[:24]}.json")


def cost_table(
    model,
    *,
    batch_size: int,
    window: int,
    mask_token_id: int,
    given=None,
    memory: PlannerMemory | None = None,
    known_only: bool = False,
) -> CostTable | None:
    """The cost curve for this model and batch: ``given`` if any, flat without a ``memory``, else measured
    once into ``memory`` (or read from ``MARS_HF_COST_CACHE``). ``known_only``: None instead of measuring
    when neither the memory nor the disk cache has the curve yet."""
    batch = batch_bucket(batch_size)
    widest = candidate_widths(window)[-1]
    if given is not None:
        return dataclasses.replace(CostTable.from_mapping(given, "given", batch), widest=widest, batch=batch)
    if memory is None:
        return CostTable.flat(batch)
    sizes = tuple(probe_sizes(candidate_widths(window)))
    key = _key(model, model.device, batch, sizes)
    per_model = memory.bind(model).cost_tables
    if key in per_model:
        return per_model[key]
    path = _disk_path(model, key)
    table = _read(path, batch, sizes) if path else None
    if table is not None:
        logger.info("MARS cost curve (batch %d) read from %s: %s", batch, path, table.as_dict())
    else:
        if known_only:
            return None
        table = measure(model, batch=batch, sizes=sizes, mask_token_id=mask_token_id)
        if path:
            _write(path, table)
    table = dataclasses.replace(table, widest=widest)
    per_model[key] = table
    return table


@contextlib.contextmanager
def disk_cache_by_default(folder):
    """Within the block, measured curves are written to and read from ``folder`` unless
    ``MARS_HF_COST_CACHE`` is set (an empty value: no disk cache at all).

    Why: a one-shot ``mars-hf generate`` with verified decoding otherwise pays the probe (about 2 s)
    in every process, where its whole answer takes about 12 s on a 2-core CPU; a restarted server pays
    one per batch bucket. The library's ``generate`` never writes to disk unless asked.
    """
    if CACHE_ENV in os.environ:
        yield
        return
    os.environ[CACHE_ENV] = str(folder)
    try:
        yield
    finally:
        os.environ.pop(CACHE_ENV, None)


def _read(path: str, batch: int, sizes: tuple[int, ...]) -> CostTable | None:
    """The curve stored at ``path``, or None (with a warning) when the file is not one this module wrote
    for ``sizes``: unreadable, too large, nested past the parser's limit, not two equal lists, or sizes
    the probe never times (a hand-edited ``{"sizes": [1, 100000000], ...}`` once padded every step to
    that width). It is then measured again and rewritten."""
    if not os.path.exists(path):
        return None
    try:
        record = json.loads(_read_capped(path))
        known, costs = record["sizes"], record["costs"]
        if not (isinstance(known, list) and isinstance(costs, list) and len(known) == len(costs)):
            raise ValueError("sizes and costs are not two lists of one length")
        if len(set(known)) != len(known) or not set(known) <= set(sizes) | {1}:
            raise ValueError(f"sizes {_short(known)} are not widths the probe times ({list(sizes)})")
        return CostTable.from_mapping(dict(zip(known, costs)), "disk", batch)
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as error:  # Recursion: nested JSON
        logger.warning(
            "Ignoring the MARS cost table at %s: not a readable curve (%s).", path, _short(error, 200)
        )
        return None


def _read_capped(path: str) -> str:
    """The text of ``path`` when it is a regular file of at most :data:`MAX_CURVE_FILE_BYTES`, else a
    ValueError. Why opened non-blocking and checked with ``fstat`` on the open descriptor: a FIFO at the
    path blocked ``open`` forever, and ``getsize`` reads 0 for ``/dev/zero`` (through a symlink), which
    ``json.load`` then read without end; checking the descriptor, not the name, leaves no gap for the path
    to be swapped between the check and the read."""
    descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    try:
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError("not a regular file (a FIFO, a device or a folder)")
        if info.st_size > MAX_CURVE_FILE_BYTES:
            raise ValueError(f"larger than {MAX_CURVE_FILE_BYTES} bytes")
        with os.fdopen(descriptor, "rb", closefd=False) as handle:
            data = handle.read(
                MAX_CURVE_FILE_BYTES + 1
            )  # the file may grow after fstat: read the cap, no more
    finally:
        os.close(descriptor)
    if len(data) > MAX_CURVE_FILE_BYTES:
        raise ValueError(f"larger than {MAX_CURVE_FILE_BYTES} bytes")
    return data.decode("utf-8")


def _write(path: str, table: CostTable) -> None:
    # written aside and renamed: another process (a second server, a concurrent `mars-hf generate`) reads
    # either no file or a whole one, never a half-written one
    partial = f"{path}.{os.getpid()}.partial"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(partial, "w", encoding="utf-8") as handle:
            json.dump({"sizes": list(table.sizes), "costs": list(table.costs)}, handle)
        os.replace(partial, path)
    except OSError as error:
        with contextlib.suppress(OSError):
            os.remove(partial)  # a read-only folder only costs the next process a probe
        logger.warning("Could not write the MARS cost table to %s: %s", path, error)


# --------------------------------------------------------------------------------------------------
# Learning from decoding's own forwards
# --------------------------------------------------------------------------------------------------

OBSERVED_RECENT = 5  # observations kept per width (medians of the most recent)
OBSERVED_MIN = 3  # observations of a width before they replace the probe's reading of it
# A trusted width's median must move by more than this share before the curve is rebuilt: rebuilding it after
# every forward (its median of five moves by a hair each time) cost ≈ 2 % of a small model's decoding time.
OBSERVED_TOLERANCE = 0.02
# Forwards of as many rows without a one-column one before a plain step is due to time the unit: the first
# time (no wide forward is compared before it) and from then on (the context grows). A plain step in place
# of a planned one gives up what that step would have gained over one token: every 32 forwards, ≈ 1 % of the
# tokens at 1.3 tokens per forward, ≈ 2 % at 3.8 (the synthetic model's 3 plain steps in 105 forwards).
UNIT_FIRST = 8
UNIT_REFRESH = 32
REFINABLE = ("measured", "disk", "observed")  # a given or flat curve is the user's: never corrected

class ObservedCosts:
    """Decoding's own forwards of one model and batch bucket: each wider forward's time over the fastest
    of the recent one-column forwards *of as many rows* (the context grows while decoding, so a ratio to
    *recent* one-column forwards, not to the first ones; and a bucket holds several row counts — a batch of
    4 passes through 3 rows as its rows finish — whose forwards cost differently). The fastest, not the
    median: a forward is slowed by whatever else runs, never sped up, and while a planner that thinks wide
    steps cheap runs few one-column forwards, one slow one in a median of two made every wide forward look
    as cheap as one column (a batch-4 bf16 curve read 3 columns 1.00×, measured 1.35×).

    The unit is decoding's own: the probe's one-column time, on a scratch cache of 32 tokens with no
    attention mask and no step around it, is not comparable with a decoding forward (divided by it, a
    batch-4 bf16 run's 3-column forwards read 1.76×; a probe timed through a slow spell made them read
    1.05×, re-run 1.50×). Wide forwards are kept as seconds and compared once decoding has timed one
    column of as many rows, and a planner that believes wide steps cheap would never run one: after
    :data:`UNIT_FIRST`, then every :data:`UNIT_REFRESH` forwards without one, a plain step is due
    (:meth:`unit_due`).
    """

    def __init__(self):
        self.ones: dict[int, collections.deque] = {}  # rows -> recent one-column forwards' seconds
        self.wide: dict[int, collections.deque] = {}  # width -> recent (seconds, rows)
        self.applied: dict[int, float] = {}  # each trusted width's median as the current curve has it
        self.since_one: dict[int, int] = {}  # rows -> forwards of that many rows since a one-column one

    def record(self, width: int, seconds: float, rows: int) -> bool:
        """Add one forward of ``rows`` rows; True when a width's observed cost is newly trusted or has moved
        by more than :data:`OBSERVED_TOLERANCE` since the curve last took it (worth a new table)."""
        if width == 1:
            self.ones.setdefault(rows, collections.deque(maxlen=OBSERVED_RECENT)).append(seconds)
            self.since_one[rows] = 0
            return any(self._moved(w) for w in self.wide)  # a new unit moves every ratio
        self.since_one[rows] = self.since_one.get(rows, 0) + 1
        self.wide.setdefault(width, collections.deque(maxlen=OBSERVED_RECENT)).append((seconds, rows))
        return self._moved(width)

    def unit_due(self, rows: int) -> bool:
        """A plain step of ``rows`` rows is due, to re-time the unit (see the class docstring)."""
        every = UNIT_REFRESH if rows in self.ones else UNIT_FIRST
        return self.since_one.get(rows, 0) >= every

    def _ratios(self, width: int) -> list[float]:
        return [seconds / min(self.ones[rows]) for seconds, rows in self.wide[width] if rows in self.ones]

    def _moved(self, width: int) -> bool:
        ratios = self._ratios(width)
        if len(ratios) < OBSERVED_MIN:
            return False
        applied = self.applied.get(width)
        return applied is None or abs(statistics.median(ratios) - applied) > OBSERVED_TOLERANCE * applied

    def refine(self, table: CostTable) -> CostTable:
        """``table`` with every trusted width's observed cost (never below one column's)."""
        points = table.as_dict()
        for width in self.wide:
            ratios = self._ratios(width)
            if len(ratios) >= OBSERVED_MIN:
                self.applied[width] = statistics.median(ratios)
                points[width] = max(1.0, self.applied[width])
        refined = CostTable.from_mapping(points, "observed", table.batch)
        return dataclasses.replace(refined, unit_seconds=table.unit_seconds, widest=table.widest)


def _observed(memory: PlannerMemory | None, table: CostTable, create: bool = False) -> tuple:
    """What decoding observed of ``table``'s curve (None where it is not a curve of ``memory``: a given or flat
    one, or one handed over by a caller), with its key there."""
    if memory is None or table.source not in REFINABLE:
        return None, None
    key = next((k for k, known in memory.cost_tables.items() if known is table), None)
    if key is None:
        return None, None
    observed = memory.observations.get(key)
    if observed is None and create:
        observed = memory.observations[key] = ObservedCosts()
    return observed, key


def curve_key(memory: PlannerMemory | None, table: CostTable) -> tuple | None:
    """``memory``'s key of ``table`` (device, dtype, threads, batch, sizes, hooks, kernels), or None for a
    given, flat, borrowed or handed-over curve: what else is learnt of decoding the model on this machine at
    this batch size may be kept under it for later calls (``planner.StepPlanner``'s drafting floor)."""
    return _observed(memory, table)[1]


def observe(
    memory: PlannerMemory | None, table: CostTable, width: int, seconds: float, rows: int | None = None
) -> CostTable:
    """Record that a forward of ``rows`` rows (default: the table's batch) of ``width`` columns per sequence
    took ``seconds`` where ``table`` was the curve in use; returns the curve to use from now on (the same one
    until the width is trusted).

    The refined curve replaces the probe's in ``memory`` (later calls given that memory start from it). Only
    curves a memory holds (measured or read) are refined.
    """
    observed, key = _observed(memory, table, create=True)
    if observed is None or not observed.record(width, seconds, table.batch if rows is None else rows):
        return table
    refined = observed.refine(table)
    memory.cost_tables[key] = refined
    return refined


def unit_due(memory: PlannerMemory | None, table: CostTable, rows: int) -> bool:
    """A plain step of ``rows`` rows is due to re-time the curve's unit (``ObservedCosts.unit_due``); never
    for a curve decoding does not correct."""
    observed, _ = _observed(memory, table)
    return observed is not None and observed.unit_due(rows)


# --------------------------------------------------------------------------------------------------
# The probe
# --------------------------------------------------------------------------------------------------


@torch.no_grad()
def measure(
    model,
    *,
    batch: int,
    sizes,
    mask_token_id: int,
    budget_s: float = PROBE_BUDGET_S,
    rounds: int = PROBE_ROUNDS,
    context: int = PROBE_CONTEXT,
) -> CostTable:
    """Time cached forwards of each width in ``sizes`` (one real token then masks, like a MARS step)
    on a scratch cache of ``context`` tokens; the fastest of interleaved rounds, relative to width 1 (a
    forward is slowed by whatever else the machine does, never sped up: on one 2-vCPU AVX2 EPYC six probes of
    SmolLM2 spread by 0.03–0.09 per width this way, by 0.09–0.21 with medians of the same rounds).

    The user's cache, inputs and random state are untouched (the scratch cache is dropped; nothing is
    sampled). Under the budget, fewer sizes, then fewer rounds, are timed: the middle sizes are dropped
    (widest first) and interpolated, but 1, 2 and the widest are always timed. Why: the curve is not
    linear (on one 2-core AVX2 CPU, 2 columns cost 1.7× one, 9 columns 2.0×): a line from 1 to a wide size
    would call 2 columns nearly free and plan steps slower than stock, and a curve cut short would be
    extrapolated far above what wide steps (prompt lookup's, quadratic groups) really cost.
    """
    from .cache import MARSBlockCache

    started = time.perf_counter()
    device = model.device
    sizes = sorted({int(n) for n in sizes} | {1})
    limit = position_limit(model.config)
    if limit is not None:  # an absolute-position model: stay inside its positions
        sizes = [n for n in sizes if n <= max(limit // 2, 1)]
        context = max(1, min(context, limit - sizes[-1]))
    vocab = model.get_input_embeddings().weight.shape[0]
    kv = MARSBlockCache(model.config, context + sizes[-1] + 8, batch)
    prefix = (torch.arange(batch * context, device=device).reshape(batch, context) * 7919) % vocab
    kv.begin_forward([0] * batch, context, device)
    model(input_ids=prefix, cache=kv, use_cache=True, logits_to_keep=1)
    inputs = {n: _probe_inputs(n, batch, context, mask_token_id, device) for n in sizes}

    def timed(n: int) -> float:
        ids, positions = inputs[n]
        kv.begin_forward([context] * batch, n, device)
        _synchronize(device)
        start = time.perf_counter()
        model(input_ids=ids, position_ids=positions, cache=kv, use_cache=True, logits_to_keep=n)
        _synchronize(device)
        return time.perf_counter() - start

    first, widest = timed(1), timed(sizes[-1])  # warm-up, and the scale of one round
    timed(1)
    per_round = sum(first + (widest - first) * (n - 1) / max(sizes[-1] - 1, 1) for n in sizes)
    left = budget_s - (time.perf_counter() - started)
    while len(sizes) > 3 and per_round * 3 > left:  # keep >= 3 rounds: drop the widest middle size
        sizes = sizes[:-2] + sizes[-1:]
        per_round = sum(first + (widest - first) * (n - 1) / max(sizes[-1] - 1, 1) for n in sizes)
    times = {n: [] for n in sizes}
    count, last_round = 0, 0.0
    # another round only if it fits the budget (the first always runs; a round as long as the last one)
    while count < rounds and (count == 0 or time.perf_counter() - started + last_round <= budget_s):
        round_started = time.perf_counter()
        for n in sizes:  # interleaved: a busy spell of a shared machine hits every size alike
            times[n].append(timed(n))
        count += 1
        last_round = time.perf_counter() - round_started
    fastest = {n: min(values) for n, values in times.items()}
    one = fastest[1]
    table = CostTable(tuple(sizes), tuple(fastest[n] / one for n in sizes), "measured", batch, one)
    logger.info(
        "MARS cost curve (batch %d, %.1f ms per 1-column forward, %d rounds, %.2f s): %s",
        batch,
        one * 1000,
        count,
        time.perf_counter() - started,
        {n: round(c, 3) for n, c in table.as_dict().items()},
    )
    return table


def _probe_inputs(n: int, batch: int, context: int, mask_token_id: int, device):
    ids = torch.full((batch, n), mask_token_id, dtype=torch.long, device=device)
    ids[:, 0] = 1
    positions = torch.arange(context, context + n, device=device)[None, :].expand(batch, n)
    return ids, positions


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
