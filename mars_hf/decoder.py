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

from .acceptance import (
    ACCEPTANCE_RULES,
    ScoreProcessing,
    choose,
    confidence,
    cut_at_floor,
    passes,
    threshold_count,
    verify_greedy,
    verify_sampled,
)
from .cache import MARSBlockCache, make_scheme
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

    def __init__(self, row_id, prompt, settings, window, processing, batch_index, lead, buffer_lead, floor):
        self.row_id = row_id
        self.tokens = list(prompt)  # real tokens: the prompt, then everything accepted
        self.prompt_length = len(prompt)
        self.settings = settings
        self.verify = settings.acceptance == "verify"
        self.metric = settings.acceptance
        tau = settings.threshold
        one_token = not self.verify and settings.acceptance in ("probability", "margin") and tau >= 1.0
        self.window = 0 if one_token else window
        self.tau = float(tau) if tau is not None else 0.0
        self.floor = floor
        self.eos = frozenset(settings.eos_token_ids)
        self.do_sample = settings.do_sample
        self.generator = None
        if settings.seed is not None and settings.do_sample:
            self.generator = torch.Generator(device=processing_device(processing))
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
        sequences / stopping_criteria: ``generate``'s token buffer and its non-EOS stopping criteria,
            checked token by token inside a step (rows then carry ``batch_index`` into the buffer).
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
        row = _Row(row_id, prompt, settings, self.window, processing, batch_index, fed_lead, lead, floor)
        if settings.max_new_tokens <= 0:
            row.finished = True
        self.joining.append(row)
        return row_id

    @torch.no_grad()
    def drop_row(self, row_id: int) -> None:
        """Forget a row (finished or cancelled); its KV slot is reused."""
        for queue in (self.joining,):
            for i, row in enumerate(queue):
                if row.row_id == row_id:
                    del queue[i]
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
                    one_token = row.metric in ("probability", "margin") and tau >= 1.0
                    row.window = 0 if one_token else self.window
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
        if threshold_rows:
            outcome.update(self._decide_threshold(rows, plans, threshold_rows, logits, where))
        if verify_rows:
            outcome.update(self._decide_verify(rows, plans, verify_rows, logits, where))
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
        if not self.scheme.uses_cache:
            for row in rows:
                row.committed = 0
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

    @staticmethod
    def _gather(logits, where, entries):
        """``[len(entries), vocab]`` float32 logits of (row-in-step, column) pairs."""
        if logits.shape[0] == 1:  # one row: a slice when the columns are consecutive (the usual case)
            first = where[entries[0][1]]
            if all(where[c] == first + k for k, (_, c) in enumerate(entries)):
                return logits[0, first : first + len(entries)].float()
        rows = torch.tensor([i for i, _ in entries], device=logits.device)
        columns = torch.tensor([where[c] for _, c in entries], device=logits.device)
        return logits[rows, columns].float()

    # ----------------------------------------------------------------------- threshold acceptance
    def _decide_threshold(self, rows, plans, members, logits, where):
        """Prediction 0 and the masks' predictions; keep while confident (MARS_SPEC §2)."""
        outcome = {}
        for group in _groups(
            rows, members, lambda r: (id(r.processing), r.do_sample, r.metric, id(r.generator))
        ):
            first = rows[group[0]]
            processing, do_sample, metric = first.processing, first.do_sample, first.metric
            generator = first.generator
            entries, spans = [], []
            for i in group:
                plan = plans[i]
                columns = plan.check_columns[:1] + (plan.group_columns.get(0, []) if rows[i].window else [])
                spans.append((len(entries), len(columns)))
                entries += [(i, c) for c in columns]
            raw = self._gather(logits, where, entries)
            if processing.position_free:
                scores = processing.free(raw)
                tokens = choose(scores, do_sample, generator)
            else:
                scores, tokens = self._choose_in_order(
                    rows, group, spans, raw, processing, do_sample, generator
                )
            # one transfer to the host; the §2 rule then runs on W + 1 numbers per row
            chosen_all, values = torch.stack([tokens.double(), confidence(scores, tokens, metric)]).tolist()
            for i, (start, count) in zip(group, spans):
                row = rows[i]
                chosen = [int(t) for t in chosen_all[start : start + count]]
                passed = [passes(v, row.tau, metric) for v in values[start : start + count]]
                limit = min(count, row.settings.max_new_tokens - row.generated)
                n = threshold_count(passed, limit)
                kept, reason = self._stops(row, chosen[:n])
                self._record(row, scores[start : start + len(kept)], raw[start : start + len(kept)])
                fed = len(row.tokens) - row.committed
                outcome[i] = (kept, fed, 0, reason)
        return outcome

    def _choose_in_order(self, rows, group, spans, raw, processing, do_sample, generator=None):
        """Prefix-dependent processors: prediction ``j`` sees the tokens chosen at ``0 … j-1``."""
        scores = torch.empty_like(raw)
        tokens = torch.zeros(raw.shape[0], dtype=torch.long, device=raw.device)
        for j in range(max(count for _, count in spans)):
            active = [(i, start + j) for i, (start, count) in zip(group, spans) if j < count]
            flat = [k for _, k in active]
            picked = processing.at_prefixes(
                raw[flat],
                [rows[i].batch_index for i, _ in active],
                [rows[i].column + j for i, _ in active],
            )
            chosen = choose(picked, do_sample, generator)
            scores[flat] = picked
            tokens[flat] = chosen
            self._write(processing, [(rows[i], rows[i].column + j) for i, _ in active], chosen.tolist())
        return scores, tokens

    # -------------------------------------------------------------------------- verified acceptance
    def _decide_verify(self, rows, plans, members, logits, where):
        """Check last step's drafts against the model's own choices; propose new drafts (§6)."""
        outcome = {}
        for group in _groups(rows, members, lambda r: (id(r.processing), r.do_sample, id(r.generator))):
            processing, do_sample = rows[group[0]].processing, rows[group[0]].do_sample
            generator = rows[group[0]].generator
            entries, spans = [], []
            for i in group:
                spans.append((len(entries), len(plans[i].check_columns)))
                entries += [(i, c) for c in plans[i].check_columns]
            raw = self._gather(logits, where, entries)
            if processing.position_free:
                scores = processing.free(raw)
            else:  # check j sees the fresh tokens and drafts 0 … j-1
                for i in group:
                    row = rows[i]
                    self._write(
                        processing, [(row, row.column + j) for j in range(len(row.drafts))], row.drafts
                    )
                batch_rows, lengths = [], []
                for i, (_, count) in zip(group, spans):
                    batch_rows += [rows[i].batch_index] * count
                    lengths += [rows[i].column + j for j in range(count)]
                scores = processing.at_prefixes(raw, batch_rows, lengths)
            own = None if do_sample else scores.argmax(-1).tolist()
            target = torch.softmax(scores, -1) if do_sample else None
            followers = []
            for i, (start, count) in zip(group, spans):
                row = rows[i]
                if do_sample:
                    kept, token = verify_sampled(
                        row.drafts, row.proposal, target[start : start + count], generator
                    )
                else:
                    kept = verify_greedy(row.drafts, own[start : start + count])
                    token = own[start + kept]
                new = row.drafts[:kept] + [token]
                new = new[: row.settings.max_new_tokens - row.generated]
                final, reason = self._stops(row, new)
                self._record(row, scores[start : start + len(final)], raw[start : start + len(final)])
                fed = len(row.tokens) - row.committed  # fresh tokens, all verified
                outcome[i] = (final, fed + min(kept, len(final)), min(kept, len(final)), reason)
                has_group = kept in plans[i].group_columns
                if reason is None and len(final) == len(new) and has_group:
                    followers.append((i, kept))
                else:
                    row.drafts, row.proposal = [], None
            if followers:
                self._propose(
                    rows, plans, followers, logits, where, processing, do_sample, generator, outcome
                )
        return outcome

    def _propose(self, rows, plans, followers, logits, where, processing, do_sample, generator, outcome):
        """New drafts from the mask group that follows the kept prefix."""
        entries = []
        for i, kept in followers:
            entries += [(i, c) for c in plans[i].group_columns[kept]]
        scores = processing.for_drafts(self._gather(logits, where, entries))
        if do_sample:
            proposal = torch.softmax(scores, -1)
            tokens = torch.multinomial(proposal, 1, generator=generator).squeeze(1)
            confidence = proposal.gather(-1, tokens[:, None]).squeeze(1)
        else:
            proposal = None
            confidence, tokens = torch.softmax(scores, -1).max(-1)
        tokens, confidence = tokens.tolist(), confidence.tolist()
        for n, (i, _) in enumerate(followers):
            row = rows[i]
            start, width = n * self.window, self.window
            accepted_now = len(outcome[i][0])
            room = row.settings.max_new_tokens - row.generated - accepted_now - 1
            drafts = cut_at_floor(tokens[start : start + width], confidence[start : start + width], row.floor)
            row.drafts = drafts[: max(room, 0)]
            row.proposal = proposal[start : start + len(row.drafts)] if proposal is not None else None

    # ------------------------------------------------------------------------------ stops, records
    def _stops(self, row, tokens):
        """Cut ``tokens`` right after an EOS or where a stopping criterion fires; say why."""
        for j, token in enumerate(tokens):
            if token in row.eos:
                return tokens[: j + 1], "stop"
        if self.stopping_criteria and tokens:
            self._write(row.processing, [(row, row.column + j) for j in range(len(tokens))], tokens)
            buffer = row.processing.sequences
            for j in range(len(tokens)):
                done = self.stopping_criteria(buffer[:, : row.column + j + 1], None)
                if bool(done[row.batch_index]):
                    return tokens[: j + 1], "stop"
        return tokens, None

    @staticmethod
    def _write(processing, places, tokens):
        """Write provisional tokens into the stock-layout buffer (for prefix-dependent processors)."""
        if processing.sequences is None or not places:
            return
        rows = torch.tensor([row.batch_index for row, _ in places], device=processing.sequences.device)
        columns = torch.tensor([c for _, c in places], device=processing.sequences.device)
        values = torch.tensor(tokens, dtype=torch.long, device=processing.sequences.device)
        processing.sequences[rows, columns] = values

    def _record(self, row, scores, logits):
        if self.score_records is not None and scores.shape[0]:
            self.score_records.append((row.row_id, row.generated, scores, logits))


def _groups(rows, members, key):
    """Row indices grouped by ``key(row)`` (rows sharing processors and sampling decide together)."""
    groups: dict = {}
    for i in members:
        groups.setdefault(key(rows[i]), []).append(i)
    return list(groups.values())


def processing_device(processing: ScoreProcessing) -> str:
    """Where a row's random draws happen: its token buffer's device, else the CPU (the host draws)."""
    return processing.sequences.device if processing.sequences is not None else "cpu"


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
