"""The project's own instruction prompts: templates with slots, filled with a fixed seed.

Why templates: the quickstart needs a few hundred varied prompts on a machine that cannot download a
dataset, and it needs *held-out* prompts that never appear in training. Every prompt the templates
can produce is assigned to the training or the held-out split by a hash of its text, so the split
does not depend on how many prompts are drawn: asking for more training prompts can never pull in
an evaluation prompt. Prompts are drawn round-robin over the templates, so every size keeps the
same mix of code, lists, formatted answers, explanations, short writing and arithmetic.

The templates live in ``mars_hf/templates/instruction_prompts.json``.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import random
import re
from functools import lru_cache
from pathlib import Path

TEMPLATES_FILE = Path(__file__).resolve().parents[1] / "templates" / "instruction_prompts.json"
# One prompt in HELD_OUT_MODULUS (by hash of its text) is reserved for evaluation.
HELD_OUT_MODULUS = 8
_SLOT = re.compile(r"\{(\w+)\}")


@lru_cache(maxsize=4)
def load_templates(path: str | None = None) -> dict:
    """The template file as a dict with ``slots`` and ``templates`` (validated)."""
    data = json.loads(Path(path or TEMPLATES_FILE).read_text(encoding="utf-8"))
    for template in data["templates"]:
        missing = [slot for slot in _SLOT.findall(template["text"]) if slot not in data["slots"]]
        if missing:
            raise ValueError(f"Template {template['text']!r} uses undefined slots {missing}.")
    return data


def is_held_out(prompt: str) -> bool:
    """Whether ``prompt`` belongs to the held-out (evaluation) split; fixed by its text alone."""
    digest = hashlib.sha1(prompt.encode("utf-8")).digest()
    return digest[0] % HELD_OUT_MODULUS == 0


def _expand(template: dict, slots: dict) -> list[tuple[str, str]]:
    """Every ``(prompt, category)`` a template can produce, in a fixed order."""
    names = _SLOT.findall(template["text"])
    prompts = []
    for values in itertools.product(*(slots[name] for name in names)):
        text = template["text"]
        for name, value in zip(names, values):
            text = text.replace("{" + name + "}", value, 1)
        prompts.append((text, template["category"]))
    return prompts


def _pools(held_out: bool, path: str | None) -> list[list[tuple[str, str]]]:
    """Per template, its prompts in the requested split (duplicates across templates removed)."""
    data = load_templates(path)
    seen: set[str] = set()
    pools = []
    for template in data["templates"]:
        pool = []
        for prompt, category in _expand(template, data["slots"]):
            if prompt in seen or is_held_out(prompt) != held_out:
                continue
            seen.add(prompt)
            pool.append((prompt, category))
        pools.append(pool)
    return pools


def _draw(num_prompts: int, seed: int, held_out: bool, path: str | None, with_category: bool):
    pools = _pools(held_out, path)
    rng = random.Random(seed)
    for pool in pools:
        rng.shuffle(pool)
    available = sum(len(pool) for pool in pools)
    if num_prompts > available:
        split = "held-out" if held_out else "training"
        raise ValueError(
            f"Asked for {num_prompts} {split} prompts but the templates only produce {available}; "
            f"ask for fewer or add templates/slot values to {TEMPLATES_FILE.name}."
        )
    order = list(range(len(pools)))
    drawn: list[tuple[str, str]] = []
    cursor = [0] * len(pools)
    while len(drawn) < num_prompts:  # round-robin over templates, in a shuffled order each round
        rng.shuffle(order)
        for index in order:
            if len(drawn) == num_prompts:
                break
            if cursor[index] < len(pools[index]):
                drawn.append(pools[index][cursor[index]])
                cursor[index] += 1
    return drawn if with_category else [prompt for prompt, _ in drawn]


def training_prompts(num_prompts: int = 300, seed: int = 0, *, path: str | None = None, with_category=False):
    """``num_prompts`` training prompts (never held-out ones), balanced over the templates."""
    return _draw(num_prompts, seed, held_out=False, path=path, with_category=with_category)


def held_out_prompts(num_prompts: int = 24, seed: int = 0, *, path: str | None = None, with_category=False):
    """``num_prompts`` evaluation prompts, disjoint from every possible training prompt.

    A different ``seed`` gives a different (overlapping) draw from the same held-out split, e.g. a
    second evaluation set for checking a saved checkpoint.
    """
    return _draw(num_prompts, seed, held_out=True, path=path, with_category=with_category)
