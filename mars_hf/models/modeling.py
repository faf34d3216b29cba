"""Load any MARS checkpoint with one call: ours, a LoRA adapter on its base, or the paper's releases.

Three formats reach us:

* **ours**: an ordinary causal-LM folder whose ``config.json`` carries ``config.mars``;
* **a PEFT adapter** (``adapter_config.json``, no ``config.json``) written by
  :func:`mars_hf.hub.save_pretrained`, with ``mars_config.json`` and the trained mask-token row in
  ``mars_mask_token.safetensors`` (the base model on the Hub has no such row);
* **the paper's releases** (``Xalphinions/MARS-Qwen2.5-7B-blk8``): ``model_type: "a2d-qwen2"`` /
  ``"a2d-qwen3"``, which stock transformers does not know. The weights use the Qwen2/Qwen3 layout
  verbatim and MARS decodes with plain causal attention, so we load them as ``Qwen2ForCausalLM`` /
  ``Qwen3ForCausalLM``. Their tokenizer has ``<|mask|>``; their block size is only in the repo name.

Everything resolves files through transformers/huggingface_hub, so a Hub id that is in the local
cache loads with ``HF_HUB_OFFLINE=1``.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.utils import cached_file

from mars_hf.decoding.gated_lora import (
    GATING_KEY,
    MARS_MASK_ROWS_FILE,
    MASK_GATING,
    MERGE_REFUSED,
    MergeRefusedError,
    apply_mask_rows,
    grow_embeddings,
)
from mars_hf.models.adapters import is_peft_model
from mars_hf.models.mask_token import DEFAULT_MASK_TOKEN, set_mars_config

logger = logging.getLogger(__name__)

# model_type of the paper's checkpoints -> the stock transformers model_type with the same weights.
PAPER_MODEL_TYPES = {"a2d-qwen2": "qwen2", "a2d-qwen3": "qwen3", "a2d-llama": "llama"}
# Keyword arguments that choose *which files* to read; passed to every file lookup.
HUB_KWARGS = ("revision", "cache_dir", "token", "local_files_only", "force_download", "proxies")

# JSON files one of which a saved tokenizer always has (``save_pretrained`` writes both).
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")

_BLOCK_SUFFIX = re.compile(r"(?:^|[-_.])blk(\d+)$", re.IGNORECASE)


class AutoMARSModelForCausalLM:
    """Like ``AutoModelForCausalLM``, but the model comes back ready for ``generate(mars_threshold=...)``.

    Example::

        model = AutoMARSModelForCausalLM.from_pretrained("Xalphinions/MARS-Qwen2.5-0.5B-blk4")
        out = model.generate(**inputs, mars_threshold=0.9)
    """

    def __init__(self, *args, **kwargs):
        raise OSError("Use `AutoMARSModelForCausalLM.from_pretrained(name_or_path)` to load a MARS model.")

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, block_size: int | None = None, **kwargs):
        """Load a MARS checkpoint from a local folder or a Hub id (see :func:`load_mars_model`)."""
        model, _ = load_mars_model(pretrained_model_name_or_path, block_size=block_size, **kwargs)
        return model


def load_mars_model(
    name_or_path: str | os.PathLike,
    block_size: int | None = None,
    *,
    base_model_name_or_path: str | None = None,
    merge_adapter: bool = False,
    enable: bool = True,
    adapter_gating: str | None = None,
    **kwargs,
):
    """Load ``(model, tokenizer)`` from any MARS checkpoint format. ``tokenizer`` is None for a checkpoint saved
    without one (the model needs none: ``config.mars`` holds the mask token id; :func:`require_tokenizer` says
    so where one is needed).

    Args:
        name_or_path: local folder or Hub id (a cached Hub repo loads offline).
        block_size: used only when neither ``config.mars`` nor a ``blkN`` name suffix gives one.
        base_model_name_or_path: base model of a LoRA adapter (default: the adapter config's).
        merge_adapter: merge a LoRA adapter into its base (faster decoding, no PEFT wrapper). A LoRA
            gated to mask positions (``config.mars.adapter_gating == "mask"``) cannot be merged: ``True``
            raises for it, ``"auto"`` merges every adapter that can be merged and keeps a gated one as is.
        enable: build the model as its MARS class (``mars_hf.decoding.generation.mars_class``), so
            ``generate(mars_threshold=τ)`` decodes with MARS; ``False``: the plain transformers class.
        adapter_gating: how a LoRA adapter that carries no gating record was trained: ``"none"`` (a plain LoRA
            on every position) or ``"mask"`` (gated to the tokenizer's mask token). An adapter with a record
            (``gate_token_id`` in ``adapter_config.json``, or ``mars_config.json``) needs none; one without is
            refused unless told, since a gated adapter loaded ungated changes every real token's output.
        **kwargs: file-lookup options (``revision``, ``cache_dir``, ``token``, ``local_files_only``)
            and anything ``AutoModelForCausalLM.from_pretrained`` takes (``dtype``, ``device_map``...).
    """
    from mars_hf.models.embedded_model import EMBEDDED_MARS_NAME, embedded_mars_checkpoint

    name_or_path = str(name_or_path)
    if name_or_path == EMBEDDED_MARS_NAME:  # the MARS model shipped inside the package
        name_or_path = str(embedded_mars_checkpoint())
    hub_kwargs = {key: kwargs.pop(key) for key in HUB_KWARGS if key in kwargs}
    how_to = (
        "Pass a local checkpoint folder or a Hub repo id; offline (HF_HUB_OFFLINE=1) the repo must already be "
        "in the Hugging Face cache (download it once with `hf download <repo_id>`)."
    )
    if not os.path.isdir(name_or_path):
        try:
            validate_repo_id(name_or_path)
        except HFValidationError as error:
            raise OSError(
                f"{name_or_path!r} is neither an existing folder nor a Hub repo id. {how_to}"
            ) from error
    config_dict = read_checkpoint_json(name_or_path, "config.json", hub_kwargs)
    adapter_config = (
        None
        if config_dict is not None
        else read_checkpoint_json(name_or_path, "adapter_config.json", hub_kwargs)
    )
    if config_dict is None and adapter_config is None:
        raise OSError(f"{name_or_path!r} has neither a config.json nor an adapter_config.json. {how_to}")

    if adapter_config is not None:
        model, tokenizer, mars = _load_adapter(
            name_or_path,
            adapter_config,
            base_model_name_or_path,
            merge_adapter,
            adapter_gating,
            hub_kwargs,
            kwargs,
            as_mars=enable,
        )
    else:
        model = _load_backbone(name_or_path, config_dict, hub_kwargs, kwargs, as_mars=enable)
        # The model needs no tokenizer: config.mars holds the mask id. A folder saved without one returns None.
        has_tokenizer = any(_checkpoint_file(name_or_path, name, hub_kwargs) for name in TOKENIZER_FILES)
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, **hub_kwargs) if has_tokenizer else None
        if tokenizer is None:
            logger.info("%s was saved without a tokenizer: the tokenizer returned is None.", name_or_path)
        mars = dict(config_dict.get("mars") or {})

    mask_token_id = _ensure_mask_token(tokenizer, mars, name_or_path)
    rows = model.get_input_embeddings().weight.shape[0]
    if mask_token_id >= rows:
        raise ValueError(
            f"The mask token id {mask_token_id} of {name_or_path!r} does not fit its {rows}-row embedding matrix; "
            "the tokenizer and the weights do not belong together."
        )
    resolved_block_size, source = resolve_block_size(mars, name_or_path, block_size)
    logger.info("MARS block size %d for %s (%s).", resolved_block_size, name_or_path, source)
    extra = {k: v for k, v in mars.items() if k not in ("block_size", "mask_token_id", "format_version")}
    set_mars_config(model, block_size=resolved_block_size, mask_token_id=mask_token_id, **extra)

    if enable:  # built as the MARS class (`_load_backbone`): what is left is checking its settings
        check_mars_settings(model.get_base_model() if is_peft_model(model) else model)
    return model, tokenizer


def resolve_block_size(mars: dict, name_or_path: str, explicit: int | None) -> tuple[int, str]:
    """Block size from ``config.mars``, else a ``blkN`` name suffix, else ``explicit``; plus where it came from."""
    found, source = None, None
    if mars.get("block_size") is not None:
        found, source = int(mars["block_size"]), "from config.mars"
    else:
        name = _checkpoint_name(name_or_path)
        match = _BLOCK_SUFFIX.search(name)
        if match:
            found, source = int(match.group(1)), f"from the 'blk{match.group(1)}' suffix of the name {name!r}"
    if found is not None:
        if explicit is not None and int(explicit) != found:
            logger.warning(
                "Ignoring block_size=%d: the checkpoint says %d (%s). To decode with another window, pass "
                "`mars_block_size=` to generate().",
                explicit,
                found,
                source,
            )
        return found, source
    if explicit is not None:
        if int(explicit) < 1:
            raise ValueError(f"block_size must be >= 1, got {explicit}.")
        return int(explicit), "from the block_size argument"
    raise ValueError(
        f"Cannot tell the MARS block size of {name_or_path!r}: its config has no `mars` entry and its name "
        "has no `-blkN` suffix. Pass it explicitly, e.g. "
        "`AutoMARSModelForCausalLM.from_pretrained(name, block_size=4)` (the block size it was trained with)."
    )


def _checkpoint_name(name_or_path: str) -> str:
    """The repo name of a Hub id or folder; for a path inside the HF cache, the cached repo's name."""
    path = Path(name_or_path.rstrip("/"))
    for part in reversed(path.parts):
        if part.startswith("models--"):  # .../models--org--name/snapshots/<sha>
            return part.split("--")[-1]
    return path.name


def _checkpoint_file(name_or_path: str, filename: str, hub_kwargs: dict) -> str | None:
    """The local path of ``filename`` of a folder or (cached) Hub repo; None when the checkpoint has no such file."""
    return cached_file(
        name_or_path,
        filename,
        _raise_exceptions_for_missing_entries=False,
        _raise_exceptions_for_connection_errors=False,
        _raise_exceptions_for_gated_repo=False,
        **hub_kwargs,
    )


def read_checkpoint_json(name_or_path: str, filename: str, hub_kwargs: dict) -> dict | None:
    """``filename`` of a folder or (cached) Hub repo as a dict; None when the checkpoint has no such file."""
    resolved = _checkpoint_file(name_or_path, filename, hub_kwargs)
    if resolved is None:
        return None
    with open(resolved, encoding="utf-8") as handle:
        return json.load(handle)


def check_mars_settings(model) -> None:
    """The window and the mask token of a loaded MARS model, checked once (errors name the fix)."""
    from mars_hf.decoding.settings import check_model_window, resolve_mask_token, resolve_window

    check_model_window(model, resolve_window(model, None), "The window W (`config.mars['block_size']`)")
    resolve_mask_token(model, None)


def _load_backbone(
    name_or_path: str, config_dict: dict, hub_kwargs: dict, model_kwargs: dict, *, as_mars: bool = True
):
    """``AutoModelForCausalLM.from_pretrained``'s model, mapping the paper's ``a2d-*`` model types onto stock
    ones; ``as_mars``: built as its MARS class (``generation.mars_class``: ``generate(mars_threshold=τ)``
    decodes with MARS), no object changed after it was built."""
    model_type = config_dict.get("model_type")
    if model_type in PAPER_MODEL_TYPES and "config" not in model_kwargs:
        stock_type = PAPER_MODEL_TYPES[model_type]
        cleaned = {
            k: v
            for k, v in config_dict.items()
            if k not in ("model_type", "architectures", "auto_map", "transformers_version")
        }
        config = AutoConfig.for_model(stock_type, **cleaned)
        model_class = AutoModelForCausalLM._model_mapping[type(config)]
        config.architectures = [model_class.__name__]
        logger.info(
            "%s is a paper-format checkpoint (model_type %r): loading it as %s with causal attention.",
            name_or_path,
            model_type,
            model_class.__name__,
        )
        model_kwargs = {**model_kwargs, "config": config}
    if not as_mars:
        return AutoModelForCausalLM.from_pretrained(name_or_path, **hub_kwargs, **model_kwargs)
    from mars_hf.decoding.generation import mars_class

    config = model_kwargs.get("config")
    if config is None:
        trust = model_kwargs.get("trust_remote_code", False)
        config = AutoConfig.from_pretrained(name_or_path, **hub_kwargs, trust_remote_code=trust)
    model_class = _causal_lm_class(config, name_or_path)
    return mars_class(model_class).from_pretrained(name_or_path, **hub_kwargs, **{**model_kwargs, "config": config})


def _causal_lm_class(config, name_or_path: str) -> type:
    """The class ``AutoModelForCausalLM`` builds for ``config`` (a checkpoint's own code under ``auto_map``
    needs ``trust_remote_code=True``, as with transformers)."""
    from transformers.dynamic_module_utils import get_class_from_dynamic_module
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    remote = (getattr(config, "auto_map", None) or {}).get("AutoModelForCausalLM")
    if remote is not None and type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        return get_class_from_dynamic_module(remote, name_or_path)
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(f"{name_or_path!r} ({type(config).__name__}) is not a causal LM transformers knows.")
    return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]


def require_tokenizer(tokenizer, name_or_path, purpose: str):
    """``tokenizer``, or the error that says ``name_or_path`` was saved without one and what needs it."""
    if tokenizer is None:
        raise ValueError(
            f"{str(name_or_path)!r} was saved without a tokenizer, and {purpose} needs one (the model itself loads "
            "without it: config.mars holds the mask token id). Save the tokenizer the model was trained with into "
            "the folder (`tokenizer.save_pretrained(folder)`, or `mars_hf.hub.save_pretrained(model, tokenizer, "
            "folder)`)."
        )
    return tokenizer


def _ensure_mask_token(tokenizer, mars: dict, name_or_path: str) -> int:
    """The tokenizer's mask token id; adopts ``<|mask|>`` (the paper's) when it is only an added token. Without a
    tokenizer, ``config.mars``'s ``mask_token_id``."""
    if tokenizer is None:
        if mars.get("mask_token_id") is None:
            raise ValueError(
                f"{name_or_path!r} has no tokenizer and its config has no `mars.mask_token_id`, so its mask token "
                "is unknown: save the tokenizer with the model, or record the mask token with "
                "`mars_hf.set_mars_config(model, block_size=..., mask_token_id=...)` before saving."
            )
        return int(mars["mask_token_id"])
    if tokenizer.mask_token is None:
        vocab = tokenizer.get_vocab()
        if DEFAULT_MASK_TOKEN in vocab:
            tokenizer.mask_token = DEFAULT_MASK_TOKEN
            logger.info("Using %r (id %d) as the mask token.", DEFAULT_MASK_TOKEN, vocab[DEFAULT_MASK_TOKEN])
        elif mars.get("mask_token_id") is not None:
            tokenizer.mask_token = tokenizer.convert_ids_to_tokens(int(mars["mask_token_id"]))
        else:
            raise ValueError(
                f"{name_or_path!r} has no mask token: its tokenizer has neither a mask token nor "
                f"{DEFAULT_MASK_TOKEN!r}, and its config has no `mars.mask_token_id`. It is not a MARS checkpoint; "
                "fine-tune it first (`mars_hf.add_mask_token(model, tokenizer)` + `MARSTrainer`)."
            )
    mask_token_id = int(tokenizer.mask_token_id)
    if mars.get("mask_token_id") is not None and int(mars["mask_token_id"]) != mask_token_id:
        raise ValueError(
            f"{name_or_path!r}: config.mars.mask_token_id is {mars['mask_token_id']} but the tokenizer's mask token "
            f"{tokenizer.mask_token!r} has id {mask_token_id}; the tokenizer and the model do not belong together."
        )
    return mask_token_id


def _load_adapter(
    name_or_path,
    adapter_config,
    base_model_name_or_path,
    merge_adapter,
    adapter_gating,
    hub_kwargs,
    model_kwargs,
    as_mars: bool = True,
):
    """Base model (any format above) + the trained mask-token rows + the LoRA adapter.

    A mask-gated adapter is attached by :func:`mars_hf.decoding.gated_lora.attach_shipped_adapter` (each adapted
    linear layer replaced by one that adds the gated delta; the model stays a plain transformers model, its
    state dict the base's); an ungated one loads with PEFT. Both are checked against the base first, so an
    adapter on the wrong base or with damaged factors is refused naming the layer, not with a bare shape error.
    """
    from peft import PeftModel
    from safetensors.torch import load_file

    from mars_hf.decoding.gated_lora import attach_shipped_adapter, check_adapter_fits, read_gating_record
    from mars_hf.models.embedded_model import resolve_adapter_base

    # The shipped adapter (and any trained on the embedded SmolLM2 elsewhere) runs on the embedded base.
    base = base_model_name_or_path or resolve_adapter_base(
        name_or_path, adapter_config.get("base_model_name_or_path")
    )
    if not base:
        raise ValueError(
            f"The adapter {name_or_path!r} does not name its base model; pass `base_model_name_or_path=`."
        )
    # An adapter repo is small: take it whole, so that the tokenizer and PEFT read a local folder
    # (AutoTokenizer on a Hub id without config.json cannot tell "missing" from "not cached" offline).
    folder = name_or_path
    if not os.path.isdir(name_or_path):
        from huggingface_hub import snapshot_download

        folder = snapshot_download(
            name_or_path, **{k: v for k, v in hub_kwargs.items() if k not in ("proxies",)}
        )
    # Refuses an adapter whose gating record is lost, contradicted or missing (never loads a gated one ungated).
    tokenizer = _adapter_tokenizer(folder, base, hub_kwargs) if adapter_gating == MASK_GATING else None
    mask_token_id = None if tokenizer is None else _ensure_mask_token(tokenizer, {}, name_or_path)
    mars = read_gating_record(folder, gating=adapter_gating, mask_token_id=mask_token_id)
    gated = mars.get(GATING_KEY) == MASK_GATING
    if gated and merge_adapter is True:
        raise MergeRefusedError(f"{name_or_path}: {MERGE_REFUSED} (pass merge_adapter=False or 'auto')")
    base_config = read_checkpoint_json(base, "config.json", hub_kwargs)
    if base_config is None:
        raise OSError(
            f"Cannot find the base model {base!r} of the adapter {name_or_path!r} (locally or in the HF cache); "
            "pass `base_model_name_or_path=` pointing to it."
        )
    tokenizer = tokenizer or _adapter_tokenizer(folder, base, hub_kwargs)
    logger.info("Loading the LoRA adapter %s onto its base model %s.", name_or_path, base)
    model = _load_backbone(base, base_config, hub_kwargs, model_kwargs, as_mars=as_mars)
    check_adapter_fits(model, folder, given=base)

    rows_file = os.path.join(folder, MARS_MASK_ROWS_FILE)
    if os.path.isfile(rows_file):
        apply_mask_rows(model, load_file(rows_file), min_rows=len(tokenizer))
    else:
        grow_embeddings(model, len(tokenizer))
        if mars:
            logger.warning(
                "%s has no %s: the mask token keeps the base model's row (fine only if it was never trained).",
                name_or_path,
                MARS_MASK_ROWS_FILE,
            )
    if gated:
        # The lean gate (MARS_SPEC §7) on the plain model; the load checks real positions against the base model
        # once. mars_hf.models.gated_peft loads the same adapter through PEFT (training it further, PEFT tooling);
        # the two agree to float64 round-off (tests/test_gated_lora.py).
        attach_shipped_adapter(model, folder, adapter_gating=adapter_gating, mask_token_id=mask_token_id)
        logger.info(
            "%s is a LoRA adapter gated to mask positions: attached to the adapted linear layers "
            "(it cannot be merged; to train it further, start a run from it with MARSConfig(init_adapter=...)).",
            name_or_path,
        )
        model.eval()
        return model, tokenizer, mars
    model = PeftModel.from_pretrained(model, folder, is_trainable=False)
    if merge_adapter:
        model = model.merge_and_unload()
    model.eval()
    return model, tokenizer, mars


def _adapter_tokenizer(folder: str, base: str, hub_kwargs: dict):
    """The adapter folder's tokenizer (it has the mask token), else its base model's."""
    if os.path.isfile(os.path.join(folder, "tokenizer_config.json")):
        return AutoTokenizer.from_pretrained(folder)
    return AutoTokenizer.from_pretrained(base, **hub_kwargs)
