"""What a MARS training step costs against a plain SFT step on the same batch (docs/method.md §1.5).

Measures, on SmolLM2-135M-Instruct (the embedded model by default), one optimisation step
(forward + backward) of

* ``sft``        plain next-token loss, as `trl.SFTTrainer.compute_loss` computes it (on CPU its fused
                 LM head scores every position; on a Triton GPU only the supervised ones),
* ``sft-plain``  (optional) transformers' own loss, ``model(..., labels=...)``, full logits,
* ``mars-full``  MARS with the whole noisy half (length 2L),
* ``mars-drop``  MARS with target-free noisy blocks dropped (exact, the default),
* ``gated-2s``   a LoRA (r32, all linear layers) gated to mask positions + the mask row, run as today's
                 two-stream forward + backward,
* ``gated-frozen`` the same adapter with the frozen clean stream (``MARSConfig.frozen_clean_stream``): the
                 clean half runs without autograd, forward + backward over the noisy half only (same loss
                 and gradients),

on chat batches with long prompts (where dropping saves most) and with short prompts. It prints
tokens/s (real tokens of the batch per second of step time) and peak memory: CUDA's peak allocation on
a GPU, and on CPU the peak resident set size of a fresh process per measurement, minus its size after
loading the model, sampled every 2 ms (so the numbers are the step's own working memory: activations,
gradients, logits).
Timing is a median over ``--steps`` after one warm-up step. A script, not a test: numbers depend on
the machine.

    python examples/training_cost.py                       # embedded SmolLM2-135M, CPU
    python examples/training_cost.py --model path --batch_size 8 --device cuda

Measured once (2 shared CPU cores, heavily loaded, so absolute times are slow and noisy; batch 4, B=4,
float32, no gradient checkpointing, median of 3 steps). Relative to TRL's SFT step:

    data          step          L  noisy  s/step  time/token  peak RSS+ MiB
    long-prompt   sft         410      0    66.7       1.00x    5371 (1.00x)
    long-prompt   sft-plain   410      0    63.9       0.90x    4643 (0.85x)
    long-prompt   mars-full   410    410   106.3       1.59x    7730 (1.44x)
    long-prompt   mars-drop   410     50    55.4       0.83x    4325 (0.81x)
    short-prompt  sft          95      0    27.6       1.00x    1759 (1.00x)
    short-prompt  mars-full    95     95    37.7       1.37x    2232 (1.27x)
    short-prompt  mars-drop    95     51    29.3       1.06x    1806 (1.03x)

Gated adapter, measured 2026-12-01 on an AVX2 CPU without native bf16 (2 cores shared by five engineers, load
average 6-8, 1 torch thread, nice 10; batch 4, B=2, float32, short prompts, median of 2 steps after a warm-up;
absolute times are slow, the ratios are the point):

    data          step           s/step   vs SFT
    short-prompt  sft             40.5     1.00x
    short-prompt  mars-drop       47.6     1.18x
    short-prompt  gated-2s        48.7     1.20x
    short-prompt  gated-frozen    29.2     0.72x   (0.60x of the same adapter's two-stream step)

MARS costs less than the paper's ~2x here because its LM head only scores target columns, while both
SFT steps score every position (on CPU), and SmolLM2's 49k-vocabulary head is a large share of a
135M model's step.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import statistics
import sys
import threading
import time

WORDS = (
    "the model reads a long document about rivers mountains cities history science music and art then answers "
    "questions with care giving short clear reasons numbers dates names places and a final summary of key points"
).split()


def make_batch(tokenizer, batch_size: int, prompt_words: int, answer_words: int, seed: int = 0):
    """Right-padded chat batch, loss on the assistant turn only (prompt tokens are -100)."""
    import torch

    rng = random.Random(seed)
    rows = []
    for _ in range(batch_size):
        prompt = " ".join(rng.choice(WORDS) for _ in range(prompt_words + rng.randint(0, prompt_words // 8)))
        answer = " ".join(rng.choice(WORDS) for _ in range(answer_words + rng.randint(0, answer_words // 8)))
        prompt_ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
        )
        full_ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}], tokenize=True
        )
        prompt_ids = prompt_ids["input_ids"] if hasattr(prompt_ids, "keys") else prompt_ids
        full_ids = full_ids["input_ids"] if hasattr(full_ids, "keys") else full_ids
        labels = [-100] * len(prompt_ids) + full_ids[len(prompt_ids) :]
        rows.append((full_ids, labels))
    length = max(len(ids) for ids, _ in rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    input_ids = torch.full((batch_size, length), pad)
    attention_mask = torch.zeros((batch_size, length), dtype=torch.long)
    labels = torch.full((batch_size, length), -100)
    for row, (ids, lab) in enumerate(rows):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention_mask[row, : len(ids)] = 1
        labels[row, : len(ids)] = torch.tensor(lab)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


class RSSSampler:
    """Peak resident set size while a block runs, sampled from /proc every few milliseconds (Linux)."""

    def __init__(self, interval: float = 0.002):
        self.interval, self.peak, self._stop = interval, 0.0, threading.Event()

    @staticmethod
    def current_mib() -> float:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.current_mib())
            time.sleep(self.interval)

    def __enter__(self):
        self.start = self.current_mib()
        self.peak = self.start
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.current_mib())


def measure(args_dict: dict, mode: str, regime: str, queue) -> None:
    """One (mode, regime) measurement in its own process, so peak RSS is its own."""
    import tempfile

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from mars_hf import MARSConfig, MARSTrainer
    from mars_hf.models.embedded_model import resolve_model_path
    from mars_hf.training.attention_mask import build_mars_inputs

    args = argparse.Namespace(**args_dict)
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    path = str(resolve_model_path(args.model))
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").to(
        device
    )
    model.train()
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    prompt_words, answer_words = {
        "long-prompt": (args.long_prompt, args.answer),
        "short-prompt": (16, args.answer),
    }[regime]
    batch = make_batch(tokenizer, args.batch_size, prompt_words, answer_words)
    batch = {k: v.to(device) for k, v in batch.items()}

    noisy_width = 0
    if mode == "sft-plain":
        # transformers' own causal-LM loss: full logits at every position.

        def step_fn():
            return model(**batch, use_cache=False).loss

    elif mode == "sft":
        # The SFT step users get: TRL's SFTTrainer.compute_loss on the same batch.
        with tempfile.TemporaryDirectory() as tmp:
            sft = SFTTrainer(
                model=model,
                args=SFTConfig(
                    output_dir=tmp,
                    report_to=[],
                    bf16=False,
                    use_cpu=device.type == "cpu",
                    gradient_checkpointing=False,
                ),
                train_dataset=Dataset.from_list([{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}]),
                processing_class=tokenizer,
            )

        def step_fn():
            return sft.compute_loss(model, dict(batch))

    else:
        gated = mode.startswith("gated")
        peft_config = None
        if gated:
            from peft import LoraConfig

            peft_config = LoraConfig(r=32, lora_alpha=64, target_modules="all-linear", lora_dropout=0.0)
        with tempfile.TemporaryDirectory() as tmp:
            trainer = MARSTrainer(
                model=model,
                args=MARSConfig(
                    output_dir=tmp,
                    report_to=[],
                    bf16=False,
                    use_cpu=device.type == "cpu",
                    block_size=args.block_size,
                    drop_target_free_blocks=mode != "mars-full",
                    gradient_checkpointing=False,
                    adapter_gating="mask" if gated else None,
                    frozen_clean_stream=mode == "gated-frozen",
                    ar_weight=0.0 if gated else 1.0,
                ),
                train_dataset=Dataset.from_list([{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}]),
                processing_class=tokenizer,
                peft_config=peft_config,
            )
        mask_id = trainer.mask_token_id
        inputs = build_mars_inputs(
            batch["input_ids"],
            batch["attention_mask"],
            batch["labels"],
            block_size=args.block_size,
            mask_token_id=mask_id,
            drop_target_free_blocks=mode != "mars-full",
        )
        noisy_width = inputs.input_ids.shape[1] - inputs.clean_length

        def step_fn():
            return trainer.compute_loss(trainer.model, dict(batch))

    def synchronize():
        if device.type == "cuda":
            torch.cuda.synchronize()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        baseline_cuda = torch.cuda.memory_allocated() / 2**20
    times = []
    with RSSSampler() as rss:
        for step in range(args.steps + 1):
            model.zero_grad(set_to_none=True)
            synchronize()
            start = time.perf_counter()
            loss = step_fn()
            loss.backward()
            synchronize()
            if step:  # the first step is a warm-up
                times.append(time.perf_counter() - start)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated() / 2**20 - baseline_cuda
    else:
        peak = rss.peak - rss.start
    tokens = int(batch["attention_mask"].sum())
    step_time = statistics.median(times)
    queue.put(
        {
            "regime": regime,
            "mode": mode,
            "length": batch["input_ids"].shape[1],
            "noisy_width": noisy_width,
            "targets": int((batch["labels"][:, 1:] != -100).sum()),
            "tokens": tokens,
            "step_s": step_time,
            "tokens_per_s": tokens / step_time,
            "peak_mib": peak,
            "loss": float(loss.detach()),
        }
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default=None, help="Model folder (default: the embedded SmolLM2-135M-Instruct)."
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--block_size", type=int, default=4)
    parser.add_argument("--long_prompt", type=int, default=300, help="Words in a long prompt (default 300).")
    parser.add_argument("--answer", type=int, default=40, help="Words in an answer (default 40).")
    parser.add_argument("--steps", type=int, default=3, help="Timed steps after one warm-up (default 3).")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default).")
    parser.add_argument("--gradient_checkpointing", action="store_true")
    parser.add_argument("--regimes", default="long-prompt,short-prompt")
    parser.add_argument(
        "--modes",
        default="sft,mars-drop,gated-2s,gated-frozen",
        help="Subset of sft (TRL's SFTTrainer step), sft-plain (model(..., labels=...)), mars-full, mars-drop, "
        "gated-2s, gated-frozen; 'sft' must be included (it is the reference).",
    )
    parser.add_argument("--json", default=None, help="Also write the rows to this JSON file.")
    args = parser.parse_args(argv)

    context = mp.get_context("spawn")
    rows = []
    for regime in args.regimes.split(","):
        for mode in args.modes.split(","):
            queue = context.Queue()
            process = context.Process(target=measure, args=(vars(args), mode, regime, queue))
            process.start()
            row = queue.get()
            process.join()
            rows.append(row)
            print(f"  measured {regime} {mode}: {row['step_s']:.2f} s/step", file=sys.stderr)

    memory_label = "peak alloc MiB" if args.device.startswith("cuda") else "peak RSS+ MiB"
    header = (
        f"{'data':<13} {'step':<10} {'L':>5} {'noisy':>6} {'targets':>7} {'s/step':>8} {'tok/s':>8} "
        f"{'vs SFT':>7} {memory_label:>15} {'vs SFT':>7}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        sft = next(r for r in rows if r["regime"] == row["regime"] and r["mode"] == "sft")
        print(
            f"{row['regime']:<13} {row['mode']:<10} {row['length']:>5} {row['noisy_width']:>6} {row['targets']:>7} "
            f"{row['step_s']:>8.2f} {row['tokens_per_s']:>8.0f} {sft['tokens_per_s'] / row['tokens_per_s']:>6.2f}x "
            f"{row['peak_mib']:>15.0f} {row['peak_mib'] / max(sft['peak_mib'], 1e-9):>6.2f}x"
        )
    print(
        "\n'vs SFT' = cost relative to the plain SFT step (time per token, peak memory); 'noisy' = columns of the "
        "noisy half actually run (L without dropping)."
    )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
