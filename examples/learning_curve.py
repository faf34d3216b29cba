"""Learning curve of a MARS training run: what each saved checkpoint buys, on data it never saw.

For every ``checkpoint-N`` folder of a ``mars-hf train`` run (and the final folder), two measurements:

* teacher-forced (cheap proxy, one two-stream forward per answer): top-1 accuracy of each mask offset
  and the share of masks confident at 0.9, on held-out self-distilled answers;
* real decoding on held-out template prompts (batch 1, greedy, float32): tokens per forward of
  verified decoding (a fixed ``--layout``, the cost probe off, so the counts do not depend on the
  machine's speed) and of τ = 0.9, and τ = 0.9's prefix agreement with the base model's greedy output.
  ``checkpoint-N`` folders carry no calibration (``mars-hf train`` fits it at the end), so their τ is
  the raw confidence's; the final folder's is calibrated.

Usage::

    python examples/learning_curve.py embedded-mars-run --held-out-data data/embedded-mars/calibration.jsonl \
        --num-prompts 8 --output docs/embedded_mars_curve.json
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import torch

from mars_hf.models.eos import trim_at_eos


def checkpoints(run_dir: Path) -> list[tuple[int | None, Path]]:
    found = []
    for folder in run_dir.glob("checkpoint-*"):
        match = re.fullmatch(r"checkpoint-(\d+)", folder.name)
        if match:
            found.append((int(match.group(1)), folder))
    found.sort()
    if (run_dir / "adapter_config.json").exists():
        found.append((None, run_dir))
    return found


@torch.no_grad()
def decode(model, ids, eos, **kwargs):
    input_ids = torch.tensor([ids])
    out = model.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        do_sample=False,
        max_new_tokens=kwargs.pop("max_new_tokens"),
        pad_token_id=eos[0],
        eos_token_id=eos,
        return_dict_in_generate=True,
        **kwargs,
    )
    tokens = trim_at_eos(out.sequences[0, input_ids.shape[1] :].tolist(), eos)
    return tokens, int(getattr(out, "num_forwards", len(tokens)))


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mars_hf import AutoMARSModelForCausalLM
    from mars_hf.evaluation.metrics import load_metric
    from mars_hf.evaluation.runs import teacher_forced_acceptance
    from mars_hf.models.embedded_model import embedded_model_dir
    from mars_hf.training.data import chat_prompt_ids
    from mars_hf.training.prompts import held_out_prompts

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument(
        "--held-out-data", required=True, help="JSONL of self-distilled answers not trained on."
    )
    parser.add_argument("--num-examples", type=int, default=64, help="Teacher-forced answers.")
    parser.add_argument("--num-prompts", type=int, default=8, help="Held-out prompts decoded.")
    parser.add_argument("--prompt-seed", type=int, default=0)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument(
        "--only", default=None, help="Comma-separated checkpoint steps to evaluate ('final': the run's own folder)."
    )
    parser.add_argument(
        "--layout", default="quadratic", choices=["linear", "quadratic"], help="Verified decoding's fixed layout."
    )
    parser.add_argument("--no-decode", action="store_true", help="Teacher-forced numbers only (fast).")
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()

    base_dir = embedded_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    eos = [tokenizer.eos_token_id]
    prompts = held_out_prompts(args.num_prompts, seed=args.prompt_seed)
    prompt_ids = [chat_prompt_ids(tokenizer, prompt) for prompt in prompts]
    references = (
        []
        if args.no_decode
        else [decode(base, ids, eos, max_new_tokens=args.max_new_tokens)[0] for ids in prompt_ids]
    )
    agreement_metric = None if args.no_decode else load_metric("token_agreement")
    rows = [
        json.loads(line) for line in Path(args.held_out_data).read_text().splitlines()[: args.num_examples]
    ]
    results = json.loads(args.output.read_text()) if args.output.exists() else []
    done = {entry["checkpoint"] for entry in results}
    only = set(args.only.split(",")) if args.only else None
    for step, folder in checkpoints(args.run_dir):
        label = step if step is not None else "final"
        if label in done or (only is not None and str(label) not in only):
            continue
        start = time.monotonic()
        model = AutoMARSModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
        forced = teacher_forced_acceptance(
            model, [row["input_ids"] for row in rows], [row["labels"] for row in rows], thresholds=(0.9,)
        )
        entry = {"checkpoint": label, "teacher_forced": forced}
        runs = (
            ()
            if args.no_decode
            # fixed feeds, cost probe off: counts that do not depend on this machine's speed
            else (
                ("verify", {"mars_acceptance": "verify", "mars_layout": args.layout, "mars_cost_table": {1: 1.0}}),
                ("tau0.9", {"mars_threshold": 0.9, "mars_cost_table": {1: 1.0}}),
            )
        )
        for name, kwargs in runs:
            tokens = forwards = 0
            outputs = []
            for ids in prompt_ids:
                output, count = decode(model, ids, eos, max_new_tokens=args.max_new_tokens, **kwargs)
                tokens += len(output)
                forwards += count
                outputs.append(output)
            # The project's `token_agreement` metric, as in examples/mars_quality.py, so the two agree.
            agreement = agreement_metric.compute(predictions=outputs, references=references)
            entry[name] = {
                "tokens_per_forward": tokens / max(1, forwards),
                "prefix_agreement": agreement["prefix_agreement"],
                "identical": agreement["exact_match"],
            }
        entry["eval_seconds"] = time.monotonic() - start
        results.append(entry)
        args.output.write_text(json.dumps(results, indent=2) + "\n")
        print(json.dumps(entry))


if __name__ == "__main__":
    main()
