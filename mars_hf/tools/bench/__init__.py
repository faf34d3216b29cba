"""Side-by-side benchmark of stock `generate` and MARS decoding, with the §4 cost model next to it.

Why a benchmark and not a timed test: speed depends on the machine, the model and the batch, so the
only honest number is a ratio against stock `generate` measured in the same process, on the same
prompts, interleaved so that drift of a shared machine hits every configuration alike.

What is reported, per batch size and configuration (stock, or MARS with threshold τ, window W,
cache scheme and block C):

- ``tokens_per_forward``: generated tokens ÷ (batch × model calls), prompt forwards included. At
  batch 1 this is generated tokens ÷ forwards; stock `generate` reaches 1.0 only when no row stops
  early, so at larger batch compare with the stock row. Every batch size decodes the whole prompt
  set (in batches), so rows of different batch sizes do the same work.
- ``tokens_per_s`` and ``speedup`` = tokens/s ÷ stock tokens/s (equal to the wall-clock ratio when both
  produce the same number of tokens, which they do whenever the outputs match).
- ``kernels``, ``vs_off`` and ``off_reference``: what a row's forwards ran on (stock kernels or packed
  oneDNN linears) and its tokens/s ÷ the fastest MARS-off row on the same kernels (`denominators`).
- ``masks_value``: verify with the trained masks ÷ verify on the base model with an untrained mask row
  (`untrained`), same window, planner and kernels: what the training adds.
- per category (``--dataset``: MT-Bench, HumanEval, a JSONL file; `eval_sets`, `categories`): tokens per
  forward, answers identical to stock greedy, both ratios.
- ``efficiency`` = speedup ÷ (tokens_per_forward ÷ stock tokens_per_forward): the share of the saved
  forwards that turned into saved time (at batch 1: speedup ÷ tokens per forward).
- ``predicted``: the speedup docs/method.md §4's cost model predicts from the measured cost of an
  (n + W)-token cached forward relative to a 1-token cached forward (see `measure_step_costs`).
- for verified decoding with the step planner (``v-auto``, the default layout): the cost curve the
  decoder measured for itself (``mars_hf.decoding.cost_model``) and what the planner chose with it — a
  histogram of the columns per row each forward fed, and how often a row fed nothing extra, drafts
  only, a linear or a quadratic mask layout.
"""

from mars_hf.tools.bench.configurations import SCHEMES, BenchConfiguration, build_configurations
from mars_hf.tools.bench.denominators import add_denominators
from mars_hf.tools.bench.eval_sets import (
    EVAL_SETS,
    dataset_prompts,
    evaluation_prompts,
    exclude_evaluation_rows,
    load_eval_set,
)
from mars_hf.tools.bench.measure import (
    ForwardCounter,
    RunMeasurement,
    UntrainedDecoder,
    count_generated_tokens,
    greedy_generation_config,
    interleaved_runs,
    run_once,
)
from mars_hf.tools.bench.prompts import (
    BUILTIN_PROMPTS,
    PROMPT_SETS,
    grounded_prompts,
    load_prompts,
    prepare_batches,
    prepare_inputs,
)
from mars_hf.tools.bench.report import format_table
from mars_hf.tools.bench.runner import BenchArguments, run_benchmark
from mars_hf.tools.bench.summary import summarise_measurements
from mars_hf.tools.bench.untrained import load_untrained_mask_model, with_untrained_mask

__all__ = [
    "BUILTIN_PROMPTS",
    "EVAL_SETS",
    "PROMPT_SETS",
    "SCHEMES",
    "BenchArguments",
    "BenchConfiguration",
    "ForwardCounter",
    "RunMeasurement",
    "UntrainedDecoder",
    "add_denominators",
    "build_configurations",
    "count_generated_tokens",
    "dataset_prompts",
    "evaluation_prompts",
    "exclude_evaluation_rows",
    "format_table",
    "greedy_generation_config",
    "grounded_prompts",
    "interleaved_runs",
    "load_eval_set",
    "load_prompts",
    "load_untrained_mask_model",
    "prepare_batches",
    "prepare_inputs",
    "run_benchmark",
    "run_once",
    "summarise_measurements",
    "with_untrained_mask",
]
