"""The training section: one MARS step through the real `MARSTrainer.compute_loss`, forward + backward.

sdpa first, then flex_attention (CUDA: torch has no flex backward on the CPU), then the mask-gated LoRA's
frozen clean stream against its two-stream path (docs/method.md §7). Each pair is compared (loss and gradient
agreement, step-time ratio). TRL, datasets and PEFT are imported only here, when the section runs, so that
a GPU machine with a broken one of them still runs the decoding items (the section says what is missing).
"""

from __future__ import annotations

import gc
import importlib
import math
import statistics
import tempfile

import torch

from mars_hf.tools.gpu_check.machine import peak_memory_mb, peak_memory_reset
from mars_hf.tools.gpu_check.random_models import build_model, ordinary_token_ids

TRAINING_FIX = "bring their wheels (docs/gpu_check.md)"
FLEX_NEEDS_CUDA = "flex_attention has no backward on the CPU (torch raises NotImplementedError); CUDA only"
GATED_VARIANTS = ("gated frozen-clean", "gated two-stream")


def training_items(check, shape: str) -> None:
    """sdpa, then flex_attention against it, then the two gated variants against each other."""
    missing = missing_modules(("trl", "datasets", "peft"))
    if missing:
        check.skip(f"{shape}: training", f"cannot import {', '.join(missing)}: {TRAINING_FIX}")
        return
    state: dict = {}
    estimates = check.estimates
    try:
        if not _train_item(check, shape, "sdpa", estimates.train_first(shape), state):
            return
        sdpa_step = state["sdpa"]["step_seconds"]
        if check.device.type != "cuda":
            check.skip(f"{shape}: train flex_attention", FLEX_NEEDS_CUDA)
        elif _train_item(check, shape, "flex_attention", estimates.train_flex(sdpa_step), state):
            agreement(check, shape, state, "flex_attention", "sdpa")
        state.pop("full", None)
        for variant in GATED_VARIANTS:
            if not _train_item(check, shape, variant, estimates.train_gated(sdpa_step), state):
                return
        agreement(check, shape, state, *GATED_VARIANTS)
    finally:
        state.clear()
        gc.collect()
        if check.device.type == "cuda":
            torch.cuda.empty_cache()


def _train_item(check, shape: str, variant: str, estimate: float | None, state: dict) -> bool:
    return check.run_item(f"{shape}: train {variant}", estimate, train, check, shape, variant, state)


def _word_tokenizer(mask_token_id: int):
    """A word-level tokenizer whose <|mask|> sits at the shape's mask id (the trainer adds or finds the
    mask token through the tokenizer and gates adapters to that id)."""
    from mars_hf.tools.synthetic import word_level_chat_tokenizer

    words = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    words += [f"w{i}" for i in range(len(words), mask_token_id)] + ["<|mask|>"]
    return word_level_chat_tokenizer(words, "", mask_token="<|mask|>")


def _gated_lora(options: dict):
    """The gated adapter's settings (added to ``options``) and its LoRA config."""
    from peft import LoraConfig

    options["adapter_gating"] = "mask"
    # The clean stream of a gated adapter is the base model: with tied embeddings (Qwen2.5-0.5B/1.5B)
    # its loss would still reach the mask row through the output matrix, so the frozen path needs
    # ar_weight = 0 (the trainer says so); both gated variants use it.
    options["ar_weight"] = 0.0
    return LoraConfig(
        r=16,
        lora_alpha=32,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        init_lora_weights=False,  # a non-zero delta, so that every adapter weight gets a gradient
    )


def make_trainer(check, shape: str, gated: bool):
    """A real `MARSTrainer` (its `compute_loss` is the loss under test) on a float32 copy of the shape."""
    from datasets import Dataset

    from mars_hf.training.config import MARSConfig
    from mars_hf.training.trainer import MARSTrainer

    model = build_model(shape, dtype=torch.float32, device=check.device, seed=check.args.seed + 7)
    mask_token_id = int(model.config.mars["mask_token_id"])
    dataset = Dataset.from_list([{"input_ids": [3, 4, 3, 4, 2]}, {"input_ids": [4, 3, 4, 3, 2]}])
    options = dict(
        output_dir=tempfile.mkdtemp(prefix="mars-gpu-check-"),
        block_size=check.args.window,
        report_to=[],
        bf16=False,
        fp16=False,
        use_cpu=check.device.type == "cpu",
        dataset_kwargs={"skip_prepare_dataset": True},
        remove_unused_columns=False,
        save_strategy="no",
    )
    peft_config = _gated_lora(options) if gated else None
    trainer = MARSTrainer(
        model=model,
        args=MARSConfig(**options),
        train_dataset=dataset,
        processing_class=_word_tokenizer(mask_token_id),
        peft_config=peft_config,
    )
    if trainer.mask_token_id != mask_token_id:
        raise RuntimeError(f"MARSTrainer chose mask id {trainer.mask_token_id}, expected {mask_token_id}.")
    trainer.model.train()
    return trainer


def training_batch(check, model) -> dict:
    """``train_batch`` rows of ``train_length`` random tokens; the first quarter is unsupervised prompt,
    one row is shorter (right padding) so that the padding path runs."""
    args = check.args
    ordinary = ordinary_token_ids(model)
    generator = torch.Generator().manual_seed(args.seed + 11)
    shape = (args.train_batch, args.train_length)
    input_ids = ordinary[torch.randint(len(ordinary), shape, generator=generator)]
    attention_mask = torch.ones(shape, dtype=torch.long)
    if args.train_batch > 1:
        attention_mask[-1, -args.train_length // 8 :] = 0
        input_ids[-1, -args.train_length // 8 :] = model.config.pad_token_id
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[:, : args.train_length // 4] = -100
    batch = dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    return {k: v.to(check.device) for k, v in batch.items()}


def train(check, shape: str, variant: str, state: dict) -> None:
    """Forward + backward of one MARS batch through `MARSTrainer.compute_loss` (the first step compiles);
    keeps loss and gradients in ``state[variant]`` for `agreement`."""
    gated = variant.startswith("gated")
    kind = "gated" if gated else "full"
    if kind not in state:
        trainer = make_trainer(check, shape, gated)
        state[kind] = (trainer, training_batch(check, trainer.model))
    trainer, batch = state[kind]
    model = trainer.model
    implementation = "sdpa" if gated else variant
    trainer.accelerator.unwrap_model(model).set_attn_implementation(implementation)
    if gated:
        trainer.args.frozen_clean_stream = None if variant == "gated frozen-clean" else False
    frozen_clean = bool(gated and trainer._use_frozen_clean(implementation))
    steps = _timed_steps(check, trainer, model, batch)
    gradients = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    step_seconds = statistics.median(steps["times"])
    state[variant] = {"loss": steps["loss"], "gradients": gradients, "step_seconds": step_seconds}
    grad_norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in gradients.values()))
    check.result["training"].append(
        {
            "model": shape,
            "variant": variant,
            "attn_implementation": implementation,
            "dtype": "float32",
            "batch": check.args.train_batch,
            "length": check.args.train_length,
            "block_size": check.args.window,
            "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "frozen_clean_stream": frozen_clean,
            "ar_weight": trainer.args.ar_weight,
            "loss": steps["loss"],
            "grad_norm": grad_norm,
            "first_step_seconds": steps["first_seconds"],
            "step_seconds": step_seconds,
            "step_seconds_all": steps["times"],
            "peak_memory_mb": steps["peak"],
        }
    )


def _timed_steps(check, trainer, model, batch) -> dict:
    """``train_repeats + 1`` steps by the check's clock (the first one, which compiles, apart); the last
    step's gradients stay on the model."""
    cuda = check.device.type == "cuda"
    times, first_seconds, loss_value, peak = [], None, None, None
    for repeat in range(check.args.train_repeats + 1):
        check.budget.check()
        model.zero_grad(set_to_none=True)
        peak_memory_reset(check.device)
        if cuda:
            torch.cuda.synchronize()
        start = check.clock()
        loss = trainer.compute_loss(model, dict(batch))
        loss.backward()
        if cuda:
            torch.cuda.synchronize()
        seconds = check.clock() - start
        if repeat == 0:
            first_seconds = seconds
        else:
            times.append(seconds)
            peak = peak_memory_mb(check.device)
        loss_value = float(loss.detach())
    return {"times": times, "first_seconds": first_seconds, "loss": loss_value, "peak": peak}


def agreement(check, shape: str, state: dict, variant: str, reference_variant: str) -> None:
    """Loss and gradient differences of two variants of the same step, and their step-time ratio."""
    candidate, reference = state.pop(variant), state.pop(reference_variant)
    max_abs = difference_sq = reference_sq = 0.0
    for name, expected in reference["gradients"].items():
        difference = (candidate["gradients"][name] - expected).double()
        max_abs = max(max_abs, float(difference.abs().max()))
        difference_sq += float(difference.pow(2).sum())
        reference_sq += float(expected.double().pow(2).sum())
    check.result["training"].append(
        {
            "model": shape,
            "comparison": f"{variant} vs {reference_variant}",
            "same_gradient_names": candidate["gradients"].keys() == reference["gradients"].keys(),
            "loss_abs_diff": abs(candidate["loss"] - reference["loss"]),
            "grad_max_abs_diff": max_abs,
            "grad_rel_diff": math.sqrt(difference_sq / max(reference_sq, 1e-300)),
            "step_time_ratio": candidate["step_seconds"] / reference["step_seconds"],
        }
    )


def missing_modules(names) -> list[str]:
    """Modules that cannot be imported, with the reason (a present but broken package counts too)."""
    missing = []
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as error:  # ImportError, or a dependency's own failure (e.g. too old pyarrow)
            missing.append(f"{name} ({type(error).__name__}: {error})")
    return missing
