"""How MARS predictions become tokens, and which of them a row keeps (MARS_SPEC §2 steps 3-4, §6).

Two acceptance families:

- **threshold** (``probability`` / ``entropy`` / ``margin``): prediction 0 (the ordinary next-token
  prediction) is always kept; mask predictions are kept left to right while their confidence passes τ.
  Lossy below τ = 1.
- **verify**: mask predictions are *drafts*; the next step feeds them as real tokens, and a draft is
  kept only if it is what the model itself chooses there given the kept prefix (greedy: the same
  argmax; sampling: the speculative-sampling rule with the mask's own distribution as the proposal).
  Lossless: the output is the model's own greedy output, or distributed as its own samples.

``ScoreProcessing`` applies the logits processors to predictions whose provisional prefixes differ.
This file depends on torch and transformers only (it ships in a checkpoint's ``custom_generate/``).
"""

from __future__ import annotations

import torch
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    LogitsProcessorList,
    MinPLogitsWarper,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

THRESHOLD_METRICS = ("probability", "entropy", "margin")
ACCEPTANCE_RULES = THRESHOLD_METRICS + ("verify",)
# Processors that act on each row of scores alone and never read ``input_ids``: they can be applied
# to every prediction of a step in one call. Anything else is applied prefix by prefix.
POSITION_FREE_PROCESSORS = (
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    MinPLogitsWarper,
    TypicalLogitsWarper,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
)


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
        self.sequences = sequences
        if not self.position_free and sequences is None:
            raise ValueError("prefix-dependent logits processors need the rows' token buffer")

    @staticmethod
    def _apply_free(processors: LogitsProcessorList, scores: torch.Tensor) -> torch.Tensor:
        if not processors:
            return scores
        placeholder = torch.zeros((scores.shape[0], 1), dtype=torch.long, device=scores.device)
        for processor in processors:  # not LogitsProcessorList.__call__: it inspects signatures per call
            scores = processor(placeholder, scores)
        return scores

    def free(self, scores: torch.Tensor) -> torch.Tensor:
        """All processors at once; only valid when every processor is position-free."""
        return self._apply_free(self.processors, scores)

    def for_drafts(self, scores: torch.Tensor) -> torch.Tensor:
        """The position-free processors only: drafts are proposals, so any distribution is exact
        as long as it is the one they were drawn from."""
        return self._apply_free(self.free_part, scores)

    def at_prefixes(self, scores: torch.Tensor, rows: list[int], lengths: list[int]) -> torch.Tensor:
        """Process ``scores[i]`` as the prediction after ``sequences[rows[i], :lengths[i]]``."""
        if self.position_free:
            return self.free(scores)
        out = torch.empty_like(scores)
        groups: dict[int, list[int]] = {}
        for i, length in enumerate(lengths):
            groups.setdefault(length, []).append(i)
        for length, members in groups.items():
            full = scores.new_zeros((self.sequences.shape[0], scores.shape[-1]))
            index = torch.tensor([rows[i] for i in members], device=scores.device)
            picked = torch.tensor(members, device=scores.device)
            full[index] = scores[picked]
            out[picked] = self.processors(self.sequences[:, :length], full)[index]
        return out


def choose(scores: torch.Tensor, do_sample: bool, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of ``scores``: sampled from the softmax, or the argmax."""
    if do_sample:
        return torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1, generator=generator).squeeze(1)
    return scores.argmax(dim=-1)


def confidence(scores: torch.Tensor, tokens: torch.Tensor, metric: str) -> torch.Tensor:
    """Each prediction's confidence under ``metric``, as float64 (compared with τ by ``passes``)."""
    probs = torch.softmax(scores, dim=-1)
    if metric == "probability":
        return probs.gather(-1, tokens[:, None]).squeeze(-1).double()
    if metric == "entropy":
        return torch.special.entr(probs).sum(-1).double()
    top2 = probs.topk(2, dim=-1).values
    return (top2[:, 0] - top2[:, 1]).double()


def passes(value: float, tau: float, metric: str) -> bool:
    """p(chosen) >= τ, p1 - p2 >= τ, or H <= τ."""
    return value <= tau if metric == "entropy" else value >= tau


def threshold_count(passed: list[bool], limit: int) -> int:
    """Prediction 0 always; then predictions while they pass; at most ``limit``."""
    count = min(1, limit)
    while count < limit and passed[count]:
        count += 1
    return count


def verify_greedy(drafts: list[int], model_tokens: list[int]) -> int:
    """Drafts kept: the longest prefix equal to the model's own choices."""
    kept = 0
    while kept < len(drafts) and drafts[kept] == model_tokens[kept]:
        kept += 1
    return kept


def verify_sampled(
    drafts: list[int], proposal: torch.Tensor, target: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[int, int]:
    """Speculative sampling (MARS_SPEC §6): ``(drafts kept, the token that follows them)``.

    ``proposal[j]`` is the distribution draft ``j`` was drawn from, ``target[j]`` the model's processed
    distribution at that position (``len(drafts) + 1`` rows: the last one follows every draft). Draft
    ``d`` is kept with probability ``min(1, p(d) / q(d))``; at the first rejection the next token is
    drawn from ``normalise(max(0, p - q))``, so each output token is distributed exactly as ``p``.
    """
    for j, draft in enumerate(drafts):
        p, q = target[j, draft], proposal[j, draft]
        if float(torch.rand((), device=target.device, generator=generator)) * float(q) < float(p):
            continue
        residual = (target[j] - proposal[j]).clamp_(min=0)
        if float(residual.sum()) <= 0:  # p == q: the rejection has probability 0; guard rounding
            residual = target[j].clone()
        return j, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    return len(drafts), int(torch.multinomial(target[len(drafts)], 1, generator=generator))


def cut_at_floor(tokens: list[int], confidences: list[float], floor: float) -> list[int]:
    """Drafts proposed: the leading ones whose confidence reaches ``floor``."""
    kept = 0
    while kept < len(tokens) and confidences[kept] >= floor:
        kept += 1
    return tokens[:kept]
