"""The call's logits processors on a step's predictions, each as if after its own provisional prefix (as stock
``generate`` processes one token after its prefix). A checkpoint's ``custom_generate/`` ships this file verbatim."""

from __future__ import annotations

import torch
from transformers.generation.logits_process import LogitsProcessorList

from .rules import POSITION_FREE_PROCESSORS, choose


class ScoreProcessing:
    """The logits processors of a group of rows, applied to predictions at provisional prefixes.

    ``sequences`` is the group's ``[batch, length]`` token buffer (what stock ``generate`` calls
    ``input_ids``); a caller that needs prefix-dependent processing first writes each prediction's
    provisional prefix into it. Rows whose prefixes have the same length share one call on the whole
    buffer (processors may keep per-row state, indexed by row), and only their rows are read back.
    """

    def __init__(self, processors: LogitsProcessorList | None, sequences: torch.Tensor | None = None):
        self.processors = LogitsProcessorList(processors or [])
        self.position_free = all(isinstance(p, POSITION_FREE_PROCESSORS) for p in self.processors)
        self.free_part = LogitsProcessorList(
            [p for p in self.processors if isinstance(p, POSITION_FREE_PROCESSORS)]
        )
        self.runs = _runs(self.processors)
        self.sequences = sequences
        if not self.position_free and sequences is None:
            raise ValueError("prefix-dependent logits processors need the rows' token buffer")

    @staticmethod
    def _apply_free(processors: LogitsProcessorList, scores: torch.Tensor) -> torch.Tensor:
        if not processors:
            return scores
        placeholder = torch.zeros((scores.shape[0], 1), dtype=torch.long, device=scores.device)
        return _call_each(processors, placeholder, scores)

    def free(self, scores: torch.Tensor) -> torch.Tensor:
        """All processors at once; only valid when every processor is position-free."""
        return self._apply_free(self.processors, scores)

    def for_drafts(self, scores: torch.Tensor) -> torch.Tensor:
        """The position-free processors only: drafts are proposals, checked by an exact match, so any
        draft leaves the output exact."""
        return self._apply_free(self.free_part, scores)

    def at_prefixes(self, scores: torch.Tensor, rows: list[int], lengths: list[int]) -> torch.Tensor:
        """Process ``scores[i]`` as the prediction after ``sequences[rows[i], :lengths[i]]``.

        The processors run in their order, but each run of consecutive position-free ones in one call on
        every prediction (they treat each row alone), and only the prefix-dependent ones once per prefix
        length on the whole token buffer: a step that checks drafts of several lengths (a batch, verify)
        would otherwise run every processor, a whole-vocabulary pass, once per length."""
        for position_free, processors in self.runs:
            if position_free:
                scores = self._apply_free(processors, scores)
            else:
                scores = self._by_prefix(processors, scores, rows, lengths)
        return scores

    def _by_prefix(
        self, processors, scores: torch.Tensor, rows: list[int], lengths: list[int]
    ) -> torch.Tensor:
        """``processors`` applied to each prefix length's predictions, on the token buffer cut to that length
        (rows outside the group hold zeros and are not read back: a processor may keep state per row)."""
        groups: dict[int, list[int]] = {}
        for i, length in enumerate(lengths):
            groups.setdefault(length, []).append(i)
        out = torch.empty_like(scores)
        for length, members in groups.items():
            full = scores.new_zeros((self.sequences.shape[0], scores.shape[-1]))
            index = torch.tensor([rows[i] for i in members], device=scores.device)
            picked = torch.tensor(members, device=scores.device)
            full[index] = scores[picked]
            out[picked] = _call_each(processors, self.sequences[:, :length], full)[index]
        return out

    def chosen(self, raw: torch.Tensor, spans, rows: list[int], columns: list[int], draws=None, forced=None):
        """``(scores, tokens)`` of a step's predictions, processed and chosen as stock decoding would, one after
        the other: ``spans[i] = (start, count)`` are row ``i``'s entries of ``raw``, and its prediction ``j`` is
        the token at column ``columns[i] + j`` of batch row ``rows[i]``, seeing the tokens chosen at ``0 … j-1``
        (written into the buffer). ``draws[i] = (RowNoise, position of prediction 0)`` for sampled rows (None:
        greedy); ``forced``: ``{entry: token}`` chosen elsewhere (a draft model's kept prefix, §5 with τ)."""
        forced = forced or {}
        if self.position_free:
            scores = self.free(raw)
            tokens = choose(scores, _places(draws, _every(spans)))
            for entry, token in forced.items():
                tokens[entry] = token
            return scores, tokens
        scores = torch.empty_like(raw)
        tokens = torch.zeros(raw.shape[0], dtype=torch.long, device=raw.device)
        for j in range(max((count for _, count in spans), default=0)):
            active = [(i, start + j) for i, (start, count) in enumerate(spans) if j < count]
            entries = [k for _, k in active]
            where = [(rows[i], columns[i] + j) for i, _ in active]
            picked = self.at_prefixes(raw[entries], [r for r, _ in where], [c for _, c in where])
            chosen = choose(picked, _places(draws, [(i, j) for i, _ in active]))
            for position, entry in enumerate(entries):
                if entry in forced:
                    chosen[position] = forced[entry]
            scores[entries], tokens[entries] = picked, chosen
            self.write(where, chosen.tolist())
        return scores, tokens

    def checked(self, raw: torch.Tensor, spans, rows: list[int], columns: list[int], fed, draws=None):
        """``(scores, the model's own tokens)`` of verification's checks (MARS_SPEC §6): row ``i``'s check ``j``
        (entry ``spans[i][0] + j`` of ``raw``) predicts the token at column ``columns[i] + j`` of batch row
        ``rows[i]`` after the fed drafts ``fed[i][:j]`` (written into the buffer here); its own token is the
        argmax, or the keyed draw of ``draws`` (as in ``chosen``)."""
        if self.position_free:
            scores = self.free(raw)
        else:
            for i, tokens in enumerate(fed):
                self.write([(rows[i], columns[i] + j) for j in range(len(tokens))], list(tokens))
            every = _every(spans)
            scores = self.at_prefixes(raw, [rows[i] for i, _ in every], [columns[i] + j for i, j in every])
        return scores, choose(scores, _places(draws, _every(spans)))

    def proposed(self, raw: torch.Tensor, spans, draws=None, calibration=None):
        """Host lists ``(tokens, confidences)`` of drafts proposed by mask predictions (``spans[i]``: row ``i``'s
        mask group, one after the other in ``raw``; ``draws`` as in ``chosen``): the argmax or keyed draw after
        the position-free processors (``for_drafts``), with its probability, calibrated where the model has a
        calibration (draft j of a group is mask j + 1)."""
        scores = self.for_drafts(raw)
        if draws is not None:
            tokens = choose(scores, _places(draws, _every(spans)))
            probs = torch.softmax(scores, -1).gather(-1, tokens[:, None]).squeeze(1)
        else:
            probs, tokens = torch.softmax(scores, -1).max(-1)
        tokens, probs = tokens.tolist(), probs.tolist()
        if calibration is not None:
            for start, width in spans:
                calibration.apply_span(probs, start, width, first_offset=1)
        return tokens, probs

    def write(self, places, tokens) -> None:
        """Write provisional tokens at ``(batch row, column)`` places of the token buffer (nothing without one)."""
        if self.sequences is None or not places:
            return
        rows, columns = torch.tensor(places, device=self.sequences.device).T
        self.sequences[rows, columns] = torch.tensor(tokens, dtype=torch.long, device=self.sequences.device)


def _every(spans) -> list[tuple[int, int]]:
    """``(row, prediction)`` of every entry, in order (the spans lie one after the other)."""
    return [(i, j) for i, (_, count) in enumerate(spans) for j in range(count)]


def _places(draws, pairs):
    """The keyed draws' ``(RowNoise, position)`` of ``(row, prediction)`` pairs; None for greedy rows."""
    return None if draws is None else [(draws[i][0], draws[i][1] + j) for i, j in pairs]


def _call_each(processors, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """``processors`` applied in order, each called directly: ``LogitsProcessorList.__call__`` reads every
    processor's signature on each call, and verify calls them several times a step (8 % of the synthetic
    model's decoding time)."""
    for processor in processors:
        scores = processor(input_ids, scores)
    return scores


def _runs(processors: LogitsProcessorList) -> list[tuple[bool, LogitsProcessorList]]:
    """The processors cut into maximal runs of consecutive position-free ones and of the others, in order."""
    runs: list[tuple[bool, LogitsProcessorList]] = []
    for processor in processors:
        position_free = isinstance(processor, POSITION_FREE_PROCESSORS)
        if runs and runs[-1][0] == position_free:
            runs[-1][1].append(processor)
        else:
            runs.append((position_free, LogitsProcessorList([processor])))
    return runs
