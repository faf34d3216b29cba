"""MARS decoding as a transformers decoding strategy (docs/method.md §2-§3, §6).

Three ways in, one decoder (``decoder.MARSBatchDecoder``):

- ``model.generate(custom_generate=mars_generate, mars_threshold=0.9)``: the *callable* form of
  ``custom_generate``; transformers prepares inputs, logits processors and stopping criteria, then
  calls ``mars_generate``. transformers does not hand such a callable ``streamer``, ``assistant_model`` or
  ``tokenizer`` (and cannot be asked whether they were given): on a model without ``enable_mars``, pass
  ``mars_streamer=`` and ``mars_assistant_model=``, and stop strings as a ``StopStringCriteria`` in
  ``stopping_criteria``.
- ``AutoMARSModelForCausalLM`` (a class that mixes in ``MARSGenerationMixin``: ``mars_class``), or
  ``mars_model = enable_mars(model)`` on a model you already hold (a ``MARSModel`` that owns it): then
  ``model.generate(**inputs, mars_threshold=0.9)`` or ``mars_acceptance="verify"`` routes to MARS;
  without them it is stock ``generate``. The settings may also come from a ``GenerationConfig``
  (``GenerationConfig(mars_threshold=0.9)``, the model's ``generation_config``); keywords win.
- the module-level ``generate(model, ...)``: the raw ``generate`` arguments, routed to MARS or stock
  (a checkpoint's ``custom_generate/`` is a separate, slim copy: ``mars_hf/hub/custom_generate_src``).

The settings are resolved and checked once (``settings.MARSDecodingSettings``); ``mars_generate``
then sets the decoder up, runs its steps and assembles transformers' output.
This module imports only torch, transformers and its sibling modules.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch
from transformers import GenerationMixin
from transformers.generation.logits_process import (
    LogitsProcessorList,
    UnbatchedClassifierFreeGuidanceLogitsProcessor,
)
from transformers.generation.stopping_criteria import (
    EosTokenCriteria,
    MaxLengthCriteria,
    StoppingCriteriaList,
    StopStringCriteria,
)
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .acceptance import ScoreProcessing
from .cache import MARSBlockCache, MARSStaticCache
from .cost_model import CostTable, static_steps_curve
from .cpu_kernels import packed_linears
from .decoder import (  # noqa: F401  (public re-exports)
    MARSBatchDecoder,
    RowSettings,
    RowUpdate,
    check_token_ids,
    widest_step,
)
from .drafts import SOURCES
from .memory import PlannerMemory
from .sampling import draw_seed
from .settings import (
    MARS_KEYWORDS,
    MARS_ONLY_KEYWORDS,
    MARSDecodingSettings,
    check_generation_config,
    fill_from_generation_configs,
)

logger = logging.getLogger(__name__)


@dataclass
class MARSGenerateOutput(GenerateDecoderOnlyOutput):
    """``GenerateDecoderOnlyOutput`` plus MARS statistics.

    ``scores`` / ``logits`` hold, for each token a row generated, what stock ``generate`` holds there (the
    processed / raw next-token logits it was chosen from); after a row has finished they are zeros, where stock
    has the logits of the padding it keeps feeding (MARS feeds a finished row nothing).

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
            ``quadratic`` mask layout, a ``fixed`` one (explicit layout, τ without the planner), or a
            ``unit`` step (plain, to re-time one column after a long run of wider steps).
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
    mars_cost_probe: bool | PlannerMemory | None = None,
    mars_cpu_kernels: str | None = None,
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
        mars_threshold: τ, a float, one value per prompt (repeated for its ``num_return_sequences``) or one
            per row. With the probability (or margin) metric, τ >= 1 accepts exactly one token per step
            and appends no masks at all. With ``mars_acceptance="verify"`` it is optional and means a
            *proposal floor* in [0, 1]: masks whose confidence is below it are not proposed as drafts
            (fewer wasted rows; never changes the output).
        mars_block_size: window W (default ``config.mars["block_size"]``).
        mars_acceptance: (default ``"probability"``) ``"probability"`` (p(chosen) >= τ), ``"entropy"``
            (H <= τ), ``"margin"`` (p1 - p2 >= τ), or ``"verify"``: mask predictions are drafts that the
            next forward checks; the output is the model's own greedy (or sampled) output, lossless.
        mars_cache: ``"cursor"`` (commit every step, default), ``"block"`` (commit ``C`` columns at a
            time, the paper's scheme) or ``"none"`` (recompute everything each step; the reference).
        mars_cache_block: C for ``"block"`` (default 16).
        mars_mask_token_id: overrides ``config.mars["mask_token_id"]``.
        mars_layout: verify's feed. ``"auto"`` (the default on a CPU, and wherever a cost curve is measured or
            given): the step planner chooses, each step and row, how many drafts to check and how many masks (one
            group after the drafts, a group after every draft prefix, or none) for the most expected tokens per
            unit of the forward's cost (``mars_hf.decoding.planner``, ``mars_hf.decoding.cost_model``): the
            measured curve (``mars_cost_probe``), the given one (``mars_cost_table``), or else an assumed one (a
            CPU: each extra column costs 0.3 of one; an accelerator: flat). The output is the same whatever it
            chooses. ``"linear"`` (every draft, then one group of W masks; the default on an accelerator, and on a
            static cache where its full step costs about one column: ``_static_feed``) or ``"quadratic"`` (a group
            of W masks after every draft prefix) fix the feed.
        mars_planner: let the planner size τ rows' mask groups too (default False: τ keeps the
            paper's fixed window W). Changes which tokens τ can accept (never more predictions past
            the first than masks fed), so τ's output may differ from the fixed window's, and with a measured
            cost curve (``mars_cost_probe``) it follows the machine's timing.
        mars_cost_table: ``{columns per row: relative cost}`` (e.g. ``{1: 1.0, 2: 1.05, 5: 1.3}``) used
            instead of measuring the forward's cost curve; missing sizes are interpolated.
        mars_cost_probe: measure what a step of each width costs on this machine and let the planner feed what
            pays there: ``True`` for this call alone (about 2 s at most per batch size), or a
            ``mars_hf.PlannerMemory`` you keep: measured once into it, and later calls given it start from
            what it learnt (and on disk under ``$MARS_HF_COST_CACHE`` when set). Default: nothing is timed and
            nothing is kept between calls (``mars_layout``'s assumed curve or fixed feed).
        mars_cpu_kernels: ``"stock"`` (default): the stock kernels, no private op. ``"auto"`` (opt-in): on a
            float32 or bfloat16 CPU model, the linears run on oneDNN with weights packed once (a second copy)
            where that measures faster, for the whole call; ``"packed"`` always. One-row forwards keep the
            stock kernel's bits: they run packed only where the pack rounds exactly like it
            (docs/accelerators.md).
        mars_streamer: the streamer. transformers does not hand ``streamer`` to a decoding callable, so
            the MARS entry points pass it here; with the callable form on a model without
            ``enable_mars``, pass it here yourself. It receives the prompt, then only final tokens (one row:
            as each step keeps them; a batch: whole ``(batch,)`` output columns, as stock ``generate`` sends).
        mars_assistant_model: ``generate(assistant_model=...)`` (moved here by the entry points): a draft
            model with the same tokenizer (docs/method.md §5). Verify: it proposes ``num_assistant_tokens``
            drafts per step beside the masks' (the planner picks what to feed). τ: every step checks its
            ``num_assistant_tokens`` drafts exactly and extends the kept prefix with the masks after it
            that pass τ (the paper's composition).
    """
    check_token_ids(input_ids)
    generation_config = generation_config if generation_config is not None else model.generation_config
    streamer = streamer if streamer is not None else mars_streamer
    max_length, eos_ids, other_criteria = _split_stopping_criteria(stopping_criteria, generation_config)
    batch_size, prompt_length = input_ids.shape
    max_new = max(0, max_length - prompt_length)
    keywords = dict(
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
        mars_cpu_kernels=mars_cpu_kernels,
    )
    settings = MARSDecodingSettings.resolve(
        model,
        keywords,
        generation_config,
        batch_size=batch_size,
        max_new_tokens=max_new,
    )
    _check_supported(model, generation_config, model_kwargs, logits_processor)
    static = _static_cache_wanted(generation_config, model_kwargs, settings.cache)
    if static:
        settings = _static_feed(model, settings, mars_assistant_model is not None)
    # one seed per call, from torch's global generator; each row's draws are keyed to (seed, row, position)
    seed = draw_seed() if generation_config.do_sample else None
    leads = _prompt_leads(model_kwargs.pop("attention_mask", None), input_ids)
    user_cache = _take_model_inputs(model_kwargs, settings.cache, generation_config)
    pad_token_id = _pad_token(generation_config, eos_ids)
    processing = ScoreProcessing(
        logits_processor, _token_buffer(input_ids, max_new, settings.window, pad_token_id)
    )
    decoder = _make_decoder(
        model,
        settings,
        input_ids,
        max_new,
        pad_token_id,
        user_cache,
        other_criteria,
        mars_assistant_model,
        generation_config if static else None,
    )
    if _wants_scores(generation_config):
        decoder.score_records = []
    for b in range(batch_size):
        row = _row_settings(settings, b, max_new, eos_ids, generation_config, seed)
        decoder.add_row(
            input_ids[b, leads[b] :], row, processing=processing, batch_index=b, lead=leads[b], row_id=b
        )
    if streamer is not None:
        streamer.put(input_ids.cpu())
    # prefix-dependent processors and stop criteria read the accepted tokens back from the buffer
    write_back = not processing.position_free or len(other_criteria) > 0
    transcript = _Transcript(batch_size, prompt_length, processing.sequences if write_back else None)
    _run(decoder, transcript, streamer, pad_token_id, max_new)
    return _output(input_ids, transcript, decoder, pad_token_id, generation_config)


# --------------------------------------------------------------------------------------------------
# Setting up: what the call asks for, and what MARS can do with it
# --------------------------------------------------------------------------------------------------


def _check_supported(model, generation_config, model_kwargs, logits_processor=None) -> None:
    """Refuse what MARS decoding cannot do, naming the setting to change."""
    guidance = getattr(generation_config, "guidance_scale", None)
    if (guidance is not None and guidance != 1) or any(
        isinstance(p, UnbatchedClassifierFreeGuidanceLogitsProcessor) for p in logits_processor or ()
    ):
        # its processor runs the model on the unconditional prompt with a cache of its own, one call per new token;
        # a MARS step scores several prefixes at once (its scores would be wrong, or its dtypes clash)
        raise ValueError(
            "MARS decoding does not support classifier-free guidance; unset `guidance_scale` (or set it to 1)."
        )
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


def _pad_token(generation_config, eos_ids: list[int]) -> int:
    pad = getattr(generation_config, "_pad_token_tensor", None)
    if pad is not None:
        return int(pad.flatten()[0])
    if generation_config.pad_token_id is not None:
        return int(generation_config.pad_token_id)
    return eos_ids[0] if eos_ids else 0


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


def _static_feed(model, settings: MARSDecodingSettings, assistant: bool) -> MARSDecodingSettings:
    """The feed on transformers' fast path, where a decode step runs at one of two shapes (two compiled graphs at
    most): one column, or ``widest_step`` columns. Nothing is timed. Where columns are nearly free
    (``cost_model.columns_nearly_free``: an accelerator, a CPU computing bf16 natively) the fixed linear feed, every
    step at the full width; elsewhere verify's planner chooses between a plain step and a full one on the
    assumed or given curve read at those widths (``cost_model.static_steps_curve``). The compiler picks the
    kernels (``cpu_kernels``' packed linears are the eager path's; Inductor emits its own)."""
    if settings.cost_memory is not None:
        raise ValueError(
            "`mars_cost_probe` measures eager steps of every width, but a static cache's steps run at one column or "
            "at the full width (compiled graphs); drop it (a `mars_cost_table` is read at those two widths), or drop "
            "`cache_implementation='static'`."
        )
    if settings.layout in ("linear", "quadratic"):
        return dataclasses.replace(settings, cost_table=None, cpu_kernels="stock")
    width = widest_step(settings, assistant)  # the linear feed's width: only "quadratic" widens a step
    given = CostTable.from_mapping(settings.cost_table) if settings.cost_table is not None else None
    curve = static_steps_curve(model, width, given) if width > 1 else None
    layout = "auto" if curve is not None else "linear"
    return dataclasses.replace(settings, layout=layout, cost_table=curve, cpu_kernels="stock")


def _static_cache_wanted(generation_config, model_kwargs, scheme: str) -> bool:
    """``cache_implementation="static"`` (transformers' fast path), or a ``MARSStaticCache`` passed as ``cache``."""
    given = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    static = generation_config.cache_implementation == "static" or isinstance(given, MARSStaticCache)
    if static and scheme == "none":
        raise ValueError(
            "`mars_cache='none'` recomputes everything and keeps no cache; drop `cache_implementation='static'` "
            "(or use the default `mars_cache='cursor'`)."
        )
    return static


def _take_model_inputs(model_kwargs, scheme: str, generation_config) -> MARSBlockCache | None:
    """The caller's cache, if any; the model inputs MARS builds itself are dropped, others named."""
    user_cache = _user_cache(model_kwargs, scheme)
    if (
        user_cache is None
        and scheme != "none"
        and generation_config.cache_implementation not in (None, "static")
    ):
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
    return user_cache


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


def _token_buffer(input_ids, max_new: int, window: int, pad_token_id: int) -> torch.Tensor:
    """The rows' tokens in stock ``generate``'s layout (what processors and stop criteria read), with
    room for the provisional tokens of a step past the last one kept."""
    batch_size, prompt_length = input_ids.shape
    sequences = torch.full(
        (batch_size, prompt_length + max_new + min(window, max_new) + 2),
        pad_token_id,
        dtype=torch.long,
        device=input_ids.device,
    )
    sequences[:, :prompt_length] = input_ids
    return sequences


def _make_decoder(
    model,
    settings: MARSDecodingSettings,
    input_ids,
    max_new,
    pad_token_id,
    user_cache,
    criteria,
    assistant,
    static_config=None,
):
    """The decoder for this call's rows, given the call's settings whole. ``static_config``: the call's generation
    config when it asked for transformers' fast path: then a ``MARSStaticCache`` (unless the caller passed one) and,
    where transformers would compile, the model's compiled call."""
    batch_size, prompt_length = input_ids.shape
    compiled = None
    if static_config is not None:
        if user_cache is None:
            needed = prompt_length + max_new + widest_step(settings, assistant is not None) + 8
            user_cache = MARSStaticCache(
                model.config, static_capacity(needed, static_config.max_cache_len), batch_size
            )
        compiled = compiled_forward(model, static_config)
    return MARSBatchDecoder(
        model,
        settings,
        max_rows=batch_size,
        max_length=prompt_length + max_new,
        pad_token_id=pad_token_id,
        kv_cache=user_cache,
        stopping_criteria=criteria if len(criteria) else None,
        assistant_model=assistant,
        compiled_forward=compiled,
    )


# A static cache's size is rounded up to a multiple of this, so that a new prompt length or ``max_new_tokens``
# mostly finds the shapes a compiled forward was already compiled for (``max_cache_len`` fixes it outright).
STATIC_CAPACITY_STEP = 256


def static_capacity(needed: int, max_cache_len: int | None = None) -> int:
    """Entries per row of the call's ``MARSStaticCache``: ``max_cache_len`` when it suffices (transformers'
    meaning: one size for every call), else ``needed`` rounded up to ``STATIC_CAPACITY_STEP``."""
    if max_cache_len is not None and max_cache_len >= needed:
        return int(max_cache_len)
    return -(-needed // STATIC_CAPACITY_STEP) * STATIC_CAPACITY_STEP


def compiled_forward(model, generation_config):
    """The model's compiled call for decode steps, or None, by transformers' own criteria: on an accelerator
    with a static cache (``compile_config`` or the default one); on CPU only when the call gives a
    ``compile_config`` (transformers needs a private flag for that; giving the config is the request here);
    never with ``disable_compile``, a quantizer that cannot compile, or CPU/disk offload."""
    config = generation_config.compile_config
    if generation_config.disable_compile:
        return None
    if model.device.type not in ("cuda", "xpu", "neuron", "tpu") and config is None:
        return None
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and not quantizer.is_compileable:
        logger.warning("This model's quantization cannot be compiled; decoding eager on the static cache.")
        return None
    devices = set(getattr(model, "hf_device_map", {}).values())
    if "disk" in devices or ("cpu" in devices and len(devices) > 1):
        logger.warning(
            "Offloaded models are not compiled (as in transformers); decoding eager on the static cache."
        )
        return None
    call = model.get_compiled_call(config)
    return _with_freezing(call) if config is not None and (config.options or {}).get("freezing") else call


def _with_freezing(call):
    """``call`` run with Inductor's weight freezing on, as ``compile_config.options={"freezing": True}`` asks: Dynamo
    reads the switch when it traces a forward (it then makes the parameters constants that Inductor prepacks),
    before the backend applies the config's options, so given as an option alone it never took effect. The switch
    is Inductor's process-wide config, set for the length of each call: a thread compiling at the same time sees it."""

    def frozen_call(*args, **kwargs):
        with torch._inductor.config.patch(freezing=True):
            return call(*args, **kwargs)

    return frozen_call


def _row_settings(
    settings: MARSDecodingSettings, b: int, max_new: int, eos_ids, generation_config, seed: int | None
) -> RowSettings:
    """Batch row ``b``'s settings (its own τ; the rest is the call's; its sampling keyed to the call's seed
    and its index in the batch)."""
    return RowSettings(
        threshold=settings.thresholds[b],
        acceptance=settings.acceptance,
        max_new_tokens=max_new,
        eos_token_ids=tuple(eos_ids),
        do_sample=bool(generation_config.do_sample),
        seed=seed,
        row_key=b,
        prompt_lookup_num_tokens=settings.prompt_lookup_num_tokens,
        max_matching_ngram_size=settings.max_matching_ngram_size,
    )


def _wants_scores(generation_config) -> bool:
    return bool(generation_config.return_dict_in_generate) and bool(
        generation_config.output_scores or generation_config.output_logits
    )


# --------------------------------------------------------------------------------------------------
# The steps, and what they produced
# --------------------------------------------------------------------------------------------------


class _Transcript:
    """What the steps produced: each row's tokens, per-step counts, drafts per source; and, given the
    rows' token buffer (``sequences``), the accepted tokens written into it."""

    def __init__(self, batch_size: int, prompt_length: int, sequences: torch.Tensor | None):
        self.batch_size = batch_size
        self.prompt_length = prompt_length
        self.sequences = sequences
        self.generated: list[list[int]] = [[] for _ in range(batch_size)]
        self.per_step: list[tuple[list[int], list[int], list[int]]] = []
        self.by_source = {source: {"proposed": 0, "accepted": 0} for source in SOURCES}

    def record(self, updates: list[RowUpdate]) -> None:
        counts, proposed, accepted = [0] * self.batch_size, [0] * self.batch_size, [0] * self.batch_size
        places = []
        for update in updates:
            b = update.row_id
            if self.sequences is not None:
                start = self.prompt_length + len(self.generated[b])
                places += [(b, start + j) for j in range(len(update.tokens))]
            self.generated[b] += update.tokens
            counts[b], proposed[b], accepted[b] = (
                len(update.tokens),
                update.drafts_proposed,
                update.drafts_accepted,
            )
            self.by_source[update.draft_source]["proposed"] += update.drafts_proposed
            self.by_source[update.draft_source]["accepted"] += update.drafts_accepted
        if places:
            device = self.sequences.device
            rows = torch.tensor([b for b, _ in places], device=device)
            columns = torch.tensor([c for _, c in places], device=device)
            tokens = [t for u in updates for t in u.tokens]
            self.sequences[rows, columns] = torch.tensor(tokens, dtype=torch.long, device=device)
        self.per_step.append((counts, proposed, accepted))

    def counts(self, k: int, device) -> torch.Tensor:
        """``[num_steps, batch]``: accepted tokens (``k = 0``), drafts proposed (1) or kept (2)."""
        if not self.per_step:
            return torch.zeros((0, self.batch_size), dtype=torch.long, device=device)
        return torch.tensor([s[k] for s in self.per_step], dtype=torch.long, device=device)


def _run(
    decoder: MARSBatchDecoder, transcript: _Transcript, streamer, pad_token_id: int, max_new: int
) -> None:
    """Step until every row has finished; finished rows leave the decoder, final tokens are streamed. The
    linears are routed to their kernels once for the whole call, not per step."""
    stream = _FinalTokenStream(streamer, transcript, pad_token_id) if streamer is not None else None
    with packed_linears(decoder.model, decoder.cpu_kernels):
        _step_until_done(decoder, transcript, stream, max_new)
    if stream is not None:
        stream.end()


def _step_until_done(decoder, transcript: _Transcript, stream, max_new: int) -> None:
    while max_new and decoder.num_rows:
        updates = decoder.step()
        transcript.record(updates)
        for update in updates:
            if update.finished:
                decoder.drop_row(update.row_id)
        if stream is not None:
            stream.after_step(updates)


class _FinalTokenStream:
    """Sends the streamer final (accepted / verified) tokens only, in stock `generate`'s shapes.

    One row: its tokens as each step keeps them (several at once). A batch: whole columns of the output, a
    ``(batch,)`` tensor each as stock sends them, once every row still running has reached that column (a
    finished row's place holds the pad token), so that the columns sent stack to exactly the output's new
    tokens. Rows keep different numbers of tokens per step, so a column is held back until the slowest running
    row has filled it."""

    def __init__(self, streamer, transcript: _Transcript, pad_token_id: int):
        self.streamer, self.transcript, self.pad_token_id = streamer, transcript, pad_token_id
        self.sent = 0  # columns sent (batch > 1)
        self.finished: set[int] = set()

    def after_step(self, updates: list[RowUpdate]) -> None:
        if self.transcript.batch_size == 1:
            tokens = next((u.tokens for u in updates if u.row_id == 0), None)
            if tokens:
                self.streamer.put(torch.tensor(tokens))
            return
        self.finished.update(u.row_id for u in updates if u.finished)
        generated = self.transcript.generated
        running = [len(tokens) for b, tokens in enumerate(generated) if b not in self.finished]
        self._send_columns_up_to(min(running) if running else max(map(len, generated)))

    def end(self) -> None:
        self._send_columns_up_to(max(map(len, self.transcript.generated), default=0))
        self.streamer.end()

    def _send_columns_up_to(self, columns: int) -> None:
        if self.transcript.batch_size == 1:
            return
        for j in range(self.sent, columns):
            column = [
                tokens[j] if j < len(tokens) else self.pad_token_id for tokens in self.transcript.generated
            ]
            self.streamer.put(torch.tensor(column))
        self.sent = max(self.sent, columns)


# --------------------------------------------------------------------------------------------------
# Output assembly
# --------------------------------------------------------------------------------------------------


def _output(
    input_ids, transcript: _Transcript, decoder: MARSBatchDecoder, pad_token_id: int, generation_config
):
    """The sequences (rows padded after their end), or a ``MARSGenerateOutput`` with the statistics."""
    batch_size, prompt_length = input_ids.shape
    longest = max((len(g) for g in transcript.generated), default=0)
    output = torch.full(
        (batch_size, prompt_length + longest), pad_token_id, dtype=torch.long, device=input_ids.device
    )
    output[:, :prompt_length] = input_ids
    for b, tokens in enumerate(transcript.generated):
        if tokens:
            output[b, prompt_length : prompt_length + len(tokens)] = torch.tensor(
                tokens, device=output.device
            )
    return_dict = bool(generation_config.return_dict_in_generate)
    if not return_dict:
        return output
    keep_scores = return_dict and bool(generation_config.output_scores)
    keep_logits = return_dict and bool(generation_config.output_logits)
    scores, logits = _assemble_scores(decoder.score_records, batch_size, longest, keep_scores, keep_logits)
    return MARSGenerateOutput(
        sequences=output,
        scores=scores,
        logits=logits,
        cache=decoder.kv,
        num_forwards=decoder.num_forwards,
        accepted_counts=transcript.counts(0, input_ids.device),
        drafts_proposed=transcript.counts(1, input_ids.device),
        drafts_accepted=transcript.counts(2, input_ids.device),
        forward_widths=torch.tensor(decoder.forward_widths, dtype=torch.long),
        plan_counts=dict(decoder.plan_counts),
        cost_curve=_cost_curve(decoder),
        drafts_by_source=transcript.by_source,
    )


def _cost_curve(decoder) -> dict | None:
    """The curve the planner used at this batch (the widest bucket when rows left and it shrank)."""
    if not decoder.cost_tables:
        return None
    return decoder.cost_tables[max(decoder.cost_tables)].as_dict()


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


def _wants_mars(values: dict) -> bool:
    return values.get("mars_threshold") is not None or values.get("mars_acceptance") == "verify"


def _call_values(model, args, kwargs) -> dict:
    """This call's MARS settings: keywords, else the call's GenerationConfig, else the model's."""
    call_config = _call_config(args, kwargs)
    check_generation_config(call_config, "the call's `generation_config`")
    check_generation_config(getattr(model, "generation_config", None), "the model's `generation_config`")
    values = {key: kwargs.get(key) for key in MARS_KEYWORDS}
    return fill_from_generation_configs(values, call_config, getattr(model, "generation_config", None))


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


def _route_to_mars(model, args, kwargs, values=None, decode=None):
    """Call stock ``GenerationMixin.generate`` with ``mars_generate`` as the decoding callable (``decode``: another
    callable of its signature, e.g. ``enable.MARSModel``'s, which decodes with the wrapper's settings)."""
    kwargs = dict(kwargs)
    values = values if values is not None else _call_values(model, args, kwargs)
    ids = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))
    if torch.is_tensor(ids):  # before transformers' preparation, which fails on 1-D ids with an IndexError
        check_token_ids(ids)
    _refuse_rerouting(kwargs, kwargs.get("generation_config"))
    kwargs.pop("custom_generate", None)
    kwargs.pop("trust_remote_code", None)
    _stop_strings_as_criteria(model, args, kwargs)
    kwargs.update({key: value for key, value in values.items() if value is not None})
    kwargs["mars_streamer"] = kwargs.pop("streamer", None)
    # transformers hands a custom decoding function only its own keywords: the draft model travels as one
    kwargs["mars_assistant_model"] = kwargs.pop("assistant_model", None)
    return GenerationMixin.generate(model, *args, custom_generate=decode or mars_generate, **kwargs)


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
    stray = [k for k in MARS_ONLY_KEYWORDS if kwargs.get(k) is not None]
    if stray:
        raise ValueError(
            f"{stray} only apply to MARS decoding; also pass `mars_threshold=τ` or `mars_acceptance='verify'`."
        )
    stray = sorted(set(check_generation_config(_call_config(args, kwargs), "")) & set(MARS_ONLY_KEYWORDS))
    if stray:
        raise ValueError(
            f"The call's `generation_config` sets {stray}, which only apply to MARS decoding; also set "
            "`mars_threshold=τ` or `mars_acceptance='verify'` in it (or as a keyword), or remove them."
        )
    for key in MARS_KEYWORDS:
        kwargs.pop(key, None)
    return GenerationMixin.generate(model, *args, **kwargs)


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


def mars_class(cls: type) -> type:
    """``cls`` with ``MARSGenerationMixin`` mixed in before it: ``MARS<name>``, importable by that name from
    :mod:`mars_hf.decoding.mars_classes` (pickle, ``torch.save``, ``copy.deepcopy`` and spawned processes find
    it). Load with ``mars_class(model_class).from_pretrained(...)``; ``generate(mars_threshold=τ)`` then decodes
    with MARS, with no instance changed after it was built, and ``save_pretrained`` records ``cls``'s name."""
    from .mars_classes import mars_class as build

    return build(cls)


def __getattr__(name):
    """``enable_mars`` lives in :mod:`mars_hf.decoding.enable` (for a model object you already hold);
    the import from here keeps working without loading that module on the default path."""
    if name == "enable_mars":
        from .enable import enable_mars

        return enable_mars
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
