"""MARS decoding as a transformers decoding strategy (MARS_SPEC §2-§3).

Three ways in, one loop:

- ``model.generate(custom_generate=mars_generate, mars_threshold=0.9)``: the *callable* form of
  ``custom_generate``; transformers prepares inputs, logits processors and stopping criteria, then
  calls ``mars_generate``.
- ``enable_mars(model)`` (or a class that mixes in ``MARSGenerationMixin``): afterwards
  ``model.generate(**inputs, mars_threshold=0.9)`` routes to MARS; without ``mars_threshold`` it is
  stock ``generate``.
- the module-level ``generate(model, ...)``: the *string* form of ``custom_generate`` (this file
  ships verbatim as a checkpoint's ``custom_generate/generate.py``), which receives raw arguments.

This module imports only torch, transformers and its sibling ``cache`` module.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass

import torch
from transformers import GenerationMixin
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
from transformers.generation.stopping_criteria import (
    EosTokenCriteria,
    MaxLengthCriteria,
    StoppingCriteriaList,
)
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .cache import MARSBlockCache, MARSRowState

logger = logging.getLogger(__name__)

ACCEPTANCE_METRICS = ("probability", "entropy", "margin")
CACHE_SCHEMES = ("cursor", "block", "none")
DEFAULT_CACHE_BLOCK = 16
# Processors that act on each row of scores alone and never read ``input_ids``: they can be applied
# to all window positions in one call. Anything else is applied position by position.
_POSITION_FREE_PROCESSORS = (
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    MinPLogitsWarper,
    TypicalLogitsWarper,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
)
# CPU matrix kernels (MKL/oneDNN in the torch CPU wheels) take a much slower path when a linear layer
# sees fewer than 4 rows: measured here on SmolLM2-135M, a cached forward of 3 tokens costs 82 ms
# against 62 ms for 4 and 57 ms for 5 (and 39 ms for 1, where the matrix-vector path is fast). A MARS
# step of 1 + 2 tokens (B = 2) therefore pays less when extra masks are appended past the window: by
# causality no real position attends to them, their predictions are never used and their cache
# entries are dropped with the window's, so the accepted tokens are the same (an optimisation that
# keeps results identical, MARS_SPEC header).
_MIN_FORWARD_ROWS = {"cpu": 4}
_MARS_KWARGS = ("mars_block_size", "mars_acceptance", "mars_cache", "mars_cache_block", "mars_mask_token_id")


@dataclass
class MARSGenerateOutput(GenerateDecoderOnlyOutput):
    """``GenerateDecoderOnlyOutput`` plus MARS statistics.

    Args:
        num_forwards: every model call of the generation, the prompt's included.
        accepted_counts: ``[num_steps, batch]`` tokens accepted by each row at each step (0 once a
            row has finished, or while it waits for a block commit).
    """

    num_forwards: int | None = None
    accepted_counts: torch.LongTensor | None = None


# --------------------------------------------------------------------------------------------------
# Argument resolution and validation
# --------------------------------------------------------------------------------------------------


def _mars_settings(model) -> dict:
    """``config.mars`` merged with the overrides ``enable_mars`` stored on the model."""
    settings = dict(getattr(model.config, "mars", None) or {})
    settings.update(getattr(model, "_mars_overrides", None) or {})
    return settings


def _resolve_window(model, block_size) -> int:
    if block_size is None:
        block_size = _mars_settings(model).get("block_size")
    if block_size is None:
        raise ValueError(
            "No MARS window: pass `mars_block_size=W` or set `config.mars['block_size']` "
            "(`mars_hf.set_mars_config` / `enable_mars(model, block_size=...)`)."
        )
    if int(block_size) != block_size or int(block_size) < 1:
        raise ValueError(f"`mars_block_size` (the window W) must be an integer >= 1, got {block_size!r}.")
    return int(block_size)


def _resolve_mask_token(model, mask_token_id) -> int:
    if mask_token_id is None:
        mask_token_id = _mars_settings(model).get("mask_token_id")
    if mask_token_id is None:
        raise ValueError(
            "This model has no MARS mask token. Add one with `mars_hf.add_mask_token(model, tokenizer)` and "
            "record it with `mars_hf.set_mars_config(model, block_size=..., mask_token_id=...)`, or pass "
            "`mars_mask_token_id=`."
        )
    rows = model.get_input_embeddings().weight.shape[0]
    if not 0 <= int(mask_token_id) < rows:
        raise ValueError(
            f"Mask token id {mask_token_id} is outside the {rows}-row embedding matrix; resize the embeddings "
            "with `mars_hf.add_mask_token(model, tokenizer)`."
        )
    return int(mask_token_id)


def _resolve_threshold(threshold, acceptance: str, batch_size: int, device) -> torch.Tensor:
    if threshold is None:
        raise ValueError(
            "MARS decoding needs `mars_threshold=τ` (a float, or one value per batch row); τ = 1.0 "
            "reproduces ordinary decoding."
        )
    tau = torch.as_tensor(threshold, dtype=torch.float64).flatten().to("cpu")
    if tau.numel() == 1:
        tau = tau.expand(batch_size)
    if tau.numel() != batch_size:
        raise ValueError(f"`mars_threshold` has {tau.numel()} values for a batch of {batch_size} rows.")
    if torch.isnan(tau).any():
        raise ValueError("`mars_threshold` contains NaN.")
    if acceptance in ("probability", "margin") and ((tau < 0) | (tau > 1)).any():
        raise ValueError(
            f"`mars_threshold` must lie in [0, 1] for the {acceptance!r} metric, got {tau.tolist()}. "
            "1.0 means one token per step, 0.0 accepts every prediction."
        )
    if acceptance == "entropy" and (tau < 0).any():
        raise ValueError(
            f"`mars_threshold` is an entropy bound for 'entropy' and must be >= 0, got {tau.tolist()}."
        )
    return tau.to(device=device)


def _pad_token(generation_config, eos_ids: list[int]) -> int:
    pad = getattr(generation_config, "_pad_token_tensor", None)
    if pad is not None:
        return int(pad.flatten()[0])
    if generation_config.pad_token_id is not None:
        return int(generation_config.pad_token_id)
    return eos_ids[0] if eos_ids else 0


def _split_stopping_criteria(stopping_criteria, generation_config):
    """Pull out max length and EOS (handled vectorised); keep the rest for token-by-token checks."""
    max_length = generation_config.max_length
    eos_ids: list[int] = []
    other = StoppingCriteriaList()
    for criterion in stopping_criteria or []:
        if isinstance(criterion, MaxLengthCriteria):
            max_length = criterion.max_length if max_length is None else min(max_length, criterion.max_length)
        elif isinstance(criterion, EosTokenCriteria):
            eos_ids.extend(int(i) for i in criterion.eos_token_id.flatten().tolist())
        else:
            other.append(criterion)
    return max_length, sorted(set(eos_ids)), other


def _caller_streamer():
    """transformers does not pass ``streamer`` to a custom decoding callable; recover it from the caller.

    ``GenerationMixin.generate`` already sent the prompt to it, so the caller must not send it again.
    """
    try:
        frame = sys._getframe(2)
    except ValueError:
        return None
    for _ in range(4):
        if frame is None:
            return None
        if frame.f_code.co_name == "generate" and "custom_generate" in frame.f_locals:
            return frame.f_locals.get("streamer")
        frame = frame.f_back
    return None


# --------------------------------------------------------------------------------------------------
# The decoding loop
# --------------------------------------------------------------------------------------------------


def mars_generate(
    model,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList | None = None,
    stopping_criteria: StoppingCriteriaList | None = None,
    generation_config=None,
    synced_gpus: bool = False,
    streamer=None,
    mars_threshold=None,
    mars_block_size: int | None = None,
    mars_acceptance: str | None = None,
    mars_cache: str | None = None,
    mars_cache_block: int | None = None,
    mars_mask_token_id: int | None = None,
    mars_streamer=None,
    **model_kwargs,
):
    """MARS decoding loop for ``generate(custom_generate=mars_generate, mars_threshold=τ, ...)``.

    Each step feeds the accepted sequence followed by ``W`` mask tokens, reads prediction 0 from the
    last real token and prediction ``j`` from the ``j``-th mask (``W + 1`` predictions), chooses a
    token for each (greedy or sampled after the logits processors, applied per position with the
    provisional prefix), accepts prediction 0 and then predictions while their confidence passes
    ``τ``, stopping right after EOS / a stop criterion and never beyond ``max_length``.

    Args:
        mars_threshold: τ, a float or one value per batch row. With the probability (or margin) metric,
            τ >= 1 accepts exactly one token per step and appends no masks at all.
        mars_block_size: window W (default ``config.mars["block_size"]``).
        mars_acceptance: (default ``"probability"``) ``"probability"`` (p(chosen) >= τ), ``"entropy"`` (H <= τ) or ``"margin"``
            (p1 - p2 >= τ).
        mars_cache: ``"cursor"`` (commit every step, default), ``"block"`` (commit ``C`` columns at a
            time, the paper's scheme) or ``"none"`` (recompute everything each step; the reference).
        mars_cache_block: C for ``"block"`` (default 16).
        mars_mask_token_id: overrides ``config.mars["mask_token_id"]``.
        mars_streamer: the streamer (the MARS entry points pass it here because transformers does not
            forward ``streamer`` to custom decoding functions).
    """
    generation_config = generation_config if generation_config is not None else model.generation_config
    prompt_already_streamed = False
    if streamer is None and mars_streamer is None:
        streamer = _caller_streamer()
        prompt_already_streamed = streamer is not None
    streamer = streamer if streamer is not None else mars_streamer

    settings = _mars_settings(model)
    mars_acceptance = mars_acceptance or settings.get("acceptance", "probability")
    mars_cache = mars_cache or settings.get("cache", "cursor")
    if mars_cache_block is None:
        mars_cache_block = settings.get("cache_block")
    if mars_acceptance not in ACCEPTANCE_METRICS:
        raise ValueError(f"`mars_acceptance` must be one of {ACCEPTANCE_METRICS}, got {mars_acceptance!r}.")
    if mars_cache not in CACHE_SCHEMES:
        raise ValueError(f"`mars_cache` must be one of {CACHE_SCHEMES}, got {mars_cache!r}.")
    if getattr(generation_config, "num_beams", 1) not in (None, 1):
        raise ValueError("MARS decoding does not support beam search; set `num_beams=1`.")
    if model.config.is_encoder_decoder:
        raise ValueError("MARS decoding is for decoder-only models.")
    if generation_config.output_attentions or generation_config.output_hidden_states:
        raise ValueError(
            "MARS decoding does not return attentions or hidden states (a forward mixes real and mask "
            "tokens); unset `output_attentions` / `output_hidden_states`."
        )
    if model_kwargs.get("inputs_embeds") is not None:
        raise ValueError("MARS decoding needs `input_ids`, not `inputs_embeds`.")
    window = _resolve_window(model, mars_block_size)
    mask_token_id = _resolve_mask_token(model, mars_mask_token_id)
    batch_size = input_ids.shape[0]
    tau = _resolve_threshold(mars_threshold, mars_acceptance, batch_size, input_ids.device)
    cache_block = DEFAULT_CACHE_BLOCK if mars_cache_block is None else int(mars_cache_block)
    if cache_block < 1:
        raise ValueError(f"`mars_cache_block` (C) must be >= 1, got {mars_cache_block}.")

    decoder = _MARSDecoder(
        model=model,
        input_ids=input_ids,
        logits_processor=logits_processor,
        stopping_criteria=stopping_criteria,
        generation_config=generation_config,
        streamer=streamer,
        tau=tau,
        window=window,
        acceptance=mars_acceptance,
        scheme=mars_cache,
        cache_block=cache_block,
        mask_token_id=mask_token_id,
        model_kwargs=model_kwargs,
    )
    if streamer is not None and not prompt_already_streamed:
        streamer.put(input_ids.cpu())
    return decoder.run()


class _MARSDecoder:
    """State of one MARS generation: the token buffer, per-row counters, the cache and statistics."""

    def __init__(
        self,
        *,
        model,
        input_ids,
        logits_processor,
        stopping_criteria,
        generation_config,
        streamer,
        tau,
        window,
        acceptance,
        scheme,
        cache_block,
        mask_token_id,
        model_kwargs,
    ):
        self.model = model
        self.device = input_ids.device
        self.batch_size, self.prompt_length = input_ids.shape
        self.generation_config = generation_config
        self.streamer = streamer
        self.tau = tau
        self.acceptance = acceptance
        self.scheme = scheme
        self.cache_block = cache_block
        self.mask_token_id = mask_token_id
        self.processors = LogitsProcessorList(logits_processor or [])
        self.position_free = all(isinstance(p, _POSITION_FREE_PROCESSORS) for p in self.processors)
        self.do_sample = bool(generation_config.do_sample)
        self.stopping_criteria = StoppingCriteriaList(stopping_criteria or [])
        max_length, self.eos_ids, self.other_criteria = _split_stopping_criteria(
            stopping_criteria, generation_config
        )
        self.max_new = max(0, max_length - self.prompt_length)
        self.pad_token_id = _pad_token(generation_config, self.eos_ids)
        self.eos_tensor = torch.tensor(self.eos_ids, dtype=torch.long, device=self.device)
        # τ >= 1 with probability/margin can only accept prediction 0: such rows need no masks at all.
        one_token_rows = (
            (tau >= 1.0) if acceptance in ("probability", "margin") else torch.zeros_like(tau, dtype=bool)
        )
        self.one_token_rows = one_token_rows
        self.one_token_list = one_token_rows.tolist()
        self.window = 0 if bool(one_token_rows.all()) else window
        min_rows = _MIN_FORWARD_ROWS.get(self.device.type, 1)
        self.min_columns = -(-min_rows // self.batch_size)  # columns a window forward is padded to

        attention_mask = model_kwargs.pop("attention_mask", None)
        if attention_mask is not None and attention_mask.shape != input_ids.shape:
            raise ValueError("MARS decoding needs a 2D `attention_mask` shaped like `input_ids`.")
        self.prompt_valid = None
        if attention_mask is not None and not bool((attention_mask == 1).all()):
            self.prompt_valid = attention_mask.to(device=self.device, dtype=torch.bool)
        self.cache = self._prepare_cache(
            model_kwargs.pop("cache", None), model_kwargs.pop("past_key_values", None)
        )
        for key in ("position_ids", "use_cache", "logits_to_keep", "cache_position"):
            model_kwargs.pop(key, None)
        leftover = sorted(k for k, v in model_kwargs.items() if v is not None)
        if leftover:
            logger.warning("MARS decoding ignores these model inputs: %s", leftover)

        buffer_length = self.prompt_length + self.max_new + self.window + 2
        self.sequences = torch.full(
            (self.batch_size, buffer_length), self.pad_token_id, dtype=torch.long, device=self.device
        )
        self.sequences[:, : self.prompt_length] = input_ids
        self.num_forwards = 0
        self.accepted_counts: list = []
        self.return_dict = bool(generation_config.return_dict_in_generate)
        self.keep_scores = self.return_dict and bool(generation_config.output_scores)
        self.keep_logits = self.return_dict and bool(generation_config.output_logits)
        self._score_records: list = []

    # ---------------------------------------------------------------------------------------- cache
    def _prepare_cache(self, cache, legacy_cache):
        cache = cache if cache is not None else legacy_cache
        if self.scheme == "none":
            if cache is not None and getattr(cache, "_is_user_defined", False):
                raise ValueError("`mars_cache='none'` recomputes everything; do not pass a cache object.")
            return None
        if cache is not None and getattr(cache, "_is_user_defined", False):
            if not getattr(cache, "is_croppable", False) or not hasattr(cache, "crop"):
                raise ValueError(
                    f"MARS decoding must drop the mask entries after each forward, but this "
                    f"{type(cache).__name__} cannot be cropped. Pass no cache (a `MARSBlockCache` is created), "
                    "a `mars_hf.MARSBlockCache`, or use `mars_cache='none'`."
                )
            if cache.get_seq_length() != 0:
                raise ValueError(
                    "MARS decoding starts from an empty cache; continuing from a filled cache is not supported."
                )
            return cache
        if self.generation_config.cache_implementation is not None:
            logger.warning(
                "MARS decoding manages its own cache (`mars_cache=%r`); ignoring cache_implementation=%r.",
                self.scheme,
                self.generation_config.cache_implementation,
            )
        # Room for the prompt, every generated token and one window of masks; with the cursor scheme a
        # batch also leaves holes, so reserve as much again for them (the buffer still grows if needed).
        capacity = self.prompt_length + self.max_new + self.window + self.min_columns + 1
        if self.scheme == "cursor" and self.batch_size > 1 and self.window:
            capacity += self.max_new
        return MARSBlockCache(self.model.config, capacity=capacity)

    def _new_rows(self) -> MARSRowState:
        if isinstance(self.cache, MARSBlockCache):
            return self.cache.init_rows(self.batch_size, self.device)
        return MARSRowState(self.batch_size, self.device, capacity=self.prompt_length + self.max_new + 16)

    def _commit(self, rows: MARSRowState, keep: int) -> None:
        if isinstance(self.cache, MARSBlockCache):
            self.cache.commit(keep)
            return
        drop = rows.staged - keep
        rows.commit(keep)
        if drop and self.cache is not None:
            self.cache.crop(-drop)

    def _forward(self, input_ids, attention_mask, position_ids, logits_to_keep):
        self.num_forwards += 1
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=self.cache,
            use_cache=self.cache is not None,
            logits_to_keep=logits_to_keep,
            return_dict=True,
        )
        return outputs.logits

    # ----------------------------------------------------------------------------------------- run
    def run(self):
        if self.max_new == 0:
            generated = 0
        elif self.window == 0 and self.scheme != "none":
            generated = self._run_one_token()
        else:
            generated = self._run_window()
        if self.streamer is not None:
            self.streamer.end()
        sequences = self.sequences[:, : self.prompt_length + generated]
        if not self.return_dict:
            return sequences
        counts = (
            torch.stack(self.accepted_counts)
            if self.accepted_counts
            else torch.zeros((0, self.batch_size), dtype=torch.long, device=self.device)
        )
        scores, logits = self._assemble_scores(generated)
        return MARSGenerateOutput(
            sequences=sequences,
            scores=scores,
            logits=logits,
            cache=self.cache,
            num_forwards=self.num_forwards,
            accepted_counts=counts.to(torch.long),
        )

    def _choose_one(self, ids, logits, rows=None):
        scores = self.processors(ids, logits) if self.processors else logits
        if rows is not None:
            scores = scores[rows]
        if self.do_sample:
            tokens = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
        else:
            tokens = torch.argmax(scores, dim=-1)
        return scores, tokens

    def _run_one_token(self) -> int:
        """τ >= 1 for every row: plain one-token decoding, no masks (the cost of stock ``generate``)."""
        rows = self._new_rows()
        prompt_length, pad = self.prompt_length, self.pad_token_id
        attention_mask, position_ids = rows.stage(prompt_length, self.prompt_valid)
        logits = self._forward(self.sequences[:, :prompt_length], attention_mask, position_ids, 1)
        self._commit(rows, prompt_length)
        unfinished = torch.ones(self.batch_size, dtype=torch.bool, device=self.device)
        length = prompt_length
        limit = prompt_length + self.max_new
        while True:
            next_logits = logits[:, -1].to(dtype=torch.float32, copy=True)
            scores, tokens = self._choose_one(self.sequences[:, :length], next_logits)
            tokens = torch.where(unfinished, tokens, pad)
            self.sequences[:, length] = tokens
            length += 1
            if self.keep_scores or self.keep_logits:
                self._score_records.append((scores[:, None], next_logits[:, None], None, unfinished.long()))
            if self.streamer is not None:
                self.streamer.put(tokens.cpu())
            self.accepted_counts.append(unfinished.long())
            unfinished = unfinished & ~self.stopping_criteria(self.sequences[:, :length], None)
            if length >= limit or not bool(unfinished.any()):
                return length - prompt_length
            attention_mask, position_ids = rows.stage(1)
            logits = self._forward(self.sequences[:, length - 1 : length], attention_mask, position_ids, 1)
            self._commit(rows, 1)

    def _run_window(self) -> int:
        """The general MARS step loop (any τ, any cache scheme)."""
        batch, prompt_length, window = self.batch_size, self.prompt_length, self.window
        device = self.device
        generated = [0] * batch  # tokens accepted per row
        committed = [0] * batch  # generated tokens of each row whose KV sits in the cache
        finished = [False] * batch
        rows = self._new_rows() if self.cache is not None else None
        first = True
        arange_w = torch.arange(window + 1, device=device)
        generated_t = torch.zeros(batch, dtype=torch.long, device=device)  # same as `generated`, on device
        mask_columns = torch.full((batch, window), self.mask_token_id, dtype=torch.long, device=device)
        while True:
            # ---- which rows take a decision this step, and what each feeds
            if self.scheme == "block" and not first:
                active = [u for u, f in zip(self._uncommitted(generated, committed), finished) if not f]
                commit_block = bool(active) and min(active) >= self.cache_block
            else:
                commit_block = False
            uncommitted = [0 if f else g - c for g, c, f in zip(generated, committed, finished)]
            if self.scheme == "none":
                starts, counts, right_aligned = [prompt_length] * batch, generated, False
                prefix = prompt_length
            else:
                starts = [prompt_length + c for c in committed]
                counts, right_aligned = uncommitted, self.scheme == "cursor"
                prefix = prompt_length if first else 0
            participating = [
                not f and (self.scheme != "block" or first or commit_block or u < self.cache_block)
                for f, u in zip(finished, uncommitted)
            ]
            width = max(counts)
            gen_ids, gen_valid = self._gather_chunk(starts, counts, width, right_aligned)
            pieces, valid_pieces = [], []
            if prefix:
                pieces.append(self.sequences[:, :prefix])
                valid_pieces.append(self.prompt_valid)
            if width:
                pieces.append(gen_ids)
                valid_pieces.append(gen_valid)
            pieces.append(mask_columns)
            valid_pieces.append(None)
            chunk = torch.cat(pieces, dim=1) if len(pieces) > 1 else pieces[0]
            num_columns = chunk.shape[1]
            if all(v is None for v in valid_pieces):
                valid = None
            else:
                valid = torch.cat(
                    [
                        torch.ones(batch, p.shape[1], dtype=torch.bool, device=device) if v is None else v
                        for p, v in zip(pieces, valid_pieces)
                    ],
                    dim=1,
                )

            # ---- where prediction 0 of each row sits; keep only the logits that are needed
            if right_aligned:
                pred0 = [prefix + width - 1] * batch
            else:
                pred0 = [prefix + c - 1 for c in counts]
            lowest = min(
                (p for p, part in zip(pred0, participating) if part), default=num_columns - window - 1
            )
            keep = num_columns - max(lowest, 0)

            # ---- pad short forwards with unused masks past the window (see _MIN_FORWARD_ROWS)
            extra = max(0, self.min_columns - num_columns) if window else 0
            if extra:
                chunk = torch.cat([chunk, chunk.new_full((batch, extra), self.mask_token_id)], dim=1)
                if valid is not None:
                    valid = torch.cat([valid, valid.new_ones(batch, extra)], dim=1)
            lm_keep = min(num_columns + extra, max(keep + extra, self.min_columns))
            step_rows = (
                rows if rows is not None else MARSRowState(batch, device, capacity=num_columns + extra)
            )
            attention_mask, position_ids = step_rows.stage(num_columns + extra, valid)
            logits = self._forward(chunk, attention_mask, position_ids, lm_keep)
            if lm_keep != keep:  # the columns [num_columns - keep, num_columns) of the unpadded chunk
                first_kept = lm_keep - extra - keep
                logits = logits[:, first_kept : first_kept + keep]
            # commit what stays in the cache
            if self.cache is not None:
                if self.scheme == "cursor":
                    kept, committed = num_columns - window, list(generated)
                elif first:
                    kept = prefix
                elif commit_block:
                    kept = self.cache_block
                    committed = [min(c + self.cache_block, g) for c, g in zip(committed, generated)]
                else:
                    kept = 0
                self._commit(step_rows, kept)
                committed = [g if f else c for c, g, f in zip(committed, generated, finished)]
            else:
                step_rows.commit(0)
            first = False

            if keep == window + 1:  # every row's prediction 0 sits right before the masks
                step_logits = logits.float()
            else:
                index = torch.tensor([max(p - (num_columns - keep), 0) for p in pred0], device=device)
                index = torch.cat(
                    [index[:, None], torch.arange(keep - window, keep, device=device).expand(batch, window)],
                    dim=1,
                )
                step_logits = logits.gather(1, index[:, :, None].expand(-1, -1, logits.shape[-1])).float()
            n_accept, stopped, counts_t = self._decide(
                step_logits, generated, generated_t, participating, arange_w
            )
            generated_t += counts_t
            for b in range(batch):
                generated[b] += n_accept[b]
                if stopped[b] or generated[b] >= self.max_new:
                    finished[b] = True
            if all(finished):
                return max(generated)

    @staticmethod
    def _uncommitted(generated, committed):
        return [g - c for g, c in zip(generated, committed)]

    def _gather_chunk(self, starts, counts, width, right_aligned):
        """``[batch, width]`` ids of each row's tokens ``starts[b] : starts[b] + counts[b]`` plus holes."""
        if width == 0:
            return None, None
        if all(c == width for c in counts) and all(x == starts[0] for x in starts):
            return self.sequences[:, starts[0] : starts[0] + width], None
        device = self.device
        columns = torch.arange(width, device=device)[None, :]
        start = torch.tensor(starts, device=device)[:, None]
        count = torch.tensor(counts, device=device)[:, None]
        if right_aligned:
            source = start + count - width + columns
            valid = columns >= width - count
        else:
            source = start + columns
            valid = columns < count
        source = source.clamp_(0, self.sequences.shape[1] - 1)
        ids = self.sequences.gather(1, source).masked_fill_(~valid, self.pad_token_id)
        if all(c == width for c in counts):
            valid = None
        return ids, valid

    # -------------------------------------------------------------------------------- acceptance
    def _decide(self, step_logits, generated, gen, participating, arange_w):
        """Choose W + 1 tokens per row, accept by the §2 rule, apply stops; writes accepted tokens.

        Returns the accepted count and the stop flag of each row (lists) and the counts as a tensor.
        """
        batch, positions, vocab = step_logits.shape
        device = self.device
        slots = self.prompt_length + gen[:, None] + arange_w[None, :positions]  # buffer columns
        if not self.processors or self.position_free:
            if self.processors:
                flat = self.processors(
                    self.sequences[:, :1].repeat_interleave(positions, 0), step_logits.reshape(-1, vocab)
                )
                scores = flat.view(batch, positions, vocab)
            else:
                scores = step_logits
            if self.do_sample:
                tokens = torch.multinomial(torch.softmax(scores, -1).view(-1, vocab), 1).view(
                    batch, positions
                )
            else:
                tokens = scores.argmax(-1)
            if self.other_criteria:  # they read the candidate tokens from the buffer
                self.sequences.scatter_(1, slots, tokens)
        else:
            scores = torch.empty_like(step_logits)
            tokens = torch.zeros((batch, positions), dtype=torch.long, device=device)
            # Rows whose provisional prefixes have the same length share one call on the *whole* batch
            # (processors may keep per-row state, e.g. a per-row prompt length); only their rows are
            # read back. Every row thus sees exactly its own prefix, as in stock ``generate``.
            for j in range(positions):
                for length, members in self._groups(generated, participating, j).items():
                    index = torch.tensor(members, device=device)
                    row_scores, row_tokens = self._choose_one(
                        self.sequences[:, :length], step_logits[:, j].clone(), rows=index
                    )
                    scores[index, j] = row_scores
                    tokens[index, j] = row_tokens
                self.sequences.scatter_(1, slots[:, j : j + 1], tokens[:, j : j + 1])

        probs = torch.softmax(scores, dim=-1)
        if self.acceptance == "probability":
            passed = probs.gather(-1, tokens[..., None]).squeeze(-1).double() >= self.tau[:, None]
        elif self.acceptance == "entropy":
            passed = torch.special.entr(probs).sum(-1).double() <= self.tau[:, None]
        else:
            top2 = probs.topk(2, dim=-1).values
            passed = (top2[..., 0] - top2[..., 1]).double() >= self.tau[:, None]
        # One transfer to the host, then the §2 rule row by row (W + 1 flags per row: cheap in Python).
        if self.eos_ids:
            passed, is_eos = torch.stack([passed, torch.isin(tokens, self.eos_tensor)]).tolist()
        else:
            passed, is_eos = passed.tolist(), None
        n_accept, stopped = [0] * batch, [0] * batch
        for b in range(batch):
            if not participating[b]:
                continue
            limit = min(1 if self.one_token_list[b] else positions, self.max_new - generated[b])
            for j in range(limit):
                if j and not passed[b][j]:  # prediction 0 is always accepted
                    break
                n_accept[b] = j + 1
                if is_eos is not None and is_eos[b][j]:  # nothing is accepted after an EOS
                    stopped[b] = 1
                    break

        if self.other_criteria:
            for j in range(max(n_accept)):
                live = [b for b in range(batch) if j < n_accept[b]]
                for length, members in self._groups(generated, live, j, include_current=True).items():
                    done = self.other_criteria(self.sequences[:, :length], None).tolist()
                    for b in members:
                        d = done[b]
                        if d:
                            n_accept[b], stopped[b] = j + 1, 1
        counts = torch.tensor(n_accept, device=device)
        keep_mask = arange_w[None, :positions] < counts[:, None]
        self.sequences.scatter_(1, slots, torch.where(keep_mask, tokens, self.pad_token_id))
        self.accepted_counts.append(counts)
        if self.keep_scores or self.keep_logits:
            self._score_records.append((scores, step_logits, gen.clone(), counts))
        if self.streamer is not None:
            self._stream(tokens, n_accept)
        return n_accept, stopped, counts

    def _groups(self, generated, members, j, include_current=False):
        """Rows grouped by the length their provisional prefix has at window position ``j``."""
        if members and isinstance(members[0], bool):
            members = [b for b, m in enumerate(members) if m]
        groups: dict[int, list[int]] = {}
        for b in members:
            length = self.prompt_length + generated[b] + j + (1 if include_current else 0)
            groups.setdefault(length, []).append(b)
        return groups

    def _stream(self, tokens, n_accept):
        if self.batch_size == 1:
            if n_accept[0]:
                self.streamer.put(tokens[0, : n_accept[0]].cpu())
            return
        for j in range(max(n_accept)):
            column = tokens[:, j].clone()
            column[torch.tensor([j >= n for n in n_accept], device=self.device)] = self.pad_token_id
            self.streamer.put(column.cpu())

    def _assemble_scores(self, generated: int):
        """Per generated position, the ``[batch, vocab]`` scores/logits used for each row's token there."""
        if not (self.keep_scores or self.keep_logits) or not self._score_records:
            return None, None
        vocab = self._score_records[0][0].shape[-1]
        scores = [torch.zeros(self.batch_size, vocab, device=self.device) for _ in range(generated)]
        logits = [torch.zeros(self.batch_size, vocab, device=self.device) for _ in range(generated)]
        step_of_row = [0] * self.batch_size
        for record_scores, record_logits, gen, counts in self._score_records:
            counts = counts.tolist()
            for b in range(self.batch_size):
                start = step_of_row[b] if gen is None else int(gen[b])
                for j in range(counts[b] if gen is not None else 1):
                    if start + j < generated:
                        scores[start + j][b] = record_scores[b, j]
                        logits[start + j][b] = record_logits[b, j]
                step_of_row[b] = start + (counts[b] if gen is not None else 1)
        return (tuple(scores) if self.keep_scores else None), (tuple(logits) if self.keep_logits else None)


# --------------------------------------------------------------------------------------------------
# Entry points: the mixin, enable_mars, and the string form of custom_generate
# --------------------------------------------------------------------------------------------------


def _route_to_mars(model, args, kwargs):
    """Call stock ``GenerationMixin.generate`` with ``mars_generate`` as the decoding callable."""
    kwargs = dict(kwargs)
    kwargs.pop("custom_generate", None)
    kwargs.pop("trust_remote_code", None)
    kwargs["mars_streamer"] = kwargs.pop("streamer", None)
    return GenerationMixin.generate(model, *args, custom_generate=mars_generate, **kwargs)


def _stock(model, args, kwargs):
    stray = [k for k in _MARS_KWARGS if kwargs.get(k) is not None]
    if stray:
        raise ValueError(f"{stray} only apply to MARS decoding; also pass `mars_threshold=τ`.")
    for key in _MARS_KWARGS:
        kwargs.pop(key, None)
    return GenerationMixin.generate(model, *args, **kwargs)


def generate(model, *args, **kwargs):
    """The string form of ``custom_generate`` (``custom_generate/generate.py`` of a MARS checkpoint).

    transformers calls it with the raw ``generate`` arguments. With ``mars_threshold`` it decodes
    with MARS; without it, it is stock ``generate``. Always calls the unbound
    ``GenerationMixin.generate`` so that a patched ``model.generate`` cannot recurse into this.
    """
    if kwargs.get("custom_generate") is not None and kwargs.get("custom_generate") is not mars_generate:
        raise ValueError("A MARS checkpoint's `generate` cannot chain to another `custom_generate`.")
    kwargs.pop("custom_generate", None)
    if kwargs.get("mars_threshold") is None:
        kwargs.pop("mars_threshold", None)
        return _stock(model, args, kwargs)
    return _route_to_mars(model, args, kwargs)


class MARSGenerationMixin:
    """Mix into a causal LM class (before it) so that ``generate(mars_threshold=τ)`` decodes with MARS.

    Without ``mars_threshold`` (and without ``custom_generate=mars_generate``) ``generate`` is the
    stock transformers method.
    """

    def generate(self, *args, **kwargs):
        custom = kwargs.get("custom_generate")
        if kwargs.get("mars_threshold") is not None or custom is mars_generate:
            return _route_to_mars(self, args, kwargs)
        if kwargs.get("mars_threshold", 0) is None:
            kwargs.pop("mars_threshold")
        if custom is not None:
            return GenerationMixin.generate(self, *args, **kwargs)
        return _stock(self, args, kwargs)


def enable_mars(
    model,
    block_size: int | None = None,
    mask_token_id: int | None = None,
    *,
    acceptance: str | None = None,
    cache: str | None = None,
    cache_block: int | None = None,
):
    """Make ``model.generate(mars_threshold=τ)`` decode with MARS; returns the same model object.

    Reads ``config.mars`` (``block_size``, ``mask_token_id``); keyword arguments override it for this
    model object only (``config.mars`` is not modified). ``acceptance``, ``cache`` and
    ``cache_block`` set defaults for ``mars_acceptance``, ``mars_cache`` and ``mars_cache_block``.
    The class is swapped for a subclass with the same name that mixes in ``MARSGenerationMixin``,
    so ``save_pretrained`` still records the original architecture.
    """
    overrides = {
        key: value
        for key, value in (
            ("block_size", block_size),
            ("mask_token_id", mask_token_id),
            ("acceptance", acceptance),
            ("cache", cache),
            ("cache_block", cache_block),
        )
        if value is not None
    }
    model._mars_overrides = {**(getattr(model, "_mars_overrides", None) or {}), **overrides}
    _resolve_window(model, None)
    _resolve_mask_token(model, None)
    if acceptance is not None and acceptance not in ACCEPTANCE_METRICS:
        raise ValueError(f"`acceptance` must be one of {ACCEPTANCE_METRICS}, got {acceptance!r}.")
    if cache is not None and cache not in CACHE_SCHEMES:
        raise ValueError(f"`cache` must be one of {CACHE_SCHEMES}, got {cache!r}.")
    cls = type(model)
    if not isinstance(model, MARSGenerationMixin):
        model.__class__ = type(cls.__name__, (MARSGenerationMixin, cls), {"__module__": cls.__module__})
    return model
