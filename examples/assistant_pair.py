"""Target forwards of speculative decoding on a small pair: transformers' assisted decoding against MARS
verify with the same draft model (its tokens after the masks' drafts, docs/method.md §5) and without it,
and against MARS τ with the same draft model (the paper's composition: the drafts checked exactly, then
the masks after the kept prefix accepted at τ; lossy below τ = 1, so its rows report prefix agreement
with stock greedy instead of identity).

The pair: tiny float64 models of two architectures (``--target`` / ``--assistant``), each trained briefly
on the synthetic language of the tests (``tests.test_generation.peaked_model``: AR and mask predictions),
so that the target's masks are useful and the draft model agrees with the target often. Batch 1, greedy;
counts only (a forward pre-hook on each model), with a flat cost table (``mars_cost_table={1: 1.0}``), so
the machine does not matter. Every row is checked against the target's stock greedy output.

Run from the repository root: ``python examples/assistant_pair.py`` (about a minute on one CPU thread).
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' tiny models and tokenizer

from mars_hf.decoding.drafts import DraftChooser  # noqa: E402
from tests.test_generation import peaked_model  # noqa: E402
from tests.tiny import tiny_tokenizer  # noqa: E402

PROMPTS = [
    "the cat sat",
    "hello world the dog sat on a",
    "one two",
    "a red",
    "the dog sat on a mat and one two three the cat",
]
FLAT = {1: 1.0}


class Counter:
    """Counts a model's forwards (a pre-hook on the top module: one per call of ``model(...)``)."""

    def __init__(self, model):
        self.count = 0
        model.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        self.count += 1


def transformers_assisted(model, assistant, encoded, max_new: int, tokens: int | None):
    """Stock ``generate(assistant_model=...)`` (no MARS keyword: transformers' assisted decoding).
    ``tokens``: ``num_assistant_tokens`` with a constant schedule and no confidence cut-off (the same
    drafts per step as MARS gets); None: transformers' defaults (20, its confidence threshold 0.4)."""
    saved = copy.deepcopy(assistant.generation_config)  # the schedule / threshold adapt in place
    if tokens is not None:
        assistant.generation_config.num_assistant_tokens = tokens
        assistant.generation_config.num_assistant_tokens_schedule = "constant"
        assistant.generation_config.assistant_confidence_threshold = 0.0
    try:
        return model.generate(**encoded, assistant_model=assistant, do_sample=False, max_new_tokens=max_new)
    finally:
        assistant.generation_config = saved


def mars(model, encoded, max_new: int, layout: str, assistant=None, tokens: int = 4):
    kwargs = {"assistant_model": assistant, "num_assistant_tokens": tokens} if assistant is not None else {}
    return model.generate(
        **encoded,
        do_sample=False,
        max_new_tokens=max_new,
        mars_acceptance="verify",
        mars_layout=layout,
        mars_cost_table=FLAT,
        return_dict_in_generate=True,
        **kwargs,
    ).sequences


def tau_assisted(model, assistant, encoded, max_new: int, tau: float, tokens: int):
    kwargs = {"assistant_model": assistant, "num_assistant_tokens": tokens} if assistant is not None else {}
    return model.generate(
        **encoded,
        do_sample=False,
        max_new_tokens=max_new,
        mars_threshold=tau,
        mars_cost_table=FLAT,
        **kwargs,
        return_dict_in_generate=True,
    ).sequences


def agreement(sequences, stock, prompt_length: int) -> float:
    """Share of stock greedy's new tokens reproduced before the first difference."""
    ours, theirs = sequences[0, prompt_length:].tolist(), stock[0, prompt_length:].tolist()
    same = 0
    while same < min(len(ours), len(theirs)) and ours[same] == theirs[same]:
        same += 1
    return same / max(len(theirs), 1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="llama")
    parser.add_argument("--assistant", default="qwen3")
    parser.add_argument("--num-assistant-tokens", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--num-prompts", type=int, default=len(PROMPTS))
    parser.add_argument("--taus", default="1.0,0.9", help="τ values of the τ + draft model rows")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    k, max_new = args.num_assistant_tokens, args.max_new_tokens
    tokenizer = tiny_tokenizer()
    model, assistant = peaked_model(args.target), peaked_model(args.assistant)
    target_forwards, draft_forwards = Counter(model), Counter(assistant)
    never_chain = staticmethod(lambda held, eos, room: 0)

    def either_or(encoded, layout):
        original = DraftChooser.__dict__["chainable"]
        DraftChooser.chainable = never_chain  # the draft model reads the row's tokens alone: before chaining
        try:
            return mars(model, encoded, max_new, layout, assistant, k)
        finally:
            DraftChooser.chainable = original

    def chained(encoded, layout):
        return mars(model, encoded, max_new, layout, assistant, k)

    def stock_assisted(encoded, tokens):
        return transformers_assisted(model, assistant, encoded, max_new, tokens)

    runs = [
        (f"transformers assisted k={k}", lambda e: stock_assisted(e, k)),
        ("transformers assisted (its defaults)", lambda e: stock_assisted(e, None)),
        (f"MARS verify auto + assistant k={k} (chained)", lambda e: chained(e, "auto")),
        (f"MARS verify linear + assistant k={k} (chained)", lambda e: chained(e, "linear")),
        (f"MARS verify auto + assistant k={k} (either/or)", lambda e: either_or(e, "auto")),
        (f"MARS verify linear + assistant k={k} (either/or)", lambda e: either_or(e, "linear")),
        ("MARS verify auto, no assistant", lambda e: mars(model, e, max_new, "auto")),
        ("MARS verify linear, no assistant", lambda e: mars(model, e, max_new, "linear")),
    ]
    for tau in (float(t) for t in args.taus.split(",") if t):
        runs.append((f"MARS τ = {tau:g} + assistant k={k} (paper §5)", lambda e, t=tau: tau_assisted(model, assistant, e, max_new, t, k)))
        runs.append((f"MARS τ = {tau:g}, no assistant", lambda e, t=tau: tau_assisted(model, None, e, max_new, t, k)))
    prompts = PROMPTS[: args.num_prompts]
    table = {name: [] for name, _ in runs}
    for prompt in prompts:
        encoded = tokenizer([prompt], return_tensors="pt")
        target_forwards.count = 0
        stock = model.generate(**encoded, do_sample=False, max_new_tokens=max_new)
        stock_forwards = target_forwards.count
        table.setdefault("stock greedy", []).append((stock_forwards, 0, 1.0))
        for name, run in runs:
            target_forwards.count = draft_forwards.count = 0
            sequences = run(encoded)
            same = agreement(sequences, stock, encoded["input_ids"].shape[1])
            table[name].append((target_forwards.count, draft_forwards.count, same))
    new_tokens = max_new * len(prompts)
    print(f"target {args.target}, draft model {args.assistant}, {max_new} new tokens, batch 1, flat costs")
    print(f"prompts: {prompts}")
    header = "decoding".ljust(52) + " | target forwards per prompt | total | tok/fwd | draft fwds | = stock | agreement"
    print(header)
    print("-" * len(header))
    for name in ["stock greedy"] + [name for name, _ in runs]:
        cells = table[name]
        total = sum(c[0] for c in cells)
        same = sum(c[2] == 1.0 for c in cells)
        mean = sum(c[2] for c in cells) / len(cells)
        print(
            f"{name.ljust(52)} | {' / '.join(str(c[0]) for c in cells).ljust(26)} | {total:5d} | "
            f"{new_tokens / total:7.2f} | {sum(c[1] for c in cells):10d} | {same}/{len(cells)}     | {mean:8.1%}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
