"""`MARSBlockCache`: a KV cache for MARS decoding (MARS_SPEC §3).

Every MARS step forwards some real tokens followed by ``W`` mask tokens, then throws the mask
entries away (they are not valid for the tokens accepted there). With the stock ``DynamicCache`` each
``update`` concatenates, i.e. reallocates and copies the whole cache, and each ``crop`` slices it.
Here every layer writes into a pre-allocated buffer that grows geometrically, so:

- ``update`` is an in-place copy of the new entries (no whole-cache reallocation per step);
- discarding the last ``k`` entries (``crop(-k)``) only moves a length counter.

The cache also keeps the per-row bookkeeping a batch needs: rows accept different numbers of
tokens, so a committed chunk can contain *holes* (columns of one row that hold no real token).
The 2D attention mask hides them; position ids follow the real tokens only. ``stage`` returns the
attention mask and position ids for the next forward, ``commit`` keeps a prefix of what was staged.

This file depends on torch and transformers only (it ships as a checkpoint's
``custom_generate/cache.py``).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer


class MARSCacheLayer(DynamicLayer):
    """A full-attention layer cache backed by a growable buffer: in-place appends, O(1) crops."""

    def __init__(self, capacity: int | None = None, **kwargs):
        super().__init__(**kwargs)
        self.capacity_hint = capacity
        self.length = 0
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None
        # Counters that tests use to prove nothing is copied per step.
        self.num_allocations = 0
        self.num_copied_entries = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.dtype = key_states.dtype
        self.is_initialized = True
        capacity = max(self.capacity_hint or 0, 2 * key_states.shape[-2], 16)
        self._allocate(capacity, key_states, value_states)

    def _allocate(self, capacity: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, key_dim = key_states.shape
        new_keys = key_states.new_empty((batch, heads, capacity, key_dim))
        new_values = value_states.new_empty((batch, value_states.shape[1], capacity, value_states.shape[-1]))
        if self._key_buffer is not None and self.length:
            new_keys[:, :, : self.length].copy_(self._key_buffer[:, :, : self.length])
            new_values[:, :, : self.length].copy_(self._value_buffer[:, :, : self.length])
            self.num_copied_entries += self.length
        self._key_buffer, self._value_buffer = new_keys, new_values
        self.num_allocations += 1

    # ``keys``/``values`` are read-only views of the live part of the buffers, computed on access so
    # that a crop is only a counter move (the base class assigns them; those assignments are ignored).
    @property
    def keys(self):
        return None if self._key_buffer is None else self._key_buffer[:, :, : self.length]

    @keys.setter
    def keys(self, value):
        pass

    @property
    def values(self):
        return None if self._value_buffer is None else self._value_buffer[:, :, : self.length]

    @values.setter
    def values(self, value):
        pass

    @property
    def capacity(self) -> int:
        return 0 if self._key_buffer is None else self._key_buffer.shape[-2]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        new = key_states.shape[-2]
        end = self.length + new
        if end > self.capacity:
            # Geometric growth: amortised O(1) per entry, never a reallocation per step.
            self._allocate(max(end, 2 * self.capacity), key_states, value_states)
        self._key_buffer[:, :, self.length : end].copy_(key_states)
        self._value_buffer[:, :, self.length : end].copy_(value_states)
        self.length = end
        return self._key_buffer[:, :, :end], self._value_buffer[:, :, :end]

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` entries (a counter move; the buffer is reused)."""
        if tokens_to_remove > 0:
            raise ValueError("MARSCacheLayer.crop takes a negative number of entries to remove.")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        self.length = max(0, self.length + tokens_to_remove)

    def reset(self) -> None:
        self.length = 0
        self._key_buffer = self._value_buffer = None
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


class MARSRowState:
    """Per-row attention mask and real-token count for a batch whose rows advance unevenly.

    Kept apart from the KV tensors so that the uncached reference path (``mars_cache="none"``) and
    caches of other types compute masks and positions exactly the same way.
    """

    def __init__(self, batch_size: int, device: torch.device, capacity: int = 64):
        self.batch_size = batch_size
        self.device = device
        self._mask = torch.ones((batch_size, max(capacity, 16)), dtype=torch.long, device=device)
        self.committed = 0  # committed columns (real tokens and holes)
        self.staged = 0  # columns of the last staged chunk
        self.real_counts = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.has_holes = False  # Python flag: lets an all-valid batch skip the mask entirely
        self._staged_valid: torch.Tensor | None = None

    def _ensure(self, columns: int) -> None:
        if columns > self._mask.shape[1]:
            grown = torch.ones(
                (self.batch_size, max(columns, 2 * self._mask.shape[1])), dtype=torch.long, device=self.device
            )
            grown[:, : self.committed].copy_(self._mask[:, : self.committed])
            self._mask = grown

    def stage(self, num_columns: int, valid: torch.Tensor | None = None):
        """Stage a chunk of ``num_columns`` columns (``valid``: bool ``[batch, num_columns]``, None = all real).

        Returns ``(attention_mask, position_ids)`` for the forward: the 2D mask over committed + staged
        columns (None when nothing is hidden anywhere) and positions that count real tokens only.
        """
        end = self.committed + num_columns
        self._ensure(end)
        if valid is None:
            self._mask[:, self.committed : end].fill_(1)
            offsets = torch.arange(num_columns, device=self.device)
            position_ids = self.real_counts[:, None] + offsets[None, :]
        else:
            self._mask[:, self.committed : end].copy_(valid)
            self.has_holes = self.has_holes or not bool(valid.all())
            before = valid.long().cumsum(1) - 1
            position_ids = (self.real_counts[:, None] + before).clamp_(min=0)
        self.staged = num_columns
        self._staged_valid = valid
        attention_mask = self._mask[:, :end] if self.has_holes else None
        return attention_mask, position_ids

    def commit(self, num_columns: int) -> None:
        """Keep the first ``num_columns`` staged columns as part of the sequence; forget the rest."""
        if num_columns > self.staged:
            raise ValueError(f"cannot commit {num_columns} columns, only {self.staged} were staged.")
        if num_columns:
            if self._staged_valid is None:
                self.real_counts += num_columns
            else:
                self.real_counts += self._staged_valid[:, :num_columns].sum(1)
        self.committed += num_columns
        self.staged = 0
        self._staged_valid = None


class MARSBlockCache(DynamicCache):
    """KV cache for MARS decoding, in the ``DynamicCache`` family.

    Supports both schemes of MARS_SPEC §3 through two calls around each forward:
    ``stage(num_columns, valid)`` (mask + positions for ``[real tokens ; holes ; masks]``) and
    ``commit(num_columns)`` (keep a prefix of the chunk in the cache, drop the rest in O(1)).
    ``cursor`` commits every real column each step; ``block`` commits ``C`` columns at a time.

    Args:
        config: the model config (one buffer layer per decoder layer is created up front).
        capacity: entries to pre-allocate per layer (e.g. prompt + max_new_tokens + window); the buffer
            grows geometrically when it is exceeded.
    """

    def __init__(self, config=None, capacity: int | None = None):
        layers = None
        if config is not None:
            text_config = config.get_text_config(decoder=True)
            layer_types = getattr(text_config, "layer_types", None)
            if layer_types:
                unsupported = sorted({t for t in layer_types if t != "full_attention"})
            elif getattr(text_config, "sliding_window", None) and getattr(
                text_config, "use_sliding_window", True
            ):
                unsupported = ["sliding_attention"]
            else:
                unsupported = []
            if unsupported:
                raise ValueError(
                    f"MARSBlockCache only supports full-attention layers; this model has {unsupported} layers. "
                    "Decode with `mars_cache='none'` instead."
                )
            layers = [MARSCacheLayer(capacity) for _ in range(text_config.num_hidden_layers)]
        if layers is None:
            Cache.__init__(self, layer_class_to_replicate=lambda: MARSCacheLayer(capacity))
        else:
            Cache.__init__(self, layers=layers)
        self.capacity = capacity
        self.rows: MARSRowState | None = None

    def init_rows(self, batch_size: int, device: torch.device) -> MARSRowState:
        self.rows = MARSRowState(batch_size, device, capacity=(self.capacity or 64))
        return self.rows

    def stage(self, num_columns: int, valid: torch.Tensor | None = None):
        return self.rows.stage(num_columns, valid)

    def commit(self, num_columns: int) -> None:
        """Keep the first ``num_columns`` columns of the last forward's chunk; drop the rest."""
        drop = self.rows.staged - num_columns
        self.rows.commit(num_columns)
        if drop:
            self.crop(-drop)

    @property
    def num_allocations(self) -> int:
        return sum(getattr(layer, "num_allocations", 0) for layer in self.layers)

    @property
    def num_copied_entries(self) -> int:
        return sum(getattr(layer, "num_copied_entries", 0) for layer in self.layers)
