"""What a MARS checkpoint's masks are worth on prompts it never saw: tokens per forward and agreement.

Greedy, float32 by default, batch 1 and batch 4 (left padding, pad = EOS), on held-out template prompts
(`mars_hf.training.prompts.held_out_prompts`: no training prompt can be drawn). For each run:

* ``stock``: plain ``generate`` (the reference: a gated checkpoint's real tokens run the base weights,
  so this is the base model's own greedy output);
* ``verify-linear`` / ``verify-quadratic``: verified decoding with a fixed layout (the cost probe off, so
  the counts do not depend on how fast this machine is);
* ``tau=…``: the paper's threshold rule, with the checkpoint's calibration and, with ``--uncalibrated``,
  also without it (the same model with ``config.mars["calibration"]`` removed).

Tokens per forward, prefix agreement with stock (share of stock's tokens reproduced before the first
difference, averaged over prompts) and identical answers are counted; nothing is timed (use
``mars-hf bench`` on an idle machine for speed).

Usage::

    python examples/mars_quality.py embedded-mars --num-prompts 32 --output quality.json --uncalibrated
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoTokenizer

import mars_hf
from mars_hf import AutoMARSModelForCausalLM
from mars_hf.evaluation.metrics import load_metric
from mars_hf.models.chat_inputs import chat_inputs
from mars_hf.models.eos import trim_at_eos
from mars_hf.training.prompts import held_out_prompts


@torch.no_grad()
def decode(model, tokenizer, prompts, batch_size, max_new_tokens, **mars):
    """Answers (token lists, cut after the first EOS), the forwards each row took part in, and the batch's forwards.

    A row's forwards: the steps in which it accepted tokens (stock: one per token), so batch 4's tokens per
    forward is per row like batch 1's, not inflated by rows that finished early."""
    eos = model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos)
    answers, row_forwards, forwards = [], [], 0
    for start in range(0, len(prompts), batch_size):
        batch = chat_inputs(tokenizer, prompts[start : start + batch_size])
        out = model.generate(
            **batch,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=eos[0],
            eos_token_id=eos,
            return_dict_in_generate=True,
            **mars,
        )
        new = out.sequences[:, batch["input_ids"].shape[1] :].tolist()
        rows = [trim_at_eos(row, eos) for row in new]
        answers.extend(rows)
        if getattr(out, "accepted_counts", None) is not None:  # MARS: steps in which the row took tokens
            row_forwards.extend(int(n) for n in (out.accepted_counts > 0).sum(dim=0).tolist())
            forwards += int(out.num_forwards)
        else:  # stock: one forward per token
            row_forwards.extend(len(row) for row in rows)
            forwards += len(new[0])
    return answers, row_forwards, forwards


def summarise(name, decoded, reference, batch_size, agreement_metric):
    """One table row; prefix agreement and identical answers from the project's `token_agreement` metric."""
    answers, row_forwards, forwards = decoded
    tokens = sum(len(a) for a in answers)
    agreement = agreement_metric.compute(predictions=answers, references=reference)
    return {
        "run": name,
        "batch": batch_size,
        "tokens": tokens,
        "batch_forwards": forwards,
        "tokens_per_forward": tokens / max(1, sum(row_forwards)),
        "prefix_agreement": agreement["prefix_agreement"],
        "identical": agreement["exact_match"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="MARS checkpoint folder or 'embedded-mars'.")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--prompt-seed", type=int, default=7)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch-sizes", default="1,4")
    parser.add_argument("--taus", default="1.0,0.95,0.9,0.8,0.7")
    parser.add_argument("--layouts", default="linear,quadratic")
    parser.add_argument("--uncalibrated", action="store_true", help="Also run τ without the calibration.")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()

    model = AutoMARSModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).eval()
    folder = mars_hf.embedded_mars_checkpoint() if args.model == "embedded-mars" else args.model
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = held_out_prompts(args.num_prompts, seed=args.prompt_seed)
    fixed = {"mars_cost_table": {1: 1.0}}
    agreement_metric = load_metric("token_agreement")
    rows = []
    for batch_size in [int(b) for b in args.batch_sizes.split(",")]:
        stock = decode(model, tokenizer, prompts, batch_size, args.max_new_tokens)
        reference = stock[0]
        rows.append(summarise("stock", stock, reference, batch_size, agreement_metric))
        runs = [
            (f"verify-{layout}", {"mars_acceptance": "verify", "mars_layout": layout, **fixed})
            for layout in args.layouts.split(",")
            if layout
        ]
        runs += [(f"tau={tau}", {"mars_threshold": float(tau), **fixed}) for tau in args.taus.split(",")]
        for name, mars in runs:
            decoded = decode(model, tokenizer, prompts, batch_size, args.max_new_tokens, **mars)
            rows.append(summarise(name, decoded, reference, batch_size, agreement_metric))
            print(json.dumps(rows[-1]), flush=True)
        if args.uncalibrated and "calibration" in model.config.mars:
            calibration = model.config.mars.pop("calibration")
            try:
                for tau in args.taus.split(","):
                    decoded = decode(
                        model,
                        tokenizer,
                        prompts,
                        batch_size,
                        args.max_new_tokens,
                        mars_threshold=float(tau),
                        **fixed,
                    )
                    rows.append(
                        summarise(f"tau={tau} uncalibrated", decoded, reference, batch_size, agreement_metric)
                    )
                    print(json.dumps(rows[-1]), flush=True)
            finally:
                model.config.mars["calibration"] = calibration
    meta = {
        "model": args.model,
        "dtype": args.dtype,
        "prompts": args.num_prompts,
        "prompt_seed": args.prompt_seed,
        "max_new_tokens": args.max_new_tokens,
        "window": model.config.mars.get("block_size"),
    }
    args.output.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
