"""`MARSBatchDecoder`: rows advanced one MARS step at a time; rows join and leave between steps.

The loop is thin; the parts it drives live apart:

- ``layouts``: what a row feeds in a step (fresh tokens, drafts, mask groups) and where its
  predictions sit;
- ``acceptance``: how predictions become tokens and which a row keeps (threshold or verify);
- ``cache``: the per-row KV store and the scheme that says what stays in it (cursor / block / none).

``mars_generate`` (in ``generation``) drives it for ``model.generate``; a server drives it directly
(``add_row`` / ``step`` / ``drop_row``). Live rows occupy KV slots ``0 … n-1``: a row that leaves is
replaced by the last one (one row copy), so memory is bounded by ``max_rows`` and reused.

This file depends on torch and transformers only (it ships in a checkpoint's ``custom_generate/``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from .acceptance import ACCEPTANCE_RULES, ScoreProcessing, StepDecisions, one_token_per_step
from .cache import MARSBlockCache, make_scheme
from .calibration import calibration_for
from .layouts import LAYOUTS, idle_plan, pack, plan_row

# CPU matrix kernels (MKL/oneDNN in the torch CPU wheels) take a much slower path when a linear layer
# sees fewer than 4 rows: measured on SmolLM2-135M, a cached forward of 3 tokens cost 82 ms against
# 62 ms for 4 (39 ms for 1, where the matrix-vector path is fast). A step that carries masks is
# therefore padded to 4 rows: padding columns come after every real column and mask, nothing real
# attends to them and their entries are never kept, so the tokens are the same.
MIN_FORWARD_ROWS = {"cpu": 4}
# Verified decoding's draft layout per device type (see docs/verified_decoding.md): a CPU forward
# costs more with every row, so the quadratic layout's extra mask groups cost more than they save;
# an accelerator's forward at small batch barely grows with rows, so every group is almost free.
DEFAULT_LAYOUT = {"cpu": "linear"}
FALLBACK_LAYOUT = "quadratic"


@dataclass
class RowSettings:
    """How one row decodes.

    Args:
        threshold: τ for threshold acceptance (``>= 1`` with probability/margin: one token per step).
            With ``acceptance="verify"``: a proposal floor, masks below it are not proposed (default 0).
        acceptance: ``"probability"``, ``"entropy"``, ``"margin"`` or ``"verify"``.
        max_new_tokens: tokens to generate at most.
        eos_token_ids: tokens that end the row (kept in the output).
        do_sample / temperature / top_k / top_p: sampling, as in ``GenerationConfig``; ignored when
            ``logits_processor`` is given.
        logits_processor: processors for this row alone (position-free ones only; a server's rows).
        seed: a seed for this row's own random generator (sampling is then reproducible per row,
            whatever else the batch holds); None uses torch's global generator, like ``generate``.
    """

    threshold: float | None = None
    acceptance: str = "probability"
    max_new_tokens: int = 256
    eos_token_ids: tuple[int, ...] = ()
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    logits_processor: LogitsProcessorList | None = None
    seed: int | None = None


@dataclass
class RowUpdate:
    """What a row gained in one step: tokens now final (verified or accepted), and whether it ended."""

    row_id: int
    tokens: list[int]
    finished: bool
    finish_reason: str | None  # "stop" (EOS / stop criterion), "length", or None while running
    drafts_proposed: int = 0
    drafts_accepted: int = 0


class _Row:
    """One row's decoding state."""

    def __init__(
        self, row_id, prompt, settings, window, processing, batch_index, lead, buffer_lead, floor, device
    ):
        self.row_id = row_id
        self.tokens = list(prompt)  # real tokens: the prompt, then everything accepted
        self.prompt_length = len(prompt)
        self.settings = settings
        self.verify = settings.acceptance == "verify"
        self.metric = settings.acceptance
        tau = settings.threshold
        self.window = 0 if one_token_per_step(settings.acceptance, tau) else window
        self.tau = float(tau) if tau is not None else 0.0
        self.floor = floor
        self.eos = frozenset(settings.eos_token_ids)
        self.do_sample = settings.do_sample
        self.generator = None
        if settings.seed is not None and settings.do_sample:
            self.generator = torch.Generator(device=device)  # where its logits are
            self.generator.manual_seed(int(settings.seed))
        self.processing = processing
        self.batch_index = batch_index  # row of ``processing.sequences`` (the stock ``input_ids`` layout)
        self.lead = lead  # left-padding columns of the prompt fed to the model (and kept in the cache)
        self.buffer_lead = buffer_lead  # left-padding columns before the prompt in ``processing.sequences``
        self.prefilled = False
        self.committed = 0  # real tokens whose keys/values are in the cache
        self.drafts: list[int] = []
        self.proposal: torch.Tensor | None = None  # [len(drafts), vocab] draft distributions (sampling)
        self.finished = False

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_length

    @property
    def cache_offset(self) -> int:
        return (self.lead if self.prefilled else 0) + self.committed

    @property
    def column(self) -> int:
        """Buffer column of the next token (``processing.sequences`` layout)."""
        return self.buffer_lead + len(self.tokens)


class MARSBatchDecoder:
    """Advance a set of rows one MARS step at a time.

    Args:
        model: a causal LM whose ``config.mars`` (or the arguments) give the window and mask token.
        max_rows: KV slots (rows decoded at once).
        max_length: longest row (prompt + generated) the cache is sized for (it grows if exceeded).
        window: W (default ``config.mars["block_size"]``); mask_token_id likewise.
        cache: ``"cursor"``, ``"block"`` (with ``cache_block`` = C) or ``"none"``.
        layout: verify's draft layout, ``"linear"`` or ``"quadratic"`` (default per device type).
        kv_cache: a ``MARSBlockCache`` to use (e.g. the caller's), else one is created.
        stopping_criteria: ``generate``'s non-EOS stopping criteria, checked token by token inside a step
            on the rows' token buffer (``ScoreProcessing.sequences``, indexed by each row's ``batch_index``).
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
        kv_cache: MARSBlockCache | None = None,
        stopping_criteria=None,
    ):
        self.model = model
        self.device = model.device
        self.window = window
        self.mask_token_id = mask_token_id
        self.pad_token_id = pad_token_id
        self.scheme = make_scheme(cache, cache_block)
        layout = layout or DEFAULT_LAYOUT.get(self.device.type, FALLBACK_LAYOUT)
        if layout not in LAYOUTS:
            raise ValueError(f"`mars_layout` must be one of {LAYOUTS}, got {layout!r}.")
        self.layout = layout
        self.kv = None
        if self.scheme.uses_cache:
            capacity = max_length + window * (window + 2) + 8
            self.kv = kv_cache if kv_cache is not None else MARSBlockCache(model.config, capacity, max_rows)
        self.max_rows = max_rows
        self.stopping_criteria = stopping_criteria or None
        self.rows: list[_Row] = []  # live rows, in KV slot order
        self.joining: list[_Row] = []  # added, prefilled by the next step
        self.num_forwards = 0
        self.score_records: list | None = None  # set to a list to keep (row, start, scores, logits)
        self._next_id = 0
        self._dtype = next(model.parameters()).dtype
        self.calibration = calibration_for(model, window)  # None: raw confidences (no config.mars calibration)

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
        prompt = [int(t) for t in (prompt_ids.tolist() if torch.is_tensor(prompt_ids) else prompt_ids)]
        if not prompt:
            raise ValueError("a row needs at least one prompt token")
        if settings.acceptance not in ACCEPTANCE_RULES:
            raise ValueError(
                f"`mars_acceptance` must be one of {ACCEPTANCE_RULES}, got {settings.acceptance!r}."
            )
        verify = settings.acceptance == "verify"
        if not verify and settings.threshold is None:
            raise ValueError("threshold acceptance needs a τ (`mars_threshold`); or use acceptance='verify'")
        if processing is None:
            processing = ScoreProcessing(settings.logits_processor or _sampling_processors(settings))
        row_id = self._next_id if row_id is None else row_id
        self._next_id = max(self._next_id, row_id + 1)
        floor = float(settings.threshold) if (verify and settings.threshold is not None) else 0.0
        fed_lead = lead if self.scheme.uses_cache else 0  # without a cache, padding is simply not fed
        row = _Row(
            row_id, prompt, settings, self.window, processing, batch_index, fed_lead, lead, floor, self.device
        )
        if settings.max_new_tokens <= 0:
            row.finished = True
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
        rows = self.rows[first:end]
        live = [r for r in rows if not r.finished]
        if not live:
            return [RowUpdate(r.row_id, [], True, "length") for r in rows]
        self.scheme.begin_step([len(r.tokens) - r.committed for r in live if r.prefilled])
        plans, deciding = [], []
        for row in rows:
            decides = not row.finished and (
                not row.prefilled or self.scheme.participates(len(row.tokens) - row.committed)
            )
            deciding.append(decides)
            if not decides:
                plans.append(idle_plan(self.pad_token_id))
                continue
            drafts = row.drafts if row.verify else []
            plans.append(
                plan_row(
                    row.tokens[row.committed :],
                    drafts,
                    row.window,
                    self.mask_token_id,
                    self.layout if row.verify else "linear",
                    lead=0 if row.prefilled else row.lead,
                    pad_token_id=self.pad_token_id,
                )
            )
        checked = [len(r.drafts) if (d and r.verify) else 0 for r, d in zip(rows, deciding)]
        logits, where = self._forward(rows, plans, deciding, first)
        threshold_rows = [i for i, r in enumerate(rows) if deciding[i] and not r.verify]
        verify_rows = [i for i, r in enumerate(rows) if deciding[i] and r.verify]
        outcome: dict[int, tuple[list[int], int, int, str | None]] = {}
        decisions = StepDecisions(
            logits,
            where,
            window=self.window,
            stopping_criteria=self.stopping_criteria,
            score_records=self.score_records,
            calibration=self.calibration,
        )
        if threshold_rows:
            outcome.update(decisions.threshold(rows, plans, threshold_rows))
        if verify_rows:
            outcome.update(decisions.verify(rows, plans, verify_rows))
        updates = []
        for i, row in enumerate(rows):
            if i not in outcome:
                updates.append(RowUpdate(row.row_id, [], row.finished, "length" if row.finished else None))
                continue
            tokens, verified_fed, kept_drafts, reason = outcome[i]
            row.committed += self.scheme.keep(row.prefilled, verified_fed)
            row.prefilled = True
            row.tokens += tokens
            if reason is None and row.generated >= row.settings.max_new_tokens:
                reason = "length"
            row.finished = reason is not None
            if row.finished:
                row.drafts, row.proposal = [], None
            updates.append(RowUpdate(row.row_id, tokens, row.finished, reason, checked[i], kept_drafts))
        return updates

    # ------------------------------------------------------------------------------- the forward
    def _forward(self, rows, plans, deciding, first):
        """Run the model on the packed plans; return the needed logits and where each column went."""
        needed: set[int] = set()
        for plan, decides in zip(plans, deciding):
            if decides:
                needed.update(plan.check_columns)
                for columns in plan.group_columns.values():
                    needed.update(columns)
        carries_masks = any(p.group_columns for p in plans)
        min_rows = MIN_FORWARD_ROWS.get(self.device.type, 1) if carries_masks else 1
        min_width = -(-min_rows // len(rows))
        offsets = [r.cache_offset for r in rows]
        step = pack(
            plans,
            offsets,
            [r.lead for r in rows],
            min_width=min_width,
            dtype=self._dtype,
            device=self.device,
            pad_token_id=self.pad_token_id,
        )
        keep = sorted(needed)
        if len(keep) * len(rows) < min_rows:
            # the LM head on fewer than min_rows rows takes the same slow path: keep padding logits too
            spare = [c for c in range(step.width - 1, -1, -1) if c not in needed]
            keep = sorted(keep + spare[: -(-min_rows // len(rows)) - len(keep)])
        where = {c: i for i, c in enumerate(keep)}
        if keep == list(range(step.width - len(keep), step.width)):
            logits_to_keep = len(keep)
        else:
            logits_to_keep = torch.tensor(keep, device=self.device)
        if self.kv is not None:
            self.kv.begin_forward(offsets, step.width, self.device, first_row=first)
        self.num_forwards += 1
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


def _sampling_processors(settings: RowSettings) -> LogitsProcessorList:
    """The position-free warpers of a row's sampling settings (what a server request asks for)."""
    processors = LogitsProcessorList()
    if settings.do_sample:
        if settings.temperature not in (None, 1.0):
            processors.append(TemperatureLogitsWarper(settings.temperature))
        if settings.top_k:
            processors.append(TopKLogitsWarper(settings.top_k))
        if settings.top_p is not None and settings.top_p < 1.0:
            processors.append(TopPLogitsWarper(settings.top_p))
    return processors
