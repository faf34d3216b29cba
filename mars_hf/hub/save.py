"""Write a Hub-ready MARS folder: weights, tokenizer, ``config.mars``, ``custom_generate/`` and a model card.

A folder written by :func:`save_pretrained` works for two kinds of users:

* with mars_hf: :func:`mars_hf.hub.load` (or ``AutoMARSModelForCausalLM.from_pretrained``) then
  ``model.generate(mars_threshold=...)``;
* with only torch + transformers: ``model.generate(custom_generate=<repo>, trust_remote_code=True,
  mars_threshold=...)`` runs ``custom_generate/`` (see :mod:`mars_hf.hub.custom_generate`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from mars_hf.decoding.gated_lora import MARS_ADAPTER_CONFIG_FILE, MARS_MASK_ROWS_FILE
from mars_hf.hub.card import render_model_card
from mars_hf.hub.custom_generate import write_custom_generate
from mars_hf.models.adapters import is_peft_model, save_mask_rows, unwrap_peft
from mars_hf.models.mask_token import get_mars_config

logger = logging.getLogger(__name__)


def save_pretrained(
    model,
    tokenizer,
    out_dir: str | os.PathLike,
    *,
    repo_id: str | None = None,
    base_model: str | None = None,
    datasets: list[str] | str | None = None,
    license: str | None = "apache-2.0",
    language: list[str] | str | None = None,
    tags: list[str] | None = None,
    training: dict | None = None,
    results: list[dict] | None = None,
    results_description: str | None = None,
    quality_metric: str = "quality",
    overwrite: bool = False,
) -> list[str]:
    """Write a Hub-ready MARS folder and return the relative paths of every file written.

    The folder holds the weights in safetensors (for a ``PeftModel``: the adapter, ``mars_config.json``
    and the trained mask-token row), the tokenizer with its mask token, ``config.mars``,
    ``custom_generate/`` (a small self-contained MARS decoder) and a ``README.md`` model card.

    Args:
        repo_id: the Hub id the folder is meant for (used in the card's usage snippets).
        base_model: Hub id of the model this one was fine-tuned from (card metadata); default: the
            adapter's base, or ``config._name_or_path`` when it looks like a Hub id.
        training: settings shown as the card's training table, e.g. ``{"epochs": 3, "lr": 1e-4}``.
        results: speed/quality rows for the card (see :func:`mars_hf.hub.render_model_card`).
        overwrite: allow a non-empty ``out_dir`` (its contents are removed first).
    """
    out_dir = Path(out_dir)
    is_adapter = is_peft_model(model)
    mars = dict(get_mars_config(model))
    mask_token_id = _check_mask_token(model, tokenizer, mars)
    _prepare_empty_folder(out_dir, overwrite)

    if is_adapter:
        # save_embedding_layers="auto" would ask the Hub whether the base vocab changed; the mask row is
        # saved on its own instead (a few KB instead of the whole embedding matrix).
        model.save_pretrained(out_dir, save_embedding_layers=False)
        (out_dir / MARS_ADAPTER_CONFIG_FILE).write_text(json.dumps(mars, indent=2, sort_keys=True) + "\n")
        save_mask_rows(model, mask_token_id, out_dir / MARS_MASK_ROWS_FILE)
    else:
        model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    write_custom_generate(out_dir / "custom_generate")

    config = model.config
    card = render_model_card(
        repo_id=repo_id or out_dir.resolve().name,
        mars=mars,
        mask_token=tokenizer.mask_token,
        architecture=(getattr(config, "architectures", None) or [type(unwrap_peft(model)).__name__])[0],
        is_adapter=is_adapter,
        base_model=base_model or _guess_base_model(model, is_adapter),
        datasets=datasets,
        license=license,
        language=language,
        tags=tags,
        training=training,
        results=results,
        results_description=results_description,
        quality_metric=quality_metric,
    )
    card.save(out_dir / "README.md")
    files = list_folder(out_dir)
    logger.info("Wrote %d files to %s.", len(files), out_dir)
    return files


def list_folder(folder: str | os.PathLike) -> list[str]:
    """Relative POSIX paths of all files under ``folder``, sorted (what ``upload_folder`` sends)."""
    folder = Path(folder)
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def _prepare_empty_folder(out_dir: Path, overwrite: bool) -> None:
    """The folder must hold exactly what will be uploaded: refuse a non-empty one unless ``overwrite``."""
    if out_dir.exists() and any(out_dir.iterdir()):
        if not overwrite:
            raise FileExistsError(
                f"{out_dir} is not empty: choose an empty folder or pass overwrite=True (removes its contents), "
                "so that the folder holds exactly what will be uploaded."
            )
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)


def _check_mask_token(model, tokenizer, mars: dict) -> int:
    if tokenizer.mask_token_id is None:
        raise ValueError(
            "The tokenizer has no mask token, so the checkpoint could not decode with MARS. Call "
            "`mars_hf.add_mask_token(model, tokenizer)` before training and save the same tokenizer."
        )
    mask_token_id = int(tokenizer.mask_token_id)
    if mask_token_id != int(mars["mask_token_id"]):
        raise ValueError(
            f"config.mars.mask_token_id is {mars['mask_token_id']} but the tokenizer's mask token "
            f"{tokenizer.mask_token!r} has id {mask_token_id}; save the tokenizer the model was trained with."
        )
    rows = model.get_input_embeddings().weight.shape[0]
    if mask_token_id >= rows:
        raise ValueError(f"The mask token id {mask_token_id} does not fit the {rows}-row embedding matrix.")
    return mask_token_id


def _looks_like_hub_id(name: str | None) -> bool:
    return (
        bool(name) and name.count("/") == 1 and not os.path.exists(name) and not name.startswith((".", "/"))
    )


def _guess_base_model(model, is_adapter: bool) -> str | None:
    if is_adapter:
        candidate = getattr(next(iter(model.peft_config.values())), "base_model_name_or_path", None)
    else:
        candidate = getattr(model.config, "_name_or_path", None)
    if _looks_like_hub_id(candidate):
        return candidate
    logger.warning("No Hub id for the base model; pass base_model= so the card's metadata names it.")
    return None
