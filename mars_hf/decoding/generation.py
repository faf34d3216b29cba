"""MARS decoding as a transformers decoding strategy (MARS_SPEC §2-§3, §6).

Three ways in, one decoder (``decoder.MARSBatchDecoder``):

- ``model.generate(custom_generate=mars_generate, mars_threshold=0.9)``: the *callable* form of
  ``custom_generate``; transformers prepares inputs, logits processors and stopping criteria, then
  calls ``mars_generate``.
- ``enable_mars(model)`` (or a class that mixes in ``MARSGenerationMixin``): afterwards
  ``model.generate(**inputs, mars_threshold=0.9)`` or ``mars_acceptance="verify"`` routes to MARS;
  without them it is stock ``generate``. The settings may also come from a ``GenerationConfig``
  (``GenerationConfig(mars_threshold=0.9)``, the model's ``generation_config``); keywords win.
- the module-level ``generate(model, ...)``: the *string* form of ``custom_generate`` (this file
  ships verbatim as a checkpoint's ``custom_generate/generate.py``), which receives raw arguments.

This module imports only torch, transformers and its sibling modules (shipped beside it).
"""

from __future__ import annotations

import logging
import numbers
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import GenerationMixin
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.stopping_criteria import (
    EosTokenCriteria,
    MaxLengthCriteria,
    StoppingCriteriaList,
    StopStringCriteria,
)
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .acceptance import ACCEPTANCE_RULES, ScoreProcessing, one_token_per_step
from .cache import CACHE_SCHEMES, MARSBlockCache
from .decoder import MARSBatchDecoder, RowSettings, RowUpdate  # noqa: F401  (public re-exports)
from .draft_sources import DEFAULT_MAX_NGRAM, SOURCES
from .layouts import LAYOUT_CHOICES

logger = logging.getLogger(__name__)

DEFAULT_CACHE_BLOCK = 16
_MARS_KWARGS = (
    "mars_block_size",
    "mars_acceptance",
    "mars_cache",
    "mars_cache_block",
    "mars_mask_token_id",
    "mars_layout",
    "mars_planner",
    "mars_cost_table",
    "mars_cost_probe",
)
_MARS_SETTINGS = ("mars_threshold",) + _MARS_KWARGS


@dataclass
class MARSGenerateOutput(GenerateDecoderOnlyOutput):
    """``GenerateDecoderOnlyOutput`` plus MARS statistics.

    Args:
        num_forwards: every model call of the generation, the prompt's included.
        accepted_counts: ``[num_steps, batch]`` tokens accepted by each row at each step (0 once a
            row has finished, or while it waits for a block commit).
        drafts_proposed: ``[num_steps, batch]`` drafts each row checked at each step (verify only;
            zeros for threshold acceptance, which has no drafts).
        drafts_accepted: ``[num_steps, batch]`` of those, how many were kept.
        forward_widths: ``[num_forwards]`` columns per row each forward fed, padding included (the
            prompt's first): what the step planner chose, next to ``cost_curve``.
        plan_counts: how often a row fed nothing extra (``plain``), drafts only, a ``linear`` or a
            ``quadratic`` mask layout, or a ``fixed`` one (explicit layout, τ without the planner).
        drafts_by_source: ``{"masks": {"proposed": n, "accepted": n}, "lookup": {...}}``: drafts checked
            and kept per source over the whole call (``lookup``: ``prompt_lookup_num_tokens``).
        cost_curve: the relative forward cost per columns-per-row the planner used (``{n: cost}``), or
            None when no step needed it (one-token decoding).
    """

    num_forwards: int | None = None
    accepted_counts: torch.LongTensor | None = None
    drafts_proposed: torch.LongTensor | None = None
    drafts_accepted: torch.LongTensor | None = None
    forward_widths: torch.LongTensor | None = None
    plan_counts: dict | None = None
    cost_curve: dict | None = None
    drafts_by_source: dict | None = None


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
    _check_window(block_size)
    return int(block_size)


def _check_window(block_size, name: str = "`mars_block_size` (the window W)") -> None:
    """W is a whole number >= 1; a string, bool, NaN or inf gets this message, not int()'s."""
    whole = (isinstance(block_size, numbers.Integral) and not isinstance(block_size, bool)) or (
        isinstance(block_size, float) and block_size.is_integer()
    )
    if not whole or block_size < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {block_size!r}.")


def _check_model_window(model, window, name: str) -> None:
    """A model-wide W is not capped per call by ``max_new_tokens``: bound it by the position limit instead."""
    _check_window(window, name)
    limit = _position_limit(model)
    if limit is not None and window >= limit:
        raise ValueError(
            f"{name} = {window} must be below the model's position limit ({limit}): no step can feed "
            f"{window} masks after a prompt. The paper uses W = 4 to 16; a per-call `mars_block_size` is "
            "capped by `max_new_tokens` instead."
        )


def _position_limit(model) -> int | None:
    """The model's largest position (absolute-position models fail past it), when its config says."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for key in ("max_position_embeddings", "n_positions"):
        limit = getattr(config, key, None)
        if isinstance(limit, int) and limit > 0:
            return limit
    return None


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


def _from_generation_configs(values: dict, *configs) -> dict:
    """Fill the MARS settings a call left unset from generation configs (first that has one wins)."""
    filled = dict(values)
    for key in _MARS_SETTINGS:
        for config in configs:
            if filled.get(key) is None and config is not None:
                filled[key] = getattr(config, key, None)
    return filled


def _wants_mars(values: dict) -> bool:
    return values.get("mars_threshold") is not None or values.get("mars_acceptance") == "verify"


def _resolve_threshold(threshold, acceptance: str, batch_size: int) -> list[float | None]:
    if acceptance == "verify" and threshold is None:
        return [None] * batch_size
    if threshold is None:
        raise ValueError(
            "MARS decoding needs `mars_threshold=τ` (a float, or one value per batch row); τ = 1.0 "
            "reproduces ordinary decoding. Or use `mars_acceptance='verify'` (lossless, no τ needed)."
        )
    tau = _threshold_values(threshold)
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
    if acceptance == "verify" and ((tau < 0) | (tau > 1)).any():
        raise ValueError(
            f"With `mars_acceptance='verify'`, `mars_threshold` is a proposal floor in [0, 1] (masks less "
            f"confident than it are not proposed as drafts), got {tau.tolist()}."
        )
    if acceptance == "entropy" and (tau < 0).any():
        raise ValueError(
            f"`mars_threshold` is an entropy bound for 'entropy' and must be >= 0, got {tau.tolist()}."
        )
    return tau.tolist()


def _threshold_values(threshold) -> torch.Tensor:
    """τ as a flat float64 CPU tensor; anything but numbers is refused by name (torch's TypeError was opaque)."""
    items = threshold if isinstance(threshold, (list, tuple)) else [threshold]
    bad = isinstance(threshold, torch.Tensor) and (threshold.dtype == torch.bool or threshold.is_complex())
    bad = bad or any(isinstance(item, (str, bytes, bool)) for item in items)
    try:
        if not bad:
            return torch.as_tensor(threshold, dtype=torch.float64).flatten().to("cpu")
    except (TypeError, ValueError, RuntimeError):
        pass
    hint = ""
    if isinstance(threshold, str):
        try:
            hint = f" (write mars_threshold={float(threshold)!r}, a number, not the string {threshold!r})"
        except ValueError:
            pass
    raise TypeError(
        f"`mars_threshold` (τ) must be a real number, or one per batch row (a list or tensor of numbers); got "
        f"{type(threshold).__name__} {threshold!r}{hint}."
    )


def _prompt_leads(attention_mask, input_ids) -> list[int]:
    """Left-padding columns per row; MARS needs left padding (as stock decoder-only generation does)."""
    batch, length = input_ids.shape
    if attention_mask is None or bool((attention_mask == 1).all()):
        return [0] * batch
    if attention_mask.shape != input_ids.shape:
        raise ValueError("MARS decoding needs a 2D `attention_mask` shaped like `input_ids`.")
    valid = attention_mask.to(torch.bool)
    counts = valid.sum(1)
    leads = (length - counts).tolist()
    expected = torch.arange(length, device=valid.device)[None, :] >= (length - counts)[:, None]
    if not torch.equal(valid, expected):
        raise ValueError(
            "MARS decoding needs left-padded prompts (padding first, then the prompt); set "
            "`tokenizer.padding_side = 'left'`."
        )
    if any(lead >= length for lead in leads):
        raise ValueError("A batch row has no prompt token at all (its attention mask is all zeros).")
    return leads


def _user_cache(model_kwargs, scheme: str):
    cache = model_kwargs.pop("cache", None)
    legacy = model_kwargs.pop("past_key_values", None)
    cache = cache if cache is not None else legacy
    if cache is None or not getattr(cache, "_is_user_defined", isinstance(cache, MARSBlockCache)):
        return None
    if scheme == "none":
        raise ValueError("`mars_cache='none'` recomputes everything; do not pass a cache object.")
    if not isinstance(cache, MARSBlockCache):
        raise ValueError(
            f"MARS decoding keeps one length per row and drops the mask entries after each forward; a "
            f"{type(cache).__name__} cannot be cropped per row. Pass no cache (a `MARSBlockCache` is created), "
            "a `mars_hf.MARSBlockCache`, or use `mars_cache='none'`."
        )
    if any(getattr(layer, "is_initialized", False) for layer in cache.layers):
        raise ValueError(
            "MARS decoding starts from an empty cache; continuing from a filled cache is not supported."
        )
    return cache


# --------------------------------------------------------------------------------------------------
# The decoding function
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
    mars_layout: str | None = None,
    mars_planner: bool | None = None,
    mars_cost_table: dict | None = None,
    mars_cost_probe: bool | None = None,
    mars_streamer=None,
    mars_assistant_model=None,
    **model_kwargs,
):
    """MARS decoding loop for ``generate(custom_generate=mars_generate, mars_threshold=τ, ...)``.

    Each step feeds each row's new tokens (and, for ``verify``, last step's drafts) followed by ``W``
    mask tokens, reads the ordinary next-token prediction from the last real token and prediction
    ``j`` from the ``j``-th mask, and keeps tokens by the acceptance rule, stopping right after EOS / a
    stop criterion and never beyond ``max_length``.

    Args:
        mars_threshold: τ, a float or one value per batch row. With the probability (or margin) metric,
            τ >= 1 accepts exactly one token per step and appends no masks at all. With
            ``mars_acceptance="verify"`` it is optional and means a *proposal floor* in [0, 1]: masks
            whose confidence is below it are not proposed as drafts (fewer wasted rows; never changes
            the output).
        mars_block_size: window W (default ``config.mars["block_size"]``).
        mars_acceptance: (default ``"probability"``) ``"probability"`` (p(chosen) >= τ), ``"entropy"``
            (H <= τ), ``"margin"`` (p1 - p2 >= τ), or ``"verify"``: mask predictions are drafts that the
            next forward checks; the output is the model's own greedy (or sampled) output, lossless.
        mars_cache: ``"cursor"`` (commit every step, default), ``"block"`` (commit ``C`` columns at a
            time, the paper's scheme) or ``"none"`` (recompute everything each step; the reference).
        mars_cache_block: C for ``"block"`` (default 16).
        mars_mask_token_id: overrides ``config.mars["mask_token_id"]``.
        mars_layout: verify's feed. ``"auto"`` (default): the step planner chooses, each step and row,
            how many drafts to check and how many masks (one group after the drafts, a group after
            every draft prefix, or none) for the most expected tokens per unit of the forward's
            measured cost (``mars_hf.decoding.planner``, ``mars_hf.decoding.cost_model``); the output is the same
            whatever it chooses. ``"linear"`` (every draft, then one group of W masks) or
            ``"quadratic"`` (a group of W masks after every draft prefix) fix the feed.
        mars_planner: let the planner size τ rows' mask groups too (default False: τ keeps the
            paper's fixed window W). Changes which tokens τ can accept (never more predictions past
            the first than masks fed), so τ's output may differ from the fixed window's.
        mars_cost_table: ``{columns per row: relative cost}`` (e.g. ``{1: 1.0, 2: 1.05, 5: 1.3}``) used
            instead of measuring the forward's cost curve; missing sizes are interpolated.
        mars_cost_probe: False skips the measurement and assumes a flat curve (every width costs one
            column's: the planner then goes as wide as the window allows). Default True: measured at
            first use (about 2 s at most, per model, device, dtype, threads and batch size; cached for
            the process, and on disk under ``$MARS_HF_COST_CACHE`` when set).
        mars_streamer: the streamer (the MARS entry points pass it here because transformers does not
            forward ``streamer`` to custom decoding functions).
        mars_assistant_model: ``generate(assistant_model=...)`` (moved here by the entry points): a draft
            model with the same tokenizer, verify only; it proposes ``num_assistant_tokens`` drafts per
            step beside the masks' (MARS_SPEC §5).
    """
    generation_config = generation_config if generation_config is not None else model.generation_config
    prompt_already_streamed = False
    if streamer is None and mars_streamer is None:
        streamer = _caller_streamer()
        prompt_already_streamed = streamer is not None
    streamer = streamer if streamer is not None else mars_streamer

    values = _from_generation_configs(
        dict(
            mars_threshold=mars_threshold,
            mars_block_size=mars_block_size,
            mars_acceptance=mars_acceptance,
            mars_cache=mars_cache,
            mars_cache_block=mars_cache_block,
            mars_mask_token_id=mars_mask_token_id,
            mars_layout=mars_layout,
            mars_planner=mars_planner,
            mars_cost_table=mars_cost_table,
            mars_cost_probe=mars_cost_probe,
        ),
        generation_config,
    )
    settings = _mars_settings(model)
    acceptance = values["mars_acceptance"] or settings.get("acceptance", "probability")
    scheme = values["mars_cache"] or settings.get("cache", "cursor")
    cache_block = (
        values["mars_cache_block"] if values["mars_cache_block"] is not None else settings.get("cache_block")
    )
    layout = values["mars_layout"] or settings.get("layout")
    if acceptance not in ACCEPTANCE_RULES:
        raise ValueError(f"`mars_acceptance` must be one of {ACCEPTANCE_RULES}, got {acceptance!r}.")
    if scheme not in CACHE_SCHEMES:
        raise ValueError(f"`mars_cache` must be one of {CACHE_SCHEMES}, got {scheme!r}.")
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
    window = _resolve_window(model, values["mars_block_size"])
    mask_token_id = _resolve_mask_token(model, values["mars_mask_token_id"])
    batch_size, prompt_length = input_ids.shape
    taus = _resolve_threshold(values["mars_threshold"], acceptance, batch_size)
    cache_block = DEFAULT_CACHE_BLOCK if cache_block is None else int(cache_block)
    if cache_block < 1:
        raise ValueError(f"`mars_cache_block` (C) must be >= 1, got {cache_block}.")

    leads = _prompt_leads(model_kwargs.pop("attention_mask", None), input_ids)
    user_cache = _user_cache(model_kwargs, scheme)
    if user_cache is None and scheme != "none" and generation_config.cache_implementation is not None:
        logger.warning(
            "MARS decoding manages its own cache (`mars_cache=%r`); ignoring cache_implementation=%r.",
            scheme,
            generation_config.cache_implementation,
        )
    for key in ("position_ids", "use_cache", "logits_to_keep", "cache_position"):
        model_kwargs.pop(key, None)
    leftover = sorted(k for k, v in model_kwargs.items() if v is not None)
    if leftover:
        logger.warning("MARS decoding ignores these model inputs: %s", leftover)

    max_length, eos_ids, other_criteria = _split_stopping_criteria(stopping_criteria, generation_config)
    max_new = max(0, max_length - prompt_length)
    # Masks past the last token to generate predict nothing that is kept, while the window's buffers and
    # per-step work grow with W (W = 5000 for 8 tokens took 35 s): capped, a wider W decodes the same.
    window = min(window, max(1, max_new))
    pad_token_id = _pad_token(generation_config, eos_ids)
    # room for the provisional tokens of a step past the last one kept (processors and stop criteria read them)
    sequences = torch.full(
        (batch_size, prompt_length + max_new + min(window, max_new) + 2),
        pad_token_id,
        dtype=torch.long,
        device=input_ids.device,
    )
    sequences[:, :prompt_length] = input_ids
    processing = ScoreProcessing(logits_processor, sequences)
    lookup, ngram = _prompt_lookup(generation_config, acceptance)
    if mars_assistant_model is not None and acceptance != "verify":
        raise ValueError(
            "An `assistant_model` proposes drafts that only verified decoding checks; add "
            "`mars_acceptance='verify'`, or drop the MARS settings for transformers' assisted decoding."
        )
    assistant_tokens = getattr(generation_config, "num_assistant_tokens", None) or 5
    one_token = all(one_token_per_step(acceptance, tau) for tau in taus)
    decoder = MARSBatchDecoder(
        model,
        max_rows=batch_size,
        max_length=prompt_length + max_new,
        window=min(window, max(max_new, 1)),  # masks past the last new token could never be kept
        mask_token_id=mask_token_id,
        pad_token_id=pad_token_id,
        # with no masks to drop, a block has nothing to wait for: one-token decoding is cursor decoding
        cache="cursor" if (scheme == "block" and one_token) else scheme,
        cache_block=cache_block,
        layout=layout,
        planner=bool(values["mars_planner"]),
        cost_table=values["mars_cost_table"],
        cost_probe=values["mars_cost_probe"] is not False,
        kv_cache=user_cache,
        stopping_criteria=other_criteria if len(other_criteria) else None,
        assistant_model=mars_assistant_model,
        assistant_tokens=int(assistant_tokens),
    )
    return_dict = bool(generation_config.return_dict_in_generate)
    keep_scores = return_dict and bool(generation_config.output_scores)
    keep_logits = return_dict and bool(generation_config.output_logits)
    if keep_scores or keep_logits:
        decoder.score_records = []
    for b in range(batch_size):
        decoder.add_row(
            input_ids[b, leads[b] :],
            RowSettings(
                threshold=taus[b],
                acceptance=acceptance,
                max_new_tokens=max_new,
                eos_token_ids=tuple(eos_ids),
                do_sample=bool(generation_config.do_sample),
                prompt_lookup_num_tokens=lookup,
                max_matching_ngram_size=ngram,
            ),
            processing=processing,
            batch_index=b,
            lead=leads[b],
            row_id=b,
        )
    if streamer is not None and not prompt_already_streamed:
        streamer.put(input_ids.cpu())

    # prefix-dependent processors and stop criteria read the accepted tokens back from the buffer
    needs_buffer = not processing.position_free or len(other_criteria) > 0
    generated: list[list[int]] = [[] for _ in range(batch_size)]
    per_step: list[tuple[list[int], list[int], list[int]]] = []
    by_source = {source: {"proposed": 0, "accepted": 0} for source in SOURCES}
    while max_new and decoder.num_rows:
        updates = decoder.step()
        counts, proposed, accepted = [0] * batch_size, [0] * batch_size, [0] * batch_size
        places = []
        for update in updates:
            b = update.row_id
            if needs_buffer:
                places += [(b, prompt_length + len(generated[b]) + j) for j in range(len(update.tokens))]
            generated[b] += update.tokens
            counts[b], proposed[b], accepted[b] = (
                len(update.tokens),
                update.drafts_proposed,
                update.drafts_accepted,
            )
            by_source[update.draft_source]["proposed"] += update.drafts_proposed
            by_source[update.draft_source]["accepted"] += update.drafts_accepted
            if update.finished:
                decoder.drop_row(b)
        if places:
            rows = torch.tensor([b for b, _ in places], device=sequences.device)
            columns = torch.tensor([c for _, c in places], device=sequences.device)
            sequences[rows, columns] = torch.tensor(
                [t for u in updates for t in u.tokens], dtype=torch.long, device=sequences.device
            )
        per_step.append((counts, proposed, accepted))
        if streamer is not None:
            _stream(streamer, updates, batch_size, pad_token_id)
    if streamer is not None:
        streamer.end()
    longest = max((len(g) for g in generated), default=0)
    output = torch.full(
        (batch_size, prompt_length + longest), pad_token_id, dtype=torch.long, device=input_ids.device
    )
    output[:, :prompt_length] = input_ids
    for b, tokens in enumerate(generated):
        if tokens:
            output[b, prompt_length : prompt_length + len(tokens)] = torch.tensor(
                tokens, device=output.device
            )
    if not return_dict:
        return output

    def stat(k):
        if not per_step:
            return torch.zeros((0, batch_size), dtype=torch.long, device=input_ids.device)
        return torch.tensor([s[k] for s in per_step], dtype=torch.long, device=input_ids.device)

    scores, logits = _assemble_scores(decoder.score_records, batch_size, longest, keep_scores, keep_logits)
    return MARSGenerateOutput(
        sequences=output,
        scores=scores,
        logits=logits,
        cache=decoder.kv,
        num_forwards=decoder.num_forwards,
        accepted_counts=stat(0),
        drafts_proposed=stat(1),
        drafts_accepted=stat(2),
        forward_widths=torch.tensor(decoder.forward_widths, dtype=torch.long),
        plan_counts=dict(decoder.plan_counts),
        cost_curve=_cost_curve(decoder),
        drafts_by_source=by_source,
    )


def _prompt_lookup(generation_config, acceptance: str) -> tuple[int | None, int]:
    """``prompt_lookup_num_tokens`` / ``max_matching_ngram_size`` (transformers' keywords), checked."""
    lookup = getattr(generation_config, "prompt_lookup_num_tokens", None)
    ngram = getattr(generation_config, "max_matching_ngram_size", None)
    if lookup is None:
        return None, DEFAULT_MAX_NGRAM
    if acceptance != "verify":
        raise ValueError(
            "`prompt_lookup_num_tokens` proposes drafts that only verified decoding checks; add "
            "`mars_acceptance='verify'` (threshold acceptance has no drafts), or drop the MARS settings "
            "for transformers' own prompt lookup."
        )
    for name, value in (("prompt_lookup_num_tokens", lookup), ("max_matching_ngram_size", ngram)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1):
            raise ValueError(f"`{name}` must be an integer >= 1, got {value!r}.")
    return int(lookup), int(ngram) if ngram is not None else DEFAULT_MAX_NGRAM


def _cost_curve(decoder) -> dict | None:
    """The curve the planner used at this batch (the widest bucket when rows left and it shrank)."""
    if not decoder.cost_tables:
        return None
    return decoder.cost_tables[max(decoder.cost_tables)].as_dict()


def _stream(streamer, updates: list[RowUpdate], batch_size: int, pad_token_id: int) -> None:
    """Send only final (accepted / verified) tokens: a row's tokens at once for one row, else by column."""
    tokens = {u.row_id: u.tokens for u in updates}
    if batch_size == 1:
        if tokens.get(0):
            streamer.put(torch.tensor(tokens[0]))
        return
    for j in range(max((len(t) for t in tokens.values()), default=0)):
        column = [tokens[b][j] if j < len(tokens.get(b, ())) else pad_token_id for b in range(batch_size)]
        streamer.put(torch.tensor(column))


def _assemble_scores(records, batch_size, generated, keep_scores, keep_logits):
    """Per generated position, the ``[batch, vocab]`` scores/logits used for each row's token there."""
    if not records:
        return None, None
    vocab = records[0][2].shape[-1]
    device = records[0][2].device
    scores = [torch.zeros(batch_size, vocab, device=device) for _ in range(generated)]
    logits = [torch.zeros(batch_size, vocab, device=device) for _ in range(generated)]
    for row, start, row_scores, row_logits in records:
        for j in range(row_scores.shape[0]):
            if start + j < generated:
                scores[start + j][row] = row_scores[j]
                logits[start + j][row] = row_logits[j]
    return (tuple(scores) if keep_scores else None), (tuple(logits) if keep_logits else None)


# --------------------------------------------------------------------------------------------------
# Entry points: the mixin, enable_mars, and the string form of custom_generate
# --------------------------------------------------------------------------------------------------


def _call_config(args, kwargs):
    call_config = kwargs.get("generation_config")
    if call_config is None and len(args) > 1:
        call_config = args[1]
    return call_config


def _config_settings(config, source: str) -> dict:
    """The MARS settings a GenerationConfig sets, checked as keywords are.

    A misspelt ``mars_*`` name or a value outside its choices is refused even when the call then decodes
    stock: ``GenerationConfig(mars_acceptance="bogus")`` used to decode stock without a word.
    """
    if config is None:
        return {}
    unknown = sorted(key for key in vars(config) if key.startswith("mars_") and key not in _MARS_SETTINGS)
    if unknown:
        raise ValueError(f"{source} sets unknown MARS settings {unknown}; they are {list(_MARS_SETTINGS)}.")
    settings = {key: getattr(config, key, None) for key in _MARS_SETTINGS}
    settings = {key: value for key, value in settings.items() if value is not None}
    where = f" (set in {source})"
    choices = {"mars_acceptance": ACCEPTANCE_RULES, "mars_cache": CACHE_SCHEMES, "mars_layout": LAYOUT_CHOICES}
    for key, allowed in choices.items():
        if key in settings and settings[key] not in allowed:
            raise ValueError(f"`{key}` must be one of {tuple(allowed)}, got {settings[key]!r}{where}.")
    if "mars_block_size" in settings:
        _check_window(settings["mars_block_size"], f"`mars_block_size` (the window W){where}")
    if "mars_cache_block" in settings:
        _check_window(settings["mars_cache_block"], f"`mars_cache_block` (C){where}")
    if "mars_mask_token_id" in settings:
        token = settings["mars_mask_token_id"]
        if isinstance(token, bool) or not isinstance(token, numbers.Integral) or token < 0:
            raise ValueError(f"`mars_mask_token_id` must be a token id (an integer >= 0), got {token!r}{where}.")
    if "mars_threshold" in settings:
        _threshold_values(settings["mars_threshold"])
    return settings


def _call_values(model, args, kwargs) -> dict:
    """This call's MARS settings: keywords, else the call's GenerationConfig, else the model's."""
    call_config = _call_config(args, kwargs)
    _config_settings(call_config, "the call's `generation_config`")
    _config_settings(getattr(model, "generation_config", None), "the model's `generation_config`")
    values = {key: kwargs.get(key) for key in _MARS_SETTINGS}
    return _from_generation_configs(values, call_config, getattr(model, "generation_config", None))


def _refuse_rerouting(kwargs, call_config) -> None:
    """Settings under which stock ``generate`` would bypass the decoding callable: refuse, not skip MARS."""
    paged = kwargs.get("cache_implementation") == "paged" or (
        call_config is not None and getattr(call_config, "cache_implementation", None) == "paged"
    )
    if paged:
        raise ValueError(
            "cache_implementation='paged' makes transformers switch to its continuous-batching engine, "
            "which would decode without MARS. Drop it (MARS keeps its own per-row cache), or serve with "
            "`mars-hf serve`, which batches continuously with MARS."
        )


def _route_to_mars(model, args, kwargs, values=None):
    """Call stock ``GenerationMixin.generate`` with ``mars_generate`` as the decoding callable."""
    kwargs = dict(kwargs)
    values = values if values is not None else _call_values(model, args, kwargs)
    _refuse_rerouting(kwargs, kwargs.get("generation_config"))
    kwargs.pop("custom_generate", None)
    kwargs.pop("trust_remote_code", None)
    _stop_strings_as_criteria(model, args, kwargs)
    kwargs.update({key: value for key, value in values.items() if value is not None})
    kwargs["mars_streamer"] = kwargs.pop("streamer", None)
    # transformers hands a custom decoding function only its own keywords: the draft model travels as one
    kwargs["mars_assistant_model"] = kwargs.pop("assistant_model", None)
    return GenerationMixin.generate(model, *args, custom_generate=mars_generate, **kwargs)


def _stop_strings_as_criteria(model, args, kwargs) -> None:
    """Turn stop strings into a stopping criterion here: transformers drops the ``tokenizer`` keyword
    before calling a custom decoding function, so it could not build the criterion itself."""
    tokenizer = kwargs.pop("tokenizer", None)
    call_config = kwargs.get("generation_config") or (args[1] if len(args) > 1 else None)
    stop_strings = kwargs.get("stop_strings")
    for config in (call_config, getattr(model, "generation_config", None)):
        if stop_strings is None and config is not None:
            stop_strings = getattr(config, "stop_strings", None)
    if not stop_strings:
        return
    if tokenizer is None:
        raise ValueError("Stop strings need the model's tokenizer: pass `tokenizer=` to `generate`.")
    criteria = StoppingCriteriaList(kwargs.get("stopping_criteria") or [])
    criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings))
    kwargs["stopping_criteria"] = criteria
    kwargs["stop_strings"] = None  # also overrides a generation config's


def _stock(model, args, kwargs):
    stray = [k for k in _MARS_KWARGS if kwargs.get(k) is not None]
    if stray:
        raise ValueError(
            f"{stray} only apply to MARS decoding; also pass `mars_threshold=τ` or `mars_acceptance='verify'`."
        )
    stray = sorted(set(_config_settings(_call_config(args, kwargs), "")) & set(_MARS_KWARGS))
    if stray:
        raise ValueError(
            f"The call's `generation_config` sets {stray}, which only apply to MARS decoding; also set "
            "`mars_threshold=τ` or `mars_acceptance='verify'` in it (or as a keyword), or remove them."
        )
    for key in _MARS_SETTINGS:
        kwargs.pop(key, None)
    return GenerationMixin.generate(model, *args, **kwargs)


def _attach_shipped_adapter(model) -> None:
    """In a checkpoint's ``custom_generate/``: apply the gated adapter stored beside it, if any.

    A gated-adapter checkpoint (MARS_SPEC §7) is an adapter on a base model; plain transformers loads
    the base, and this applies the adapter and the trained mask row from the checkpoint (the
    ``custom_generate=`` argument of the running ``generate`` call: transformers runs a *copy* of this
    file from its module cache, so the checkpoint is not this file's parent). Inside the mars_hf
    package this does nothing: its loaders do it.
    """
    here = Path(__file__).resolve().parent
    if here.name != "custom_generate":
        return
    from .gated_lora import attach_shipped_adapter, find_custom_generate_checkpoint

    checkpoint = find_custom_generate_checkpoint()
    if checkpoint is not None:
        attach_shipped_adapter(model, checkpoint)


def generate(model, *args, **kwargs):
    """The string form of ``custom_generate`` (``custom_generate/generate.py`` of a MARS checkpoint).

    transformers calls it with the raw ``generate`` arguments. With ``mars_threshold`` or
    ``mars_acceptance="verify"`` (as keywords or in a generation config) it decodes with MARS; without
    them it is stock ``generate``. Always calls the unbound ``GenerationMixin.generate`` so that a
    patched ``model.generate`` cannot recurse into this.
    """
    if kwargs.get("custom_generate") is not None and kwargs.get("custom_generate") is not mars_generate:
        raise ValueError("A MARS checkpoint's `generate` cannot chain to another `custom_generate`.")
    kwargs.pop("custom_generate", None)
    _attach_shipped_adapter(model)
    values = _call_values(model, args, kwargs)
    if not _wants_mars(values):
        kwargs.pop("mars_threshold", None)
        return _stock(model, args, kwargs)
    return _route_to_mars(model, args, kwargs, values)


class MARSGenerationMixin:
    """Mix into a causal LM class (before it) so that ``generate(mars_threshold=τ)`` decodes with MARS.

    MARS is on when ``mars_threshold`` or ``mars_acceptance="verify"`` is given — as a keyword, in the
    call's ``generation_config`` or in the model's — or with ``custom_generate=mars_generate``;
    otherwise ``generate`` is the stock transformers method.
    """

    def generate(self, *args, **kwargs):
        custom = kwargs.get("custom_generate")
        values = _call_values(self, args, kwargs)
        if custom is mars_generate or (custom is None and _wants_mars(values)):
            return _route_to_mars(self, args, kwargs, values)
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
    layout: str | None = None,
):
    """Make ``model.generate(mars_threshold=τ)`` decode with MARS; returns the same model object.

    Reads ``config.mars`` (``block_size``, ``mask_token_id``); keyword arguments override it for this
    model object only (``config.mars`` is not modified). ``acceptance``, ``cache`` and
    ``cache_block`` and ``layout`` set defaults for ``mars_acceptance``, ``mars_cache``,
    ``mars_cache_block`` and ``mars_layout``.
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
            ("layout", layout),
        )
        if value is not None
    }
    if block_size is not None:
        _check_model_window(model, block_size, "`block_size` (the window W)")
    model._mars_overrides = {**(getattr(model, "_mars_overrides", None) or {}), **overrides}
    _check_model_window(model, _resolve_window(model, None), "The window W (`config.mars['block_size']`)")
    _resolve_mask_token(model, None)
    if acceptance is not None and acceptance not in ACCEPTANCE_RULES:
        raise ValueError(f"`acceptance` must be one of {ACCEPTANCE_RULES}, got {acceptance!r}.")
    if cache is not None and cache not in CACHE_SCHEMES:
        raise ValueError(f"`cache` must be one of {CACHE_SCHEMES}, got {cache!r}.")
    if layout is not None and layout not in LAYOUT_CHOICES:
        raise ValueError(f"`layout` must be one of {LAYOUT_CHOICES}, got {layout!r}.")
    cls = type(model)
    if not isinstance(model, MARSGenerationMixin):
        model.__class__ = type(cls.__name__, (MARSGenerationMixin, cls), {"__module__": cls.__module__})
    return model
