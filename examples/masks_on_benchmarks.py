"""What a MARS checkpoint's masks verify on benchmark prompts, as a count (no timing, no planner).

Tokens per forward of verified decoding with the fixed linear and quadratic layouts, float32 greedy, batch 1, for
the shipped `embedded-mars` and each checkpoint given, on MT-Bench's first turns and HumanEval's prompts
(``--per-category`` of each category; never trained on: ``mars_hf.tools.bench.eval_sets``) and on held-out template
prompts. Every answer is the base model's own greedy answer, so the counts compare masks, not kernels or machines.

Usage::

    python examples/masks_on_benchmarks.py path/to/candidate --per-category 2 --max-new-tokens 96
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoTokenizer

from mars_hf import AutoMARSModelForCausalLM, embedded_mars_checkpoint
from mars_hf.tools.bench.eval_sets import first_per_category, load_eval_set
from mars_hf.training.prompts import held_out_prompts


def prompt_sets(per_category: int, templates: int) -> dict[str, list[str]]:
    real = [
        p.message
        for name in ("mt-bench", "humaneval")
        for p in first_per_category(load_eval_set(name), per_category)
    ]
    return {"real-world": real, "template held-out": held_out_prompts(templates)}


def tokens_per_forward(
    model, tokenizer, prompts: list[str], layout: str, max_new_tokens: int
) -> tuple[float, int]:
    tokens = forwards = 0
    for prompt in prompts:
        inputs = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        )
        out = model.generate(
            **inputs, max_new_tokens=max_new_tokens, mars_acceptance="verify", mars_layout=layout,
            do_sample=False, return_dict_in_generate=True,
        )  # fmt: skip
        tokens += out.sequences.shape[1] - inputs["input_ids"].shape[1]
        forwards += int(out.num_forwards)
    return tokens / forwards, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoints", nargs="*", help="Checkpoints to compare with embedded-mars.")
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--templates", type=int, default=24)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(embedded_mars_checkpoint())
    sets = prompt_sets(args.per_category, args.templates)
    for path in ["embedded-mars", *args.checkpoints]:
        model = AutoMARSModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        for name, prompts in sets.items():
            for layout in ("linear", "quadratic"):
                rate, tokens = tokens_per_forward(model, tokenizer, prompts, layout, args.max_new_tokens)
                print(
                    f"{path}  {name:18s} {layout:9s} tokens/forward {rate:.3f}  ({tokens} tokens)", flush=True
                )


if __name__ == "__main__":
    main()
