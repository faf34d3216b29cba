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
from .cost_model import cost_table
from .draft_sources import ASSISTANT, LOOKUP, MASKS, lookup_drafts
from .layouts import LAYOUT_CHOICES, idle_plan, pack, plan_row, position_limit
from .planner import AUTO, FIXED, THRESHOLD, AcceptanceStats, RowChoice, RowSpec, choose

# The cache is sized for the prompt, the new tokens and one step's columns; a step wider than this
# (a huge W with the quadratic layout) grows it geometrically instead of allocating W² up front.
_STEP_CAPACITY = 256


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
        prompt_lookup_num_tokens / max_matching_ngram_size: verify only: also propose drafts by prompt
            lookup (transformers' meaning, ``draft_sources.lookup_drafts``); each step the row feeds the
            lookup's or the masks' drafts, whichever chain it expects to keep more of.
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
    prompt_lookup_num_tokens: int | None = None
    max_matching_ngram_size: int = 2


@dataclass
class RowUpdate:
    """What a row gained in one step: tokens now final (verified or accepted), and whether it ended."""

    row_id: int
    tokens: list[int]
    finished: bool
    finish_reason: str | None  # "stop" (EOS / stop criterion), "length", or None while running
    drafts_proposed: int = 0
    drafts_accepted: int = 0
    draft_source: str = MASKS  # where the checked drafts came from ("masks" or "lookup")


class _LookupStats(AcceptanceStats):
    """Prompt lookup's acceptance per offset. Its prior is optimistic: a source is only observed when
    fed, and a verbatim n-gram match's continuation is usually the model's own on input-grounded text
    (a row whose lookups fail drops below the masks within two or three tries)."""

    PRIOR = 0.8

    def future(self) -> list[float]:
        """Offsets not yet reached lean on the first offset's estimate, not on the prior: a row whose
        lookups fail at once must not keep valuing the unobserved tail of its chains at 0.8."""
        w = self.PRIOR_WEIGHT
        first = (self.kept[0] + w * self.PRIOR) / (self.reached[0] + w)
        tail = zip(self.kept[1:], self.reached[1:])
        return [first] + [(kept + w * first) / (reached + w) for kept, reached in tail]


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
        self.draft_confidence: list[float] = []  # the drafts' own (calibrated) probabilities
        self.proposal: torch.Tensor | None = None  # [len(drafts), vocab] draft distributions (sampling)
        self.finished = False
        self.stats = AcceptanceStats(min(window, max(settings.max_new_tokens, 1)))  # the planner's view
        self.draft_source = MASKS  # where ``drafts`` came from
        lookup = settings.prompt_lookup_num_tokens if self.verify else None
        self.lookup_stats = _LookupStats(int(lookup)) if lookup else None  # prompt lookup's acceptance
        self.assistant_stats = None  # an assistant model's acceptance (set by the decoder that has one)

    def source_stats(self, source: str):
        """The acceptance statistics of a draft source other than the masks."""
        return self.lookup_stats if source == LOOKUP else self.assistant_stats

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
        layout: verify's feed: ``"auto"`` (default: the step planner chooses drafts, masks and groups
            per step and row from the measured cost curve), or a fixed ``"linear"`` / ``"quadratic"``.
        planner: also let the planner size threshold (τ) rows' mask groups (default False: the paper's
            fixed window; with the planner τ can accept no more predictions than the masks fed).
        cost_table: ``{columns per row: relative cost}`` to use instead of measuring
            (``cost_model.CostTable.from_mapping``); ``cost_probe=False``: assume a flat curve.
        kv_cache: a ``MARSBlockCache`` to use (e.g. the caller's), else one is created.
        stopping_criteria: ``generate``'s non-EOS stopping criteria, checked token by token inside a step
            on the rows' token buffer (``ScoreProcessing.sequences``, indexed by each row's ``batch_index``).

    ``forward_widths`` (columns per row of each forward, padding included) and ``plan_counts`` (how
    often a row fed nothing extra, drafts only, a linear or a quadratic group, or a fixed layout)
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
        kv_cache: MARSBlockCache | None = None,
        stopping_criteria=None,
        assistant_model=None,
        assistant_tokens: int = 5,
    ):
        self.model = model
        self.assistant = assistant_model  # verify rows also get a draft model's drafts (MARS_SPEC §5)
        self.assistant_tokens = int(assistant_tokens)
        self.device = model.device
        self.window = window
        self.mask_token_id = mask_token_id
        self.pad_token_id = pad_token_id
        self.scheme = make_scheme(cache, cache_block)
        layout = layout or "auto"
        if layout not in LAYOUT_CHOICES:
            raise ValueError(f"`mars_layout` must be one of {LAYOUT_CHOICES}, got {layout!r}.")
        self.layout = layout
        self.threshold_planner = bool(planner)
        self.cost_given, self.cost_probe = cost_table, bool(cost_probe)
        if cost_table is not None:
            from .cost_model import CostTable

            CostTable.from_mapping(cost_table)  # a malformed table fails here, naming the keyword
        self.cost_tables: dict = {}  # batch bucket -> CostTable, filled at first need
        self.position_limit = position_limit(model.config)
        self.kv = None
        if self.scheme.uses_cache:
            capacity = max_length + min(window * (window + 2), _STEP_CAPACITY) + 8
            self.kv = kv_cache if kv_cache is not None else MARSBlockCache(model.config, capacity, max_rows)
        self.max_rows = max_rows
        self.stopping_criteria = stopping_criteria or None
        self.rows: list[_Row] = []  # live rows, in KV slot order
        self.joining: list[_Row] = []  # added, prefilled by the next step
        self.num_forwards = 0
        self.forward_widths: list[int] = []
        self.plan_counts: dict[str, int] = {}
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
        if self.assistant is not None and verify:
            row.assistant_stats = _LookupStats(self.assistant_tokens)
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
        deciding = [
            not row.finished and (not row.prefilled or self.scheme.participates(len(row.tokens) - row.committed))
            for row in rows
        ]
        plans, specs, choices, width, cost = self._plan_step(rows, deciding)
        checked = [len(r.drafts) if (d and r.verify) else 0 for r, d in zip(rows, deciding)]
        sources = [r.draft_source for r in rows]
        fed_confidence = [r.draft_confidence for r in rows]  # replaced by the new drafts' below
        logits, where = self._forward(rows, plans, deciding, first, width)
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
            for i in verify_rows:  # any drafts in hand now are the masks' (or none)
                rows[i].draft_source = MASKS
        self._learn(rows, specs, choices, outcome, fed_confidence, cost, checked, sources)
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
                row.drafts, row.proposal, row.draft_confidence = [], None, []
            updates.append(
                RowUpdate(row.row_id, tokens, row.finished, reason, checked[i], kept_drafts, sources[i])
            )
        return updates

    # ------------------------------------------------------------------------------ what rows feed
    def _plan_step(self, rows, deciding):
        """Each row's plan, the planner's specs and choices, the step's width and its relative cost.

        Rows the planner serves (verify with ``layout="auto"``, τ rows with ``planner=True``) get their
        feed from ``planner.choose``; the others keep a fixed plan and only set a floor on the width.
        When no row could feed a mask or draft nothing is measured and nothing padded: one-token
        decoding stays stock decoding, column for column. A step that carries masks runs at the
        cheapest measured width at least as wide as it needs (the padding replaces a fixed minimum).
        """
        plans, specs = [], []
        if self.assistant is not None:
            assisted = [r for r, d in zip(rows, deciding) if d and r.assistant_stats is not None]
            self._assistant_drafts(assisted, len(rows))
        for row, decides in zip(rows, deciding):
            if decides and row.lookup_stats is not None:
                self._pick_drafts(row, len(rows))
            kind = self._kind(row) if decides else FIXED
            if kind == FIXED:
                plan = self._fixed_plan(row) if decides else idle_plan(self.pad_token_id)
                plans.append(plan)
                specs.append(RowSpec(FIXED, len(plan.tokens)))
            else:
                plans.append(None)
                specs.append(self._row_spec(row, kind))
        wants_table = any(s.kind != FIXED and (s.max_masks > 0 or s.draft_probs) for s in specs) or any(
            p is not None and p.group_columns for p in plans
        )
        if not wants_table:
            choices = [RowChoice() for _ in rows]
            width, table = 1, None
        else:
            table = self._cost_table(len(rows))
            # lookup drafts may outnumber the window: the grid then allows that many
            longest = max((len(s.draft_probs) for s in specs if s.kind == AUTO), default=0)
            width, choices = choose(specs, table.effective, max(self.window, longest))
        for i, (row, spec) in enumerate(zip(rows, specs)):
            if spec.kind != FIXED:
                plans[i] = self._chosen_plan(row, choices[i])
                kind = choices[i].kind
            else:
                kind = "fixed" if deciding[i] else None
            if kind is not None:
                self.plan_counts[kind] = self.plan_counts.get(kind, 0) + 1
        natural = max(len(p.tokens) for p in plans)
        width = max(width, natural)
        carries_masks = any(p.group_columns for p in plans)
        if table is not None and carries_masks:
            width = table.padded_width(width)
        cost = table.cost(width) if table is not None else 1.0
        return plans, specs, choices, width, cost

    def _kind(self, row) -> str:
        """A row with its own seed keeps a fixed feed: the planner fills a row up to the batch's width,
        so its draws would depend on its companions (their distribution would not)."""
        if row.verify:
            return AUTO if (self.layout == "auto" and row.generator is None) else FIXED
        return THRESHOLD if (self.threshold_planner and row.window) else FIXED

    def _room(self, row) -> tuple[int, int]:
        """``(masks at most, drafts + masks at most)``: the window, the tokens left (a mask past them
        predicts a token that can never be kept), and the model's positions left (masks and drafts sit
        past the real tokens; an absolute-position model must never see a position past its table)."""
        remaining = row.settings.max_new_tokens - row.generated
        extra = self.position_limit - len(row.tokens) if self.position_limit else remaining + self.window
        return max(0, min(row.window, remaining - 1, extra)), max(0, extra)

    def _fixed_plan(self, row):
        """The paper's feed: every draft and full groups of W masks, capped by ``_room``."""
        max_masks, extra = self._room(row)
        self._keep_drafts(row, min(len(row.drafts), extra) if row.verify else 0)
        masks = min(max_masks, extra - len(row.drafts))
        layout = self.layout if (row.verify and self.layout != "auto") else "linear"
        return self._row_plan(row, masks, layout)

    def _row_spec(self, row, kind) -> RowSpec:
        max_masks, extra = self._room(row)
        stats = row.stats
        if stats.probing and not row.drafts:
            stats.probing = False  # the probe proposed nothing (a floor, a stop): nothing to check
        return RowSpec(
            kind,
            base=len(row.tokens) - row.committed + (0 if row.prefilled else row.lead),
            draft_probs=self._draft_probs(row) if kind == AUTO else [],
            future=stats.future(),
            gain=max(1.0, stats.gain),
            max_masks=max_masks,
            max_extra=extra,
            force_masks=stats.probe_due(),
            force_drafts=stats.probing and bool(row.drafts),
        )

    @staticmethod
    def _draft_probs(row) -> list[float]:
        """Chance that each draft in hand is kept given the ones before it. Prompt lookup's: its
        observed acceptance per offset. Sampled mask drafts: the masks' observed acceptance, not the
        drafts' own probabilities (feeding a sampled draft because of its value would bias the output)."""
        if row.draft_source != MASKS:
            return row.source_stats(row.draft_source).future()[: len(row.drafts)]
        if row.do_sample:
            return row.stats.future()[: len(row.drafts)]
        return row.stats.calibrated(row.draft_confidence[: len(row.drafts)])

    def _pick_drafts(self, row, batch: int) -> None:
        """Prompt lookup's drafts replace the masks' when their chain is worth more: expected drafts
        kept (from the row's observed acceptance per source) less what checking them costs, at the
        best length (``_draft_value``); a re-probe of the masks keeps theirs. The choice never reads a
        sampled draft's value, so sampling stays exact."""
        if not row.prefilled or (row.stats.probing and row.drafts):
            # the prompt's last n-gram is its end (a chat template's assistant header), whose earlier
            # occurrences continue into another turn: a first lookup there fails and would cost the
            # source its prior
            return
        _, extra = self._room(row)
        room = min(row.settings.max_new_tokens - row.generated - 1, extra)
        if room <= 0:
            return
        found = lookup_drafts(
            row.tokens, row.settings.prompt_lookup_num_tokens, row.settings.max_matching_ngram_size, row.eos
        )[:room]
        if not found:
            return
        table = self._cost_table(batch)
        mine = self._draft_value(row, row.lookup_stats.future()[: len(found)], table)
        if mine > (self._draft_value(row, self._draft_probs(row), table) if row.drafts else 0.0):
            row.drafts, row.draft_confidence, row.proposal, row.draft_source = found, [], None, LOOKUP

    @torch.no_grad()
    def _assistant_drafts(self, rows, batch: int) -> None:
        """MARS_SPEC §5: a draft model proposes ``assistant_tokens`` tokens after each row's tokens (one
        batched stock ``generate`` call, left-padded; greedy rows greedily, sampled rows sampled with
        their distributions kept as the proposals q); a row takes them instead of its masks' drafts
        when they are worth more net of cost (``_draft_value``). The planner then feeds them with mask
        groups after them (quadratic: fresh mask drafts after whatever prefix is kept)."""
        for do_sample in (False, True):
            group = [r for r in rows if r.do_sample == do_sample and not (r.stats.probing and r.drafts)]
            rooms = [min(r.settings.max_new_tokens - r.generated - 1, self._room(r)[1]) for r in group]
            group = [(r, room) for r, room in zip(group, rooms) if room > 0]
            if not group:
                continue
            longest = max(len(r.tokens) for r, _ in group)
            pad = self.pad_token_id
            ids = [[pad] * (longest - len(r.tokens)) + r.tokens for r, _ in group]
            ids = torch.tensor(ids, device=self.device)
            mask = torch.tensor(
                [[0] * (longest - len(r.tokens)) + [1] * len(r.tokens) for r, _ in group], device=self.device
            )
            sampling = {"top_k": 0, "top_p": 1.0, "temperature": 1.0} if do_sample else {}
            out = self.assistant.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=self.assistant_tokens,
                min_new_tokens=0,
                do_sample=do_sample,
                pad_token_id=pad,
                eos_token_id=None,  # every row proposes its tokens; verify stops at an EOS it keeps
                return_dict_in_generate=True,
                output_scores=do_sample,
                **sampling,
            )
            new = out.sequences[:, longest:].tolist()
            table = self._cost_table(batch)
            for b, (row, room) in enumerate(group):
                drafts = new[b][:room]
                for j, token in enumerate(drafts):
                    if token in row.eos:
                        drafts = drafts[: j + 1]
                        break
                value = self._draft_value(row, row.assistant_stats.future()[: len(drafts)], table)
                current = self._draft_value(row, self._draft_probs(row), table) if row.drafts else 0.0
                if drafts and value > current:
                    proposal = None
                    if do_sample:
                        proposal = torch.stack(
                            [torch.softmax(out.scores[j][b].float(), -1) for j in range(len(drafts))]
                        ).to(self.device)
                    row.drafts, row.draft_confidence, row.proposal = drafts, [], proposal
                    row.draft_source = ASSISTANT

    @staticmethod
    def _draft_value(row, probs, table) -> float:
        """``max_k [E[kept among the first k drafts] − λ·(cost(base + k) − cost(base))]`` (k = 0: 0):
        what feeding a chain of drafts alone is worth this step (the planner's objective, no masks)."""
        base = len(row.tokens) - row.committed + (0 if row.prefilled else row.lead)
        gain, start = max(1.0, row.stats.gain), table.effective(base)
        best, chain, reach = 0.0, 0.0, 1.0
        for k, p in enumerate(probs, 1):
            reach *= p
            chain += reach
            best = max(best, chain - gain * (table.effective(base + k) - start))
        return best

    def _chosen_plan(self, row, choice: RowChoice):
        self._keep_drafts(row, choice.drafts)
        return self._row_plan(row, choice.masks, "quadratic" if choice.quadratic else "linear")

    def _row_plan(self, row, masks: int, layout: str):
        return plan_row(
            row.tokens[row.committed :],
            row.drafts if row.verify else [],
            masks,
            self.mask_token_id,
            layout,
            lead=0 if row.prefilled else row.lead,
            pad_token_id=self.pad_token_id,
        )

    @staticmethod
    def _keep_drafts(row, count: int) -> None:
        """Feed only the first ``count`` drafts (the rest are proposals nobody checks: dropping them
        never changes what verify keeps, only how much it can keep)."""
        if count < len(row.drafts):
            row.drafts = row.drafts[:count]
            row.draft_confidence = row.draft_confidence[:count]
            row.proposal = row.proposal[:count] if row.proposal is not None else None

    def _learn(self, rows, specs, choices, outcome, fed_confidence, cost: float, checked, sources) -> None:
        """Update the planner's view of each row it served: acceptance per offset, gain, re-probes
        (prompt lookup's acceptance apart from the masks', whatever the layout)."""
        for i, (row, spec, choice) in enumerate(zip(rows, specs, choices)):
            if i in outcome and sources[i] != MASKS:
                row.source_stats(sources[i]).observe(checked[i], outcome[i][2])
            if spec.kind == FIXED or i not in outcome:
                continue
            tokens, _, kept_drafts, _ = outcome[i]
            stats = row.stats
            if spec.kind == AUTO:
                if sources[i] == MASKS:  # the other sources' acceptance was counted above
                    stats.observe(choice.drafts, kept_drafts, fed_confidence[i])
                if choice.masks and row.draft_confidence and not row.do_sample:
                    # what this step's masks proposed values fresh drafts, checked or not (greedy only:
                    # a sampled draft's own probability must not steer whether it is fed)
                    stats.propose(row.draft_confidence)
            else:  # τ rows: how many mask predictions passed τ
                stats.observe(choice.masks, max(len(tokens) - 1, 0))
            if spec.force_drafts:
                stats.probing = False
            elif spec.force_masks and choice.masks:
                stats.probing = True
            stats.observe_step(len(tokens), cost, fed_masks=choice.masks > 0)

    def measure_costs(self) -> None:
        """Measure the cost curves of every batch bucket up to ``max_rows`` now (a server at start-up),
        instead of at the first step that needs each (about 2 s at most per bucket, once per process)."""
        from .cost_model import batch_bucket

        for rows in sorted({batch_bucket(n) for n in range(1, self.max_rows + 1)}):
            self._cost_table(rows)

    def _cost_table(self, rows: int):
        from .cost_model import batch_bucket

        bucket = batch_bucket(rows)
        table = self.cost_tables.get(bucket)
        if table is None:
            table = cost_table(
                self.model,
                batch_size=rows,
                window=self.window,
                mask_token_id=self.mask_token_id,
                given=self.cost_given,
                probe=self.cost_probe,
            )
            self.cost_tables[bucket] = table
        return table

    # ------------------------------------------------------------------------------- the forward
    def _forward(self, rows, plans, deciding, first, width):
        """Run the model on the packed plans (``width`` columns per row, padding included); return the
        needed logits and where each column went."""
        needed: set[int] = set()
        for plan, decides in zip(plans, deciding):
            if decides:
                needed.update(plan.check_columns)
                for columns in plan.group_columns.values():
                    needed.update(columns)
        offsets = [r.cache_offset for r in rows]
        step = pack(
            plans,
            offsets,
            [r.lead for r in rows],
            min_width=width,
            dtype=self._dtype,
            device=self.device,
            pad_token_id=self.pad_token_id,
            max_position=self.position_limit,
        )
        keep = sorted(needed)
        if keep and step.width > max(len(p.tokens) for p in plans):
            # padded to a cheaper measured width: the LM head then runs on every column from the first
            # needed one, as the cost probe measured it (fewer rows can take a slower kernel path)
            keep = list(range(keep[0], step.width))
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
