"""Every MARS setting of one ``generate`` call, gathered and checked in one place.

A setting may come from a keyword (``mars_threshold=0.9``), the call's or the model's
``GenerationConfig``, ``enable_mars(model, ...)`` or ``config.mars``; ``MARSDecodingSettings.resolve``
reads them in that order, checks each once (errors name the keyword and the fix) and returns one frozen
object that the decoding loop reads from. ``check_generation_config`` checks what a ``GenerationConfig``
sets before any decoding is chosen, so a misspelt or out-of-range ``mars_*`` setting never decodes
stock in silence.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch

from .acceptance import ACCEPTANCE_RULES, one_token_per_step
from .cache import CACHE_SCHEMES
from .cost_model import CostTable
from .cpu_kernels import CPU_KERNEL_MODES, DEFAULT_CPU_KERNELS
from .drafts import DEFAULT_MAX_NGRAM
from .layouts import LAYOUT_CHOICES, position_limit
from .memory import PlannerMemory

DEFAULT_CACHE_BLOCK = 16
DEFAULT_ASSISTANT_TOKENS = 5  # transformers' default ``num_assistant_tokens``
# Drafts one source may propose per step (``prompt_lookup_num_tokens``, ``num_assistant_tokens``), as a server
# request allows (``serving.protocol.MAX_LOOKUP_TOKENS``). Why a bound: each draft is a column of the step's
# forward and an entry of the row's statistics, sized at the setting (10**9 allocated lists of that length);
# the cost curve is measured up to 64 columns (``cost_model.MAX_PROBED_WIDTH``), and transformers' defaults
# are 10 and 20.
MAX_DRAFT_TOKENS = 64
# The keywords that only mean something to MARS decoding (given without τ or verify, they are refused).
MARS_ONLY_KEYWORDS = (
    "mars_block_size",
    "mars_acceptance",
    "mars_cache",
    "mars_cache_block",
    "mars_mask_token_id",
    "mars_layout",
    "mars_planner",
    "mars_cost_table",
    "mars_cost_probe",
    "mars_cpu_kernels",
)
# Every MARS keyword of ``generate`` (also accepted as ``GenerationConfig`` attributes).
MARS_KEYWORDS = ("mars_threshold",) + MARS_ONLY_KEYWORDS
_CHOICES = {
    "mars_acceptance": ACCEPTANCE_RULES,
    "mars_cache": CACHE_SCHEMES,
    "mars_layout": LAYOUT_CHOICES,
    "mars_cpu_kernels": CPU_KERNEL_MODES,
}


@dataclass(frozen=True)
class MARSDecodingSettings:
    """The MARS settings of one ``generate`` call, resolved and checked (build with ``resolve``).

    Attributes:
        thresholds: τ per batch row (``mars_threshold``); None for a verify row without a proposal floor. Empty
            for a decoder whose rows bring their own τ (``decoder.RowSettings``: a server's).
        window: W (``mars_block_size``), capped by the tokens to generate (a mask past them is never kept).
        mask_token_id: ``mars_mask_token_id``, else ``config.mars["mask_token_id"]``.
        acceptance: ``mars_acceptance``: ``"probability"``, ``"entropy"``, ``"margin"`` or ``"verify"``.
        cache / cache_block: ``mars_cache`` (``"cursor"``, ``"block"``, ``"none"``) and its C.
        layout: ``mars_layout`` (None: the step planner, ``"auto"``, where it has a cost curve, measured, given or
            assumed on a CPU; else the fixed ``"linear"`` feed).
        planner / cost_table: ``mars_planner``, ``mars_cost_table``.
        cost_memory: ``mars_cost_probe``'s ``PlannerMemory`` (``True``: a fresh one for the call), where the
            measured cost curves and what the planner learns are kept; None: nothing is timed.
        cpu_kernels: ``mars_cpu_kernels``: ``"stock"`` (default: no private torch op on the default path),
            or the opt-in packed oneDNN linears, ``"auto"`` / ``"packed"`` (``cpu_kernels.py``).
        prompt_lookup_num_tokens / max_matching_ngram_size: transformers' prompt-lookup settings (verify only).
        assistant_tokens: ``num_assistant_tokens`` of a draft model (``assistant_model=``).
    """

    window: int
    mask_token_id: int
    thresholds: tuple[float | None, ...] = ()
    acceptance: str = "probability"
    cache: str = "cursor"
    cache_block: int = DEFAULT_CACHE_BLOCK
    layout: str | None = None
    planner: bool = False
    cost_table: dict | None = None
    cost_memory: PlannerMemory | None = None
    cpu_kernels: str = DEFAULT_CPU_KERNELS
    prompt_lookup_num_tokens: int | None = None
    max_matching_ngram_size: int = DEFAULT_MAX_NGRAM
    assistant_tokens: int = DEFAULT_ASSISTANT_TOKENS

    def __post_init__(self):
        """Every construction is checked here, once (``resolve`` or a server's own): the decoder, the planner
        and the rules read the settings without checking them again."""
        check_choice("mars_acceptance", self.acceptance)
        check_choice("mars_cache", self.cache)
        check_layout(self.layout)
        check_cost_table(self.cost_table)
        if self.cost_memory is not None and not isinstance(self.cost_memory, PlannerMemory):
            kind = type(self.cost_memory).__name__
            raise TypeError(f"`cost_memory` must be a PlannerMemory or None, not {kind}.")
        check_choice("mars_cpu_kernels", self.cpu_kernels)
        check_window(self.window)
        if not isinstance(self.cache_block, numbers.Integral) or self.cache_block < 1:
            raise ValueError(f"`mars_cache_block` (C) must be an integer >= 1, got {self.cache_block!r}.")
        check_draft_count("num_assistant_tokens", self.assistant_tokens)
        if self.prompt_lookup_num_tokens is not None:
            check_draft_count("prompt_lookup_num_tokens", self.prompt_lookup_num_tokens)

    @classmethod
    def for_model(cls, model, **fields) -> MARSDecodingSettings:
        """Settings for a decoder driven row by row (a server): W and the mask token from ``config.mars``
        (or ``enable_mars``), anything else from ``fields``."""
        fields.setdefault("window", resolve_window(model, None))
        fields.setdefault("mask_token_id", resolve_mask_token(model, None))
        return cls(**fields)

    @classmethod
    def resolve(
        cls, model, keywords: dict, generation_config, *, batch_size: int, max_new_tokens: int
    ) -> MARSDecodingSettings:
        """The settings of a call: ``keywords`` (``MARS_KEYWORDS`` → value or None), else
        ``generation_config``'s, else ``enable_mars`` / ``config.mars``; each checked, naming the keyword."""
        values = fill_from_generation_configs(keywords, generation_config)
        defaults = model_defaults(model)
        acceptance = values["mars_acceptance"] or defaults.get("acceptance", "probability")
        cache = values["mars_cache"] or defaults.get("cache", "cursor")
        cache_block = values["mars_cache_block"]
        cache_block = defaults.get("cache_block") if cache_block is None else cache_block
        check_choice("mars_acceptance", acceptance)
        check_choice("mars_cache", cache)
        window = resolve_window(model, values["mars_block_size"])
        mask_token_id = resolve_mask_token(model, values["mars_mask_token_id"])
        per_prompt = int(getattr(generation_config, "num_return_sequences", None) or 1)
        thresholds = resolve_thresholds(values["mars_threshold"], acceptance, batch_size, per_prompt)
        cache_block = DEFAULT_CACHE_BLOCK if cache_block is None else int(cache_block)
        if cache_block < 1:
            raise ValueError(f"`mars_cache_block` (C) must be >= 1, got {cache_block}.")
        positions = position_limit(model.config)
        if positions is not None and cache_block > positions:
            # a static cache is sized for a block of C (``decoder.widest_step``): 10**9 allocated that many
            raise ValueError(
                f"`mars_cache_block` (C) = {cache_block} is above the model's position limit ({positions}): no "
                f"row holds a block that long. Pass at most {positions} (the default is {DEFAULT_CACHE_BLOCK})."
            )
        lookup, ngram = prompt_lookup(generation_config, acceptance)
        layout = values["mars_layout"] or defaults.get("layout")
        check_layout(layout)
        check_cost_table(values["mars_cost_table"])
        cpu_kernels = values["mars_cpu_kernels"] or DEFAULT_CPU_KERNELS
        check_choice("mars_cpu_kernels", cpu_kernels)
        return cls(
            thresholds=tuple(thresholds),
            # Masks past the last token to generate predict nothing that is kept, while the window's
            # buffers and per-step work grow with W (W = 5000 for 8 tokens took 35 s): capped, a wider W
            # decodes the same. So is a W past the model's positions (no step feeds more masks than the
            # positions left), which a huge `max_new_tokens` left uncapped: the row's statistics are W long.
            window=min(window, max(1, max_new_tokens), max(1, (positions or window + 1) - 1)),
            mask_token_id=mask_token_id,
            acceptance=acceptance,
            cache=cache,
            cache_block=cache_block,
            layout=layout,
            planner=bool(values["mars_planner"]),
            cost_table=values["mars_cost_table"],
            cost_memory=resolve_cost_memory(values["mars_cost_probe"]),
            cpu_kernels=cpu_kernels,
            prompt_lookup_num_tokens=lookup,
            max_matching_ngram_size=ngram,
            assistant_tokens=assistant_tokens(generation_config),
        )

    @property
    def one_token_per_step(self) -> bool:
        """Every row keeps exactly one token per step (τ >= 1 with probability or margin): no masks. False
        without per-row τ (a server's settings: each row brings its own)."""
        return bool(self.thresholds) and all(
            one_token_per_step(self.acceptance, tau) for tau in self.thresholds
        )

    @property
    def decoder_cache(self) -> str:
        """The cache scheme the decoder runs: with no masks to drop, a block has nothing to wait for, so
        one-token decoding under ``"block"`` is cursor decoding."""
        return "cursor" if (self.cache == "block" and self.one_token_per_step) else self.cache


# --------------------------------------------------------------------------------------------------
# Where values come from
# --------------------------------------------------------------------------------------------------


def model_defaults(model) -> dict:
    """``config.mars`` merged with the overrides ``enable_mars`` stored on the model."""
    settings = dict(getattr(model.config, "mars", None) or {})
    settings.update(getattr(model, "_mars_overrides", None) or {})
    return settings


def fill_from_generation_configs(values: dict, *configs) -> dict:
    """Fill the MARS settings a call left unset from generation configs (first that has one wins)."""
    filled = dict(values)
    for key in MARS_KEYWORDS:
        for config in configs:
            if filled.get(key) is None and config is not None:
                filled[key] = getattr(config, key, None)
    return filled


def check_generation_config(config, source: str) -> dict:
    """The MARS settings a GenerationConfig sets, checked as keywords are.

    A misspelt ``mars_*`` name or a value outside its choices is refused even when the call then decodes
    stock: ``GenerationConfig(mars_acceptance="bogus")`` used to decode stock without a word.
    """
    if config is None:
        return {}
    unknown = sorted(key for key in vars(config) if key.startswith("mars_") and key not in MARS_KEYWORDS)
    if unknown:
        raise ValueError(f"{source} sets unknown MARS settings {unknown}; they are {list(MARS_KEYWORDS)}.")
    settings = {key: getattr(config, key, None) for key in MARS_KEYWORDS}
    settings = {key: value for key, value in settings.items() if value is not None}
    where = f" (set in {source})"
    for key in _CHOICES:
        if key in settings:
            check_choice(key, settings[key], where)
    if "mars_block_size" in settings:
        check_window(settings["mars_block_size"], f"`mars_block_size` (the window W){where}")
    if "mars_cache_block" in settings:
        check_window(settings["mars_cache_block"], f"`mars_cache_block` (C){where}")
    if "mars_mask_token_id" in settings:
        token = settings["mars_mask_token_id"]
        if isinstance(token, bool) or not isinstance(token, numbers.Integral) or token < 0:
            raise ValueError(
                f"`mars_mask_token_id` must be a token id (an integer >= 0), got {token!r}{where}."
            )
    if "mars_threshold" in settings:
        threshold_values(settings["mars_threshold"])
    return settings


# --------------------------------------------------------------------------------------------------
# Checks, one per setting
# --------------------------------------------------------------------------------------------------


def check_choice(keyword: str, value, where: str = "", allowed=None) -> None:
    """``value`` is one of the choices of ``keyword`` (``mars_acceptance``, ``mars_cache``, ``mars_layout``)."""
    allowed = tuple(_CHOICES[keyword] if allowed is None else allowed)
    if value not in allowed:
        raise ValueError(f"`{keyword}` must be one of {allowed}, got {value!r}{where}.")


def check_layout(layout: str | None) -> None:
    """``mars_layout``: None (the planner) or one of ``LAYOUT_CHOICES``."""
    check_choice("mars_layout", layout or "auto")


def check_cost_table(cost_table) -> None:
    """``mars_cost_table``: None, or a mapping ``CostTable.from_mapping`` reads (it names the keyword)."""
    if cost_table is not None:
        CostTable.from_mapping(cost_table)


def resolve_cost_memory(probe) -> PlannerMemory | None:
    """``mars_cost_probe``: None or False (default): nothing timed; True: measure for this call alone; a
    ``PlannerMemory``: measure into it and start from what it holds (the caller keeps it between calls)."""
    if probe is None or probe is False:
        return None
    if probe is True:
        return PlannerMemory()
    if isinstance(probe, PlannerMemory):
        return probe
    raise TypeError(
        "`mars_cost_probe` must be True (measure the step costs for this call), a "
        f"`mars_hf.PlannerMemory` (measure into it, kept between calls) or False, got {type(probe).__name__}."
    )


def check_window(block_size, name: str = "`mars_block_size` (the window W)") -> None:
    """W is a whole number >= 1; a string, bool, NaN or inf gets this message, not int()'s."""
    whole = (isinstance(block_size, numbers.Integral) and not isinstance(block_size, bool)) or (
        isinstance(block_size, float) and block_size.is_integer()
    )
    if not whole or block_size < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {block_size!r}.")


def check_model_window(model, window, name: str) -> None:
    """A model-wide W is not capped per call by ``max_new_tokens``: bound it by the position limit instead."""
    check_window(window, name)
    limit = position_limit(model.config)
    if limit is not None and window >= limit:
        raise ValueError(
            f"{name} = {window} must be below the model's position limit ({limit}): no step can feed "
            f"{window} masks after a prompt. The paper uses W = 4 to 16; a per-call `mars_block_size` is "
            "capped by `max_new_tokens` instead."
        )


def resolve_window(model, block_size) -> int:
    """``mars_block_size``, else the model's W; checked."""
    if block_size is None:
        block_size = model_defaults(model).get("block_size")
    if block_size is None:
        raise ValueError(
            "No MARS window: pass `mars_block_size=W` or set `config.mars['block_size']` "
            "(`mars_hf.set_mars_config` / `enable_mars(model, block_size=...)`)."
        )
    check_window(block_size)
    return int(block_size)


def resolve_mask_token(model, mask_token_id) -> int:
    """``mars_mask_token_id``, else the model's mask token; a row of its embedding matrix."""
    if mask_token_id is None:
        mask_token_id = model_defaults(model).get("mask_token_id")
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


def resolve_thresholds(
    threshold, acceptance: str, batch_size: int, per_prompt: int = 1
) -> list[float | None]:
    """τ per batch row, in the range ``acceptance`` gives it. With ``per_prompt`` sequences per prompt
    (``num_return_sequences``: transformers repeats each prompt's row that many times, side by side), one value
    per prompt is repeated for each of its sequences."""
    if acceptance == "verify" and threshold is None:
        return [None] * batch_size
    if threshold is None:
        raise ValueError(
            "MARS decoding needs `mars_threshold=τ` (a float, or one value per batch row); τ = 1.0 "
            "reproduces ordinary decoding. Or use `mars_acceptance='verify'` (lossless, no τ needed)."
        )
    tau = threshold_values(threshold)
    if tau.numel() == 1:
        tau = tau.expand(batch_size)
    elif per_prompt > 1 and tau.numel() * per_prompt == batch_size:
        tau = tau.repeat_interleave(per_prompt)
    if tau.numel() != batch_size:
        rows = f"{batch_size} rows"
        if per_prompt > 1:
            rows += f" ({batch_size // per_prompt} prompts x num_return_sequences={per_prompt})"
        raise ValueError(
            f"`mars_threshold` has {tau.numel()} values for a batch of {rows}: give one value, one per prompt, "
            "or one per row."
        )
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


def threshold_values(threshold) -> torch.Tensor:
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


def prompt_lookup(generation_config, acceptance: str) -> tuple[int | None, int]:
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
    check_draft_count("prompt_lookup_num_tokens", lookup)
    if ngram is not None and (
        isinstance(ngram, bool) or not isinstance(ngram, numbers.Integral) or ngram < 1
    ):
        raise ValueError(f"`max_matching_ngram_size` must be an integer >= 1, got {ngram!r}.")
    return int(lookup), int(ngram) if ngram is not None else DEFAULT_MAX_NGRAM


def assistant_tokens(generation_config) -> int:
    """``num_assistant_tokens`` (transformers' keyword; unset: :data:`DEFAULT_ASSISTANT_TOKENS`), checked."""
    value = getattr(generation_config, "num_assistant_tokens", None)
    if value is None:
        return DEFAULT_ASSISTANT_TOKENS
    check_draft_count("num_assistant_tokens", value)
    return int(value)


def check_draft_count(name: str, value) -> None:
    """A draft count is a whole number from 1 to :data:`MAX_DRAFT_TOKENS`: drafts past it are refused, not
    allocated (``prompt_lookup_num_tokens=10**9`` sized the row's statistics at 10**9 entries)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"`{name}` must be an integer >= 1, got {value!r}.")
    if value > MAX_DRAFT_TOKENS:
        raise ValueError(
            f"`{name}` = {value} is above the {MAX_DRAFT_TOKENS} drafts a MARS step checks from one source: "
            f"pass at most {MAX_DRAFT_TOKENS} (transformers' defaults are 10 for prompt lookup, 20 for a draft "
            "model); more drafts are more columns per forward, rarely all kept."
        )
