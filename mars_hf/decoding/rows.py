"""One row of a MARS batch: how it decodes (``RowSettings``), what it gained in a step (``RowUpdate``)
and its state between steps (``RowState``: tokens, cache commit point, drafts in hand, statistics).
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from .acceptance import one_token_per_step
from .draft_sources import LOOKUP, MASKS
from .planner import AcceptanceStats
from .sampling import RowNoise, draw_seed


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
        seed / row_key: a sampled row's randomness: the token at position ``t`` of the row (prompt
            included) is the keyed draw of ``(seed, row_key, t)`` (``sampling.py``), so the same seed gives
            the same tokens whatever the plan, the timing, the kernels or the rest of the batch. ``seed=None``
            draws a seed from torch's global generator when the row is added (``torch.manual_seed`` fixes it).
            ``generate`` gives every row of a call one seed and its batch index as ``row_key``; a server
            request's ``seed`` with ``row_key`` 0.
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
    row_key: int = 0
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


class SourceStats(AcceptanceStats):
    """A draft source's acceptance per offset (prompt lookup's, a draft model's). Its prior is
    optimistic: a source is only observed when fed, and a verbatim n-gram match's continuation is
    usually the model's own on input-grounded text (a row whose lookups fail drops below the masks
    within two or three tries)."""

    PRIOR = 0.8

    def future(self) -> list[float]:
        """Offsets not yet reached lean on the first offset's estimate, not on the prior: a row whose
        lookups fail at once must not keep valuing the unobserved tail of its chains at 0.8."""
        w = self.PRIOR_WEIGHT
        first = (self.kept[0] + w * self.PRIOR) / (self.reached[0] + w)
        tail = zip(self.kept[1:], self.reached[1:])
        return [first] + [(kept + w * first) / (reached + w) for kept, reached in tail]

    def forget(self) -> None:
        """A match was found but not fed: old outcomes weigh less, the estimate drifts back to the prior.

        Why: a source is only observed when fed, so without this one failed chain (its first offset
        then estimated at 0.4, its chains worth less than their cost where extra columns are dear)
        would keep a row from ever trying it again, although the text moves on (an answer starts
        copying a passage of the input after a sentence of its own). A row re-tries after about a
        dozen declined matches; each failure costs one wide step."""
        for j in range(len(self.reached)):
            self.reached[j] *= self.DECAY
            self.kept[j] *= self.DECAY
            self.predicted[j] *= self.DECAY


class RowState:
    """One row's decoding state."""

    def __init__(self, row_id, prompt, settings, window, processing, batch_index, lead, buffer_lead, floor):
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
        self.noise = None  # keyed sampling noise (``sampling.RowNoise``); None: greedy
        if settings.do_sample:
            seed = settings.seed if settings.seed is not None else draw_seed()
            self.noise = RowNoise(seed, settings.row_key)
        self.processing = processing
        self.batch_index = batch_index  # row of ``processing.sequences`` (the stock ``input_ids`` layout)
        self.lead = lead  # left-padding columns of the prompt fed to the model (and kept in the cache)
        self.buffer_lead = buffer_lead  # left-padding columns before the prompt in ``processing.sequences``
        self.prefilled = False
        self.committed = 0  # real tokens whose keys/values are in the cache
        self.drafts: list[int] = []
        self.draft_confidence: list[float] = []  # the drafts' own (calibrated) probabilities
        self.finished = False
        self.stats = AcceptanceStats(min(window, max(settings.max_new_tokens, 1)))  # the planner's view
        self.draft_source = MASKS  # where ``drafts`` came from
        lookup = settings.prompt_lookup_num_tokens if self.verify else None
        self.lookup_stats = SourceStats(int(lookup)) if lookup else None  # prompt lookup's acceptance
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


def sampling_processors(settings: RowSettings) -> LogitsProcessorList:
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
