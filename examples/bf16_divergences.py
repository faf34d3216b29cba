"""Where bfloat16 verified decoding leaves stock bfloat16 greedy, and whether a float32 last projection helps.

Verified decoding keeps a draft only where it is the model's own greedy choice, so in float32 its output is
stock greedy's token for token. In bfloat16 a forward of several rows runs other kernels than a one-row
forward and rounds differently; where the model's top two tokens are almost tied, greedy's choice can flip.
This script decodes the bench's chat prompts at batch 1 with stock `generate` and with verify (fixed linear
and quadratic layouts: the widest forwards, so the most rounding), and judges every differing answer at its
first differing token by the float32 model's logit gap there (`mars_hf.tools.divergence`). Variants:

- ``bf16``: the model as loaded;
- ``float32-head``: the last projection (``lm_head``) computed in float32 for stock and verify alike, to see
  whether the flips come from rounding the logits to bf16 (spacing 0.125 at a logit of 16) or from the
  hidden states before it.

It also reports how far stock bfloat16 greedy itself is from float32 greedy (the context: bf16 is another
model's greedy output already). Counts, not timings: the machine's load does not matter.

    python examples/bf16_divergences.py --model embedded-mars
    python examples/bf16_divergences.py --model embedded-mars --num-prompts 2 --max-new-tokens 16   # smoke run
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from mars_hf.decoding.home import cpu_name, speed_cpu_flags
from mars_hf.tools.bench import (
    BUILTIN_PROMPTS,
    count_generated_tokens,
    greedy_generation_config,
    prepare_batches,
)
from mars_hf.tools.bench.divergences import divergence_line
from mars_hf.tools.divergence import judge_against_stock, prompt_rows
from mars_hf.tools.loading import load_model_and_tokenizer


class Float32Head(torch.nn.Module):
    """The model's last projection computed in float32 (logits in float32, never rounded to bf16)."""

    def __init__(self, head: torch.nn.Linear):
        super().__init__()
        self.weight32 = head.weight.detach().float()

    def forward(self, hidden):
        return F.linear(hidden.float(), self.weight32)


def decode(model, tokenizer, batches, config, **kwargs) -> list[list[int]]:
    """Each prompt's new tokens, cut after its EOS."""
    answers = []
    for inputs in batches:
        output = model.generate(**inputs, generation_config=config, **kwargs)
        new = output.sequences[:, inputs["input_ids"].shape[1] :]
        lengths = count_generated_tokens(new, [tokenizer.eos_token_id]).tolist()
        answers += [row[:n] for row, n in zip(new.tolist(), lengths)]
    return answers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="embedded-mars")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--layouts", default="linear,quadratic")
    parser.add_argument("--variants", default="bf16,float32-head")
    args = parser.parse_args()

    model, tokenizer, _ = load_model_and_tokenizer(args.model, dtype="bfloat16")
    reference = load_model_and_tokenizer(args.model, dtype="float32")[0]
    config = greedy_generation_config(model, args.max_new_tokens, tokenizer=tokenizer)
    batches = prepare_batches(tokenizer, BUILTIN_PROMPTS[: args.num_prompts], 1)
    prompts = prompt_rows(batches)
    print(f"{args.model}, batch 1, {len(prompts)} prompts x {args.max_new_tokens} tokens; CPU {cpu_name()} "
          f"(flags: {speed_cpu_flags()}), torch {torch.__version__}, {torch.get_num_threads()} threads")  # fmt: skip

    float32_greedy = decode(reference, tokenizer, batches, config)
    head = model.lm_head
    for variant in args.variants.split(","):
        model.lm_head = Float32Head(head) if variant == "float32-head" else head
        stock = decode(model, tokenizer, batches, config)
        result = judge_against_stock(lambda: reference, prompts, float32_greedy, stock)
        print(f"{variant}: stock bf16 greedy against float32 greedy: {divergence_line(result)}")
        for layout in args.layouts.split(","):
            verify = decode(model, tokenizer, batches, config, mars_acceptance="verify", mars_layout=layout)
            result = judge_against_stock(lambda: reference, prompts, stock, verify)
            print(
                f"{variant}: verify-{layout} against stock bf16 greedy: {divergence_line(result)}", flush=True
            )
    model.lm_head = head


if __name__ == "__main__":
    main()
