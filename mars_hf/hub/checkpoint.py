"""Hub-ready MARS checkpoints: save a folder, render its model card, push it, load any MARS checkpoint.

A folder written by :func:`save_pretrained` works for two kinds of users:

* with mars_hf: :func:`load` (or ``AutoMARSModelForCausalLM.from_pretrained``) then
  ``model.generate(mars_threshold=...)``;
* with only torch + transformers: ``model.generate(custom_generate=<repo>, trust_remote_code=True,
  mars_threshold=...)`` runs ``custom_generate/generate.py``, a verbatim copy of
  ``mars_hf/decoding/generation.py`` (with ``mars_hf/decoding/cache.py`` beside it: transformers resolves the
  relative import of a sibling file both for local folders and Hub repos).
"""

from __future__ import annotations

import ast
import json
import logging
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mars_hf import __version__
from mars_hf.decoding.gated_lora import GATING_METADATA_KEY
from mars_hf.models.mask_token import get_mars_config
from mars_hf.models.modeling import MARS_ADAPTER_CONFIG_FILE, MARS_MASK_ROWS_FILE, load_mars_model

logger = logging.getLogger(__name__)

MODEL_CARD_TEMPLATE = "mars_model_card.md"
CARD_TAGS = ["mars", "multi-token-prediction", "custom_generate", "text-generation"]
# The files copied into ``custom_generate/`` (source module in mars_hf -> name in the checkpoint).
CUSTOM_GENERATE_FILES = {
    "generation.py": "generate.py",
    "cache.py": "cache.py",
    "decoder.py": "decoder.py",
    "layouts.py": "layouts.py",
    "acceptance.py": "acceptance.py",
    "gated_lora.py": "gated_lora.py",
    "calibration.py": "calibration.py",
    "cost_model.py": "cost_model.py",
    "planner.py": "planner.py",
    "draft_sources.py": "draft_sources.py",
}
# What custom_generate/ may import: transformers checks requirements.txt, Python the rest.
_ALLOWED_IMPORTS = {"torch", "transformers", "safetensors", "__future__"}
CUSTOM_GENERATE_REQUIREMENTS = "torch>=2.4\ntransformers>=5.24.0\nsafetensors\n"


def load(name_or_path, block_size: int | None = None, **kwargs):
    """``(model, tokenizer)`` from a local folder or Hub id, ready for ``generate(mars_threshold=...)``.

    Takes our checkpoints, LoRA adapters (loaded onto their base) and the paper's ``a2d-*``
    checkpoints; see :func:`mars_hf.models.modeling.load_mars_model` for the options.
    """
    return load_mars_model(name_or_path, block_size=block_size, **kwargs)


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
        library_name="peft" if is_adapter else "transformers",
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
    ``custom_generate/`` (the package's own decoding module) and a ``README.md`` model card.

    Args:
        repo_id: the Hub id the folder is meant for (used in the card's usage snippets).
        base_model: Hub id of the model this one was fine-tuned from (card metadata); default: the
            adapter's base, or ``config._name_or_path`` when it looks like a Hub id.
        training: settings shown as the card's training table, e.g. ``{"epochs": 3, "lr": 1e-4}``.
        results: speed/quality rows for the card (see :func:`render_model_card`).
        overwrite: allow a non-empty ``out_dir`` (its contents are removed first).
    """
    out_dir = Path(out_dir)
    is_adapter = _is_peft_model(model)
    mars = dict(get_mars_config(model))
    mask_token_id = _check_mask_token(model, tokenizer, mars)
    if out_dir.exists() and any(out_dir.iterdir()):
        if not overwrite:
            raise FileExistsError(
                f"{out_dir} is not empty: choose an empty folder or pass overwrite=True (removes its contents), "
                "so that the folder holds exactly what will be uploaded."
            )
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

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

    base_model = base_model or _guess_base_model(model, is_adapter)
    config = model.config
    card = render_model_card(
        repo_id=repo_id or out_dir.resolve().name,
        mars=mars,
        mask_token=tokenizer.mask_token,
        architecture=(getattr(config, "architectures", None) or [type(_unwrap(model)).__name__])[0],
        is_adapter=is_adapter,
        base_model=base_model,
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


def write_custom_generate(target: str | os.PathLike) -> list[str]:
    """Copy the decoding module into ``target`` verbatim, after checking it needs only torch/transformers."""
    target = Path(target)
    source_dir = Path(__file__).resolve().parents[1] / "decoding"
    sources = {source_dir / name: target / copy_name for name, copy_name in CUSTOM_GENERATE_FILES.items()}
    for source in sources:
        if not source.is_file():
            raise FileNotFoundError(
                f"{source} is missing; the package's decoding module is needed for custom_generate/."
            )
        _check_self_contained(source)
    target.mkdir(parents=True, exist_ok=True)
    for source, destination in sources.items():
        shutil.copyfile(source, destination)
    (target / "requirements.txt").write_text(CUSTOM_GENERATE_REQUIREMENTS)
    return sorted(p.name for p in target.iterdir())


def _check_self_contained(source: Path) -> None:
    """custom_generate/ runs where mars_hf is not installed: only torch, transformers, stdlib, ``.cache``."""
    allowed_relative = {Path(copy).stem for copy in CUSTOM_GENERATE_FILES.values()}
    tree = ast.parse(source.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                if node.module is None or node.module.split(".")[0] not in allowed_relative:
                    raise ImportError(
                        f"{source.name} line {node.lineno} imports from .{node.module or ''}: custom_generate/ only "
                        f"ships {sorted(allowed_relative)}, so the decoding module may import only from those."
                    )
                continue
            modules = [node.module or ""]
        else:
            continue
        for module in modules:
            top = module.split(".")[0]
            if top not in _ALLOWED_IMPORTS and top not in sys.stdlib_module_names:
                raise ImportError(
                    f"{source.name} line {node.lineno} imports {module!r}: custom_generate/ must import only "
                    "torch, transformers, safetensors and the standard library."
                )


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


@torch.no_grad()
def save_mask_rows(model, mask_token_id: int, path: Path) -> None:
    """The *effective* mask-token rows (LoRA / trainable-token deltas applied), plus any rows the base lacks."""
    from safetensors.torch import save_file

    input_embeddings = model.get_input_embeddings()
    num_rows = input_embeddings.weight.shape[0]
    base_rows = _base_vocab_size(model)
    ids = sorted({mask_token_id} | set(range(base_rows, num_rows) if base_rows is not None else []))
    index = torch.tensor(ids, device=input_embeddings.weight.device)
    tensors = {
        "ids": index.cpu(),
        "num_embeddings": torch.tensor(num_rows),
        "input_embeddings": input_embeddings(index).detach().cpu().contiguous(),
    }
    output = model.get_output_embeddings()
    output_weight = _effective_weight(output)
    if (
        output_weight is not None
        and output_weight.data_ptr() != _effective_weight(input_embeddings).data_ptr()
    ):
        tensors["output_embeddings"] = output_weight[index].detach().cpu().contiguous()
    # The gating is repeated here, so a gated adapter that lost mars_config.json is refused, not run ungated.
    gating = (getattr(_unwrap(model).config, "mars", None) or {}).get("adapter_gating")
    metadata = {"format": "pt", **({GATING_METADATA_KEY: str(gating)} if gating else {})}
    save_file(tensors, str(path), metadata=metadata)


def _effective_weight(module):
    """The weight a (possibly PEFT-wrapped) embedding or head really uses."""
    if module is None:
        return None
    if hasattr(module, "get_merged_weights") and hasattr(module, "active_adapters"):
        return module.get_merged_weights(module.active_adapters)
    return getattr(module, "weight", None)


def _base_vocab_size(model) -> int | None:
    """Rows of the adapter's base checkpoint, when its config can be read without a network."""
    base = getattr(next(iter(model.peft_config.values())), "base_model_name_or_path", None)
    if not base:
        return None
    try:
        from transformers import AutoConfig

        return int(AutoConfig.from_pretrained(base, local_files_only=True).vocab_size)
    except Exception:  # noqa: BLE001 - any failure just means "only save the mask row"
        return None


def _is_peft_model(model) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is a dependency
        return False
    return isinstance(model, PeftModel)


def _unwrap(model):
    return model.get_base_model() if _is_peft_model(model) else model


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


class HubTokenError(OSError):
    """Pushing needs a Hugging Face token and none was found."""


@dataclass
class PushResult:
    """What :func:`push_to_hub` did: the folder it wrote, its files, and the commit (None on a dry run)."""

    repo_id: str
    folder: Path
    files: list[str] = field(default_factory=list)
    commit: object | None = None
    dry_run: bool = False


def resolve_token(token: str | None = None) -> str:
    """``token``, else huggingface_hub's (``HF_TOKEN`` or ``hf auth login``); never logged."""
    from huggingface_hub import get_token

    token = token or get_token()
    if not token:
        raise HubTokenError(
            "No Hugging Face token found. Run `hf auth login`, or set the HF_TOKEN environment variable to a "
            "token with write access (https://huggingface.co/settings/tokens), or use --dry-run."
        )
    return token


def push_to_hub(
    model,
    tokenizer,
    repo_id: str,
    *,
    private: bool | None = None,
    create_pr: bool = False,
    commit_message: str | None = None,
    token: str | None = None,
    revision: str | None = None,
    dry_run: bool = False,
    save_dir: str | os.PathLike | None = None,
    **save_kwargs,
) -> PushResult:
    """:func:`save_pretrained` into ``save_dir`` (default: a temporary folder), then ``HfApi.upload_folder``.

    With ``dry_run=True`` nothing is sent: the folder is written (kept at ``save_dir``, or a new
    temporary folder) and :attr:`PushResult.files` lists exactly what would be uploaded.
    """
    from huggingface_hub import HfApi

    if "/" not in repo_id:
        raise ValueError(f"repo_id must look like 'user/name', got {repo_id!r}.")
    token = None if dry_run else resolve_token(token)
    temporary = save_dir is None
    folder = Path(tempfile.mkdtemp(prefix="mars_hf_push_")) if temporary else Path(save_dir)
    try:
        files = save_pretrained(model, tokenizer, folder, repo_id=repo_id, **save_kwargs)
        if dry_run:
            return PushResult(repo_id=repo_id, folder=folder, files=files, dry_run=True)
        api = HfApi(token=token)
        api.create_repo(repo_id, private=private, exist_ok=True)
        commit = api.upload_folder(
            repo_id=repo_id,
            folder_path=folder,
            commit_message=commit_message or "Upload MARS checkpoint with mars_hf",
            revision=revision,
            create_pr=create_pr,
        )
        logger.info("Uploaded %d files to %s.", len(files), repo_id)
        return PushResult(repo_id=repo_id, folder=folder, files=files, commit=commit)
    finally:
        if temporary and not dry_run:
            shutil.rmtree(folder, ignore_errors=True)


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
