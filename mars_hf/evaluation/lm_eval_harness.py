"""MARS decoding inside lm-evaluation-harness: the ``mars-hf`` model and the offline HumanEval task.

Importing this module registers ``--model mars-hf`` with lm-eval. It is lm-eval's own ``HFLM`` (same
batching, left padding, chat templates, loglikelihood tasks) with three changes:

* the checkpoint loads through :func:`mars_hf.models.modeling.load_mars_model` (full model, LoRA adapter or
  the paper's releases; ``pretrained=embedded`` is the embedded SmolLM2), with the mask token
  suppressed as an output;
* MARS settings (``mars_threshold``, ``mars_acceptance="verify"``, ``mars_block_size``, ``mars_cache``)
  come from ``--gen_kwargs`` (per task) or ``--model_args`` (defaults for every task) and reach
  ``model.generate`` together with lm-eval's ``max_length``, left-padded ``attention_mask`` and
  ``pad_token_id``;
* stop strings (``until``) are checked by a criterion that judges each row on its own text. lm-eval's
  ``MultiTokenEOSCriteria`` remembers rows as done, which is right for stock decoding (one token per
  step) but wrong for MARS, whose provisional window tokens may be rejected after being looked at.

Tokens per forward (every model call, the prompt's included) is counted per task and logged; ``mars-hf
eval --tasks`` puts it next to each task's score.

Usage::

    mars-hf eval CHECKPOINT --tasks humaneval_mars --thresholds 1.0,0.9 --limit 20 --confirm-run-unsafe-code
    python -m mars_hf.evaluation.lm_eval_harness run --model mars-hf --model_args pretrained=CHECKPOINT \\
        --tasks humaneval_mars --include_path "$(python -m mars_hf.evaluation.lm_eval_harness --tasks-dir)" \\
        --gen_kwargs mars_threshold=0.9 --confirm_run_unsafe_code
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import subprocess
import sys
from pathlib import Path

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from transformers import StoppingCriteriaList

from mars_hf.evaluation.runs import StopOnSequences
from mars_hf.models.eos import eos_token_ids, trim_at_eos

logger = logging.getLogger(__name__)

TASKS_DIR = Path(__file__).resolve().parent / "lm_eval_tasks"
MARS_GENERATE_KWARGS = (
    "mars_threshold",
    "mars_acceptance",
    "mars_block_size",
    "mars_cache",
    "mars_cache_block",
)


@dataclasses.dataclass
class DecodingStats:
    """Tokens and forwards of every generation of one task."""

    num_tokens: int = 0
    num_forwards: int = 0
    num_generations: int = 0

    @property
    def tokens_per_forward(self) -> float | None:
        return self.num_tokens / self.num_forwards if self.num_forwards else None

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "tokens_per_forward": self.tokens_per_forward}


def _stock_counts(generated: torch.Tensor, stop_ids: set[int]) -> list[int]:
    """Tokens stock ``generate`` produced per row: up to and including the first EOS / pad."""
    return [len(trim_at_eos(row, stop_ids)) for row in generated.tolist()]


@register_model("mars-hf", "mars")
class MARSLM(HFLM):
    """lm-eval's ``HFLM`` decoding with MARS; see the module docstring.

    Model args beyond ``HFLM``'s: ``mars_threshold``, ``mars_acceptance``, ``mars_block_size``,
    ``mars_cache``, ``mars_cache_block`` (defaults for every generation; ``--gen_kwargs`` win) and
    ``merge_adapter`` (merge a LoRA adapter into its base; default "auto": every adapter but a
    mask-gated one, which cannot be merged).
    """

    instances: list[MARSLM] = []

    def __init__(self, pretrained="embedded", merge_adapter="auto", dtype="float32", **kwargs):
        from mars_hf.models.embedded_model import resolve_model_path
        from mars_hf.models.mask_token import suppress_mask_token
        from mars_hf.models.modeling import load_mars_model, require_tokenizer

        MARSLM.instances.append(self)  # so that `cli_evaluate` can print their statistics
        self.mars_defaults = {key: kwargs.pop(key) for key in MARS_GENERATE_KWARGS if key in kwargs}
        self.mars_stats: dict[str, DecodingStats] = {}
        self._stats_key = "default"
        if isinstance(pretrained, str):
            dtype = getattr(torch, dtype) if isinstance(dtype, str) and dtype != "auto" else dtype
            load_kwargs = {"dtype": dtype} if dtype != "auto" else {}
            model, tokenizer = load_mars_model(
                resolve_model_path(pretrained), merge_adapter=merge_adapter, **load_kwargs
            )
            tokenizer = require_tokenizer(tokenizer, pretrained, "lm_eval (it tokenizes the requests)")
            suppress_mask_token(model)
            self.checkpoint = pretrained
            kwargs.setdefault("tokenizer", tokenizer)
            device = kwargs.pop("device", None) or ("cuda" if torch.cuda.is_available() else "cpu")
            model.to(device)
            pretrained = model.eval()
        else:
            self.checkpoint = getattr(getattr(pretrained, "config", None), "name_or_path", None)
        super().__init__(pretrained=pretrained, **kwargs)

    # ------------------------------------------------------------------------------------- generate
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Run each task's requests as a group so that tokens per forward is counted per task."""
        by_task: dict[str, list[int]] = {}
        for index, request in enumerate(requests):
            by_task.setdefault(getattr(request, "task_name", None) or "default", []).append(index)
        results: list[str | None] = [None] * len(requests)
        for task, indices in by_task.items():
            self._stats_key = task
            outputs = super().generate_until([requests[i] for i in indices], disable_tqdm=disable_tqdm)
            for i, output in zip(indices, outputs):
                results[i] = output
            stats = self.mars_stats.get(task)
            if stats is not None and stats.num_forwards:
                logger.info(
                    "mars-hf %s: %.3f tokens per forward (%d tokens in %d forwards, %d generations)",
                    task,
                    stats.tokens_per_forward,
                    stats.num_tokens,
                    stats.num_forwards,
                    stats.num_generations,
                )
        return results

    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs) -> torch.Tensor:
        settings = {**self.mars_defaults}
        settings.update(
            {key: generation_kwargs.pop(key) for key in MARS_GENERATE_KWARGS if key in generation_kwargs}
        )
        settings = {key: value for key, value in settings.items() if value is not None}
        # HFLM's greedy normalisation: temperature 0 means greedy, and greedy takes no temperature.
        generation_kwargs["temperature"] = generation_kwargs.get("temperature", 0.0)
        do_sample = generation_kwargs.get("do_sample")
        if generation_kwargs["temperature"] == 0.0 and do_sample is None:
            generation_kwargs["do_sample"] = do_sample = False
        if do_sample is False and generation_kwargs["temperature"] == 0.0:
            generation_kwargs.pop("temperature")
        prompt_length = context.shape[1]
        # special tokens kept in the text, as lm-eval's own criterion decodes it
        criterion = StopOnSequences(self.tokenizer, stop, prompt_length, skip_special_tokens=False)
        stopping = StoppingCriteriaList([criterion])
        use_mars = settings.get("mars_threshold") is not None or settings.get("mars_acceptance") == "verify"
        with torch.autocast(
            device_type=self.device.type,
            dtype=self.mixed_precision_dtype,
            enabled=self.mixed_precision_dtype is not None,
        ):
            output = self.model.generate(
                input_ids=context,
                max_length=max_length,
                stopping_criteria=stopping,
                pad_token_id=self.tokenizer.pad_token_id,
                use_cache=True,
                return_dict_in_generate=True,
                **settings,
                **generation_kwargs,
            )
        stats = self.mars_stats.setdefault(self._stats_key, DecodingStats())
        stats.num_generations += context.shape[0]
        if use_mars:
            counts = output.accepted_counts.to("cpu")  # [steps, batch], one forward per step
            stats.num_tokens += int(counts.sum())
            if counts.shape[1] == 1:
                stats.num_forwards += int(output.num_forwards)
            else:  # a row's forwards: every step until its last accepted token (waiting steps included)
                for row in range(counts.shape[1]):
                    steps = torch.nonzero(counts[:, row]).flatten()
                    stats.num_forwards += int(steps[-1]) + 1 if len(steps) else 0
        else:
            stop_ids = eos_token_ids(self.model, self.tokenizer) | {self.tokenizer.pad_token_id}
            tokens = sum(_stock_counts(output.sequences[:, prompt_length:], stop_ids))
            stats.num_tokens += tokens
            stats.num_forwards += tokens  # one forward per token, the prefill yielding the first
        return output.sequences


def task_manager(include_path=None, tasks=None):
    """An lm-eval ``TaskManager`` that also knows the tasks shipped in ``mars_hf/evaluation/lm_eval_tasks``.

    With ``tasks`` given and all of them found there or in ``include_path``, lm-eval's thousands of
    built-in task files are not indexed (that scan dominates a small evaluation).
    """
    from lm_eval.tasks import TaskManager

    paths = [str(TASKS_DIR)]
    if include_path:
        paths += [include_path] if isinstance(include_path, str | Path) else list(include_path)
    paths = [str(p) for p in paths]
    if tasks:
        local = TaskManager(include_path=paths, include_defaults=False)
        if all(task in local.all_tasks for task in tasks):
            return local
    return TaskManager(include_path=paths)


@contextlib.contextmanager
def quiet_git_hash():
    """lm-eval records the working folder's git commit by running ``git describe`` with our stderr, so
    every run outside a repository printed ``fatal: not a git repository``: ask git quietly instead
    (the same value: the commit, else lm-eval's own reading of ``.git``, else None)."""
    from lm_eval import evaluator
    from lm_eval.loggers.utils import get_commit_from_path

    def git_commit_hash():
        try:
            command = ["git", "describe", "--always"]
            return subprocess.check_output(command, stderr=subprocess.DEVNULL).strip().decode()
        except (OSError, subprocess.CalledProcessError):
            return get_commit_from_path(os.getcwd())

    original = evaluator.get_git_commit_hash
    evaluator.get_git_commit_hash = git_commit_hash
    try:
        yield
    finally:
        evaluator.get_git_commit_hash = original


def cli_evaluate(argv: list[str] | None = None) -> None:
    """lm-eval's own command line with ``--model mars-hf`` registered (``--tasks-dir`` prints the task folder)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv == ["--tasks-dir"]:
        print(TASKS_DIR)
        return
    from lm_eval.__main__ import cli_evaluate as lm_eval_cli

    sys.argv = ["lm-eval", *argv]
    with quiet_git_hash():
        lm_eval_cli()
    for lm in MARSLM.instances:
        for task, stats in lm.mars_stats.items():
            print(
                f"mars-hf {task}: {stats.tokens_per_forward:.3f} tokens per forward "
                f"({stats.num_tokens} tokens in {stats.num_forwards} forwards, {stats.num_generations} generations)"
            )


if __name__ == "__main__":
    cli_evaluate()


# ------------------------------------------------------------------------------------------ one call
def evaluate_tasks(
    checkpoint,
    tasks: list[str],
    thresholds=(1.0, 0.9),
    *,
    stock: bool = True,
    verify: bool = False,
    limit: int | float | None = None,
    batch_size: int = 1,
    num_fewshot: int | None = None,
    gen_kwargs: dict | None = None,
    include_path=None,
    confirm_run_unsafe_code: bool = False,
    apply_chat_template: bool = False,
    device: str | None = None,
    dtype: str = "float32",
    mars_block_size: int | None = None,
    metadata: dict | None = None,
) -> list[dict]:
    """lm-eval ``tasks`` with stock decoding, MARS at each τ (and verified decoding): one row per task and run.

    The checkpoint loads once; every run is a ``lm_eval.simple_evaluate`` call on the same weights. Each
    row holds the task's metrics as lm-eval names them plus ``tokens_per_forward`` of that run.
    """
    import lm_eval

    stray = sorted(set(gen_kwargs or {}) & set(MARS_GENERATE_KWARGS))
    if stray:
        raise ValueError(f"{stray} in gen_kwargs: choose MARS runs with `thresholds` / `verify` instead.")
    base = {"mars_block_size": mars_block_size} if mars_block_size else {}
    lm = (
        checkpoint
        if isinstance(checkpoint, MARSLM)
        else MARSLM(pretrained=checkpoint, dtype=dtype, device=device, batch_size=batch_size)
    )
    runs = [("stock", None, {})] if stock else []
    runs += [(f"mars@{tau:g}", float(tau), {"mars_threshold": float(tau)}) for tau in thresholds]
    if verify:
        runs.append(("verify", None, {"mars_acceptance": "verify"}))
    manager = task_manager(include_path, tasks)
    rows = []
    for label, tau, settings in runs:
        lm.mars_defaults = {**base, **settings}
        lm.mars_stats = {}
        logger.info("lm-eval %s with %s decoding", ",".join(tasks), label)
        with quiet_git_hash():
            output = lm_eval.simple_evaluate(
                model=lm,
                tasks=list(tasks),
                num_fewshot=num_fewshot,
                limit=limit,
                gen_kwargs=gen_kwargs or None,
                task_manager=manager,
                confirm_run_unsafe_code=confirm_run_unsafe_code,
                apply_chat_template=apply_chat_template,
                log_samples=False,
                bootstrap_iters=0,
                metadata=metadata,
            )
        for task, metrics in output["results"].items():
            stats = lm.mars_stats.get(task, DecodingStats())
            row = {"task": task, "label": label, "threshold": tau}
            row["documents"] = metrics.get("sample_len")
            drop = ("alias", "name", "sample_len")
            row.update({k: v for k, v in metrics.items() if k not in drop and "_stderr" not in k})
            row.update(stats.as_dict())
            rows.append(row)
    return rows


def format_rows(rows: list[dict]) -> str:
    """A plain table: task, decoding, each score, tokens per forward."""
    from mars_hf.evaluation.runs import format_table

    skip = {
        "task",
        "label",
        "documents",
        "threshold",
        "num_tokens",
        "num_forwards",
        "num_generations",
        "tokens_per_forward",
    }
    metrics = list(dict.fromkeys(k for row in rows for k in row if k not in skip))
    columns = [("task", "task", "{}"), ("label", "decoding", "{}"), ("documents", "documents", "{}")]
    columns += [(m, m.split(",")[0], "{:.3f}") for m in metrics]
    columns += [("tokens_per_forward", "tokens/forward", "{:.2f}")]
    printable = [
        {k: (v if not isinstance(v, str) or k in ("task", "label") else None) for k, v in r.items()}
        for r in rows
    ]
    return format_table(printable, columns)
