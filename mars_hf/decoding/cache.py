"""`MARSBlockCache`: a KV cache whose rows have lengths of their own (docs/method.md §3).

Every MARS step forwards some real tokens, maybe drafts, and mask tokens; afterwards only a prefix of
what each row fed is valid (mask entries never are; rejected drafts are not), and rows of a batch keep
different numbers of tokens. A ``DynamicCache`` shares one length across the batch, so an uneven batch
leaves *holes* in it that every later forward must mask and attend over. Here each row writes its new
entries at its own offset, so a row's entries are always contiguous and exactly its real tokens:

- the decoder calls ``begin_forward(offsets, width)`` before a forward: row ``r`` writes its ``width``
  new entries at columns ``offsets[r] …`` (whatever lies there past the row's valid length is stale);
- the decoder, not the cache, remembers each row's valid length: keeping or discarding entries is a
  number it stores, never a copy;
- every layer writes into a pre-allocated buffer that grows geometrically, in place;
- ``move_row`` copies one row onto another's place, so a server can keep its live rows in slots
  ``0 … n-1`` (rows join and leave between steps; memory stays bounded by the slots).

The attention mask the decoder passes hides each row's columns past its own length. This file depends
on torch and transformers only (it ships as a checkpoint's ``custom_generate/cache.py``).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer


class _WritePlan:
    """Where the rows of the next forward write: ``offsets`` per row, or one shared ``offset``.

    ``index`` (``[rows, width]`` cache columns) and ``row_index`` are tensors, so a compiled forward reads the
    write positions as data: a new offset never recompiles it (``indexed=True``, the static cache's form)."""

    __slots__ = ("first", "rows", "width", "offset", "offsets", "index", "row_index", "end")

    def __init__(
        self, offsets: list[int], width: int, device: torch.device, first_row: int = 0, indexed: bool = False
    ):
        self.first = first_row
        self.rows = len(offsets)
        self.width = width
        first = offsets[0]
        self.offset = first if all(o == first for o in offsets) and not indexed else None
        self.end = max(offsets) + width
        self.offsets = offsets
        self.index = self.row_index = None
        if self.offset is None:
            start = torch.tensor(offsets, device=device)
            self.index = start[:, None] + torch.arange(width, device=device)[None, :]
            self.row_index = torch.arange(self.rows, device=device)[:, None]


class MARSCacheLayer(DynamicLayer):
    """One layer's keys/values: ``[rows, heads, capacity, dim]`` buffers written at per-row offsets."""

    def __init__(self, capacity: int | None = None, max_rows: int | None = None, **kwargs):
        super().__init__(**kwargs)
        self.capacity_hint = capacity
        self.max_rows = max_rows
        self.plan: _WritePlan | None = None
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None
        # Counters that tests use to prove nothing is copied per step.
        self.num_allocations = 0
        self.num_copied_entries = 0

    # ``keys``/``values`` are views of the buffers up to the last forward's end, computed on access
    # (the base class assigns them; those assignments are ignored).
    @property
    def keys(self):
        if self._key_buffer is None or self.plan is None:
            return None
        return self._key_buffer[self.plan.first : self.plan.first + self.plan.rows, :, : self.plan.end]

    @keys.setter
    def keys(self, value):
        pass

    @property
    def values(self):
        if self._value_buffer is None or self.plan is None:
            return None
        return self._value_buffer[self.plan.first : self.plan.first + self.plan.rows, :, : self.plan.end]

    @values.setter
    def values(self, value):
        pass

    @property
    def capacity(self) -> int:
        return 0 if self._key_buffer is None else self._key_buffer.shape[-2]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.is_initialized = True
        rows = max(self.max_rows or 0, self.plan.first + key_states.shape[0])
        capacity = max(self.capacity_hint or 0, 2 * self.plan.end, 16)
        self._allocate(rows, capacity, key_states, value_states)

    def _allocate(self, rows: int, capacity: int, key_states, value_states) -> None:
        _, heads, _, key_dim = key_states.shape
        # Zeros, not empty: a row attends over columns up to the longest row's end, and an additive mask
        # cannot hide NaN that uninitialised memory may hold (NaN + min is NaN).
        new_keys = key_states.new_zeros((rows, heads, capacity, key_dim))
        new_values = value_states.new_zeros((rows, value_states.shape[1], capacity, value_states.shape[-1]))
        if self._key_buffer is not None:
            old_rows, _, old_capacity, _ = self._key_buffer.shape
            new_keys[:old_rows, :, :old_capacity].copy_(self._key_buffer)
            new_values[:old_rows, :, :old_capacity].copy_(self._value_buffer)
            self.num_copied_entries += old_capacity
        self._key_buffer, self._value_buffer = new_keys, new_values
        self.num_allocations += 1

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        plan = self.plan
        if plan is None or plan.rows != key_states.shape[0] or plan.width != key_states.shape[-2]:
            raise RuntimeError(
                "MARSBlockCache is written by the MARS decoder, which calls `begin_forward` before each "
                "forward; use a DynamicCache for ordinary forwards."
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        last_row = plan.first + plan.rows
        if plan.end > self.capacity or last_row > self._key_buffer.shape[0]:
            # Geometric growth: amortised O(1) per entry, never a reallocation per step.
            rows = max(last_row, self._key_buffer.shape[0])
            self._allocate(rows, max(plan.end, 2 * self.capacity), key_states, value_states)
        keys = self._key_buffer[plan.first : last_row]
        values = self._value_buffer[plan.first : last_row]
        if plan.offset is not None:
            keys[:, :, plan.offset : plan.offset + plan.width].copy_(key_states)
            values[:, :, plan.offset : plan.offset + plan.width].copy_(value_states)
        else:
            keys[plan.row_index, :, plan.index] = key_states.transpose(1, 2)
            values[plan.row_index, :, plan.index] = value_states.transpose(1, 2)
        return keys[:, :, : plan.end], values[:, :, : plan.end]

    def move_row(self, source: int, target: int, length: int) -> None:
        if self._key_buffer is not None and source != target and length:
            self._key_buffer[target, :, :length].copy_(self._key_buffer[source, :, :length])
            self._value_buffer[target, :, :length].copy_(self._value_buffer[source, :, :length])

    def get_seq_length(self) -> int:
        """Entries before the next forward's writes (the shared offset when rows are aligned)."""
        if self.plan is None:
            return 0
        return self.plan.offset if self.plan.offset is not None else self.plan.end - self.plan.width

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(
            "MARSBlockCache rows have lengths of their own, kept by the MARS decoder; it is not cropped."
        )

    def reset(self) -> None:
        self._key_buffer = self._value_buffer = None
        self.plan = None
        self.is_initialized = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self._key_buffer is not None:
            self._key_buffer = self._key_buffer[indices]
            self._value_buffer = self._value_buffer[indices]

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self._key_buffer is not None:
            self._key_buffer = self._key_buffer.repeat_interleave(repeats, dim=0)
            self._value_buffer = self._value_buffer.repeat_interleave(repeats, dim=0)


def unsupported_layer_types(config) -> list[str]:
    """Layer kinds of ``config`` other than full attention (MARS caches only hold full-attention KV)."""
    text_config = config.get_text_config(decoder=True)
    layer_types = getattr(text_config, "layer_types", None)
    if layer_types:
        return sorted({t for t in layer_types if t != "full_attention"})
    if getattr(text_config, "sliding_window", None) and getattr(text_config, "use_sliding_window", True):
        return ["sliding_attention"]
    return []


class MARSBlockCache(DynamicCache):
    """KV cache for MARS decoding, in the ``DynamicCache`` family, with per-row lengths.

    The MARS decoder drives it: ``begin_forward(offsets, width)`` before each forward says where each
    row's new entries go; each row's valid length is the decoder's to keep. ``move_row`` compacts
    rows (a server's slots).

    Args:
        config: the model config (one buffer layer per decoder layer is created up front).
        capacity: entries to pre-allocate per row and layer (e.g. prompt + max_new_tokens + window);
            the buffer grows geometrically when it is exceeded.
        max_rows: rows to allocate (default: the first forward's batch).
    """

    def __init__(self, config=None, capacity: int | None = None, max_rows: int | None = None):
        if config is not None:
            unsupported = unsupported_layer_types(config)
            if unsupported:
                raise ValueError(
                    f"MARSBlockCache only supports full-attention layers; this model has {unsupported} layers. "
                    "Decode with `mars_cache='none'` instead."
                )
            layers = config.get_text_config(decoder=True).num_hidden_layers
            Cache.__init__(self, layers=[MARSCacheLayer(capacity, max_rows) for _ in range(layers)])
        else:
            Cache.__init__(self, layer_class_to_replicate=lambda: MARSCacheLayer(capacity, max_rows))
        self.capacity = capacity
        self.max_rows = max_rows
        self._plan: _WritePlan | None = None

    def begin_forward(self, offsets: list[int], width: int, device: torch.device, first_row: int = 0) -> None:
        """The next forward feeds ``width`` columns for rows ``first_row …``; the ``r``-th of them
        writes at ``offsets[r]``."""
        self._plan = _WritePlan(list(offsets), width, device, first_row)
        for layer in self.layers:
            layer.plan = self._plan

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        # A cache built without a config creates its layers on first use; they need the plan too.
        while len(self.layers) <= layer_idx:
            self.layers.append(self.layer_class_to_replicate())
        self.layers[layer_idx].plan = self._plan
        return self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)

    def move_row(self, source: int, target: int, length: int) -> None:
        """Copy the first ``length`` entries of row ``source`` onto row ``target`` in every layer."""
        for layer in self.layers:
            layer.move_row(source, target, length)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if not self.layers:
            return 0 if self._plan is None else (self._plan.offset or 0)
        return self.layers[layer_idx].get_seq_length()

    def crop(self, max_length: int) -> None:
        raise NotImplementedError(
            "MARSBlockCache rows have lengths of their own, kept by the MARS decoder; it is not cropped."
        )

    @property
    def num_allocations(self) -> int:
        return sum(getattr(layer, "num_allocations", 0) for layer in self.layers)

    @property
    def num_copied_entries(self) -> int:
        return sum(getattr(layer, "num_copied_entries", 0) for layer in self.layers)


class MARSStaticLayer(MARSCacheLayer):
    """A :class:`MARSCacheLayer` allocated once at its full capacity, for a compiled forward: every forward
    writes through the plan's index tensors and attends over the whole buffer (the attention mask hides what a
    row does not hold), so shapes never change between steps and nothing the compiler guards on moves."""

    is_compileable = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.is_initialized = True
        rows = max(self.max_rows or 0, self.plan.first + key_states.shape[0])
        self._allocate(rows, self.capacity_hint, key_states, value_states)
        # Stable addresses let CUDA graphs reuse the buffers. Not on a CPU (no graphs to replay): there Inductor's
        # weight freezing would make a static-address buffer a constant of the graph, one call's cache for all.
        if self.device.type != "cpu" and not torch.compiler.is_compiling():
            torch._dynamo.mark_static_address(self._key_buffer)
            torch._dynamo.mark_static_address(self._value_buffer)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        plan = self.plan
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        last_row = plan.first + key_states.shape[0]
        keys = self._key_buffer[plan.first : last_row]
        values = self._value_buffer[plan.first : last_row]
        keys[plan.row_index, :, plan.index] = key_states.transpose(1, 2)
        values[plan.row_index, :, plan.index] = value_states.transpose(1, 2)
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.capacity_hint, 0  # every forward attends over the whole buffer


class MARSStaticCache(MARSBlockCache):
    """The MARS cache at a fixed size, for transformers' fast path (``cache_implementation="static"``, a
    ``compile_config``): ``capacity`` entries per row are allocated at the first forward and never grow;
    each row writes at its own offset (keeping or dropping entries moves a number the decoder keeps), and
    every forward attends over all ``capacity`` columns under the decoder's 4D mask. ``is_compileable``,
    like transformers' ``StaticCache``: a forward compiled once serves every step and every prompt length
    up to ``capacity``.

    Args:
        config: the model config.
        capacity: entries per row (prompt, new tokens and the widest step; the decoder rounds it up).
        max_rows: rows to allocate (default: the first forward's batch).
    """

    def __init__(self, config, capacity: int, max_rows: int | None = None):
        super().__init__(config, capacity, max_rows)
        self.layers = [MARSStaticLayer(capacity, max_rows) for _ in self.layers]

    @property
    def is_compileable(self) -> bool:
        return True

    def begin_forward(self, offsets: list[int], width: int, device: torch.device, first_row: int = 0) -> None:
        if max(offsets) + width > self.capacity:
            raise RuntimeError(
                f"MARSStaticCache holds {self.capacity} entries per row; this forward needs "
                f"{max(offsets) + width}. Size it for the prompt, max_new_tokens and the widest step."
            )
        self._plan = _WritePlan(list(offsets), width, device, first_row, indexed=True)
        for layer in self.layers:
            layer.plan = self._plan

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return self.layers[layer_idx].update(key_states, value_states)


CACHE_SCHEMES = ("cursor", "block", "none")


# ------------------------------------------------------------------------------------------------
# How the cache is kept: which rows decide in a step and how many fed tokens each keeps (§3)
# ------------------------------------------------------------------------------------------------


class CursorScheme:
    """Commit every verified token a row fed, every step (the cache follows each row's cursor)."""

    name = "cursor"
    uses_cache = True

    def begin_step(self, uncommitted: list[int]) -> None:
        pass

    def participates(self, uncommitted: int) -> bool:
        return True

    def keep(self, prefilled: bool, verified_fed: int) -> int:
        return verified_fed


class BlockScheme:
    """The paper's scheme: the prompt is committed at once, then ``C`` tokens at a time.

    Between commits a row re-feeds every token since its last commit; a row whose uncommitted tokens
    reach ``C`` waits (takes no decision) until every row has, and one step then commits ``C`` for all.
    """

    name = "block"
    uses_cache = True

    def __init__(self, block: int):
        self.block = block
        self.commit_step = False

    def begin_step(self, uncommitted: list[int]) -> None:
        self.commit_step = bool(uncommitted) and min(uncommitted) >= self.block

    def participates(self, uncommitted: int) -> bool:
        return self.commit_step or uncommitted < self.block

    def keep(self, prefilled: bool, verified_fed: int) -> int:
        if not prefilled:
            return verified_fed
        return self.block if self.commit_step else 0


class NoCacheScheme:
    """Recompute everything every step (the reference the cached schemes must equal)."""

    name = "none"
    uses_cache = False

    def begin_step(self, uncommitted: list[int]) -> None:
        pass

    def participates(self, uncommitted: int) -> bool:
        return True

    def keep(self, prefilled: bool, verified_fed: int) -> int:
        return 0


def make_scheme(name: str, block: int):
    if name == "cursor":
        return CursorScheme()
    if name == "block":
        return BlockScheme(block)
    if name == "none":
        return NoCacheScheme()
    raise ValueError(f"`mars_cache` must be one of {CACHE_SCHEMES}, got {name!r}.")
