"""The model card of a MARS checkpoint: rendered from one Jinja template, with an optional speed/quality table."""

from __future__ import annotations

import json
from pathlib import Path

from mars_hf import __version__

MODEL_CARD_TEMPLATE = "mars_model_card.md"
CARD_TAGS = ["mars", "multi-token-prediction", "custom_generate", "text-generation"]


def model_card_template_path() -> Path:
    """The Jinja template: ``model_cards/`` in a source checkout, ``mars_hf/templates/`` in a wheel.

    ``mars_hf/templates/mars_model_card.md`` is a symlink to ``model_cards/mars_model_card.md`` (one
    source of truth); building a wheel copies the file behind it.
    """
    here = Path(__file__).resolve().parents[1]
    for candidate in (
        here / "templates" / MODEL_CARD_TEMPLATE,
        here.parent / "model_cards" / MODEL_CARD_TEMPLATE,
    ):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"The model card template {MODEL_CARD_TEMPLATE} is missing; reinstall mars-hf.")


def render_model_card(
    *,
    repo_id: str,
    mars: dict,
    mask_token: str,
    architecture: str,
    is_adapter: bool = False,
    base_model: str | None = None,
    datasets: list[str] | str | None = None,
    license: str | None = "apache-2.0",
    language: list[str] | str | None = None,
    tags: list[str] | None = None,
    training: dict | None = None,
    results: list[dict] | None = None,
    results_description: str | None = None,
    quality_metric: str = "quality",
):
    """A ``huggingface_hub.ModelCard`` rendered from the MARS template.

    ``results`` is a list of rows ``{"tau": 0.9, "tokens_per_forward": 1.6, "quality": 0.41}`` (an
    optional ``"speedup"`` adds a column; ``"threshold"`` is accepted for ``"tau"``).
    """
    from huggingface_hub import ModelCard, ModelCardData

    datasets = [datasets] if isinstance(datasets, str) else list(datasets or [])
    all_tags = list(dict.fromkeys(CARD_TAGS + (["peft", "lora"] if is_adapter else []) + list(tags or [])))
    card_data = ModelCardData(
        base_model=base_model,
        datasets=datasets or None,
        language=language,
        # A gated adapter's peft_type is one plain PEFT refuses (mars_hf.decoding.gated_lora.MARS_PEFT_TYPE), so the
        # Hub's PEFT snippet would fail on it: the library that loads it is mars_hf.
        library_name=("mars-hf" if mars.get("adapter_gating") == "mask" else "peft")
        if is_adapter
        else "transformers",
        license=license,
        pipeline_tag="text-generation",
        tags=all_tags,
    )
    rows = [_result_row(row) for row in results or []]
    return ModelCard.from_template(
        card_data,
        template_path=str(model_card_template_path()),
        model_id=repo_id.split("/")[-1],
        repo_id=repo_id,
        base_model=base_model,
        is_adapter=is_adapter,
        block_size=mars["block_size"],
        mask_token=mask_token,
        mask_token_id=mars["mask_token_id"],
        mars_config_json=json.dumps(mars, sort_keys=True),
        is_gated=mars.get("adapter_gating") == "mask",
        architecture=architecture,
        training=training or None,
        results=rows,
        has_speedup=bool(rows) and all(row.get("speedup") is not None for row in rows),
        results_description=results_description,
        quality_metric=quality_metric,
        datasets=datasets,
        mars_hf_version=__version__,
    )


def _result_row(row: dict) -> dict:
    row = dict(row)
    if "tau" not in row and "threshold" in row:
        row["tau"] = row.pop("threshold")
    missing = {"tau", "tokens_per_forward", "quality"} - set(row)
    if missing:
        raise ValueError(
            f"Each results row needs tau, tokens_per_forward and quality; {row} lacks {sorted(missing)}."
        )
    for key in ("tokens_per_forward", "quality", "speedup"):
        if isinstance(row.get(key), float):
            row[key] = f"{row[key]:.3g}" if key != "speedup" else f"{row[key]:.2f}×"
    return row


def read_results_file(path: str | None) -> dict:
    """Keyword arguments for the card's speed/quality table from a JSON file (a list of rows, or an
    object with ``rows``, ``quality_metric`` and ``description``); ``None`` gives none."""
    if path is None:
        return {}
    with open(path, encoding="utf-8") as handle:
        data = json.load(handle)
    if isinstance(data, list):
        return {"results": data}
    out = {"results": data["rows"]}
    if "quality_metric" in data:
        out["quality_metric"] = data["quality_metric"]
    if "description" in data:
        out["results_description"] = data["description"]
    return out
