"""Real-world prompts for self-distillation, built from text every Python install ships: its standard library.

Why: masks trained only on answers to the project's template prompts learn those templates, not language
(they verify ~1.3 tokens per forward on real-world prompts against ~1.8 on their own templates). Soft
targets need only prompts a user could have written, and the model's own answers to them. The standard
library holds thousands of documented functions: real code to complete or explain, and real English
paragraphs to summarise, simplify or answer questions from, the kinds of request Spec-Bench and MT-Bench
measure (code, summarisation, extraction, rewriting, QA grounded in a passage). Nothing is downloaded, and
the same Python version draws the same prompts for the same seed.

Evaluation prompts (MT-Bench, HumanEval, the bench's own sets) are kept out by the caller
(``mars-hf distill`` and ``mars-hf train`` filter with ``mars_hf.tools.bench.eval_sets``).
"""

from __future__ import annotations

import ast
import random
import sysconfig
import textwrap
from functools import lru_cache
from pathlib import Path

# What each prompt kind asks; {code}, {name}, {signature} and {text} are filled from one function.
CODE_KINDS = {
    "complete": "Complete this Python function:\n\n```python\n{signature}\n```",
    "explain": "Explain what this Python function does, step by step:\n\n```python\n{code}\n```",
    "review": "Review this Python code and suggest one improvement:\n\n```python\n{code}\n```",
}
TEXT_KINDS = {
    "summarize": "Summarize the following text in two sentences:\n\n{text}",
    "simplify": "Rewrite the following text in plain language for a beginner:\n\n{text}",
    "question": "Read the passage and answer: what is `{name}` for, and when would you use it?\n\n{text}",
    "extract": "List the key terms in the following text, one per line, each with a short definition:\n\n{text}",
}
MAX_CODE_LINES = 30
MIN_TEXT_CHARS = 120


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "turtledemo"}
    return sorted(p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts))


@lru_cache(maxsize=1)
def documented_functions() -> tuple[tuple[str, str, str, str], ...]:
    """``(name, signature_with_docstring, source, docstring)`` of every short documented public function of
    the standard library, in a fixed order."""
    found = []
    for path in _stdlib_files():
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = source.splitlines()
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if not doc or node.end_lineno - node.lineno >= MAX_CODE_LINES:
                continue
            code = textwrap.dedent("\n".join(lines[node.lineno - 1 : node.end_lineno]))
            header = textwrap.dedent("\n".join(lines[node.lineno - 1 : node.body[0].end_lineno]))
            found.append((node.name, header, code, doc))
    return tuple(found)


def _prose(doc: str) -> str | None:
    """The docstring's prose (doctest and literal blocks left out, paragraphs kept), when long enough to
    summarise."""
    paragraphs = [" ".join(p.split()) for p in doc.split("\n\n")]
    prose = "\n\n".join(p for p in paragraphs if p and not p.startswith((">>>", "..", "::")))
    return prose if len(prose) >= MIN_TEXT_CHARS else None


def source_prompts(num_prompts: int, seed: int = 0) -> list[str]:
    """``num_prompts`` distinct prompts drawn from the standard library's documented functions, one per
    function (drawn without replacement by ``seed``), the kinds in turn; a text kind on a function whose
    docstring has no prose paragraph becomes a code kind."""
    functions = list(documented_functions())
    random.Random(seed).shuffle(functions)
    kinds = [(template, True) for template in CODE_KINDS.values()]
    kinds += [(template, False) for template in TEXT_KINDS.values()]
    prompts, seen = [], set()
    for index, (name, header, code, doc) in enumerate(functions):
        if len(prompts) >= num_prompts:
            break
        template, is_code = kinds[index % len(kinds)]
        text = None if is_code else _prose(doc)
        if not is_code and text is None:  # no prose to work on: a code request about the same function
            template = list(CODE_KINDS.values())[index % len(CODE_KINDS)]
        prompt = template.format(signature=header, code=code, name=name, text=text)
        if prompt not in seen:
            seen.add(prompt)
            prompts.append(prompt)
    if len(prompts) < num_prompts:
        raise ValueError(
            f"The standard library gives {len(prompts)} prompts, fewer than the {num_prompts} asked for; "
            "ask for fewer or mix in the template prompts (--prompt-source mixed)."
        )
    return prompts
