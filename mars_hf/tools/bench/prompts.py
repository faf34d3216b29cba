"""The prompts a benchmark decodes: built-in chat prompts, the grounded set, a file; and their batches."""

from __future__ import annotations

import json
import os
from pathlib import Path

from mars_hf.models.chat_inputs import chat_inputs

# General chat prompts that ask for answers longer than a typical ``max_new_tokens``, so most rows
# decode until the limit and timings compare equal amounts of work.
BUILTIN_PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a bicycle works, step by step.",
    "List the days of the week and say one thing people often do on each.",
    "Write a Python function that checks whether a number is prime, and explain it.",
    "Count from 1 to 40, separated by commas.",
    "Describe the water cycle to a ten-year-old.",
    "What are the main differences between Python and C? Give several examples.",
    "Give five tips for staying focused while studying, with a sentence on each.",
]


GROUNDED_PROMPTS_FILE = os.fspath(Path(__file__).resolve().parents[2] / "templates" / "grounded_prompts.json")
PROMPT_SETS = ("chat", "grounded")


def grounded_prompts() -> list[str]:
    """Prompts whose answers repeat their input (rewrite, summarise, convert, edit code): where prompt
    lookup's drafts are kept (``mars_hf/templates/grounded_prompts.json``)."""
    with open(GROUNDED_PROMPTS_FILE, encoding="utf-8") as handle:
        return list(json.load(handle)["prompts"])


def load_prompts(path: str | os.PathLike) -> list[str]:
    """Prompts from a file: one per line (``.txt``) or JSON lines with a ``prompt`` field or a
    ``messages`` list whose first user message is taken."""
    prompts = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            line = line.strip()
            if not line:
                continue
            if str(path).endswith((".jsonl", ".json")):
                record = json.loads(line)
                if "prompt" in record and isinstance(record["prompt"], str):
                    prompts.append(record["prompt"])
                else:
                    messages = record.get("messages") or record.get("prompt") or []
                    prompts.append(next(m["content"] for m in messages if m["role"] == "user"))
            else:
                prompts.append(line)
    if not prompts:
        raise ValueError(f"No prompts found in {path}.")
    return prompts


def prepare_inputs(tokenizer, prompts: list[str], batch_size: int) -> dict:
    """Chat-template ``batch_size`` prompts (cycling through the list), left-padded (`chat_inputs`)."""
    return chat_inputs(tokenizer, [prompts[i % len(prompts)] for i in range(batch_size)])


def prepare_batches(tokenizer, prompts: list[str], batch_size: int) -> list[dict]:
    """Every prompt once, in batches of ``batch_size`` (the last one filled up by cycling the list),
    so that each batch size decodes the same prompt set and batch 1 is not one prompt's anecdote."""
    count = max(len(prompts), batch_size)
    count = -(-count // batch_size) * batch_size
    rows = [prompts[i % len(prompts)] for i in range(count)]
    return [
        prepare_inputs(tokenizer, rows[i : i + batch_size], batch_size) for i in range(0, count, batch_size)
    ]
