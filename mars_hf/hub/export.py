"""Export a MARS checkpoint as a vLLM parallel drafter (``mars-hf export --for vllm``).

vLLM's parallel drafting (``speculative_config={"method": "draft_model", "parallel_drafting": true,
...}``) feeds the drafter ``[accepted tokens, bonus token, mask × (K-1)]`` at consecutive positions and
takes K drafts from one forward: the argmax at the bonus slot and at each mask slot — MARS's own
prediction layout (docs/serving_at_scale.md cites the vLLM source; tests/test_export.py replays it).
What vLLM needs from the drafter folder, and what this module writes:

* a stock architecture with merged weights (no PEFT adapter: vLLM loads the folder as a plain model);
* the mask id in ``config.json`` under every key some vLLM release reads: ``mask_token_id`` (0.33),
  ``pard_token`` and ``ptd_token_id`` (older releases read only these two);
* ``vocab_size`` equal to the target's (vLLM refuses a draft model otherwise), so the mask token must
  sit on a spare row or a reused token (``add_mask_token(placement="keep_vocab_size")``);
* the tokenizer (vLLM tokenizes with the target's; ours is kept for mars_hf and for inspection).

A LoRA gated to mask positions is not a weight change and cannot be merged. The export refuses it
unless ``drafter_only_merge=True``: the adapter is then merged into the weights, so it applies at every
position. That is acceptable for a drafter (the target verifies every draft, so the output is the
target's either way), but the drafter's real positions no longer run the base weights its masks were
trained on: its drafts differ from the gated model's, and acceptance may drop. Measure it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from mars_hf.decoding.gated_lora import (
    GATE_TOKEN_KEY,
    MARS_ADAPTER_CONFIG_FILE,
    is_mars_peft_type,
    read_adapter_weights,
    read_gating_record,
)
from mars_hf.models.adapters import is_peft_model
from mars_hf.models.mask_token import get_mars_config
from mars_hf.models.modeling import load_mars_model, read_checkpoint_json, require_tokenizer

logger = logging.getLogger(__name__)

# config.json keys vLLM reads the parallel-drafting token id from, in vLLM 0.33.0's order of precedence
# (vllm/v1/spec_decode/llm_base_proposer.py, _init_parallel_drafting_params, lines 355-379). We write the
# plain ones; `dflash_config` and `dspark_noise_token_id` belong to other drafter families.
VLLM_MASK_KEYS = ("mask_token_id", "pard_token", "ptd_token_id")
EXPORT_KEY = "vllm_export"


class ExportRefusedError(ValueError):
    """The checkpoint cannot become a vLLM drafter as asked; the message says why and what to do."""


def export_for_vllm(
    checkpoint: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    target: str | None = None,
    drafter_only_merge: bool = False,
    block_size: int | None = None,
    base_model_name_or_path: str | None = None,
    **hub_kwargs,
) -> Path:
    """Write ``out_dir``, a folder vLLM loads as a parallel drafter for ``target``; returns it.

    Args:
        checkpoint: any MARS checkpoint :func:`mars_hf.hub.load` takes (full model, LoRA adapter).
        out_dir: a new or empty folder.
        target: folder or Hub id of the target model; its ``vocab_size`` (as vLLM reads it) and its
            tokenizer must match the drafter's. Default: the adapter's base model, or the vocabulary size
            the checkpoint recorded before its mask token was added.
        drafter_only_merge: merge a mask-gated LoRA everywhere (see the module docstring) instead of
            refusing it.
        block_size: only for checkpoints that do not record it.
        base_model_name_or_path: base model of a LoRA adapter (default: the adapter config's).
    """

    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise ExportRefusedError(f"{out} is not empty; pass a new or empty --out folder.")
    checkpoint = str(checkpoint)
    adapter_config = read_checkpoint_json(checkpoint, "adapter_config.json", hub_kwargs)
    is_adapter = adapter_config is not None and read_checkpoint_json(checkpoint, "config.json", hub_kwargs) is None
    gated = (
        is_adapter and _adapter_mars(checkpoint, adapter_config, hub_kwargs).get("adapter_gating") == "mask"
    )
    if gated and not drafter_only_merge:
        raise ExportRefusedError(
            f"{checkpoint} is a LoRA adapter gated to mask positions: its delta applies only where the input is "
            "the mask token, so it is not a weight change and vLLM (which loads a drafter as plain weights) "
            "cannot run it. Pass --drafter-only-merge (drafter_only_merge=True) to merge it into the weights "
            "anyway: the adapter then also changes real positions, so the drafter's drafts differ from the "
            "gated model's (the target still verifies every draft; acceptance may drop), or export a "
            "checkpoint trained without adapter_gating."
        )
    model, tokenizer, mars = _load_merged(checkpoint, gated, block_size, base_model_name_or_path, hub_kwargs)
    mask_token_id = int(mars["mask_token_id"])
    tokenizer = require_tokenizer(tokenizer, checkpoint, "the vLLM export (the drafter folder holds it)")
    rows = _check_mask_token(model, tokenizer, mask_token_id)
    if target is None and is_adapter:
        target = base_model_name_or_path or adapter_config.get("base_model_name_or_path")
    _check_vocabulary(checkpoint, rows, tokenizer, mask_token_id, target, mars, hub_kwargs)
    mars[EXPORT_KEY] = {
        "drafter_only_merge": bool(gated),
        "source": checkpoint,
        **({"target": str(target)} if target is not None else {}),
    }
    _write_drafter(model, tokenizer, mars, mask_token_id, out)
    logger.info(
        "Wrote a vLLM parallel drafter to %s (mask token id %d, vocab_size %d%s).",
        out,
        mask_token_id,
        rows,
        ", gated adapter merged everywhere" if gated else "",
    )
    return out


def _load_merged(checkpoint: str, gated: bool, block_size, base_model_name_or_path, hub_kwargs):
    """The checkpoint as plain merged weights (a gated adapter merged everywhere), its tokenizer and its
    ``config.mars`` (without the gating, which the merged drafter no longer has)."""
    kwargs = dict(hub_kwargs, dtype="auto")
    if base_model_name_or_path is not None:
        kwargs["base_model_name_or_path"] = base_model_name_or_path
    model, tokenizer = load_mars_model(
        checkpoint, block_size=block_size, merge_adapter="auto" if gated else True, enable=False, **kwargs
    )
    if is_peft_model(model):  # pragma: no cover - merge_adapter=True always unwraps an ungated adapter
        raise ExportRefusedError(f"{checkpoint}: the adapter could not be merged into plain weights.")
    mars = dict(get_mars_config(model))
    if gated:
        _merge_gated_adapter_everywhere(model, checkpoint, hub_kwargs)
        mars.pop("adapter_gating", None)
    return model, tokenizer, mars


def _check_mask_token(model, tokenizer, mask_token_id: int) -> int:
    """Refuse a model whose config, embeddings and tokenizer disagree on the vocabulary or the mask id;
    returns the number of embedding rows."""
    rows = model.get_input_embeddings().weight.shape[0]
    if model.config.get_text_config().vocab_size != rows:  # pragma: no cover - from_pretrained keeps them equal
        raise ExportRefusedError(
            f"config.vocab_size is {model.config.get_text_config().vocab_size} but the embeddings have {rows} rows."
        )
    if tokenizer.mask_token_id is None or int(tokenizer.mask_token_id) != mask_token_id:
        raise ExportRefusedError(
            f"config.mars.mask_token_id is {mask_token_id} but the tokenizer's mask token id is "
            f"{tokenizer.mask_token_id}; save the tokenizer the model was trained with."
        )
    return rows


def _check_vocabulary(
    checkpoint: str, rows: int, tokenizer, mask_token_id: int, target, mars: dict, hub_kwargs
) -> None:
    """vLLM needs the drafter's vocab_size to equal its target's: checked against ``target`` when there is
    one, else against the base vocabulary the checkpoint recorded; with neither, a warning."""
    if target is not None:
        check_target_vocabulary(rows, tokenizer, mask_token_id, target, hub_kwargs)
    elif mars.get("base_vocab_size") is not None and int(mars["base_vocab_size"]) != rows:
        raise ExportRefusedError(
            f"Adding the mask token grew the vocabulary from {mars['base_vocab_size']} to {rows} rows; vLLM "
            "requires a drafter's vocab_size to equal its target's, so this model cannot draft for its base "
            "model. Retrain with MARSConfig(mask_token_placement='keep_vocab_size') (the mask then takes a "
            "spare row or an unused special token), or pass --target if your target really has "
            f"{rows} rows."
        )
    else:
        logger.warning(
            "No --target given and %s does not record its base vocabulary size: the vocabulary was not "
            "checked. vLLM refuses the drafter at start-up unless the target's vocab_size is %d.",
            checkpoint,
            rows,
        )


def _write_drafter(model, tokenizer, mars: dict, mask_token_id: int, out: Path) -> None:
    """Save the drafter with the mask id under every key vLLM reads, and read it back as vLLM would."""
    model.config.mars = mars
    for key in VLLM_MASK_KEYS:
        setattr(model.config, key, mask_token_id)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    found = read_drafter_mask_token_like_vllm(out)
    if found != mask_token_id:  # pragma: no cover - a guard on save_pretrained dropping the keys
        raise ExportRefusedError(f"{out}/config.json gives mask id {found}, not {mask_token_id}.")


def read_drafter_mask_token_like_vllm(folder: str | os.PathLike) -> int:
    """The parallel-drafting token id vLLM 0.33.0 takes from a drafter's ``config.json``.

    Same lookup order as ``SpecDecodeBaseProposer._init_parallel_drafting_params``
    (vllm/v1/spec_decode/llm_base_proposer.py lines 355-379): ``dflash_config["mask_token_id"]``, then
    ``mask_token_id`` (if not None), ``dspark_noise_token_id``, ``pard_token``, ``ptd_token_id``;
    attributes of the transformers config loaded from the folder. Raises vLLM's error when none is set.
    """
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(folder))
    dflash = getattr(config, "dflash_config", None)
    if dflash and "mask_token_id" in dflash:
        return int(dflash["mask_token_id"])
    if getattr(config, "mask_token_id", None) is not None:
        return int(config.mask_token_id)
    for key in ("dspark_noise_token_id", "pard_token", "ptd_token_id"):
        if hasattr(config, key):
            return int(getattr(config, key))
    raise ExportRefusedError(
        "For parallel drafting, the draft model config must have `dflash_config.mask_token_id`, "
        "`mask_token_id`, `dspark_noise_token_id`, `pard_token`, or `ptd_token_id` specified in its config.json "
        f"(vLLM's error; {folder} has none). Export the checkpoint with `mars-hf export --for vllm`."
    )


def vocab_size_like_vllm(config_dict: dict) -> int | None:
    """``ModelConfig.get_vocab_size()`` of vLLM: the text config's ``vocab_size`` (``text_config`` if nested)."""
    text = config_dict.get("text_config") if isinstance(config_dict.get("text_config"), dict) else config_dict
    value = text.get("vocab_size", config_dict.get("vocab_size"))
    return None if value is None else int(value)


def check_target_vocabulary(rows: int, tokenizer, mask_token_id: int, target: str, hub_kwargs: dict) -> None:
    """Refuse unless ``target`` has ``rows`` as vocab_size (vLLM's own check) and the same token ids.

    vLLM compares only the sizes (``SpeculativeConfig.verify_equal_vocab_size_if_draft_model``); equal
    sizes with different token ids would load and draft garbage, so every target token must also have
    the same id in the drafter's tokenizer (the mask token excepted: it may be a token only we have).
    """
    config = read_checkpoint_json(str(target), "config.json", hub_kwargs)
    if config is None:
        raise ExportRefusedError(
            f"Cannot read the target {target!r} (no config.json locally or in the Hugging Face cache); pass the "
            "folder or cached Hub id of the model vLLM will serve as the target."
        )
    target_size = vocab_size_like_vllm(config)
    if target_size != rows:
        raise ExportRefusedError(
            f"The drafter's vocab_size is {rows} but the target {target!r} has {target_size}: vLLM refuses a draft "
            "model whose vocabulary size differs from the target's. Use the target this model was fine-tuned "
            "from; if the mask token grew the vocabulary, retrain with "
            "MARSConfig(mask_token_placement='keep_vocab_size') so it takes a spare row or an unused special token."
        )
    from transformers import AutoTokenizer

    try:
        target_tokenizer = AutoTokenizer.from_pretrained(str(target), **hub_kwargs)
    except (OSError, ValueError) as error:
        raise ExportRefusedError(
            f"Cannot load the tokenizer of the target {target!r} ({error}); vLLM tokenizes with it, so the export "
            "checks it against the drafter's. Pass a target folder or cached Hub id that has its tokenizer."
        ) from error
    ours = tokenizer.get_vocab()
    differing = [
        (text, token_id, ours.get(text))
        for text, token_id in target_tokenizer.get_vocab().items()
        if token_id != mask_token_id and ours.get(text) != token_id
    ]
    if differing:
        shown = ", ".join(f"{text!r}: target {a}, drafter {b}" for text, a, b in sorted(differing)[:5])
        raise ExportRefusedError(
            f"The drafter's tokenizer disagrees with the target {target!r} on {len(differing)} token ids ({shown}); "
            "vLLM would feed the drafter the target's ids. Export a MARS model fine-tuned from this target."
        )


def _adapter_mars(checkpoint: str, adapter_config: dict, hub_kwargs: dict) -> dict:
    """The adapter's MARS record: ``mars_config.json``, or, when ``adapter_config.json`` itself says the adapter is
    gated (``gate_token_id``, the peft_type ``MARS_PEFT_TYPE``), the checked record, so a gated adapter that lost
    ``mars_config.json`` is still known as gated here."""
    if adapter_config.get(GATE_TOKEN_KEY) is not None or is_mars_peft_type(adapter_config.get("peft_type")):
        return read_gating_record(checkpoint, hub_kwargs)
    return read_checkpoint_json(checkpoint, MARS_ADAPTER_CONFIG_FILE, hub_kwargs) or {}


@torch.no_grad()
def _merge_gated_adapter_everywhere(model, checkpoint: str, hub_kwargs: dict) -> None:
    """``W += scaling · B A`` for every adapted layer, from the checkpoint's adapter files.

    The model comes from ``load_mars_model`` with the gate installed; that only wraps forwards and adds
    non-persistent buffers, so the weights are the base's and what is saved is exactly base + delta.
    """
    pairs, scaling = read_adapter_weights(checkpoint, hub_kwargs)
    modules = dict(model.named_modules())
    for path, pair in pairs.items():
        weight = modules[path].weight
        delta = (pair["B"].to(torch.float64) @ pair["A"].to(torch.float64)) * scaling
        weight += delta.to(device=weight.device, dtype=weight.dtype)
    logger.warning(
        "Merged the mask-gated adapter of %s into %d layers for every position (drafter-only merge): this "
        "drafter's predictions differ from the gated model's, including its one-token predictions.",
        checkpoint,
        len(pairs),
    )
