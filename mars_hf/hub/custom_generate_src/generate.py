"""MARS decoding for a checkpoint's ``custom_generate/``: torch, transformers and safetensors only.

    model.generate(**inputs, custom_generate="<checkpoint>", trust_remote_code=True, mars_threshold=0.9)

or, after ``AutoModelForCausalLM.from_pretrained("<checkpoint>", trust_remote_code=True)`` (transformers then
makes this file's ``generate`` the model's), ``model.generate(**inputs, mars_threshold=0.9)``. Without
``mars_threshold`` or ``mars_acceptance="verify"`` it is stock ``generate``.

- ``mars_threshold=τ`` (a float, or one per row): each step keeps the ordinary next-token prediction and then
  the masks' predictions while their confidence passes τ (``mars_acceptance``: ``"probability"`` (default),
  ``"entropy"`` or ``"margin"``); τ = 1 is one token per step, stock decoding.
- ``mars_acceptance="verify"``: lossless: the masks' predictions are drafts the next forward checks; the output
  is the model's own greedy output, or with ``do_sample=True`` its own keyed sample (same seed, same tokens).
- ``mars_block_size=W`` / ``mars_mask_token_id``: override ``config.mars``.
- ``mars_checkpoint="<checkpoint>"``: where a gated LoRA adapter lives when the model was loaded from its base
  (transformers does not tell this file which repository ``custom_generate=`` named).

This is the small, fixed path of mars_hf (cursor cache, linear feed, torch ops); mars_hf itself adds the step
planner, prompt lookup, draft models, the block cache and kernels (``pip install mars-hf``).
"""

from __future__ import annotations

import logging
import numbers
from dataclasses import dataclass

import torch
from transformers import GenerationMixin
from transformers.generation.stopping_criteria import (
    EosTokenCriteria,
    MaxLengthCriteria,
    StoppingCriteriaList,
    StopStringCriteria,
)
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .calibration import ConfidenceCalibration, calibration_for
from .decoder import Decoder
from .gated_lora import attach_checkpoint
from .processing import ScoreProcessing
from .rules import ACCEPTANCE_RULES
from .sampling import draw_seed

logger = logging.getLogger(__name__)

DECODING_KEYWORDS = ("mars_threshold", "mars_block_size", "mars_acceptance", "mars_mask_token_id")
# mars_hf settings that change only how fast a step runs, never the tokens: this copy has one path for them
SPEED_KEYWORDS = {
    "mars_cache": ("cursor",),
    "mars_cache_block": (),
    "mars_layout": ("auto", "linear"),
    "mars_cost_table": (),
    "mars_cost_probe": (False,),
    "mars_cpu_kernels": ("stock",),
}
MARS_KEYWORDS = DECODING_KEYWORDS + tuple(SPEED_KEYWORDS) + ("mars_planner",)
NEEDS_MARS_HF = "decode with mars_hf instead (`pip install mars-hf`; `mars_hf.AutoMARSModelForCausalLM`)"


@dataclass
class MARSGenerateOutput(GenerateDecoderOnlyOutput):
    """``GenerateDecoderOnlyOutput`` plus ``num_forwards``: every model call of the generation, the prompt's
    included. ``scores`` / ``logits`` of a row are zeros after it finished. No ``cache``: the decoding cache has
    holes (columns a row did not keep) that only its own attention mask hides."""

    num_forwards: int | None = None


@dataclass(frozen=True)
class Settings:
    acceptance: str
    thresholds: tuple
    window: int
    mask_token_id: int
    calibration: ConfidenceCalibration | None


# ------------------------------------------------------------------------------------------ the entry point
def generate(model, *args, mars_checkpoint=None, **kwargs):
    """What transformers calls for ``generate(custom_generate=<checkpoint>)`` (with the raw arguments), and what
    ``from_pretrained(trust_remote_code=True)`` installs as ``model.generate``."""
    kwargs.pop("custom_generate", None)  # this file is the custom_generate of that call
    kwargs.pop("trust_remote_code", None)
    attach_checkpoint(model, mars_checkpoint)
    call_config = kwargs.get("generation_config", args[1] if len(args) > 1 else None)
    values, given = _mars_values(model, kwargs, call_config)
    if values["mars_threshold"] is None and values["mars_acceptance"] != "verify":
        if given:  # a model-wide default (its generation_config) waits for a τ per call; the call's does not
            raise ValueError(
                f"{given} only apply to MARS decoding; also pass `mars_threshold=τ` or `mars_acceptance='verify'`."
            )
        # the unbound method: a model whose generate is this function never comes back here
        return GenerationMixin.generate(model, *args, **kwargs)
    if values["mars_planner"]:
        raise ValueError(
            f"`mars_planner` (a τ window sized per step) is not in custom_generate/; {NEEDS_MARS_HF}."
        )
    ignored = {
        k: values[k] for k, ok in SPEED_KEYWORDS.items() if values[k] is not None and values[k] not in ok
    }
    if ignored:
        logger.warning(
            "custom_generate/ has one decoding path (cursor cache, linear feed, torch ops) and ignores %s: they "
            "change only speed, never the tokens; for them, %s.",
            ignored,
            NEEDS_MARS_HF,
        )
    _refuse_unsupported(model, kwargs, call_config)
    _stop_strings_as_criteria(model, kwargs, call_config)
    kwargs.update({key: values[key] for key in DECODING_KEYWORDS if values[key] is not None})
    kwargs["mars_streamer"] = kwargs.pop(
        "streamer", None
    )  # transformers does not hand a callable the streamer
    return GenerationMixin.generate(model, *args, custom_generate=mars_generate, **kwargs)


def _mars_values(model, kwargs, call_config) -> tuple[dict, list]:
    """Every MARS setting of the call (keywords, else the call's, else the model's generation config), and
    which of them the call itself set. A misspelt ``mars_*`` setting in a generation config is refused."""
    values = {key: kwargs.pop(key, None) for key in MARS_KEYWORDS}
    given = [key for key in MARS_KEYWORDS if values[key] is not None]
    for config, where in (
        (call_config, "the call's"),
        (getattr(model, "generation_config", None), "the model's"),
    ):
        if config is None:
            continue
        unknown = sorted(k for k in vars(config) if k.startswith("mars_") and k not in MARS_KEYWORDS)
        if unknown:
            raise ValueError(
                f"{where} `generation_config` sets unknown MARS settings {unknown}; see {MARS_KEYWORDS}."
            )
        for key in MARS_KEYWORDS:
            if values[key] is None and getattr(config, key, None) is not None:
                values[key] = getattr(config, key)
                if config is call_config:
                    given.append(key)
    return values, given


def _refuse_unsupported(model, kwargs, call_config) -> None:
    configs = (call_config, getattr(model, "generation_config", None))
    if kwargs.get("assistant_model") is not None:
        raise ValueError(
            f"A draft model (`assistant_model`) with MARS is not in custom_generate/; {NEEDS_MARS_HF}."
        )
    lookup = kwargs.get("prompt_lookup_num_tokens")
    if lookup is not None or any(getattr(c, "prompt_lookup_num_tokens", None) for c in configs):
        raise ValueError(f"Prompt lookup with MARS is not in custom_generate/; {NEEDS_MARS_HF}.")
    if "paged" in (kwargs.get("cache_implementation"), getattr(call_config, "cache_implementation", None)):
        raise ValueError(
            "cache_implementation='paged' switches transformers to continuous batching, without MARS; drop it."
        )


def _stop_strings_as_criteria(model, kwargs, call_config) -> None:
    """transformers drops ``tokenizer`` before calling a decoding callable, so stop strings become a criterion here."""
    tokenizer = kwargs.pop("tokenizer", None)
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
    kwargs["stopping_criteria"], kwargs["stop_strings"] = criteria, None


# ------------------------------------------------------------------------------------------ the decoding function
def mars_generate(
    model,
    input_ids: torch.LongTensor,
    logits_processor=None,
    stopping_criteria=None,
    generation_config=None,
    synced_gpus: bool = False,
    streamer=None,
    mars_threshold=None,
    mars_block_size=None,
    mars_acceptance=None,
    mars_mask_token_id=None,
    mars_streamer=None,
    **model_kwargs,
):
    """The decoding loop transformers calls with the prepared inputs, processors and stopping criteria."""
    generation_config = generation_config if generation_config is not None else model.generation_config
    streamer = streamer if streamer is not None else mars_streamer
    if input_ids.is_floating_point():
        raise TypeError(
            f"`input_ids` must hold integer token ids, not {input_ids.dtype}; convert it with `.long()`."
        )
    max_length, eos, criteria = _split_criteria(stopping_criteria, generation_config)
    batch_size, prompt_length = input_ids.shape
    max_new = max(0, max_length - prompt_length)
    values = dict(
        zip(DECODING_KEYWORDS, (mars_threshold, mars_block_size, mars_acceptance, mars_mask_token_id))
    )
    settings = _settings(model, values, generation_config, batch_size, max_new)
    _check_supported(model, generation_config, model_kwargs)
    seed = draw_seed() if generation_config.do_sample else None  # rows' draws keyed to (seed, row, position)
    leads = _prompt_leads(model_kwargs.pop("attention_mask", None), input_ids)
    pad = _pad_token(generation_config, eos)
    buffer = torch.full((batch_size, prompt_length + max_new + settings.window + 2), pad, dtype=torch.long)
    buffer[:, :prompt_length] = input_ids
    processing = ScoreProcessing(logits_processor, buffer.to(input_ids.device))
    decoder = Decoder(
        model, input_ids, leads, settings, processing, criteria or None, eos, max_new, pad, seed
    )
    return_dict = bool(generation_config.return_dict_in_generate)
    if return_dict and (generation_config.output_scores or generation_config.output_logits):
        decoder.score_records = []
    stream = _Stream(streamer, decoder, pad) if streamer is not None else None
    if streamer is not None:
        streamer.put(input_ids.cpu())
    while decoder.live:
        kept = decoder.step()
        if stream is not None:
            stream.after_step(kept)
    if stream is not None:
        stream.end()
    return _output(input_ids, decoder, pad, generation_config)


def _settings(model, values, generation_config, batch_size: int, max_new: int) -> Settings:
    """This call's MARS settings (keywords, else ``config.mars``), each checked, naming the fix."""
    mars = dict(getattr(model.config, "mars", None) or {})
    acceptance = values["mars_acceptance"] or mars.get("acceptance") or "probability"
    if acceptance not in ACCEPTANCE_RULES:
        raise ValueError(f"`mars_acceptance` must be one of {ACCEPTANCE_RULES}, got {acceptance!r}.")
    window = values["mars_block_size"] if values["mars_block_size"] is not None else mars.get("block_size")
    mask = (
        values["mars_mask_token_id"]
        if values["mars_mask_token_id"] is not None
        else mars.get("mask_token_id")
    )
    if window is None or mask is None:
        raise ValueError(
            "This model has no MARS settings (config.mars with block_size and mask_token_id). If it is the base model "
            'of a MARS adapter checkpoint, pass `mars_checkpoint="<that checkpoint>"` (a folder or Hub id) to '
            "generate: custom_generate/ cannot see which repository `custom_generate=` named. Or pass "
            "`mars_block_size=` and `mars_mask_token_id=`."
        )
    if isinstance(window, bool) or not isinstance(window, numbers.Integral) or window < 1:
        raise ValueError(f"`mars_block_size` (the window W) must be an integer >= 1, got {window!r}.")
    rows = model.get_input_embeddings().weight.shape[0]
    if isinstance(mask, bool) or not isinstance(mask, numbers.Integral) or not 0 <= mask < rows:
        raise ValueError(f"The mask token id {mask!r} is not a row of the {rows}-row embedding matrix.")
    per_prompt = int(getattr(generation_config, "num_return_sequences", None) or 1)
    thresholds = _thresholds(values["mars_threshold"], acceptance, batch_size, per_prompt)
    window = min(int(window), max(1, max_new))  # a mask past the last token to generate is never kept
    calibration = calibration_for(model, window)
    return Settings(acceptance, tuple(thresholds), window, int(mask), calibration)


def _thresholds(threshold, acceptance: str, batch_size: int, per_prompt: int) -> list:
    """τ per batch row: one value, one per prompt (repeated for its ``num_return_sequences``) or one per row."""
    if threshold is None:
        return [None] * batch_size  # verify without a proposal floor
    items = threshold if isinstance(threshold, (list, tuple)) else [threshold]
    if any(isinstance(item, (str, bytes, bool)) for item in items):
        raise TypeError(f"`mars_threshold` (τ) must be a number or one number per row, got {threshold!r}.")
    tau = torch.as_tensor(threshold, dtype=torch.float64).flatten().cpu()
    if tau.numel() == 1:
        tau = tau.expand(batch_size)
    elif tau.numel() * per_prompt == batch_size:
        tau = tau.repeat_interleave(per_prompt)
    if tau.numel() != batch_size or torch.isnan(tau).any():
        raise ValueError(
            f"`mars_threshold` needs one number, one per prompt or one per row ({batch_size}), no NaN."
        )
    if acceptance == "entropy" and (tau < 0).any():
        raise ValueError(
            f"`mars_threshold` is an entropy bound for 'entropy' and must be >= 0, got {tau.tolist()}."
        )
    if acceptance != "entropy" and ((tau < 0) | (tau > 1)).any():
        raise ValueError(
            f"`mars_threshold` must lie in [0, 1] for {acceptance!r} (1.0: one token per step; with verify it is a "
            f"proposal floor), got {tau.tolist()}."
        )
    return tau.tolist()


def _check_supported(model, generation_config, model_kwargs) -> None:
    """Refuse what this decoding cannot do, naming the setting; drop the model inputs it builds itself."""
    if getattr(generation_config, "guidance_scale", None) not in (None, 1):
        raise ValueError("MARS decoding does not support classifier-free guidance; unset `guidance_scale`.")
    if getattr(generation_config, "num_beams", 1) not in (None, 1):
        raise ValueError("MARS decoding does not support beam search; set `num_beams=1`.")
    if model.config.is_encoder_decoder:
        raise ValueError("MARS decoding is for decoder-only models.")
    if generation_config.output_attentions or generation_config.output_hidden_states:
        raise ValueError(
            "MARS decoding returns no attentions or hidden states; unset `output_attentions` / `output_hidden_states`."
        )
    if model_kwargs.get("inputs_embeds") is not None:
        raise ValueError("MARS decoding needs `input_ids`, not `inputs_embeds`.")
    for key in ("cache", "past_key_values"):
        cache = model_kwargs.pop(key, None)
        if cache is not None and getattr(cache, "_is_user_defined", False):
            raise ValueError(
                "custom_generate/ keeps its own cache (it drops the mask entries each step); pass no cache."
            )
    for key in ("position_ids", "use_cache", "logits_to_keep", "cache_position"):
        model_kwargs.pop(key, None)
    leftover = sorted(k for k, v in model_kwargs.items() if v is not None and k != "attention_mask")
    if leftover:
        logger.warning("MARS decoding ignores these model inputs: %s", leftover)


def _split_criteria(stopping_criteria, generation_config):
    """Max length and EOS apart (checked per token by the decoder); the other criteria as a list."""
    max_length, eos, other = generation_config.max_length, set(), StoppingCriteriaList()
    for criterion in stopping_criteria or []:
        if isinstance(criterion, MaxLengthCriteria):
            max_length = criterion.max_length if max_length is None else min(max_length, criterion.max_length)
        elif isinstance(criterion, EosTokenCriteria):
            eos.update(int(i) for i in criterion.eos_token_id.flatten().tolist())
        else:
            other.append(criterion)
    return max_length, sorted(eos), other


def _pad_token(generation_config, eos: list[int]) -> int:
    pad = getattr(generation_config, "_pad_token_tensor", None)
    if pad is not None:
        return int(pad.flatten()[0])
    if generation_config.pad_token_id is not None:
        return int(generation_config.pad_token_id)
    return eos[0] if eos else 0


def _prompt_leads(attention_mask, input_ids) -> list[int]:
    """Left-padding columns per row, from the attention mask (never from token ids: pad may equal EOS)."""
    batch, length = input_ids.shape
    if attention_mask is None or bool((attention_mask == 1).all()):
        return [0] * batch
    valid = attention_mask.to(torch.bool)
    counts = valid.sum(1)
    expected = torch.arange(length, device=valid.device)[None, :] >= (length - counts)[:, None]
    if (
        attention_mask.shape != input_ids.shape
        or not torch.equal(valid, expected)
        or bool((counts == 0).any())
    ):
        raise ValueError(
            "MARS decoding needs left-padded prompts (padding first, then at least one prompt token) and a 2D "
            "`attention_mask` shaped like `input_ids`; set `tokenizer.padding_side = 'left'`."
        )
    return (length - counts).tolist()


# ------------------------------------------------------------------------------------------ streaming and output
class _Stream:
    """Final tokens only, in stock shapes: one row's as each step keeps them; a batch's as whole ``(batch,)``
    columns, each sent once every running row has filled it (finished rows hold the pad token)."""

    def __init__(self, streamer, decoder: Decoder, pad: int):
        self.streamer, self.rows, self.pad, self.sent = streamer, decoder.rows, pad, 0

    def after_step(self, kept) -> None:
        if len(self.rows) == 1:
            if kept and kept[0][1]:
                self.streamer.put(torch.tensor(kept[0][1]))
            return
        running = [len(row.generated) for row in self.rows if not row.finished]
        self._send_up_to(min(running) if running else max(len(row.generated) for row in self.rows))

    def end(self) -> None:
        if len(self.rows) > 1:
            self._send_up_to(max(len(row.generated) for row in self.rows))
        self.streamer.end()

    def _send_up_to(self, columns: int) -> None:
        for j in range(self.sent, columns):
            self.streamer.put(
                torch.tensor([row.generated[j] if j < len(row.generated) else self.pad for row in self.rows])
            )
        self.sent = max(self.sent, columns)


def _output(input_ids, decoder: Decoder, pad: int, generation_config):
    """The sequences (rows padded after their end), or a ``MARSGenerateOutput``."""
    batch_size, prompt_length = input_ids.shape
    longest = max(len(row.generated) for row in decoder.rows)
    sequences = torch.full(
        (batch_size, prompt_length + longest), pad, dtype=torch.long, device=input_ids.device
    )
    sequences[:, :prompt_length] = input_ids
    for row in decoder.rows:
        if row.generated:
            sequences[row.b, prompt_length : prompt_length + len(row.generated)] = torch.tensor(row.generated)
    if not generation_config.return_dict_in_generate:
        return sequences
    scores = logits = None
    if decoder.score_records:
        vocab, device = decoder.score_records[0][2].shape[-1], decoder.score_records[0][2].device
        scores = [torch.zeros(batch_size, vocab, device=device) for _ in range(longest)]
        logits = [torch.zeros(batch_size, vocab, device=device) for _ in range(longest)]
        for b, start, row_scores, row_logits in decoder.score_records:
            for j in range(row_scores.shape[0]):
                scores[start + j][b], logits[start + j][b] = row_scores[j], row_logits[j]
    return MARSGenerateOutput(
        sequences=sequences,
        scores=tuple(scores) if scores is not None and generation_config.output_scores else None,
        logits=tuple(logits) if logits is not None and generation_config.output_logits else None,
        num_forwards=decoder.num_forwards,
    )
