"""Verified decoding against MARS-off inside one process: stock ``generate``, τ = 1 through the MARS decoder and
verify with the default settings, interleaved, on embedded-mars (docs/numbers.md names where it was run).

Four chat prompts (the first ``batch``), 64 new tokens, a warm-up of each, then five interleaved timed repeats
(medians); the last verify call's forwards and wide steps are printed with the ratios. Run alone on the machine:

    python examples/verify_vs_mars_off.py float32 4
"""

from __future__ import annotations

import argparse
import statistics
import time

from mars_hf.tools.loading import load_model_and_tokenizer

PROMPTS = [
    "Write a short story about a robot.",
    "Explain photosynthesis simply.",
    "List three uses of Python.",
    "What is the capital of France and why?",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dtype", choices=["float32", "bfloat16"])
    parser.add_argument("batch", type=int, choices=[1, 2, 3, 4])
    args = parser.parse_args()
    model, tok, _ = load_model_and_tokenizer("embedded-mars", dtype=args.dtype)
    tok.padding_side = "left"
    texts = [
        tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
        for p in PROMPTS[: args.batch]
    ]
    inputs = tok(texts, return_tensors="pt", padding=True)
    runs = {
        "verify": lambda: model.generate(
            **inputs, max_new_tokens=64, do_sample=False, mars_acceptance="verify", return_dict_in_generate=True
        ),
        "tau=1": lambda: model.generate(**inputs, max_new_tokens=64, do_sample=False, mars_threshold=1.0),
        "stock": lambda: model.generate(**inputs, max_new_tokens=64, do_sample=False),
    }
    for run in runs.values():
        run()
    seconds = {name: [] for name in runs}
    for _ in range(5):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            seconds[name].append(time.perf_counter() - start)
    median = {name: statistics.median(values) for name, values in seconds.items()}
    last = runs["verify"]()
    wide = sum(width > 1 for width in last.forward_widths[1:].tolist())
    print(
        f"{args.dtype} batch {args.batch}: verify vs stock {median['stock'] / median['verify']:.3f}, "
        f"verify vs tau=1 {median['tau=1'] / median['verify']:.3f}, tau=1 vs stock "
        f"{median['stock'] / median['tau=1']:.3f}; last verify call: {last.num_forwards} forwards, {wide} wider than one"
    )


if __name__ == "__main__":
    main()
