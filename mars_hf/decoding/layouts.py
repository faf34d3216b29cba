"""What one MARS step feeds for a row, and where that row's predictions sit (docs/method.md §2, §5, §6).

A row feeds, after the entries it already holds in the cache:

- ``fresh``: real tokens whose keys/values are not cached yet (the prompt at the first step; the
  tokens accepted at the last step afterwards — an accepted token must be run once as a real token);
- ``drafts``: tokens proposed by the masks at the last step and not yet verified (verified decoding,
  §6; none for threshold acceptance, which accepts mask predictions directly);
- groups of ``W`` mask tokens. ``linear``: one group after the drafts (useful only if every draft is
  kept). ``quadratic``: group ``k`` after the first ``k`` drafts, for every ``k``, seeing the prefix and
  those drafts only, its position ids continuing from its anchor — so whatever prefix is accepted,
  fresh drafts conditioned on exactly that prefix are ready (the §5 layout; a separate draft model's
  tokens could stand in for ``drafts`` unchanged).

``plan_row`` says which columns hold what; ``pack`` stacks the rows of a step into model inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LAYOUTS = ("linear", "quadratic")
# ``mars_layout`` values: a fixed layout (every draft, full groups of W masks), or "auto": the step
# planner (``planner``) chooses per step and row how many drafts, masks and groups pay for their cost.
LAYOUT_CHOICES = ("auto",) + LAYOUTS
_REAL = -1  # group id of fresh/draft columns
_PADDING = -2  # group id of columns that only fill a row up to the step's width


@dataclass
class RowPlan:
    """One row's columns in one step (chunk-relative column indices).

    Attributes:
        tokens: ids fed, in column order.
        positions: position id of each column, relative to the row's first fed position.
        group: per column, ``-1`` for fresh/draft tokens, else the id ``k`` of its mask group.
        visible_real: per column, how many leading real columns (fresh + drafts) it may attend to.
        check_columns: ``check_columns[j]`` holds the model's next-token prediction after the fresh
            tokens and the first ``j`` drafts (``len(drafts) + 1`` entries).
        group_columns: ``group_columns[k]``, the ``W`` mask columns whose predictions follow the
            prefix that keeps ``k`` drafts (mask ``i`` predicts offset ``i + 2`` past that prefix).
    """

    tokens: list[int]
    positions: list[int]
    group: list[int]
    visible_real: list[int]
    check_columns: list[int]
    group_columns: dict[int, list[int]]

    @property
    def causal(self) -> bool:
        """True when plain causal attention is exactly this plan's visibility (at most one mask group,
        which then follows every real column)."""
        return len(self.group_columns) <= 1


def plan_row(
    fresh: list[int],
    drafts: list[int],
    window: int,
    mask_token_id: int,
    layout: str,
    *,
    lead: int = 0,
    pad_token_id: int = 0,
) -> RowPlan:
    """The columns of a row feeding ``lead`` padding columns (a left-padded prompt's), ``fresh`` real
    tokens, ``drafts`` and masks in ``layout``."""
    if not fresh:
        raise ValueError("a MARS step must feed at least one real token per row")
    real = fresh + drafts
    tokens = [pad_token_id] * lead + real
    positions = [0] * lead + list(range(len(real)))
    group = [_PADDING] * lead + [_REAL] * len(real)
    visible = [0] * lead + list(range(lead + 1, lead + len(real) + 1))  # causal among real columns
    check = list(range(lead + len(fresh) - 1, lead + len(real)))
    groups: dict[int, list[int]] = {}
    if window:
        anchors = range(len(drafts) + 1) if layout == "quadratic" else [len(drafts)]
        for k in anchors:
            start = len(tokens)
            prefix = len(fresh) + k  # real tokens this group sees
            tokens += [mask_token_id] * window
            positions += range(prefix, prefix + window)
            group += [k] * window
            visible += [lead + prefix] * window
            groups[k] = list(range(start, start + window))
    return RowPlan(tokens, positions, group, visible, check, groups)


def position_limit(config) -> int | None:
    """Positions the model has (``max_position_embeddings``, GPT-2's ``n_positions``), or None.

    Absolute-position models index an embedding with each position id, so no column may go past it;
    masks and drafts are placed ahead of the real tokens, hence capped by ``limit - len(tokens)``.
    """
    config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def idle_plan(pad_token_id: int) -> RowPlan:
    """A row that takes no decision this step (it waits for a block commit): one padding column."""
    return RowPlan([pad_token_id], [0], [_PADDING], [0], [], {})


def _padding_position(position: int, last: int | None) -> int:
    return position if last is None else min(position, last)


@dataclass
class PackedStep:
    """Model inputs for one step of ``n`` rows, ``width`` columns each."""

    input_ids: torch.Tensor  # [n, width]
    position_ids: torch.Tensor  # [n, width]
    attention_mask: torch.Tensor | None  # 2D [n, cached + width], additive 4D, or None (all visible)
    width: int


def pack(
    plans: list[RowPlan],
    cached: list[int],
    leads: list[int],
    *,
    min_width: int,
    dtype: torch.dtype,
    device: torch.device,
    pad_token_id: int,
    max_position: int | None = None,
    key_length: int | None = None,
) -> PackedStep:
    """Stack the rows' plans (left-aligned, padded at the end) on top of their cached entries.

    Row ``r`` writes its columns at cache offset ``cached[r]``; its first ``leads[r]`` cache columns
    are a left-padded prompt's padding, never attended. When every row has the same number of cached
    entries and a causal plan, the layout is stock ``generate``'s and a 2D padding mask is passed (the
    model builds the causal mask itself, exactly as for stock decoding), or none where no row has left
    padding (the padding columns at the end are later than every real column: the causal mask hides
    them, and a 2D mask only cost the model a merge per forward, ≈ 0.1 ms of a 2 ms synthetic one);
    otherwise an additive 4D mask gives each query its row's real cached entries plus the columns its
    plan lets it see; there, padding columns see the cached entries and themselves only (finite, never
    read; nothing real attends to them). Padding columns' position ids stay below ``max_position`` (their
    value is never read, but an absolute-position embedding would index past its table).

    ``key_length``: a static cache's capacity. Every forward then attends over that many columns, so the
    additive 4D mask is always built, that wide (the shape a compiled forward was compiled for).
    """
    width = max(min_width, max(len(p.tokens) for p in plans))
    last = max_position - 1 if max_position else None
    ids = [p.tokens + [pad_token_id] * (width - len(p.tokens)) for p in plans]
    positions = [
        [real + q for q in p.positions]
        + [_padding_position(real + len(p.positions), last)] * (width - len(p.positions))
        for p, real in zip(plans, (max(c - lead, 0) for c, lead in zip(cached, leads)))
    ]
    input_ids = torch.tensor(ids, dtype=torch.long, device=device)
    position_ids = torch.tensor(positions, dtype=torch.long, device=device)
    prefix = max(cached)
    total = prefix + width if key_length is None else key_length
    key = torch.arange(total, device=device)
    lead_t = torch.tensor(leads, dtype=torch.long, device=device)
    lengths = [len(p.tokens) for p in plans]
    aligned = all(c == prefix for c in cached)
    if key_length is None and aligned and all(p.causal for p in plans):
        # padding columns come last: the causal mask already hides them from every real query
        if not any(leads):
            return PackedStep(input_ids, position_ids, None, width)
        end = torch.tensor(lengths, dtype=torch.long, device=device) + prefix
        mask = ((key[None, :] >= lead_t[:, None]) & (key[None, :] < end[:, None])).long()
        return PackedStep(input_ids, position_ids, mask, width)
    mask = _additive_mask(plans, cached, lead_t, key, width, dtype)
    return PackedStep(input_ids, position_ids, mask, width)


def _additive_mask(plans, cached, lead_t, key, width: int, dtype) -> torch.Tensor:
    """``[n, 1, width, cached + width]``: each query sees its row's real cached entries (from its lead
    on) and the chunk columns its plan lets it see (real columns up to its visibility, its own group)."""
    n, device = len(plans), key.device
    total = key.shape[0]
    group = torch.tensor(
        [p.group + [_PADDING] * (width - len(p.group)) for p in plans], dtype=torch.long, device=device
    )
    visible = torch.tensor(
        [p.visible_real + [0] * (width - len(p.visible_real)) for p in plans], dtype=torch.long, device=device
    )
    column = torch.arange(width, device=device)
    # the chunk part, [n, query, key]
    key_is_real = group[:, None, :] == _REAL
    sees_real = key_is_real & (column[None, None, :] < visible[:, :, None])
    same_group = (group[:, :, None] == group[:, None, :]) & (group[:, :, None] >= 0)
    sees_mask = same_group & (column[None, None, :] <= column[None, :, None])
    chunk = sees_real | sees_mask | torch.eye(width, dtype=torch.bool, device=device)[None]
    # the cached part: row r's queries see its cached entries from its lead on
    offsets = torch.tensor(cached, dtype=torch.long, device=device)
    relative = key[None, :] - offsets[:, None]  # key column relative to the row's chunk, [n, total]
    in_chunk = (relative >= 0) & (relative < width)
    gathered = chunk.gather(2, relative.clamp(0, width - 1)[:, None, :].expand(n, width, total))
    cached_key = (relative < 0) & (key[None, :] >= lead_t[:, None])
    allowed = cached_key[:, None, :] | (in_chunk[:, None, :] & gathered)
    mask = torch.zeros((n, 1, width, total), dtype=dtype, device=device)
    mask.masked_fill_(~allowed[:, None], torch.finfo(dtype).min)
    return mask
