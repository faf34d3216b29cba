"""How MARS predictions become tokens, and which of them a row keeps (docs/method.md §2 steps 3-4, §6).

Two acceptance families:

- **threshold** (``probability`` / ``entropy`` / ``margin``): prediction 0 (the ordinary next-token
  prediction) is always kept; mask predictions are kept left to right while their confidence passes τ.
  Lossy below τ = 1.
- **verify**: mask predictions are *drafts*; the next step feeds them as real tokens, and a draft is
  kept only if it is what the model itself chooses there given the kept prefix: the same argmax, or
  for sampled rows the same keyed draw (``sampling.py``: the draw at each position is fixed by the
  row's seed, so checking a sampled draft is an exact match too). Lossless: the output is the model's
  own greedy output, or its own sample for the seed.

``processing.ScoreProcessing`` applies the logits processors to predictions whose provisional prefixes differ;
``decide`` applies the rules to the rows of one step (``StepLogits``: the forward's logits, the stops and
the score records they share) and returns each row's ``Decision``. Nothing here changes a row: the decoder
applies the decisions.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .processing import ScoreProcessing  # noqa: F401  (re-exported: the decoder's callers build it)
from .rules import (  # noqa: F401  (the rules' primitives, re-exported where the decoder's callers look)
    ACCEPTANCE_RULES,
    POSITION_FREE_PROCESSORS,
    choose,
    confidence,
    confidences,
    one_token_per_step,
    passes,
    threshold_count,
    verify_drafts,
)

# ------------------------------------------------------------------------------------------------
# Applying the rules to the rows of one step
# ------------------------------------------------------------------------------------------------
#
# A row is the decoder's row state, read only: it exposes ``tokens``, ``committed``, its settings,
# ``processing`` and ``noise`` (its keyed noise when it samples, ``sampling.RowNoise``; a prediction for
# the token at position ``len(tokens) + k`` uses the noise of that position); plans come from
# ``layouts``. Rows that share processors, sampling and metric decide together (one gather, one
# softmax, one host transfer). Each rule returns ``{row index: Decision}``; the drafts a row fed come
# from the step's plan (``fed[i]``, a ``drafts.Drafts``).


class StepLogits:
    """One forward's logits and what every rule does with them: read a row's predictions, cut kept
    tokens at a stop, write provisional tokens for prefix-dependent processors, record scores."""

    def __init__(self, logits, where, *, stopping_criteria=None, score_records=None, calibration=None):
        self.logits = logits
        self.where = where  # chunk column -> index in ``logits``' second dimension
        self.calibration = (
            calibration  # calibration.ConfidenceCalibration: mask k's probability -> P(own token)
        )
        self.stopping_criteria = stopping_criteria
        self.score_records = score_records

    def gather(self, entries):
        """``[len(entries), vocab]`` float32 logits of (row-in-step, column) pairs."""
        logits, where = self.logits, self.where
        if logits.shape[0] == 1:  # one row: a slice when the columns are consecutive (the usual case)
            first = where[entries[0][1]]
            if all(where[c] == first + k for k, (_, c) in enumerate(entries)):
                return logits[0, first : first + len(entries)].float()
        rows = torch.tensor([i for i, _ in entries], device=logits.device)
        columns = torch.tensor([where[c] for _, c in entries], device=logits.device)
        return logits[rows, columns].float()

    def gather_spans(self, group, columns_of):
        """The logits of ``columns_of(i)`` for each row ``i`` of ``group``, one after another, and each
        row's ``(start, count)`` among them."""
        entries, spans = [], []
        for i in group:
            columns = columns_of(i)
            spans.append((len(entries), len(columns)))
            entries += [(i, c) for c in columns]
        return self.gather(entries), spans

    def stops(self, row, tokens):
        """Cut ``tokens`` right after the first token where an EOS or a stopping criterion ends the row, as stock
        decoding checks both after every token; say why. (The criteria run up to the first EOS only: a criterion
        that fires before it ends the row there.)"""
        end = next((j + 1 for j, token in enumerate(tokens) if token in row.eos), None)
        checked = tokens if end is None else tokens[:end]
        if self.stopping_criteria and checked:
            self.write(row.processing, [(row, row.column + j) for j in range(len(checked))], checked)
            buffer = row.processing.sequences
            for j in range(len(checked)):
                done = self.stopping_criteria(buffer[:, : row.column + j + 1], None)
                if bool(done[row.batch_index]):
                    return tokens[: j + 1], "stop"
        if end is not None:
            return tokens[:end], "stop"
        return tokens, None

    @staticmethod
    def write(processing, places, tokens):
        """Write provisional tokens at ``(row, column)`` places of the rows' stock-layout buffer."""
        processing.write([(row.batch_index, column) for row, column in places], tokens)

    def record(self, row, scores, logits):
        if self.score_records is not None and scores.shape[0]:
            self.score_records.append((row.row_id, row.generated, scores, logits))


class Decision(NamedTuple):
    """What one row keeps from a step.

    ``tokens``: tokens now final; ``verified_fed``: fed tokens whose keys and values are now verified (what a
    cache scheme may commit); ``drafts_kept``: fed drafts kept; ``reason``: ``"stop"`` or None;
    ``proposes_after``: verify rows whose kept prefix had a mask group after it, that prefix's length (the
    group proposes the row's next drafts, ``drafts.MaskDrafts``), else None.
    """

    tokens: list[int]
    verified_fed: int
    drafts_kept: int
    reason: str | None
    proposes_after: int | None = None


def decide(step: StepLogits, rows, plans, fed, deciding) -> dict[int, Decision]:
    """Each deciding row's ``Decision`` (``fed[i]``: the ``drafts.Drafts`` row ``i`` fed this step). Verify rows
    check their drafts (§6); τ rows that fed a draft model's drafts check them, then accept the masks after
    the kept prefix at τ (§5); other τ rows accept their masks at τ (§2). Nothing here changes a row."""
    threshold_rows = [i for i, r in enumerate(rows) if deciding[i] and not r.verify and not fed[i]]
    drafted_rows = [i for i, r in enumerate(rows) if deciding[i] and not r.verify and fed[i]]
    verify_rows = [i for i, r in enumerate(rows) if deciding[i] and r.verify]
    decisions = {}
    if threshold_rows:
        decisions.update(decide_threshold(step, rows, plans, fed, threshold_rows))
    if drafted_rows:
        decisions.update(decide_drafts_then_threshold(step, rows, plans, fed, drafted_rows))
    if verify_rows:
        decisions.update(decide_verify(step, rows, plans, fed, verify_rows))
    return decisions


def decide_threshold(
    step: StepLogits, rows, plans, fed, members, anchors: dict | None = None
) -> dict[int, Decision]:
    """Prediction 0 and the masks' predictions; keep while confident (docs/method.md §2).

    ``anchors``: rows that fed a draft model's drafts (§5 with τ) map to ``(kept, token, scores, logits)``:
    their prediction 0 is the check after the first ``kept`` drafts and is ``token`` (what verification chose
    there), their masks are the group after that prefix; the kept drafts' checks (``scores``, ``logits``)
    are recorded before the row's own predictions.
    """
    anchors = anchors or {}
    decisions = {}
    for group in _groups(rows, members, lambda r: (id(r.processing), r.do_sample, r.metric)):
        kept_of = {i: anchors[i][0] if i in anchors else 0 for i in group}
        raw, scores, spans, chosen_all, values = _threshold_predictions(
            step, rows, plans, group, kept_of, anchors
        )
        metric = rows[group[0]].metric
        for i, (start, count) in zip(group, spans):
            row, kept = rows[i], kept_of[i]
            chosen = chosen_all[start : start + count]
            passed = [passes(v, row.tau, metric) for v in values[start : start + count]]
            n = threshold_count(passed, min(count, row.settings.max_new_tokens - row.generated - kept))
            final, reason = step.stops(row, list(fed[i].tokens[:kept]) + chosen[:n])
            own_scores, own_raw = scores[start : start + count], raw[start : start + count]
            if kept:  # the kept drafts' checks come first
                own_scores = torch.cat([anchors[i][2][:kept], own_scores])
                own_raw = torch.cat([anchors[i][3][:kept], own_raw])
            step.record(row, own_scores[: len(final)], own_raw[: len(final)])
            kept = min(kept, len(final))
            decisions[i] = Decision(final, len(row.tokens) - row.committed + kept, kept, reason)
    return decisions


def _threshold_predictions(step, rows, plans, group, kept_of, anchors):
    """Each row's prediction 0 and its masks' predictions, chosen (an anchored row's prediction 0 is forced to
    verification's token), with their confidences (calibrated where the model has a calibration):
    ``(logits, scores, spans, tokens, confidences)``, the last two as host lists."""
    first = rows[group[0]]

    def columns(i):
        plan, kept = plans[i], kept_of[i]
        return plan.check_columns[kept : kept + 1] + (
            plan.group_columns.get(kept, []) if rows[i].window else []
        )

    raw, spans = step.gather_spans(group, columns)
    forced = {start: anchors[i][1] for i, (start, _) in zip(group, spans) if i in anchors}
    draws = None if first.noise is None else [_draw(rows[i], kept_of[i]) for i in group]
    scores, tokens = first.processing.chosen(
        raw,
        spans,
        [rows[i].batch_index for i in group],
        [rows[i].column + kept_of[i] for i in group],
        draws,
        forced,
    )
    chosen_all, values = confidences(scores, tokens, first.metric, spans, step.calibration)
    return raw, scores, spans, chosen_all, values


def decide_verify(step: StepLogits, rows, plans, fed, members) -> dict[int, Decision]:
    """Check the fed drafts against the model's own choices (docs/method.md §6): keep the longest agreeing
    prefix and the model's token after it. A row that kept a prefix with a mask group after it (and did not
    stop) says so in ``proposes_after``: that group holds its next drafts."""
    decisions = {}
    for group in _groups(rows, members, lambda r: (id(r.processing), r.do_sample)):
        for i, (kept, token, scores, raw) in check_drafts(step, rows, plans, fed, group).items():
            row = rows[i]
            new = (list(fed[i].tokens[:kept]) + [token])[: row.settings.max_new_tokens - row.generated]
            final, reason = step.stops(row, new)
            step.record(row, scores[: len(final)], raw[: len(final)])
            fresh = len(row.tokens) - row.committed  # fresh tokens, all verified
            follows = reason is None and len(final) == len(new) and kept in plans[i].group_columns
            kept = min(kept, len(final))
            decisions[i] = Decision(final, fresh + kept, kept, reason, kept if follows else None)
    return decisions


def check_drafts(step: StepLogits, rows, plans, fed, group) -> dict:
    """``{row: (drafts kept, the model's token after them, checks' scores, checks' logits)}`` for rows that
    share processors and sampling: the longest prefix of drafts equal to the model's own choices (check ``j``
    decides the token at ``len(tokens) + j``: its argmax, or its keyed draw)."""
    first = rows[group[0]]
    raw, spans = step.gather_spans(group, lambda i: plans[i].check_columns)
    batch_rows, columns = [rows[i].batch_index for i in group], [rows[i].column for i in group]
    draws = None if first.noise is None else [_draw(rows[i], 0) for i in group]
    scores, own = first.processing.checked(
        raw, spans, batch_rows, columns, [fed[i].tokens for i in group], draws
    )
    own = own.tolist()
    checked = {}
    for i, (start, count) in zip(group, spans):
        kept = verify_drafts(fed[i].tokens, own[start : start + count])
        checked[i] = (kept, own[start + kept], scores[start : start + count], raw[start : start + count])
    return checked


def decide_drafts_then_threshold(step: StepLogits, rows, plans, fed, members) -> dict[int, Decision]:
    """docs/method.md §5 with τ: a threshold row that fed a draft model's drafts keeps the drafts the model
    itself would choose there and the model's token after them (``check_drafts``: an exact match of its argmax
    or keyed draw), then the predictions of the mask group that follows exactly that prefix while they pass τ
    (``decide_threshold``): one forward checks the drafts and extends whatever prefix survives."""
    anchors = {}
    for group in _groups(rows, members, lambda r: (id(r.processing), r.do_sample)):
        anchors.update(check_drafts(step, rows, plans, fed, group))
    return decide_threshold(step, rows, plans, fed, members, anchors)


def _draw(row, first: int) -> tuple:
    """``(RowNoise, position)`` of a row's prediction of the token at ``len(tokens) + first`` (the next ones
    follow it; a greedy row's noise is None and never read)."""
    return row.noise, len(row.tokens) + first


def _groups(rows, members, key):
    """Row indices grouped by ``key(row)`` (rows sharing processors and sampling decide together)."""
    groups: dict = {}
    for i in members:
        groups.setdefault(key(rows[i]), []).append(i)
    return list(groups.values())
