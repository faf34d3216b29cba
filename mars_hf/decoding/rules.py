"""The acceptance rules' primitives (docs/method.md §2 steps 3-4, §6): how a prediction becomes a token, its
confidence, τ's test, how many predictions τ keeps, how many drafts verify keeps.

One file, run by the library (``acceptance.py`` applies it to the rows of a step) and shipped verbatim in every
checkpoint's ``custom_generate/`` (``mars_hf.hub.custom_generate.LIBRARY_FILES``), so the rules a checkpoint
decodes with are the library's own. Imports only torch, transformers and ``sampling.py`` (shipped with it).
"""

from __future__ import annotations

import torch
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    MinPLogitsWarper,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from .sampling import keyed_choice, noise_for

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


def choose(scores: torch.Tensor, places=None) -> torch.Tensor:
    """One token per row of ``scores``: the argmax (``places=None``, greedy), or the keyed draw at each
    ``(RowNoise, position)`` of ``places`` (``sampling.py``)."""
    noise = None if places is None else noise_for(places, scores.shape[-1], scores.device)
    return keyed_choice(scores, noise)


def confidence(scores: torch.Tensor, tokens: torch.Tensor, metric: str) -> torch.Tensor:
    """Each prediction's confidence under ``metric``, as float64 (compared with τ by ``passes``)."""
    probs = torch.softmax(scores, dim=-1)
    if metric == "probability":
        return probs.gather(-1, tokens[:, None]).squeeze(-1).double()
    if metric == "entropy":
        return torch.special.entr(probs).sum(-1).double()
    top2 = probs.topk(2, dim=-1).values
    return (top2[:, 0] - top2[:, 1]).double()


def confidences(scores: torch.Tensor, tokens: torch.Tensor, metric: str, spans, calibration=None):
    """Host lists ``(tokens, confidences)`` in one transfer (the §2 rule then runs on W + 1 numbers per row);
    with a calibration (probability metric), each span's mask entries are calibrated (entry 0 of a span is
    prediction 0, always kept; entry k is mask k)."""
    chosen, values = torch.stack([tokens.double(), confidence(scores, tokens, metric)]).tolist()
    if calibration is not None and metric == "probability":
        for start, count in spans:
            calibration.apply_span(values, start + 1, count - 1, first_offset=1)
    return [int(t) for t in chosen], values


def passes(value: float, tau: float, metric: str) -> bool:
    """p(chosen) >= τ, p1 - p2 >= τ, or H <= τ."""
    return value <= tau if metric == "entropy" else value >= tau


def one_token_per_step(metric: str, tau: float | None) -> bool:
    """τ >= 1 with the probability or margin metric can only keep prediction 0 (docs/method.md §2): such a
    row needs no masks at all. Never true for verify, whose τ is a proposal floor."""
    return metric in ("probability", "margin") and tau is not None and tau >= 1.0


def threshold_count(passed: list[bool], limit: int) -> int:
    """Prediction 0 always; then predictions while they pass; at most ``limit``."""
    count = min(1, limit)
    while count < limit and passed[count]:
        count += 1
    return count


def proposal_count(confidences: list[float], floor: float) -> int:
    """How many leading drafts reach the proposal ``floor`` (verify's τ)."""
    count = 0
    while count < len(confidences) and confidences[count] >= floor:
        count += 1
    return count


def verify_drafts(drafts: list[int], model_tokens: list[int]) -> int:
    """Drafts kept: the longest prefix equal to the model's own choices (its argmax, or its keyed draw)."""
    kept = 0
    while kept < len(drafts) and drafts[kept] == model_tokens[kept]:
        kept += 1
    return kept
