"""`MARSConfig`: `trl.SFTConfig` plus the few knobs of MARS training (docs/method.md §1)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from trl import SFTConfig

from mars_hf.models.mask_token import MASK_PLACEMENTS

CLEAN_LOSSES = ("ce", "kl_to_base")
ADAPTER_GATINGS = ("mask",)
MASK_TARGETS = ("hard", "soft")


@dataclass
class MARSConfig(SFTConfig):
    r"""
    Configuration class for the [`MARSTrainer`].

    Everything of [`~trl.SFTConfig`] applies (dataset formats, `completion_only_loss`, `assistant_only_loss`,
    `max_length`, PEFT, gradient checkpointing, bf16, ...); the parameters below are specific to MARS.

    Parameters:
        block_size (`int`, *optional*, defaults to `4`):
            Block size `B`: the noisy stream learns to predict up to `B + 1` tokens ahead of the visible clean
            prefix. The paper uses 4, 8 or 16. Saved in the checkpoint's `config.mars`.
        ar_weight (`float`, *optional*, defaults to `1.0`):
            Weight of the clean-stream (plain next-token) term in
            `loss = (Σ noisy CE + ar_weight · Σ clean term) / N`. `0` drops it (the paper's ablation, which
            degrades badly at large blocks).
        mask_token (`str`, *optional*, defaults to `"<|mask|>"`):
            Mask token added to the tokenizer when it has none (a tokenizer's own mask token is reused). With
            `mask_token_placement="reuse_token"`, the existing token to make the mask token.
        mask_token_placement (`str`, *optional*, defaults to `"append"`):
            Where the mask token goes when the tokenizer has none (`mars_hf.add_mask_token`): `"append"` adds a
            token (on a spare embedding row if there is one, else the embeddings grow by one row);
            `"spare_row"` uses a spare row and never resizes; `"reuse_token"` turns an existing unused special
            token into the mask (`mask_token` if the tokenizer has it, else one found automatically);
            `"keep_vocab_size"` is `"spare_row"` when possible, else `"reuse_token"`. A model served as a
            separate drafter (vLLM parallel drafting, `mars-hf export --for vllm`) must keep its base vocabulary
            size, so it needs one of the last three.
        pad_to_block_with_eos (`bool`, *optional*, defaults to `True`):
            Right-pad each example that really ends with EOS to a multiple of `block_size` with supervised EOS
            tokens (done by the data collator, §1.5). Examples cut at `max_length` are never padded.
        drop_target_free_blocks (`bool`, *optional*, defaults to `True`):
            Leave noisy blocks that hold no target out of the forward pass. Exact (same loss and gradients);
            it saves most of the noisy half's cost on data with long prompts.
        clean_loss (`str`, *optional*, defaults to `"ce"`):
            Clean-stream term: `"ce"` is next-token cross-entropy (the paper's "SFT loss"); `"kl_to_base"` is
            KL(base ‖ model) at each target position, where the base is the frozen starting model (the same
            model with its adapter disabled under PEFT, otherwise a frozen copy made at init). It keeps one-token
            decoding close to the starting model while the masks learn.
        adapter_gating (`str`, *optional*):
            `"mask"` gates the PEFT LoRA adapter (`peft_config=LoraConfig(...)`) to mask positions (docs/method.md
            §7): its delta applies only where the input token is the mask token, so every real token runs the
            base weights and one-token decoding stays the base model exactly. Saved as `adapter_gating` in
            `config.mars`; such an adapter cannot be merged.
        frozen_clean_stream (`bool`, *optional*):
            Compute the clean stream without autograd and run forward + backward over the noisy stream only
            (it attends to the clean keys/values as in §1.2). Same loss and gradients, cheaper. Only valid
            when nothing trainable touches the clean stream: a mask-gated adapter, or training the mask row
            only. `None` (default) turns it on exactly in those cases.
        mask_targets (`str`, *optional*, defaults to `"hard"`):
            `"hard"`: cross-entropy to the label token at each noisy target; `"soft"`: cross-entropy to the
            frozen base model's distribution at that position (the clean stream's, so it needs a frozen clean
            stream).
        calibration_holdout (`float`, *optional*, defaults to `0.05`):
            Examples of the training data held out (a fraction below 1, a count from 1; at most 256) on which
            the training script fits the confidence calibration after training (`config.mars["calibration"]`,
            see `mars_hf.decoding.calibration`), so that τ = 0.9 means "90 % likely to be the model's own token". `0`
            disables it (fit later with `mars-hf calibrate`).
        max_train_minutes (`float`, *optional*):
            Train for this many minutes of wall-clock time: the learning rate warms up (over `warmup_steps`
            when it is a fraction below 1) and decays linearly *in time* to 0 at the budget
            (`mars_hf.training.time_budget`), whatever the machine's speed. `lr_scheduler_type` is then
            unused; training also stops at `max_steps` / `num_train_epochs` if those come first.
        init_adapter (`str`, *optional*):
            A saved MARS LoRA adapter (a folder, or `"embedded-mars"`) to start from
            (`mars_hf.training.warm_start`): the first step starts from exactly the model it saved, so several
            short runs add up. The run's LoRA must cover the adapter's layers with `lora_r` >= its rank (extra
            ranks start at zero); its calibration is not carried over.
    """

    block_size: int = field(
        default=4,
        metadata={"help": "Block size B: the noisy stream predicts offsets 2..B+1 beyond the clean prefix."},
    )
    ar_weight: float = field(
        default=1.0,
        metadata={"help": "Weight of the clean-stream (next-token) term of the loss; 0 disables it."},
    )
    mask_token: str = field(
        default="<|mask|>",
        metadata={"help": "Mask token added to the tokenizer if it has none (an existing one is reused)."},
    )
    mask_token_placement: str = field(
        default="append",
        metadata={
            "help": "Where the mask token goes if the tokenizer has none: 'append' (new token; grows the "
            "embeddings when no spare row), 'spare_row', 'reuse_token' (an unused special token, or mask_token "
            "if it exists) or 'keep_vocab_size' (spare row, else reuse). vLLM drafters need the vocabulary "
            "size kept.",
            "choices": list(MASK_PLACEMENTS),
        },
    )
    pad_to_block_with_eos: bool = field(
        default=True,
        metadata={
            "help": "Right-pad examples that end with EOS to a multiple of block_size with supervised EOS "
            "tokens (truncated examples are never padded)."
        },
    )
    drop_target_free_blocks: bool = field(
        default=True,
        metadata={"help": "Drop noisy blocks without targets from the forward pass (exact optimisation)."},
    )
    clean_loss: str = field(
        default="ce",
        metadata={
            "help": "Clean-stream term: 'ce' (next-token cross-entropy) or 'kl_to_base' (KL from the frozen "
            "starting model, keeps one-token decoding close to it).",
            "choices": list(CLEAN_LOSSES),
        },
    )

    adapter_gating: str | None = field(
        default=None,
        metadata={
            "help": "'mask': apply the LoRA adapter only at mask-token positions (real tokens run the base "
            "weights exactly; the adapter cannot be merged).",
            "choices": [None, *ADAPTER_GATINGS],
        },
    )
    frozen_clean_stream: bool | None = field(
        default=None,
        metadata={
            "help": "Run the clean stream without autograd and backpropagate through the noisy stream only "
            "(exact when nothing trainable touches the clean stream; default: on exactly then)."
        },
    )
    mask_targets: str = field(
        default="hard",
        metadata={
            "help": "'hard': the label token; 'soft': the frozen base model's distribution at each target.",
            "choices": list(MASK_TARGETS),
        },
    )

    calibration_holdout: float = field(
        default=0.05,
        metadata={
            "help": "Training examples held out to fit the confidence calibration after training (fraction < 1, "
            "count >= 1, at most 256; 0 disables)."
        },
    )

    exclude_evaluation_prompts: bool = field(
        default=True,
        metadata={
            "help": "Drop every training row that contains a prompt `mars-hf bench` evaluates on (MT-Bench, "
            "HumanEval, the built-in sets), so benchmark numbers are never measured on trained prompts."
        },
    )

    max_train_minutes: float | None = field(
        default=None,
        metadata={
            "help": "Wall-clock training budget in minutes: the learning rate decays linearly in time to 0 at "
            "the budget and training stops there (any machine speed); lr_scheduler_type is then unused."
        },
    )

    init_adapter: str | None = field(
        default=None,
        metadata={
            "help": "Start from a saved MARS LoRA adapter (a folder, or 'embedded-mars'): its LoRA factors and "
            "mask-token rows are the starting point, so training continues where it ended (needs a LoRA with "
            "lora_r >= its rank on at least its layers; its calibration is not carried over)."
        },
    )

    def __post_init__(self):
        super().__post_init__()
        if self.max_train_minutes is not None and not (
            math.isfinite(float(self.max_train_minutes)) and self.max_train_minutes > 0
        ):
            raise ValueError(f"max_train_minutes must be a number > 0 or None, got {self.max_train_minutes!r}.")
        if not math.isfinite(float(self.calibration_holdout)) or self.calibration_holdout < 0:
            raise ValueError(
                f"calibration_holdout must be >= 0 (a fraction < 1 or a count), got {self.calibration_holdout!r}."
            )
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(
                f"block_size must be an integer >= 1 (the paper uses 4, 8, 16), got {self.block_size!r}."
            )
        if not math.isfinite(float(self.ar_weight)) or self.ar_weight < 0:
            raise ValueError(f"ar_weight must be a finite number >= 0 (default 1.0), got {self.ar_weight!r}.")
        if self.clean_loss not in CLEAN_LOSSES:
            raise ValueError(f"clean_loss must be one of {CLEAN_LOSSES}, got {self.clean_loss!r}.")
        if self.adapter_gating not in (None, *ADAPTER_GATINGS):
            raise ValueError(
                f"adapter_gating must be None or one of {ADAPTER_GATINGS}, got {self.adapter_gating!r}."
            )
        if self.mask_token_placement not in MASK_PLACEMENTS:
            raise ValueError(
                f"mask_token_placement must be one of {MASK_PLACEMENTS}, got {self.mask_token_placement!r}."
            )
        if self.mask_targets not in MASK_TARGETS:
            raise ValueError(f"mask_targets must be one of {MASK_TARGETS}, got {self.mask_targets!r}.")
        if self.mask_targets == "soft" and self.frozen_clean_stream is False:
            raise ValueError(
                "mask_targets='soft' takes the base distribution from the frozen clean stream; leave "
                "frozen_clean_stream at None/True (it needs a mask-gated adapter or mask-row-only training)."
            )
        if self.packing or self.padding_free:
            raise ValueError(
                "MARS training does not support packing or padding-free batches: blocks are counted from each "
                "example's first token and the two-stream mask is per example. Set `packing=False` and "
                "`padding_free=False`."
            )
