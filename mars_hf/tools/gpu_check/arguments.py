"""What a GPU check measures: the GPU plan's defaults, and the tiny CPU plan of ``--tiny``."""

from __future__ import annotations

from dataclasses import dataclass, field

from mars_hf.tools.gpu_check.random_models import MODEL_SHAPES

PARTS = ("decode", "exactness", "training")


@dataclass
class GPUCheckArguments:
    """What to measure. Defaults are the GPU plan; `tiny_arguments` gives the CPU plan of ``--tiny``."""

    models: list[str] = field(
        default_factory=lambda: ["qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b"],
        metadata={"help": f"Model shapes, in priority order ({', '.join(MODEL_SHAPES)})."},
    )
    batch_sizes: list[int] = field(default_factory=lambda: [1, 4, 8, 16], metadata={"help": "Batch sizes."})
    rates: list[float] = field(
        default_factory=lambda: [0.4, 0.8],
        metadata={"help": "Forced mask agreement rates (0.4 is paper-like: ~1.65 tokens/step at W=4)."},
    )
    window: int = field(default=4, metadata={"help": "MARS window W (masks per step)."})
    tau: float = field(default=0.9, metadata={"help": "Threshold τ of the threshold (probability) rows."})
    cache_blocks: list[int] = field(default_factory=lambda: [16, 32], metadata={"help": "Block sizes C."})
    layouts: list[str] = field(
        default_factory=lambda: ["auto", "linear", "quadratic"],
        metadata={"help": "Verify draft layouts (auto = the step planner on the measured cost curve)."},
    )
    max_new_tokens: int = field(default=64, metadata={"help": "New tokens per row (greedy)."})
    prompt_length: int = field(default=128, metadata={"help": "Longest prompt (rows vary by up to 15)."})
    repeats: int = field(default=3, metadata={"help": "Timed repeats per configuration (median)."})
    warmup: int = field(default=1, metadata={"help": "Untimed short runs per configuration first."})
    warmup_tokens: int = field(default=8, metadata={"help": "New tokens of a warm-up run."})
    parts: list[str] = field(
        default_factory=lambda: list(PARTS),
        metadata={"help": "What to run: any of decode, exactness, training."},
    )
    exactness_batch_sizes: list[int] = field(
        default_factory=lambda: [1, 8], metadata={"help": "Batch sizes of the bf16 exactness check."}
    )
    exactness_new_tokens: int = field(default=64, metadata={"help": "New tokens of the exactness check."})
    train_batch: int = field(default=4, metadata={"help": "Rows of the training step."})
    train_length: int = field(default=512, metadata={"help": "Tokens per row of the training step."})
    train_repeats: int = field(default=3, metadata={"help": "Timed training steps per backend (median)."})
    train_models: int = field(default=2, metadata={"help": "Train-check the first N model shapes."})
    dtype: str = field(default="bfloat16", metadata={"help": "Decoding dtype (training runs in float32)."})
    device: str | None = field(default=None, metadata={"help": "Device (default: cuda if available)."})
    seed: int = field(default=0, metadata={"help": "Seed of weights, prompts and forced patterns."})

    def validate(self) -> None:
        """Name what is unknown before anything is built."""
        unknown = set(self.parts) - set(PARTS)
        if unknown:
            raise ValueError(f"Unknown part(s) {sorted(unknown)}; choose from {', '.join(PARTS)}.")
        unknown = [m for m in self.models if m not in MODEL_SHAPES]
        if unknown:
            raise ValueError(f"Unknown model shape(s) {unknown}; choose from {list(MODEL_SHAPES)}.")


def tiny_arguments(**overrides) -> GPUCheckArguments:
    """The ``--tiny`` plan: tiny shapes on the CPU, the same items and JSON as the GPU plan."""
    values = dict(
        models=["tiny"],
        batch_sizes=[1, 2],
        max_new_tokens=32,
        prompt_length=16,
        repeats=2,
        exactness_batch_sizes=[1, 3],
        exactness_new_tokens=24,
        train_batch=2,
        train_length=32,
        train_repeats=2,
        train_models=1,
        device="cpu",
    )
    values.update(overrides)
    return GPUCheckArguments(**values)
