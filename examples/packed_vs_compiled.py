"""The opt-in packed CPU kernels against transformers' fast path, side by side in one process.

Rows, interleaved and timed on the same prompts (medians of the timed repeats after one untimed run that also
compiles): stock ``generate`` eager (the baseline); stock on the packed linears (``mars_hf.packed_linears``:
MARS-off on those kernels); verify on the packed linears (``mars_cpu_kernels="packed"``, the default planner);
stock compiled (static cache + ``compile_config``: MARS-off on the fast path); verify compiled (the fixed feed).
Each ratio is against stock eager and against MARS-off on the row's own kernels. embedded-mars, MT-Bench first
turns (one per category, the first ``--prompts``), 64 new tokens, greedy. Run alone on the machine:

    python examples/packed_vs_compiled.py --dtype float32 --batch 1
    python examples/packed_vs_compiled.py --dtype bfloat16 --batch 4

``--rows`` picks other rows of the eager path (transformers' defaults: dynamic cache, no compiler): ``tau=1 eager``
(MARS-off through the MARS decoder), ``verify measured`` (the planner on the cost curve this machine measures) and
``verify fixed`` (the fixed linear feed, nothing timed), ``verify default`` (``generate``'s default: on a CPU the
planner on its assumed curve, nothing timed); ``tau=0.9 eager`` / ``tau=0.9 compiled`` (τ's fixed window),
``tau=0.9 planner eager`` (``mars_planner=True``: the planner sizes τ's mask groups, on the assumed curve);
``verify compiled fixed`` (the linear feed on the fast path, which is its default only where columns are nearly free),
``tau=1 compiled`` (MARS-off through the decoder on the fast path; its plain steps skip the gated adapter):

    python examples/packed_vs_compiled.py --dtype bfloat16 --rows "stock eager,tau=1 eager,verify measured,verify fixed"
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mars_hf import PlannerMemory, packed_linears
from mars_hf.decoding.home import cpu_name, speed_cpu_flags
from mars_hf.tools.bench import prepare_batches
from mars_hf.tools.bench.configurations import compiled_path, one_cache_length
from mars_hf.tools.bench.eval_sets import first_per_category, mt_bench_prompts
from mars_hf.tools.bench.runner import room_for_compiled_shapes
from mars_hf.tools.loading import load_model_and_tokenizer

DEFAULT_ROWS = ("stock eager", "stock packed", "verify packed", "stock compiled", "verify compiled")
EAGER_VERIFY_ROWS = ("verify default", "verify measured", "verify fixed", "verify prior15", "verify prior30")
TAU_ROWS = (
    "tau=1 compiled",
    "tau=0.9 eager",
    "tau=0.9 planner eager",
    "tau=0.9 compiled",
    "verify compiled fixed",
)
ALL_ROWS = ("stock eager", "tau=1 eager", *EAGER_VERIFY_ROWS, *DEFAULT_ROWS[1:], *TAU_ROWS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], required=True)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=4, help="MT-Bench first turns (a multiple of --batch)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rows", default=",".join(DEFAULT_ROWS), help=f"comma-separated, of {ALL_ROWS}")
    args = parser.parse_args()
    room_for_compiled_shapes()
    model, tokenizer, _ = load_model_and_tokenizer("embedded-mars", dtype=args.dtype)
    texts = [p.message for p in first_per_category(mt_bench_prompts(), 1)[: args.prompts]]
    batches = prepare_batches(tokenizer, texts, args.batch)
    greedy = dict(max_new_tokens=args.max_new_tokens, do_sample=False, return_dict_in_generate=True)
    size = one_cache_length(batches, args.max_new_tokens)  # one static cache size: no compile while timed
    fast = dict(compiled_path(stock=True), max_cache_len=size)
    fast_mars = dict(compiled_path(stock=False), max_cache_len=size)

    def stock_packed(inputs):
        with packed_linears(model, "packed"):
            return model.generate(**inputs, **greedy)

    eager_verify = dict(greedy, mars_acceptance="verify")
    # the measured planner's curves, kept across the rows' calls as a caller keeps them
    measured = PlannerMemory()

    def on_assumed_curve(inputs, per_column: float):
        """Verify with the planner on a given curve where each extra column costs ``per_column`` of one."""
        curve = {n: 1 + per_column * (n - 1) for n in (1, 64)}
        return model.generate(**inputs, **eager_verify, mars_layout="auto", mars_cost_table=curve)

    every_row = {
        "stock eager": lambda inputs: model.generate(**inputs, **greedy),
        "tau=1 eager": lambda inputs: model.generate(**inputs, **greedy, mars_threshold=1.0),
        "verify default": lambda inputs: model.generate(**inputs, **eager_verify),
        "verify measured": lambda inputs: model.generate(**inputs, **eager_verify, mars_cost_probe=measured),
        "verify fixed": lambda inputs: model.generate(
            **inputs, **eager_verify, mars_cost_probe=False, mars_layout="linear"
        ),
        "verify prior15": lambda inputs: on_assumed_curve(inputs, 0.15),
        "verify prior30": lambda inputs: on_assumed_curve(inputs, 0.3),  # as generate's default on a CPU
        "stock packed": stock_packed,
        "verify packed": lambda inputs: model.generate(
            **inputs, **greedy, mars_acceptance="verify", mars_cpu_kernels="packed", mars_cost_probe=measured
        ),
        "stock compiled": lambda inputs: model.generate(**inputs, **greedy, **fast),
        "verify compiled": lambda inputs: model.generate(
            **inputs, **greedy, **fast_mars, mars_acceptance="verify"
        ),
        "verify compiled fixed": lambda inputs: model.generate(
            **inputs, **greedy, **fast_mars, mars_acceptance="verify", mars_layout="linear"
        ),
        "tau=1 compiled": lambda inputs: model.generate(**inputs, **greedy, **fast_mars, mars_threshold=1.0),
        "tau=0.9 eager": lambda inputs: model.generate(**inputs, **greedy, mars_threshold=0.9),
        "tau=0.9 planner eager": lambda inputs: model.generate(
            **inputs, **greedy, mars_threshold=0.9, mars_planner=True
        ),
        "tau=0.9 compiled": lambda inputs: model.generate(
            **inputs, **greedy, **fast_mars, mars_threshold=0.9
        ),
    }
    chosen = args.rows.split(",")
    unknown = sorted(set(chosen) - set(every_row))
    if unknown or "stock eager" not in chosen:
        parser.error(f"--rows must name 'stock eager' and rows of {ALL_ROWS}; unknown: {unknown}")
    rows = {name: every_row[name] for name in chosen}
    seconds = {name: [] for name in rows}
    forwards = {name: 0 for name in rows}
    tokens = {name: 0 for name in rows}
    with torch.inference_mode():
        for repeat in range(args.repeats + 1):
            for name, run in rows.items():
                start = time.perf_counter()
                outputs = [run(inputs) for inputs in batches]
                if repeat:
                    seconds[name].append(time.perf_counter() - start)
                if repeat == args.repeats:
                    for inputs, out in zip(batches, outputs):
                        new = out.sequences.shape[1] - inputs["input_ids"].shape[1]
                        tokens[name] += new * args.batch
                        forwards[name] += getattr(out, "num_forwards", None) or new
    median = {name: statistics.median(values) for name, values in seconds.items()}
    # each row's MARS-off on its own kernels: the eager verify rows' is τ = 1 through the decoder
    off = {"stock packed": "stock packed", "verify packed": "stock packed", "stock compiled": "stock compiled",
           "verify compiled": "stock compiled", "tau=0.9 compiled": "stock compiled",
           "verify compiled fixed": "stock compiled", "tau=1 compiled": "stock compiled",
           "tau=0.9 eager": "tau=1 eager", "tau=0.9 planner eager": "tau=1 eager"}  # fmt: skip
    off.update({name: "tau=1 eager" for name in EAGER_VERIFY_ROWS})
    print(f"{cpu_name()} [{speed_cpu_flags()}], {torch.get_num_threads()} threads, embedded-mars {args.dtype}, "
          f"batch {args.batch}, {len(texts)} MT-Bench prompts, {args.max_new_tokens} new tokens, "
          f"medians of {args.repeats}")  # fmt: skip
    for name in rows:
        ratio = median["stock eager"] / median[name]
        versus = ""
        if off.get(name) in median:
            versus = f", {median[off[name]] / median[name]:.2f}× MARS-off ({off[name]})"
        per_forward = tokens[name] / max(1, forwards[name] * args.batch)
        print(f"  {name:16s} {per_forward:.2f} tok/fwd  {ratio:.2f}× stock eager{versus}")


if __name__ == "__main__":
    main()
