"""The quickstart's training: :class:`mars_hf.MARSTrainer` for a wall-clock budget (or a step count).

The learning rate warms up and decays linearly *in time* (``MARSConfig.max_train_minutes``,
:class:`~mars_hf.training.time_budget.TimeBudget`), so it reaches zero when the budget ends on any
machine; the method defaults (:data:`METHOD_DEFAULTS`) are the measured best for each way of training
the masks.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from mars_hf.tools.quickstart.config import QuickstartConfig

logger = logging.getLogger(__name__)


def _budget_progress_callback(budget, progress: bool):
    from tqdm.auto import tqdm
    from transformers import TrainerCallback

    class BudgetCallback(TrainerCallback):
        """A progress bar in minutes of the training budget, with the losses (the trainer stops at it)."""

        def __init__(self):
            self.bar = None
            self.last_logs = {}

        def on_train_begin(self, args, state, control, **kwargs):
            self.bar = tqdm(
                total=round(budget.seconds / 60, 1),
                desc="MARS training",
                unit="min",
                disable=not progress,
                bar_format="{l_bar}{bar}| {n:.1f}/{total:.1f} min{postfix}",
            )

        def on_step_end(self, args, state, control, **kwargs):
            if self.bar is not None:
                self.bar.n = min(self.bar.total, round(budget.elapsed() / 60, 1))
                self.bar.set_postfix(step=state.global_step, **self.last_logs, refresh=True)
            return control

        def on_log(self, args, state, control, logs=None, **kwargs):
            logs = logs or {}
            for key, name in (("mars/noisy_loss", "noisy"), ("mars/clean_loss", "clean")):
                if key in logs:
                    self.last_logs[name] = f"{logs[key]:.3f}"

        def on_train_end(self, args, state, control, **kwargs):
            if self.bar is not None:
                self.bar.close()

    return BudgetCallback()


def _tracking_callback(track_every: int, sequences, labels, thresholds, curve: list):
    from transformers import TrainerCallback

    from mars_hf.evaluation.runs import teacher_forced_acceptance

    class TrackingCallback(TrainerCallback):
        """Teacher-forced acceptance on held-out answers every ``track_every`` steps (learning curves)."""

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self.on_step_end(args, state, control, model=model)

        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step % track_every == 0:
                stats = teacher_forced_acceptance(model, sequences, labels, thresholds)
                curve.append({"step": state.global_step, **stats})
                logger.info("step %d: %s", state.global_step, {k: v for k, v in stats.items() if "@" in k})

    return TrackingCallback()


METHOD_DEFAULTS = {
    "gated_lora": {"learning_rate": 2e-3, "clean_loss": "ce", "ar_weight": 0.0},
    "mask_row": {"learning_rate": 3e-2, "clean_loss": "ce", "ar_weight": 0.0},
    "lora": {"learning_rate": 1e-3, "clean_loss": "kl_to_base", "ar_weight": 10.0},
    "full": {"learning_rate": 1e-4, "clean_loss": "kl_to_base", "ar_weight": 10.0},
}


def resolved(config: QuickstartConfig) -> QuickstartConfig:
    """Fill the method-dependent defaults (learning rate, clean loss, ar_weight)."""
    if config.method not in METHOD_DEFAULTS:
        raise ValueError(f"method must be one of {sorted(METHOD_DEFAULTS)}, got {config.method!r}.")
    changes = {k: v for k, v in METHOD_DEFAULTS[config.method].items() if getattr(config, k) is None}
    if config.lora_alpha is None:
        changes["lora_alpha"] = 2 * config.lora_r
    if config.mask_targets == "soft" and config.method not in ("gated_lora", "mask_row"):
        raise ValueError(
            "mask_targets='soft' needs a frozen clean stream (method 'gated_lora' or 'mask_row'), got "
            f"method={config.method!r}."
        )
    return dataclasses.replace(config, **changes)


def train_mars(model, tokenizer, dataset, config: QuickstartConfig, work_dir: str, tracking=None):
    """Train with :class:`MARSTrainer` for ``config.max_steps`` steps or ``config.budget_minutes``.

    ``tracking`` = ``(sequences, labels)`` of held-out answers; with ``config.track_every`` the
    teacher-forced acceptance on them is recorded every that many steps (``info["curve"]``).
    """
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from mars_hf.training.config import MARSConfig
    from mars_hf.training.trainer import MARSTrainer

    config = resolved(config)
    by_time = config.max_steps is None
    steps = config.max_steps if not by_time else 10**6
    args = MARSConfig(
        output_dir=work_dir,
        block_size=config.block_size,
        ar_weight=config.ar_weight,
        clean_loss=config.clean_loss,
        per_device_train_batch_size=config.batch_size,
        learning_rate=config.learning_rate,
        lr_scheduler_type="linear",
        warmup_steps=max(1, int(config.warmup_fraction * steps)) if not by_time else config.warmup_fraction,
        weight_decay=0.0,
        max_steps=steps,
        max_train_minutes=config.budget_minutes if by_time else None,
        logging_steps=5,
        save_strategy="no",
        report_to="none",
        seed=config.seed,
        bf16=bool(config.bf16),
        use_cpu=not torch.cuda.is_available(),
        gradient_checkpointing=False,
        adapter_gating="mask" if config.method == "gated_lora" else None,
        mask_targets=config.mask_targets,
        max_length=config.max_length,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    peft_config = None
    if config.method in ("lora", "gated_lora"):
        from peft import LoraConfig

        targets = config.lora_target_modules
        peft_config = LoraConfig(
            r=config.lora_r,
            lora_alpha=config.lora_alpha,
            lora_dropout=0.0,
            target_modules=targets if targets == "all-linear" else [t.strip() for t in targets.split(",")],
            task_type="CAUSAL_LM",
        )
    trainer = MARSTrainer(
        model=model, args=args, train_dataset=dataset, processing_class=tokenizer, peft_config=peft_config
    )
    if config.method == "mask_row":
        trainer.train_mask_row_only()
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    if by_time:
        trainer.add_callback(_budget_progress_callback(trainer.time_budget, config.progress))
    else:
        trainer.add_callback(ProgressCallback)
    curve: list[dict] = []
    if tracking is not None and config.track_every:
        trainer.add_callback(_tracking_callback(config.track_every, *tracking, config.thresholds, curve))
    start = time.monotonic()
    output = trainer.train()
    seconds = time.monotonic() - start
    history = [entry for entry in trainer.state.log_history if "mars/noisy_loss" in entry]
    info = {
        "steps": int(trainer.state.global_step),
        "seconds": seconds,
        "seconds_per_step": seconds / max(1, trainer.state.global_step),
        "examples_seen": int(trainer.state.global_step) * config.batch_size,
        "epochs": int(trainer.state.global_step) * config.batch_size / max(1, len(dataset)),
        "train_loss": float(output.training_loss),
        "first_log": history[0] if history else None,
        "last_log": history[-1] if history else None,
        "curve": curve,
    }
    # Mixed-precision training leaves `forward` wrapped in accelerate's bf16 autocast; unwrap it so the
    # evaluation (agreement with the float32 base model) runs the model as it is saved, in float32.
    model = trainer.accelerator.unwrap_model(trainer.model, keep_fp32_wrapper=False)
    if config.method == "lora":
        model = model.merge_and_unload()
    # gated_lora stays a PeftModel: the gated adapter cannot be merged (docs/method.md §7).
    model.eval()  # MARSTrainer has already suppressed the mask token as an output (generation_config)
    return model, info
