"""`MARSBatchDecoder`: rows advanced one MARS step at a time; rows join and leave between steps.

The loop is thin; the parts it drives live apart:

- ``rows``: a row's settings, its state between steps and what it gains in a step;
- ``feeding`` (with ``layouts``, ``planner``, ``cost_model``, ``draft_sources``): what each row feeds
  in a step (fresh tokens, drafts, mask groups) and where its predictions sit;
- ``acceptance``: how predictions become tokens and which a row keeps (threshold or verify);
- ``cache``: the per-row KV store and the scheme that says what stays in it (cursor / block / none).

``mars_generate`` (in ``generation``) drives it for ``model.generate``; a server drives it directly
(``add_row`` / ``step`` / ``drop_row``). Live rows occupy KV slots ``0 … n-1``: a row that leaves is
replaced by the last one (one row copy), so memory is bounded by ``max_rows`` and reused.
"""

from __future__ import annotations

import time

import torch

from .acceptance import (
    DraftsThenThreshold,
    ScoreProcessing,
    StepLogits,
    ThresholdRule,
    Verification,
    one_token_per_step,
)
from .cache import MARSBlockCache, make_scheme
from .calibration import calibration_for
from .cpu_kernels import packed_linears
from .draft_sources import MASKS
from .feeding import StepFeed
from .layouts import pack
from .rows import RowSettings, RowState, RowUpdate, SourceStats, sampling_processors
from .settings import check_choice

__all__ = ["MARSBatchDecoder", "RowSettings", "RowUpdate"]

# The cache is sized for the prompt, the new tokens and one step's columns; a step wider than this
# (a huge W with the quadratic layout) grows it geometrically instead of allocating W² up front.
_STEP_CAPACITY = 256


class MARSBatchDecoder:
    """Advance a set of rows one MARS step at a time.

    Args:
        model: a causal LM whose ``config.mars`` (or the arguments) give the window and mask token.
        max_rows: KV slots (rows decoded at once).
        max_length: longest row (prompt + generated) the cache is sized for (it grows if exceeded).
        window: W (default ``config.mars["block_size"]``); mask_token_id likewise.
        cache: ``"cursor"``, ``"block"`` (with ``cache_block`` = C) or ``"none"``.
        layout: verify's feed: ``"auto"`` (default: the step planner chooses drafts, masks and groups
            per step and row from the measured cost curve), or a fixed ``"linear"`` / ``"quadratic"``.
        planner: also let the planner size threshold (τ) rows' mask groups (default False: the paper's
            fixed window; with the planner τ can accept no more predictions than the masks fed).
        cost_table: ``{columns per row: relative cost}`` to use instead of measuring
            (``cost_model.CostTable.from_mapping``); ``cost_probe=False``: assume a flat curve.
        cpu_kernels: ``mars_cpu_kernels``: ``"auto"``, ``"packed"`` or ``"stock"`` (``cpu_kernels.py``); the
            linears run packed only inside ``step`` and ``measure_costs`` (or a caller's enclosing
            ``cpu_kernels.packed_linears`` block, as ``generate`` opens for its whole call), so the model is
            untouched between.
        kv_cache: a ``MARSBlockCache`` to use (e.g. the caller's), else one is created.
        stopping_criteria: ``generate``'s non-EOS stopping criteria, checked token by token inside a step
            on the rows' token buffer (``ScoreProcessing.sequences``, indexed by each row's ``batch_index``).

    ``forward_widths`` (columns per row of each forward, padding included) and ``plan_counts`` (how
    often a row fed nothing extra, drafts only, a linear or a quadratic group, a fixed layout, or a plain
    ``unit`` step that re-times one column)
    say what the planner chose; ``cost_tables`` the curves it used, per batch bucket.
    """

    def __init__(
        self,
        model,
        *,
        max_rows: int,
        max_length: int,
        window: int,
        mask_token_id: int,
        pad_token_id: int,
        cache: str = "cursor",
        cache_block: int = 16,
        layout: str | None = None,
        planner: bool = False,
        cost_table: dict | None = None,
        cost_probe: bool = True,
        cpu_kernels: str = "stock",
        kv_cache: MARSBlockCache | None = None,
        stopping_criteria=None,
        assistant_model=None,
        assistant_tokens: int = 5,
    ):
        self.model = model
        self.device = model.device
        check_choice("mars_cpu_kernels", cpu_kernels)
        self.cpu_kernels = cpu_kernels
        self.window = window
        self.pad_token_id = pad_token_id
        self.scheme = make_scheme(cache, cache_block)
        self.feed = StepFeed(
            model,
            window=window,
            mask_token_id=mask_token_id,
            pad_token_id=pad_token_id,
            layout=layout,
            planner=planner,
            cost_table=cost_table,
            cost_probe=cost_probe,
            assistant_model=assistant_model,
            assistant_tokens=assistant_tokens,
        )
        self.kv = None
        if self.scheme.uses_cache:
            capacity = max_length + min(window * (window + 2), _STEP_CAPACITY) + 8
            self.kv = kv_cache if kv_cache is not None else MARSBlockCache(model.config, capacity, max_rows)
        self.max_rows = max_rows
        self.stopping_criteria = stopping_criteria or None
        self.rows: list[RowState] = []  # live rows, in KV slot order
        self.joining: list[RowState] = []  # added, prefilled by the next step
        self.num_forwards = 0
        self.forward_widths: list[int] = []
        self.score_records: list | None = None  # set to a list to keep (row, start, scores, logits)
        self._next_id = 0
        self._dtype = next(model.parameters()).dtype
        self.calibration = calibration_for(model, window)  # None: raw confidences (no config.mars calibration)
        # A CPU forward ends when its call returns, so its wall time is its cost: the measured curve learns
        # from it. (On an accelerator, timing would need a synchronisation per step; its curve is flat.)
        self._times_forwards = self.device.type == "cpu" and self.kv is not None

    @property
    def plan_counts(self) -> dict[str, int]:
        return self.feed.plan_counts

    @property
    def cost_tables(self) -> dict:
        """The cost curves the planner used, per batch bucket."""
        return self.feed.cost_tables

    @property
    def cost_given(self):
        """The cost curve given instead of measuring (``cost_table=``); settable between steps."""
        return self.feed.cost_given

    @cost_given.setter
    def cost_given(self, table) -> None:
        self.feed.cost_given = table

    def measure_costs(self) -> None:
        """Measure the cost curves of every batch bucket up to ``max_rows`` now (a server at start-up),
        instead of at the first step that needs each (about 2 s at most per bucket, once per process)."""
        with packed_linears(self.model, self.cpu_kernels):
            self.feed.measure_costs(self.max_rows)

    # ----------------------------------------------------------------------------- rows in and out
    @property
    def num_rows(self) -> int:
        return len(self.rows) + len(self.joining)

    @property
    def free_slots(self) -> int:
        return self.max_rows - self.num_rows

    def add_row(
        self,
        prompt_ids,
        settings: RowSettings,
        *,
        processing: ScoreProcessing | None = None,
        batch_index: int = 0,
        lead: int = 0,
        row_id: int | None = None,
    ) -> int:
        """Queue a row; the next ``step`` prefills it. Returns its id.

        ``processing`` / ``batch_index`` / ``lead``: ``generate``'s shared processors, the row's index in
        their token buffer and its left padding there (the padding is fed with the prompt, as stock
        ``generate`` does, so that one-token decoding is numerically stock decoding).
        """
        if self.free_slots <= 0:
            raise RuntimeError(f"all {self.max_rows} rows are in use; drop a row or wait for one to finish")
        prompt = token_list(prompt_ids)
        if not prompt:
            raise ValueError("a row needs at least one prompt token")
        check_choice("mars_acceptance", settings.acceptance)
        verify = settings.acceptance == "verify"
        if not verify and settings.threshold is None:
            raise ValueError("threshold acceptance needs a τ (`mars_threshold`); or use acceptance='verify'")
        if processing is None:
            processing = ScoreProcessing(settings.logits_processor or sampling_processors(settings))
        row_id = self._next_id if row_id is None else row_id
        self._next_id = max(self._next_id, row_id + 1)
        floor = float(settings.threshold) if (verify and settings.threshold is not None) else 0.0
        fed_lead = lead if self.scheme.uses_cache else 0  # without a cache, padding is simply not fed
        row = RowState(row_id, prompt, settings, self.window, processing, batch_index, fed_lead, lead, floor)
        if settings.max_new_tokens <= 0:
            row.finished = True
        if self.feed.drafts.assistant is not None:
            row.assistant_stats = SourceStats(self.feed.drafts.assistant_tokens)
        self.joining.append(row)
        return row_id

    @torch.no_grad()
    def drop_row(self, row_id: int) -> None:
        """Forget a row (finished or cancelled); its KV slot is reused."""
        for i, row in enumerate(self.joining):
            if row.row_id == row_id:
                del self.joining[i]
                return
        for slot, row in enumerate(self.rows):
            if row.row_id == row_id:
                last = len(self.rows) - 1
                if slot != last and self.kv is not None:
                    self.kv.move_row(last, slot, self.rows[last].cache_offset)
                self.rows[slot] = self.rows[last]
                self.rows.pop()
                return
        raise KeyError(f"no row {row_id}")

    def set_threshold(self, row_id: int, tau: float) -> None:
        """Change a threshold row's τ between steps (a load controller's knob)."""
        for row in self.rows + self.joining:
            if row.row_id == row_id:
                if row.verify:
                    row.floor = float(tau)
                else:
                    row.tau = float(tau)
                    row.window = 0 if one_token_per_step(row.metric, tau) else self.window
                return
        raise KeyError(f"no row {row_id}")

    # ------------------------------------------------------------------------------------- a step
    @torch.no_grad()  # decoding never needs a graph (a server calls this outside `generate`)
    def step(self) -> list[RowUpdate]:
        """One MARS step for every live row (rows that joined since the last step are prefilled)."""
        with packed_linears(self.model, self.cpu_kernels):
            return self._step()

    def _step(self) -> list[RowUpdate]:
        updates: list[RowUpdate] = []
        if self.joining:
            joining, self.joining = self.joining, []
            first = len(self.rows)
            self.rows.extend(joining)
            updates += self._advance(first, len(self.rows))
            decode_end = first
        else:
            decode_end = len(self.rows)
        if decode_end:
            updates += self._advance(0, decode_end)
        return updates

    def _advance(self, first: int, end: int) -> list[RowUpdate]:
        """One step for rows ``first … end-1`` (KV slots): plan the feed, run the forward, decide, keep."""
        rows = self.rows[first:end]
        live = [r for r in rows if not r.finished]
        if not live:
            return [RowUpdate(r.row_id, [], True, "length") for r in rows]
        self.scheme.begin_step([len(r.tokens) - r.committed for r in live if r.prefilled])
        deciding = [
            not row.finished and (not row.prefilled or self.scheme.participates(len(row.tokens) - row.committed))
            for row in rows
        ]
        plan = self.feed.plan(rows, deciding)
        checked = [len(r.drafts) if d else 0 for r, d in zip(rows, deciding)]
        sources = [r.draft_source for r in rows]
        fed_confidence = [r.draft_confidence for r in rows]  # replaced by the new drafts' below
        started = time.perf_counter()
        logits, where = self._forward(rows, plan.plans, deciding, first, plan.width)
        if self._times_forwards and all(r.prefilled for r in rows):  # a decode step, not a prefill
            self.feed.observe_forward(len(rows), self.forward_widths[-1], time.perf_counter() - started)
        outcome = self._decide(rows, plan.plans, deciding, logits, where)
        self.feed.learn(rows, plan.specs, plan.choices, outcome, fed_confidence, plan.cost, checked, sources)
        return [self._keep(row, outcome.get(i), checked[i], sources[i]) for i, row in enumerate(rows)]

    def _decide(self, rows, plans, deciding, logits, where) -> dict[int, tuple[list[int], int, int, str | None]]:
        """Each deciding row's ``(tokens kept, fed tokens verified, drafts kept, stop reason)``."""
        step = StepLogits(
            logits,
            where,
            stopping_criteria=self.stopping_criteria,
            score_records=self.score_records,
            calibration=self.calibration,
        )
        threshold_rows = [i for i, r in enumerate(rows) if deciding[i] and not r.verify and not r.drafts]
        drafted_rows = [i for i, r in enumerate(rows) if deciding[i] and not r.verify and r.drafts]
        verify_rows = [i for i, r in enumerate(rows) if deciding[i] and r.verify]
        outcome = {}
        if threshold_rows:
            outcome.update(ThresholdRule(step).decide(rows, plans, threshold_rows))
        if drafted_rows:  # τ rows that fed a draft model's drafts (docs/method.md §5)
            outcome.update(DraftsThenThreshold(step).decide(rows, plans, drafted_rows))
        if verify_rows:
            outcome.update(Verification(step).decide(rows, plans, verify_rows))
        for i in verify_rows + drafted_rows:  # any drafts in hand now are the masks' (or none)
            rows[i].draft_source = MASKS
        return outcome

    def _keep(self, row: RowState, outcome, checked: int, source: str) -> RowUpdate:
        """Append a row's kept tokens, commit what its cache scheme keeps, and say whether it ended."""
        if outcome is None:  # the row took no decision (finished, or waiting for a block commit)
            return RowUpdate(row.row_id, [], row.finished, "length" if row.finished else None)
        tokens, verified_fed, kept_drafts, reason = outcome
        row.committed += self.scheme.keep(row.prefilled, verified_fed)
        row.prefilled = True
        row.tokens += tokens
        if row.noise is not None:
            row.noise.forget_before(len(row.tokens))
        if reason is None and row.generated >= row.settings.max_new_tokens:
            reason = "length"
        row.finished = reason is not None
        if row.finished:
            row.drafts, row.draft_confidence = [], []
        return RowUpdate(row.row_id, tokens, row.finished, reason, checked, kept_drafts, source)

    # ------------------------------------------------------------------------------- the forward
    def _forward(self, rows, plans, deciding, first, width):
        """Run the model on the packed plans (``width`` columns per row, padding included); return the
        needed logits and where each column went."""
        offsets = [r.cache_offset for r in rows]
        step = pack(
            plans,
            offsets,
            [r.lead for r in rows],
            min_width=width,
            dtype=self._dtype,
            device=self.device,
            pad_token_id=self.pad_token_id,
            max_position=self.feed.position_limit,
        )
        keep = _logit_columns(plans, deciding, step.width)
        where = {c: i for i, c in enumerate(keep)}
        if keep == list(range(step.width - len(keep), step.width)):
            logits_to_keep = len(keep)
        else:
            logits_to_keep = torch.tensor(keep, device=self.device)
        if self.kv is not None:
            self.kv.begin_forward(offsets, step.width, self.device, first_row=first)
        self.num_forwards += 1
        self.forward_widths.append(step.width)
        outputs = self.model(
            input_ids=step.input_ids,
            attention_mask=step.attention_mask,
            position_ids=step.position_ids,
            cache=self.kv,
            use_cache=self.kv is not None,
            logits_to_keep=logits_to_keep,
            return_dict=True,
        )
        return outputs.logits, where


def check_token_ids(ids: torch.Tensor, name: str = "input_ids") -> None:
    """Token ids must be integers: a float id would be truncated silently (7.9 -> 7), where stock ``generate``
    raises in the embedding."""
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TypeError(
            f"`{name}` must hold integer token ids (torch.long), not {ids.dtype}; convert it with `.long()`."
        )


def token_list(ids) -> list[int]:
    """A prompt's token ids (a tensor or a sequence of ints) as a list of ints; anything else is refused."""
    if torch.is_tensor(ids):
        check_token_ids(ids, "prompt_ids")
        return [int(t) for t in ids.tolist()]
    tokens = []
    for t in ids:
        if isinstance(t, bool) or not hasattr(t, "__index__"):
            raise TypeError(f"prompt token ids must be integers, got {t!r} ({type(t).__name__}).")
        tokens.append(t.__index__())
    return tokens


def _logit_columns(plans, deciding, width: int) -> list[int]:
    """The step columns whose logits a decision reads (checks and mask groups of deciding rows)."""
    needed: set[int] = set()
    for plan, decides in zip(plans, deciding):
        if decides:
            needed.update(plan.check_columns)
            for columns in plan.group_columns.values():
                needed.update(columns)
    keep = sorted(needed)
    if keep and width > max(len(p.tokens) for p in plans):
        # padded to a cheaper measured width: the LM head then runs on every column from the first
        # needed one, as the cost probe measured it (fewer rows can take a slower kernel path)
        keep = list(range(keep[0], width))
    return keep
