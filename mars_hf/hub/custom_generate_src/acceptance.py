"""Which predictions a row keeps (MARS_SPEC §2 steps 3-4, §6, §8): τ acceptance, verification, draft proposal.

Every rule works on one step's predictions of several rows at once: ``raw`` is the float32 logits of every
prediction, one row's after the other, and ``spans[i] = (start, count)`` says which are row ``i``'s. A
row (``decoder.Row``) exposes ``b`` (its batch index), ``length`` (its tokens so far, prompt included,
padding not: the position of its next token), ``column`` (where that token goes in the token buffer),
``generated``, ``drafts``, ``tau`` / ``floor`` and ``noise`` (its keyed sampling noise, None when greedy).
"""

from __future__ import annotations

import torch

from .processing import ScoreProcessing
from .rules import choose, confidence, passes, threshold_count, verify_drafts


def places(row, first: int, count: int):
    """``(noise, position)`` of a row's predictions of the tokens at ``length + first + k``; None when greedy."""
    return None if row.noise is None else [(row.noise, row.length + first + k) for k in range(count)]


def _joined(rows, spans, first_of):
    """Every row's places one after the other (None for greedy rows, which share the call's sampling)."""
    if rows[0].noise is None:
        return None
    return [p for row, (_, count) in zip(rows, spans) for p in places(row, first_of(row), count)]


def threshold_rule(rows, raw, spans, processing: ScoreProcessing, metric: str, calibration, max_new: int):
    """τ: prediction 0 always, then mask predictions left to right while they pass τ (MARS_SPEC §2).

    Returns ``(scores, [(tokens kept, in order) per row])``; the caller cuts at EOS / stop criteria.
    """
    if processing.position_free:
        scores = processing.free(raw)
        tokens = choose(scores, _joined(rows, spans, lambda row: 0))
    else:  # prediction j sees the tokens chosen at 0 … j-1
        scores, tokens = torch.empty_like(raw), torch.zeros(raw.shape[0], dtype=torch.long, device=raw.device)
        for j in range(max(count for _, count in spans)):
            active = [(row, start + j) for row, (start, count) in zip(rows, spans) if j < count]
            flat = [k for _, k in active]
            picked = processing.at_prefixes(
                raw[flat], [row.b for row, _ in active], [row.column + j for row, _ in active]
            )
            noise = None if rows[0].noise is None else [places(row, j, 1)[0] for row, _ in active]
            chosen = choose(picked, noise)
            scores[flat], tokens[flat] = picked, chosen
            processing.write([(row.b, row.column + j) for row, _ in active], chosen.tolist())
    chosen_all, values = torch.stack([tokens.double(), confidence(scores, tokens, metric)]).tolist()
    if calibration is not None and metric == "probability":
        for start, count in spans:  # entry 0 is prediction 0 (always kept), entry k is mask k
            calibration.apply_span(values, start + 1, count - 1, first_offset=1)
    kept = []
    for row, (start, count) in zip(rows, spans):
        limit = min(count, max_new - len(row.generated))
        n = threshold_count([passes(v, row.tau, metric) for v in values[start : start + count]], limit)
        kept.append([int(t) for t in chosen_all[start : start + n]])
    return scores, kept


def verify_rule(rows, raw, spans, processing: ScoreProcessing):
    """Check each row's drafts against the model's own choices (MARS_SPEC §6): its argmax, or its keyed draw
    (an exact match either way). Check ``j`` decides the token at ``length + j``.

    Returns ``(scores, [(drafts kept, the model's token after them) per row])``.
    """
    if processing.position_free:
        scores = processing.free(raw)
    else:
        for row in rows:
            processing.write([(row.b, row.column + j) for j in range(len(row.drafts))], row.drafts)
        batch_rows = [row.b for row, (_, count) in zip(rows, spans) for _ in range(count)]
        lengths = [row.column + j for row, (_, count) in zip(rows, spans) for j in range(count)]
        scores = processing.at_prefixes(raw, batch_rows, lengths)
    own = choose(scores, _joined(rows, spans, lambda row: 0)).tolist()
    outcome = []
    for row, (start, _) in zip(rows, spans):
        kept = verify_drafts(row.drafts, own[start : start + len(row.drafts)])
        outcome.append((kept, own[start + kept]))
    return scores, outcome


def propose_drafts(followers, raw, spans, processing: ScoreProcessing, calibration, max_new: int) -> None:
    """New drafts from the masks after each follower's kept prefix (``followers``: ``(row, drafts kept, tokens
    kept this step)``); a sampled row's draft at ``t`` is its mask's keyed draw at ``t``. Drafts stop at the first
    whose (calibrated) probability is below the row's proposal floor."""
    rows = [row for row, _, _ in followers]
    scores = processing.for_drafts(raw)
    if rows[0].noise is not None:
        kept_of = {id(row): kept for row, kept, _ in followers}
        tokens = choose(scores, _joined(rows, spans, lambda row: kept_of[id(row)] + 1))
        probs = torch.softmax(scores, -1).gather(-1, tokens[:, None]).squeeze(1)
    else:
        probs, tokens = torch.softmax(scores, -1).max(-1)
    tokens, probs = tokens.tolist(), probs.tolist()
    for (row, _, taken), (start, width) in zip(followers, spans):
        if calibration is not None:
            calibration.apply_span(probs, start, width, first_offset=1)
        n = 0
        while n < width and probs[start + n] >= row.floor:
            n += 1
        room = max_new - len(row.generated) - taken - 1
        row.drafts = tokens[start : start + min(n, max(room, 0))]
