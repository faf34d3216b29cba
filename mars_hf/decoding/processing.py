"""The call's logits processors on a step's predictions, each as if after its own provisional prefix (as stock
``generate`` processes one token after its prefix). A checkpoint's ``custom_generate/`` ships this file verbatim."""

from __future__ import annotations

import torch
from transformers.generation.logits_process import LogitsProcessorList

from .rules import POSITION_FREE_PROCESSORS


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

    def write(self, places, tokens) -> None:
        """Write provisional tokens at ``(batch row, column)`` places of the token buffer (nothing without one)."""
        if self.sequences is None or not places:
            return
        rows, columns = torch.tensor(places, device=self.sequences.device).T
        self.sequences[rows, columns] = torch.tensor(tokens, dtype=torch.long, device=self.sequences.device)


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
