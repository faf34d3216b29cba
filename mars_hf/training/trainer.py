"""`MARSTrainer`: `trl.SFTTrainer` whose loss is docs/method.md §1.4, and the collator of §1.5.

Everything else (dataset formats, PEFT, gradient accumulation, checkpointing, logging) is TRL's. The
trainer only (1) makes sure the model has a mask token and ``config.mars``, (2) screens out rows that
can teach MARS nothing (`screening`), (3) wraps the collator so examples that really end with EOS are
padded to a multiple of the block size (`collator`), and (4) replaces the loss with the two-stream one
(`losses`).
"""

from __future__ import annotations

import copy
import functools
import json
import logging
from pathlib import Path

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase
from trl import SFTTrainer

from mars_hf.decoding.gated_lora import MARS_ADAPTER_CONFIG_FILE, MARS_MASK_ROWS_FILE
from mars_hf.models.adapters import is_peft_model, save_mask_rows
from mars_hf.models.gated_peft import gate_peft_model
from mars_hf.models.mask_token import add_mask_token, set_mars_config, suppress_mask_token
from mars_hf.training.attention_mask import build_mars_inputs, check_attn_implementation, mars_attention_mask
from mars_hf.training.collator import MARSDataCollator, chat_template_eos_tail
from mars_hf.training.config import MARSConfig
from mars_hf.training.losses import LossSums, frozen_clean_sums, mars_loss, two_stream_sums
from mars_hf.training.screening import prepared_row_problems, screen_prepared, screen_raw_splits
from mars_hf.training.time_budget import TimeBudget, stop_at_budget_callback
from mars_hf.training.warm_start import load_lora_factors, read_warm_start, write_mask_rows

logger = logging.getLogger(__name__)

# Parameter-name markers of what a mask-gated adapter trains (LoRA factors, PEFT's trainable-token rows).
_GATED_TRAINABLE = ("lora_A", "lora_B", "trainable_tokens_delta")


def _mars_config(model, args) -> MARSConfig:
    """``args`` checked to be a `MARSConfig`, or a default one named after the model."""
    if args is None:
        name = model if isinstance(model, str) else model.config._name_or_path or "model"
        return MARSConfig(f"{str(name).rstrip('/').split('/')[-1]}-MARS")
    if not isinstance(args, MARSConfig):
        raise TypeError(
            f"MARSTrainer needs a `MARSConfig` (it carries block_size, ar_weight, ...), got "
            f"{type(args).__name__}. Build one with `MARSConfig(output_dir=..., block_size=4, ...)`."
        )
    return args


def _load_model(name: str, args: MARSConfig, processing_class):
    """The model (sdpa attention unless ``model_init_kwargs`` says otherwise) and, if not given, its tokenizer."""
    from trl.trainer.utils import create_model_from_path

    init_kwargs = dict(args.model_init_kwargs or {})
    init_kwargs.setdefault("trust_remote_code", args.trust_remote_code)
    init_kwargs.setdefault("attn_implementation", "sdpa")
    if processing_class is None:
        processing_class = AutoTokenizer.from_pretrained(
            name, revision=init_kwargs.get("revision"), trust_remote_code=args.trust_remote_code
        )
    model = create_model_from_path(name, **init_kwargs)
    args.model_init_kwargs = None  # consumed here
    return model, processing_class


def _prepare_mask_token(model, processing_class, args: MARSConfig, peft_config) -> int:
    """Give the base model a mask token and ``config.mars``; return the mask token id.

    Runs before PEFT wraps the model, so that a resized embedding is the adapter's base. A model that is
    already a PEFT model (and no ``peft_config``) must come with a tokenizer that has the mask token.
    """
    wrapped = is_peft_model(model) and peft_config is None
    base = model.get_base_model() if wrapped else model
    check_attn_implementation(base)
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    if wrapped:
        if tokenizer.mask_token_id is None:
            raise ValueError(
                "The PEFT model's tokenizer has no mask token. Pass the base model and a `peft_config` "
                "instead, so MARSTrainer can add the token before the adapter is created."
            )
        mask_token_id = int(tokenizer.mask_token_id)
    else:
        mask_token_id = add_mask_token(
            base, tokenizer, args.mask_token, placement=getattr(args, "mask_token_placement", "append")
        )
    previous = getattr(base.config, "mars", None) or {}
    if previous.get("block_size") not in (None, args.block_size):
        logger.warning(
            "The model was MARS-trained with block_size=%s; training now with block_size=%d.",
            previous["block_size"],
            args.block_size,
        )
    set_mars_config(base, block_size=args.block_size, mask_token_id=mask_token_id)
    # Saved in generation_config.json: with tied embeddings the trained mask row could otherwise win
    # the output argmax and be generated.
    suppress_mask_token(base)
    return mask_token_id


def _train_mask_row_through_peft(peft_config, mask_token_id: int) -> None:
    """Add the mask token to ``peft_config.trainable_token_indices`` so its embedding row learns."""
    if not hasattr(peft_config, "trainable_token_indices"):
        logger.warning(
            "%s has no `trainable_token_indices`: the mask token's embedding row stays frozen. Use a "
            "LoraConfig (or add the embedding to `modules_to_save`) so the mask token can learn.",
            type(peft_config).__name__,
        )
        return
    indices = peft_config.trainable_token_indices
    if indices is None:
        peft_config.trainable_token_indices = [mask_token_id]
    elif isinstance(indices, dict):
        name = next(iter(indices)) if len(indices) == 1 else "embed_tokens"
        if mask_token_id not in indices.setdefault(name, []):
            indices[name].append(mask_token_id)
    elif mask_token_id not in indices:
        peft_config.trainable_token_indices = [*indices, mask_token_id]


class MARSTrainer(SFTTrainer):
    """[`~trl.SFTTrainer`] for MARS (Mask AutoRegreSsion) multi-token training.

    Use it exactly like `SFTTrainer`, with a [`MARSConfig`]:

    ```python
    trainer = MARSTrainer(model=model, args=MARSConfig(block_size=4), train_dataset=dataset,
                          processing_class=tokenizer, peft_config=LoraConfig(...))
    trainer.train()
    ```

    The model gets a mask token (reused or added) and `config.mars`; with a LoRA `peft_config` the mask
    token's embedding row is trained through PEFT's `trainable_token_indices`. `compute_loss` takes a
    collated batch (`input_ids`, `attention_mask`, `labels` aligned with `input_ids`, -100 = unsupervised)
    and returns docs/method.md §1.4's loss; it logs `mars/noisy_loss` and `mars/clean_loss` (per target).
    """

    _tag_names = ["trl", "sft", "mars"]
    _name = "MARS"

    def __init__(
        self,
        model,
        args: MARSConfig | None = None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class: PreTrainedTokenizerBase | None = None,
        peft_config=None,
        **kwargs,
    ):
        args = _mars_config(model, args)
        if isinstance(model, str):
            model, processing_class = _load_model(model, args, processing_class)
        if processing_class is None:
            raise ValueError(
                "Pass `processing_class=tokenizer`: MARS needs it to add or find the mask token."
            )
        self.mask_token_id = _prepare_mask_token(model, processing_class, args, peft_config)
        warm_start = self._read_warm_start(model, args, peft_config)
        if peft_config is not None:
            _train_mask_row_through_peft(peft_config, self.mask_token_id)
        if args.adapter_gating == "mask" and peft_config is None and not is_peft_model(model):
            raise ValueError(
                "adapter_gating='mask' gates a LoRA adapter: pass `peft_config=LoraConfig(...)` (or a PEFT model)."
            )
        # Before TRL: it reads the first row of each dataset (StopIteration on an empty one) and would
        # silently train on empty completions and chats without an assistant turn.
        train_dataset, eval_dataset, screened = screen_raw_splits(
            train_dataset,
            eval_dataset,
            args.dataset_text_field,
            kwargs.get("formatting_func"),
            args.max_length,
        )
        super().__init__(
            model=model,
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            peft_config=peft_config,
            **kwargs,
        )
        if self.args.adapter_gating == "mask":
            layers = gate_peft_model(self.model, self.mask_token_id)
            logger.info("Gated %d LoRA layers to mask positions (docs/method.md §7).", layers)
        if warm_start is not None:
            layers = load_lora_factors(self.model, warm_start)
            logger.info("Started from %s: %d LoRA layers and its mask-token rows.", warm_start.checkpoint, layers)
        self._mask_row_only = False
        self._frozen_clean_checked = False
        if self.args.pad_to_block_with_eos:
            self.data_collator = self._pad_to_block_collator()
        self._screen_prepared(screened)
        self._base_model = self._frozen_base_copy()
        self.time_budget = None
        if self.args.max_train_minutes is not None:
            warmup = self.args.warmup_steps if 0 < self.args.warmup_steps < 1 else 0.0
            self.time_budget = TimeBudget(self.args.max_train_minutes * 60, warmup_fraction=warmup)
            self.add_callback(stop_at_budget_callback(self.time_budget))

    def _read_warm_start(self, model, args: MARSConfig, peft_config):
        """``args.init_adapter`` read and checked, its mask rows written into the (not yet wrapped) base model."""
        if args.init_adapter is None:
            return None
        if peft_config is None:
            raise ValueError(
                "init_adapter starts a new LoRA adapter from a saved one: pass the base model and "
                "`peft_config=LoraConfig(...)` (mars-hf train: --use_peft)."
            )
        start = read_warm_start(args.init_adapter, self.mask_token_id, args.adapter_gating)
        write_mask_rows(model, start)
        return start

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        """With ``max_train_minutes``: the learning rate decays linearly in wall-clock time to 0 at the budget."""
        if self.time_budget is None or self.lr_scheduler is not None:
            return super().create_scheduler(num_training_steps, optimizer)
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer or self.optimizer, self.time_budget)
        self._created_lr_scheduler = True
        return self.lr_scheduler

    def _pad_to_block_collator(self) -> MARSDataCollator:
        """TRL's collator wrapped so examples that really end with EOS are padded to whole blocks (§1.5)."""
        if self._tokenizer.eos_token_id is None:
            raise ValueError(
                "pad_to_block_with_eos=True needs a tokenizer with an EOS token; set one or disable it."
            )
        return MARSDataCollator(
            collator=self.data_collator,
            block_size=self.args.block_size,
            eos_token_id=int(self._tokenizer.eos_token_id),
            eos_tail_ids=chat_template_eos_tail(self._tokenizer),
        )

    def _frozen_base_copy(self):
        """For ``clean_loss="kl_to_base"`` with full fine-tuning, a frozen copy of the starting model, else None.

        A PEFT model gives the base distribution by disabling its adapter instead.
        """
        if self.args.clean_loss != "kl_to_base" or is_peft_model(self.model):
            return None
        base_model = copy.deepcopy(self.accelerator.unwrap_model(self.model))
        # SFTTrainer patches `forward` on the instance with a closure over the *original* model's forward;
        # a deep copy would keep calling the trained model. Fall back to the class's own forward.
        base_model.__dict__.pop("forward", None)
        return base_model.eval().requires_grad_(False)

    def _screen_prepared(self, screened: dict[str, tuple[int | None, dict[str, int]]]) -> None:
        """`screen_prepared` on every split TRL tokenized, keeping what it returns."""

        def row_problems(dataset):
            return prepared_row_problems(
                dataset, self.processing_class, self.args, getattr(self, "chat_template", None)
            )

        def screen(split, dataset):
            return screen_prepared(split, dataset, screened.get(split), row_problems, self.args.max_length)

        if self.train_dataset is not None:
            self.train_dataset = screen("train", self.train_dataset)
        if isinstance(self.eval_dataset, dict):
            for split, dataset in self.eval_dataset.items():
                if dataset is not None:
                    self.eval_dataset[split] = screen(split, dataset)
        elif self.eval_dataset is not None:
            self.eval_dataset = screen("eval", self.eval_dataset)

    def train_mask_row_only(self) -> None:
        """Freeze every weight except the input embedding, whose gradient is kept on the mask row only.

        Every other weight stays the starting model's (τ = 1 decoding is exactly the base model), and
        the clean stream has nothing to train, so it runs without autograd (``frozen_clean_stream``).
        """
        model = self.accelerator.unwrap_model(self.model)
        embedding = model.get_input_embeddings().weight
        for parameter in model.parameters():
            parameter.requires_grad_(False)
        embedding.requires_grad_(True)
        keep = torch.zeros(embedding.shape[0], 1, dtype=embedding.dtype, device=embedding.device)
        keep[self.mask_token_id] = 1
        embedding.register_hook(lambda grad: grad * keep.to(grad.dtype))
        self._mask_row_only = True
        self._frozen_clean_checked = False

    def _clean_stream_is_frozen(self) -> tuple[bool, str]:
        """Whether nothing trainable can change the clean stream, and why (or why not)."""
        model = self.accelerator.unwrap_model(self.model)
        trainable = [name for name, parameter in model.named_parameters() if parameter.requires_grad]
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        if getattr(config, "tie_word_embeddings", False) and self.args.ar_weight > 0:
            return False, (
                "tied embeddings make the trained mask row the mask token's output row too, so the clean loss "
                "(ar_weight > 0) depends on it; set ar_weight=0"
            )
        if self._mask_row_only:
            embedding = model.get_input_embeddings().weight
            others = [p for p in model.parameters() if p.requires_grad and p is not embedding]
            if not others:
                return True, "only the mask row is trained"
            return False, "parameters other than the mask row are trainable"
        if self.args.adapter_gating == "mask":
            stray = [name for name in trainable if not any(part in name for part in _GATED_TRAINABLE)]
            if not stray:
                return True, "the adapter is gated to mask positions"
            return False, f"parameters outside the gated adapter are trainable ({stray[:3]})"
        return False, "shared weights are trained (not a mask-gated adapter or mask-row-only training)"

    def _use_frozen_clean(self, attn_implementation: str) -> bool:
        """Resolve ``frozen_clean_stream`` (None = when exact); raise when True is asked but not exact."""
        frozen, why = self._clean_stream_is_frozen()
        setting = self.args.frozen_clean_stream
        blockers = []
        if attn_implementation == "flex_attention":
            blockers.append("flex_attention (the split path builds dense masks; use sdpa)")
        if setting is False:
            use = False
        elif not frozen or blockers:
            if setting or self.args.mask_targets == "soft":
                reason = why if not frozen else "; ".join(blockers)
                raise ValueError(
                    f"The frozen-clean-stream path (frozen_clean_stream=True or mask_targets='soft') is not "
                    f"possible: {reason}. Use adapter_gating='mask' with LoRA, or train the mask row only, "
                    "without gradient checkpointing, on sdpa/eager attention."
                )
            use = False
        else:
            use = True
        if not self._frozen_clean_checked:
            logger.info(
                "MARS training: %s.",
                f"clean stream frozen ({why}): computed without autograd, backward through the noisy stream only"
                if use
                else f"two-stream forward + backward ({why if not frozen else '; '.join(blockers) or 'frozen_clean_stream=False'})",
            )
            self._frozen_clean_checked = True
        return use

    def _save(self, output_dir: str | None = None, state_dict=None):
        """Save like `Trainer`; a PEFT adapter also gets `mars_config.json` and its mask-token rows.

        A full model carries `config.mars` in `config.json`. An adapter folder has no `config.json`, so the
        same metadata goes next to it in the files `mars_hf.AutoMARSModelForCausalLM` reads for adapters.
        """
        super()._save(output_dir, state_dict=state_dict)
        unwrapped = self.accelerator.unwrap_model(self.model)
        if is_peft_model(unwrapped) and self.args.should_save:
            output_dir = output_dir if output_dir is not None else self.args.output_dir
            mars = dict(unwrapped.get_base_model().config.mars)
            (Path(output_dir) / MARS_ADAPTER_CONFIG_FILE).write_text(
                json.dumps(mars, indent=2, sort_keys=True) + "\n"
            )
            save_mask_rows(unwrapped, self.mask_token_id, Path(output_dir) / MARS_MASK_ROWS_FILE)

    def _base_clean_logits(self, model, clean_ids, clean_valid, keep):
        """Logits of the frozen starting model on the clean stream (plain causal LM, no MARS mask)."""
        kwargs = dict(
            input_ids=clean_ids,
            attention_mask=clean_valid.long(),
            position_ids=torch.arange(clean_ids.shape[1], device=clean_ids.device).expand_as(clean_ids),
            logits_to_keep=keep,
            use_cache=False,
        )
        with torch.no_grad():
            if self._base_model is not None:
                return self._base_model(**kwargs).logits
            unwrapped = self.accelerator.unwrap_model(model)
            with unwrapped.disable_adapter():
                return unwrapped(**kwargs).logits

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """docs/method.md §1.4: ``(Σ noisy CE + ar_weight · Σ clean term) / N`` on an already-collated batch."""
        mode = "train" if self.model.training else "eval"
        unwrapped = self.accelerator.unwrap_model(self.model)
        attn_implementation = check_attn_implementation(unwrapped)
        mars = build_mars_inputs(
            inputs["input_ids"],
            inputs.get("attention_mask"),
            inputs.get("labels"),
            block_size=self.args.block_size,
            mask_token_id=self.mask_token_id,
            drop_target_free_blocks=self.args.drop_target_free_blocks,
        )
        dtype = unwrapped.get_input_embeddings().weight.dtype
        if self._use_frozen_clean(attn_implementation):
            sums = frozen_clean_sums(
                model,
                unwrapped,
                mars,
                attn_implementation,
                dtype,
                soft=self.args.mask_targets == "soft",
                ar_weight=self.args.ar_weight,
                clean_loss=self.args.clean_loss,
            )
        else:
            sums = two_stream_sums(
                model,
                mars,
                mars_attention_mask(mars, attn_implementation, dtype=dtype),
                clean_loss=self.args.clean_loss,
                base_clean_logits=functools.partial(self._base_clean_logits, model),
            )
        denominator = num_items_in_batch if num_items_in_batch is not None else mars.num_targets
        loss = mars_loss(sums, self.args.ar_weight, denominator)
        # Like SFTTrainer: num_items_in_batch counts every rank's tokens and DDP averages the gradients.
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * (self.accelerator.num_processes // self.get_tp_size())
        self._log_mars_metrics(mode, inputs, mars.num_targets, sums)
        if return_outputs:
            return loss, sums.outputs
        return loss

    @torch.no_grad()
    def _log_mars_metrics(self, mode, inputs, num_targets, sums: LossSums):
        """Per-target noisy/clean loss and accuracy (and KL), summed over every process."""
        zero = sums.noisy_sum.new_zeros((), dtype=torch.float64)

        def stat(value):
            return value.detach().to(torch.float64) if value is not None else zero

        stats = torch.stack(
            [
                stat(sums.noisy_sum),
                stat(sums.clean_sum),
                torch.as_tensor(num_targets, device=zero.device).to(torch.float64),
                stat(sums.noisy_correct),
                stat(sums.clean_correct),
                stat(sums.kl_sum),
            ]
        )
        # A plain all-reduce: gather_for_metrics would trim "duplicate" rows at the end of an epoch.
        stats = self.accelerator.reduce(stats, reduction="sum")
        count = max(stats[2].item(), 1.0)
        metrics = self._metrics[mode]
        metrics["mars/noisy_loss"].append(stats[0].item() / count)
        metrics["mars/noisy_accuracy"].append(stats[3].item() / count)
        if sums.clean_sum is not None:  # the frozen-clean path skips the clean LM head when nothing needs it
            metrics["mars/clean_loss"].append(stats[1].item() / count)
            metrics["mean_token_accuracy"].append(stats[4].item() / count)
        if sums.kl_sum is not None:
            metrics["mars/clean_kl"].append(stats[5].item() / count)
        if mode == "train" and "attention_mask" in inputs:
            tokens = self.accelerator.reduce(inputs["attention_mask"].sum(), reduction="sum").item()
            self._total_train_tokens += tokens // self._tp_size
        metrics["num_tokens"] = [self._total_train_tokens]

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Evaluation returns the MARS loss only (the two-stream logits are not comparable to labels)."""
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None
