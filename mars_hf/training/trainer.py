"""`MARSTrainer`: `trl.SFTTrainer` whose loss is MARS_SPEC §1.4, and the collator of §1.5.

Everything else (dataset formats, PEFT, gradient accumulation, checkpointing, logging) is TRL's. The
trainer only (1) makes sure the model has a mask token and ``config.mars``, (2) wraps the collator so
examples that really end with EOS are padded to a multiple of the block size, and (3) replaces the loss
with the two-stream one.
"""

from __future__ import annotations

import copy
import json
import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from accelerate.utils import is_peft_model
from datasets import Dataset
from transformers import AutoTokenizer, DynamicCache, PreTrainedTokenizerBase
from trl import SFTTrainer

from mars_hf.models.mask_token import add_mask_token, set_mars_config, suppress_mask_token
from mars_hf.training.attention_mask import (
    build_mars_inputs,
    check_attn_implementation,
    dense_mars_mask,
    mars_attention_mask,
)
from mars_hf.training.config import MARSConfig

logger = logging.getLogger(__name__)

# Parameter-name markers of what a mask-gated adapter trains (LoRA factors, PEFT's trainable-token rows).
_GATED_TRAINABLE = ("lora_A", "lora_B", "trainable_tokens_delta")

# Largest chat-template tail (e.g. "\n" after "<|im_end|>") still treated as part of a real end.
_MAX_TEMPLATE_TAIL = 4


def _chat_template_eos_tail(tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """Token ids a chat template puts after the assistant turn's EOS (SmolLM2/ChatML: the newline)."""
    if not getattr(tokenizer, "chat_template", None) or tokenizer.eos_token_id is None:
        return ()
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hi"}]
    try:
        ids = tokenizer.apply_chat_template(messages, tokenize=True)
    except Exception:  # a template that needs more than two plain messages: no tail known
        return ()
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    ids = list(ids)
    if tokenizer.eos_token_id not in ids:
        return ()
    last = len(ids) - 1 - ids[::-1].index(tokenizer.eos_token_id)
    tail = tuple(ids[last + 1 :])
    return tail if len(tail) <= _MAX_TEMPLATE_TAIL else ()


@dataclass
class MARSDataCollator:
    """Wrap a collator: pad each example that really ends with EOS to a multiple of ``block_size``.

    The padding tokens are EOS and *supervised* (MARS_SPEC §1.5: the masks learn to predict EOS past
    the end). "Really ends" means the last token is EOS, optionally followed by the chat template's tail
    (``eos_tail_ids``, e.g. the newline after ``<|im_end|>``); an example cut at ``max_length`` does
    not, so it never learns a false end. Padding is added before ``collator`` pads the batch, so it is
    real (attention mask 1) and distinct from batch padding even when pad id == EOS id.
    """

    collator: Any
    block_size: int
    eos_token_id: int
    eos_tail_ids: tuple[int, ...] = ()
    pad_to_block_with_eos: bool = True

    def ends_with_eos(self, input_ids: list[int]) -> bool:
        if input_ids and input_ids[-1] == self.eos_token_id:
            return True
        tail = list(self.eos_tail_ids)
        n = len(tail)
        return (
            bool(n)
            and len(input_ids) > n
            and input_ids[-n:] == tail
            and input_ids[-n - 1] == self.eos_token_id
        )

    def pad_example(self, example: dict[str, Any]) -> dict[str, Any]:
        input_ids = list(example["input_ids"])
        extra = -len(input_ids) % self.block_size
        if not extra or not self.ends_with_eos(input_ids):
            return example
        labels = list(example.get("labels", input_ids))
        example = dict(example)
        example["input_ids"] = input_ids + [self.eos_token_id] * extra
        example["labels"] = labels + [self.eos_token_id] * extra
        if "seq_lengths" in example:  # pragma: no cover - packing is refused by MARSConfig
            raise ValueError("MARSDataCollator cannot pad packed examples.")
        return example

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        if self.pad_to_block_with_eos:
            examples = [self.pad_example(example) for example in examples]
        return self.collator(examples)


def _has_supervised_target(dataset, limit: int | None = None) -> bool:
    """True if some example has a supervised label at position >= 1 (a MARS target)."""
    for index, example in enumerate(dataset):
        if limit is not None and index >= limit:
            return True  # an iterable dataset: cannot look at everything, trust the rest
        labels = example.get("labels", example.get("input_ids"))
        if labels is not None and any(label != -100 for label in list(labels)[1:]):
            return True
    return False


# ---- Dataset screening: rows that can teach MARS nothing are counted, reported and dropped before training.
# Each reason is a phrase completing "N rows ...".
_EMPTY_COMPLETION = "with an empty completion"
_NO_ASSISTANT_TURN = "with no assistant turn"
_EMPTY_ASSISTANT_TURN = "whose assistant turns are all empty"
_EMPTY_TEXT = "with empty text"
_NO_TARGET = "with no supervised token past the first position"


def _blank(content) -> bool:
    """Whether a message content (a string or a list of typed parts) holds no text and nothing else."""
    if content is None:
        return True
    if isinstance(content, str):
        return not content.strip()
    if isinstance(content, (list, tuple)):
        return all(
            isinstance(part, dict) and part.get("type", "text") == "text" and not str(part.get("text") or "").strip()
            for part in content
        )
    return False


def _blank_message(message) -> bool:
    return not isinstance(message, dict) or (_blank(message.get("content")) and not message.get("tool_calls"))


def _raw_row_problem(example: dict, text_field: str) -> str | None:
    """Why an untokenized row (prompt/completion, messages or text) can teach MARS nothing, or None."""
    if "prompt" in example and "completion" in example:
        completion = example["completion"]
        if isinstance(completion, str):
            return _EMPTY_COMPLETION if not completion.strip() else None
        if completion is None or (isinstance(completion, list) and all(_blank_message(m) for m in completion)):
            return _EMPTY_COMPLETION
        return None
    if "messages" in example:
        assistant = [m for m in example["messages"] or [] if isinstance(m, dict) and m.get("role") == "assistant"]
        if not assistant:
            return _NO_ASSISTANT_TURN
        return _EMPTY_ASSISTANT_TURN if all(_blank_message(m) for m in assistant) else None
    text = example.get(text_field)
    return _EMPTY_TEXT if isinstance(text, str) and not text.strip() else None


def _column_rows(dataset, columns: list[str]):
    """The rows of a `datasets.Dataset` restricted to ``columns``, read column-wise (much faster than by row)."""
    return (dict(zip(columns, values)) for values in zip(*(dataset[column] for column in columns)))


def _describe(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {reason}" for reason, n in counts.items())


def _check_not_empty(split: str, dataset) -> None:
    """Refuse an empty dataset before TRL reads its first row (which raises a bare StopIteration)."""
    if hasattr(dataset, "__len__"):
        empty = len(dataset) == 0
    else:
        empty = next(iter(dataset), None) is None
    if empty:
        raise ValueError(
            f"The {split} dataset is empty (0 rows): MARS has nothing to learn from. Pass a dataset with at least "
            "one example (columns 'messages', 'prompt'/'completion', 'text', or tokenized 'input_ids')."
        )


def _refuse_if_nothing_left(split: str, total: int, counts: dict[str, int], max_length: int | None) -> None:
    if total == 0 or sum(counts.values()) < total:
        return
    raise ValueError(
        f"The {split} dataset has no row MARS can learn from: of its {total} rows, {_describe(counts)}. A row "
        "teaches MARS only through a supervised token past its first position. Check that completions and "
        "assistant turns are not empty, `completion_only_loss` / "
        "`assistant_only_loss` (an assistant-only loss needs a chat template with {% generation %} markers), "
        f"that `max_length` ({max_length}) does not cut every response away, and that a provided 'labels' "
        "column is not all -100."
    )


def _screen_raw(split: str, dataset, text_field: str, formatting_func) -> tuple[Any, int | None, dict[str, int]]:
    """Refuse an empty dataset; count and drop untokenized rows with nothing to supervise (before TRL sees them).

    Returns the dataset to hand to TRL, its row count as given (None when unsized) and the drop counts.
    """
    _check_not_empty(split, dataset)
    total = len(dataset) if hasattr(dataset, "__len__") else None
    if not isinstance(dataset, Dataset) or formatting_func is not None:
        return dataset, total, {}
    columns = [c for c in ("prompt", "completion", "messages", text_field) if c in dataset.column_names]
    if "input_ids" in dataset.column_names or not columns:
        return dataset, total, {}
    problems = [_raw_row_problem(row, text_field) for row in _column_rows(dataset, columns)]
    counts = Counter(problem for problem in problems if problem)
    if counts:
        dataset = dataset.select([i for i, problem in enumerate(problems) if problem is None])
    return dataset, total, dict(counts)


def _warn_dropped(split: str, total: int, counts: dict[str, int]) -> None:
    dropped = sum(counts.values())
    if dropped:
        logger.warning(
            "MARSTrainer dropped %d of %d %s rows that MARS cannot learn from: %s; %d remain.",
            dropped,
            total,
            split,
            _describe(counts),
            total - dropped,
        )


class _FrozenPrefixCache(DynamicCache):
    """The clean stream's keys/values; once ``frozen``, ``update`` returns prefix + new states without storing.

    Stateless reads make the noisy pass safe to recompute (gradient checkpointing) and let the clean
    keys/values be shared by every noisy query exactly as in the two-stream forward.
    """

    frozen = False

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if not self.frozen:
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        layer = self.layers[layer_idx]
        return torch.cat([layer.keys, key_states], dim=-2), torch.cat([layer.values, value_states], dim=-2)


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
    and returns MARS_SPEC §1.4's loss; it logs `mars/noisy_loss` and `mars/clean_loss` (per target).
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
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path or "model"
            args = MARSConfig(f"{str(name).rstrip('/').split('/')[-1]}-MARS")
        elif not isinstance(args, MARSConfig):
            raise TypeError(
                f"MARSTrainer needs a `MARSConfig` (it carries block_size, ar_weight, ...), got "
                f"{type(args).__name__}. Build one with `MARSConfig(output_dir=..., block_size=4, ...)`."
            )
        if isinstance(model, str):
            from trl.trainer.utils import create_model_from_path

            init_kwargs = dict(args.model_init_kwargs or {})
            init_kwargs.setdefault("trust_remote_code", args.trust_remote_code)
            init_kwargs.setdefault("attn_implementation", "sdpa")
            if processing_class is None:
                processing_class = AutoTokenizer.from_pretrained(
                    model, revision=init_kwargs.get("revision"), trust_remote_code=args.trust_remote_code
                )
            model = create_model_from_path(model, **init_kwargs)
            args.model_init_kwargs = None  # consumed here
        if processing_class is None:
            raise ValueError(
                "Pass `processing_class=tokenizer`: MARS needs it to add or find the mask token."
            )
        if is_peft_model(model) and peft_config is None:
            base = model.get_base_model()
        else:
            base = model
        check_attn_implementation(base)

        # Mask token and config.mars (before PEFT so that a resized embedding is the adapter's base).
        tokenizer = getattr(processing_class, "tokenizer", processing_class)
        if is_peft_model(model) and peft_config is None:
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
        self.mask_token_id = mask_token_id

        if peft_config is not None and hasattr(peft_config, "trainable_token_indices"):
            indices = peft_config.trainable_token_indices
            if indices is None:
                peft_config.trainable_token_indices = [mask_token_id]
            elif isinstance(indices, dict):
                name = next(iter(indices)) if len(indices) == 1 else "embed_tokens"
                if mask_token_id not in indices.setdefault(name, []):
                    indices[name].append(mask_token_id)
            elif mask_token_id not in indices:
                peft_config.trainable_token_indices = [*indices, mask_token_id]
        elif peft_config is not None:
            logger.warning(
                "%s has no `trainable_token_indices`: the mask token's embedding row stays frozen. Use a "
                "LoraConfig (or add the embedding to `modules_to_save`) so the mask token can learn.",
                type(peft_config).__name__,
            )

        if args.adapter_gating == "mask" and peft_config is None and not is_peft_model(model):
            raise ValueError(
                "adapter_gating='mask' gates a LoRA adapter: pass `peft_config=LoraConfig(...)` (or a PEFT model)."
            )
        # Before TRL: it reads the first row of each dataset (StopIteration on an empty one) and would
        # silently train on empty completions and chats without an assistant turn.
        screened = {}
        formatting_func = kwargs.get("formatting_func")
        if train_dataset is not None:
            train_dataset, *screened["train"] = _screen_raw(
                "train", train_dataset, args.dataset_text_field, formatting_func
            )
        if isinstance(eval_dataset, dict):
            eval_dataset = dict(eval_dataset)
            for name in eval_dataset:
                eval_dataset[name], *screened[name] = _screen_raw(
                    name, eval_dataset[name], args.dataset_text_field, formatting_func
                )
        elif eval_dataset is not None:
            eval_dataset, *screened["eval"] = _screen_raw(
                "eval", eval_dataset, args.dataset_text_field, formatting_func
            )
        for split, (total, counts) in screened.items():
            _refuse_if_nothing_left(split, total or 0, counts, args.max_length)
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
            from mars_hf.decoding.gated_lora import gate_peft_model

            layers = gate_peft_model(self.model, mask_token_id)
            logger.info("Gated %d LoRA layers to mask positions (MARS_SPEC §7).", layers)
        self._mask_row_only = False
        self._frozen_clean_checked = False

        if self.args.pad_to_block_with_eos:
            if self._tokenizer.eos_token_id is None:
                raise ValueError(
                    "pad_to_block_with_eos=True needs a tokenizer with an EOS token; set one or disable it."
                )
            self.data_collator = MARSDataCollator(
                collator=self.data_collator,
                block_size=self.args.block_size,
                eos_token_id=int(self._tokenizer.eos_token_id),
                eos_tail_ids=_chat_template_eos_tail(self._tokenizer),
            )

        self._screen_prepared(screened)

        self._base_model = None
        if self.args.clean_loss == "kl_to_base" and not is_peft_model(self.model):
            # Full fine-tuning: a frozen copy of the starting model gives the base distribution.
            base_model = copy.deepcopy(self.accelerator.unwrap_model(self.model))
            # SFTTrainer patches `forward` on the instance with a closure over the *original* model's forward;
            # a deep copy would keep calling the trained model. Fall back to the class's own forward.
            base_model.__dict__.pop("forward", None)
            self._base_model = base_model.eval().requires_grad_(False)

    def _screen_prepared(self, screened: dict[str, tuple[int | None, dict[str, int]]]) -> None:
        """Count and drop tokenized rows without a MARS target; refuse a split with none left, else warn.

        A target is a supervised label past the first position. Besides rows tokenized without one, this
        counts the rows TRL's own truncation step dropped (silently) and `messages` rows that truncation at
        ``max_length`` left with prompt tokens only (TRL keeps those: every token of a chat is supervised
        unless ``assistant_only_loss``).
        """
        prepared = {"train": self.train_dataset}
        if isinstance(self.eval_dataset, dict):
            prepared.update(self.eval_dataset)
        elif self.eval_dataset is not None:
            prepared["eval"] = self.eval_dataset
        max_length = self.args.max_length
        for split, dataset in prepared.items():
            if dataset is None:
                continue
            if not isinstance(dataset, Dataset):  # streamed: look at the first rows only
                if not _has_supervised_target(dataset, limit=1000 if not hasattr(dataset, "__len__") else None):
                    _refuse_if_nothing_left(split, 1, {_NO_TARGET: 1}, max_length)
                continue
            total, counts = screened.get(split, (len(dataset), {}))
            counts = dict(counts)
            lost = total - sum(counts.values()) - len(dataset)  # TRL drops rows truncation left fully masked
            if lost > 0:
                counts[f"cut to no supervised token by truncation at max_length={max_length}"] = lost
            problems = self._prepared_row_problems(dataset)
            for problem in problems:
                if problem:
                    counts[problem] = counts.get(problem, 0) + 1
            _refuse_if_nothing_left(split, total, counts, max_length)
            _warn_dropped(split, total, counts)
            if any(problems):
                dataset = dataset.select([i for i, problem in enumerate(problems) if problem is None])
                if split == "train":
                    self.train_dataset = dataset
                elif isinstance(self.eval_dataset, dict):
                    self.eval_dataset[split] = dataset
                else:
                    self.eval_dataset = dataset

    def _prepared_row_problems(self, dataset) -> list[str | None]:
        """Per tokenized row, why it teaches MARS nothing (no target; chat cut to its prompt), or None."""
        columns = dataset.column_names
        label_column = "labels" if "labels" in columns else "input_ids"
        check_chat = (
            "messages" in columns and self.args.max_length is not None and not self.args.assistant_only_loss
        )
        extra = [c for c in ("messages", "tools", "chat_template_kwargs") if check_chat and c in columns]
        problems = []
        for row in _column_rows(dataset, [label_column, *extra]):
            labels = list(row[label_column] or [])
            if not any(label != -100 for label in labels[1:]):
                problems.append(_NO_TARGET)
            elif check_chat and len(labels) >= self.args.max_length and self._assistant_cut_away(row):
                problems.append(f"cut to prompt tokens only by truncation at max_length={self.args.max_length}")
            else:
                problems.append(None)
        return problems

    def _assistant_cut_away(self, row: dict) -> bool:
        """Whether truncation at ``max_length`` removed every assistant token of a `messages` row."""
        messages = row["messages"]
        roles = [message.get("role") for message in messages]
        if "assistant" not in roles:
            return False
        tools = row.get("tools")
        kwargs = {
            "chat_template": getattr(self, "chat_template", None),
            "tools": json.loads(tools) if isinstance(tools, str) else tools,
            **(row.get("chat_template_kwargs") or {}),
        }

        def length(part, add_generation_prompt=False):
            if not part:
                return 0
            out = self.processing_class.apply_chat_template(
                part, tokenize=True, return_dict=True, add_generation_prompt=add_generation_prompt, **kwargs
            )
            return len(out["input_ids"])

        max_length = self.args.max_length
        if self.args.truncation_mode == "keep_end":  # the kept window starts at total - max_length
            last = len(roles) - 1 - roles[::-1].index("assistant")
            return length(messages) - max_length >= length(messages[: last + 1])
        return length(messages[: roles.index("assistant")], add_generation_prompt=True) >= max_length

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
            import os

            from mars_hf.hub.save import save_mask_rows
            from mars_hf.models.modeling import MARS_ADAPTER_CONFIG_FILE, MARS_MASK_ROWS_FILE

            output_dir = output_dir if output_dir is not None else self.args.output_dir
            mars = dict(unwrapped.get_base_model().config.mars)
            with open(os.path.join(output_dir, MARS_ADAPTER_CONFIG_FILE), "w") as handle:
                handle.write(json.dumps(mars, indent=2, sort_keys=True) + "\n")
            save_mask_rows(unwrapped, self.mask_token_id, Path(output_dir) / MARS_MASK_ROWS_FILE)

    # ----------------------------------------------------------------------------------------------
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
        """MARS_SPEC §1.4: ``(Σ noisy CE + ar_weight · Σ clean term) / N`` on an already-collated batch."""
        mode = "train" if self.model.training else "eval"
        unwrapped = self.accelerator.unwrap_model(self.model)
        attn_implementation = check_attn_implementation(unwrapped)
        input_ids = inputs["input_ids"]
        mars = build_mars_inputs(
            input_ids,
            inputs.get("attention_mask"),
            inputs.get("labels"),
            block_size=self.args.block_size,
            mask_token_id=self.mask_token_id,
            drop_target_free_blocks=self.args.drop_target_free_blocks,
        )
        dtype = unwrapped.get_input_embeddings().weight.dtype
        if self._use_frozen_clean(attn_implementation):
            return self._frozen_clean_loss(
                model,
                unwrapped,
                inputs,
                mars,
                attn_implementation,
                dtype,
                mode,
                num_items_in_batch,
                return_outputs,
            )
        attention_mask = mars_attention_mask(mars, attn_implementation, dtype=dtype)
        # Only columns holding a target in some row go through the LM head.
        has_target = mars.shift_labels != -100
        keep = has_target.any(0).nonzero().flatten()
        if keep.numel() == 0:  # no targets: keep one column so the zero loss still has a graph
            keep = torch.zeros(1, dtype=torch.long, device=input_ids.device)
        length = mars.clean_length
        clean_cols = keep < length
        clean_keep = keep[clean_cols]
        base_logits = None
        if self.args.clean_loss == "kl_to_base" and clean_keep.numel():
            # Before the model's forward: a forward in between would change what a mask gate recorded,
            # which gradient checkpointing's recompute reads again in backward.
            base_logits = self._base_clean_logits(
                model, mars.input_ids[:, :length], mars.valid[:, :length], clean_keep
            )
        outputs = model(
            input_ids=mars.input_ids,
            attention_mask=attention_mask,
            position_ids=mars.position_ids,
            logits_to_keep=keep,
            use_cache=False,
        )
        logits = outputs.logits
        compute_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        logits = logits.to(compute_dtype)
        targets = mars.shift_labels[:, keep]
        noisy = mars.is_noisy[:, keep]
        is_target = targets != -100
        ce = F.cross_entropy(
            logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="none"
        ).view_as(targets)
        noisy_sum = ce[noisy].sum()
        clean_ce_sum = ce[~noisy].sum()
        clean_term = clean_ce_sum
        kl_sum = None
        if self.args.clean_loss == "kl_to_base":
            if base_logits is not None:
                base_logp = base_logits.to(compute_dtype).log_softmax(-1)
                model_logp = logits[:, clean_cols].log_softmax(-1)
                kl = (base_logp.exp() * (base_logp - model_logp)).sum(-1)
                kl_sum = kl[is_target[:, clean_cols]].sum()
            else:
                kl_sum = logits.sum() * 0.0
            clean_term = kl_sum

        num_targets = mars.num_targets
        denominator = num_items_in_batch if num_items_in_batch is not None else num_targets
        denominator = torch.as_tensor(denominator, device=logits.device).clamp(min=1)
        loss = (noisy_sum + self.args.ar_weight * clean_term) / denominator
        # Like SFTTrainer: num_items_in_batch counts every rank's tokens and DDP averages the gradients.
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * (self.accelerator.num_processes // self.get_tp_size())

        with torch.no_grad():
            correct = (logits.argmax(-1) == targets) & is_target
        self._log_mars_metrics(
            mode,
            inputs,
            num_targets,
            noisy_sum,
            (correct & noisy).sum(),
            clean_ce_sum,
            (correct & ~noisy).sum(),
            kl_sum,
        )
        if return_outputs:
            return loss, outputs
        return loss

    def _frozen_clean_loss(
        self,
        model,
        unwrapped,
        inputs,
        mars,
        attn_implementation,
        dtype,
        mode,
        num_items_in_batch,
        return_outputs,
    ):
        """The same loss as the two-stream forward, with the clean stream computed without autograd.

        Clean queries never attend to noisy keys (§1.2), so the clean half of the two-stream forward is
        a plain causal forward: run it under ``no_grad`` with a cache, then run the noisy half alone,
        attending to the cached clean keys/values through the noisy rows of the same mask. Nothing
        trainable touches the clean stream, so its gradient contribution is zero either way.
        """
        length = mars.clean_length
        allowed = dense_mars_mask(mars)
        if attn_implementation == "sdpa":
            clean_mask, noisy_mask = allowed[:, :, :length, :length], allowed[:, :, length:, :]
        else:
            additive = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
                ~allowed, torch.finfo(dtype).min
            )
            clean_mask, noisy_mask = additive[:, :, :length, :length], additive[:, :, length:, :]
        targets_all = mars.shift_labels
        clean_targets, noisy_targets_all = targets_all[:, :length], targets_all[:, length:]
        soft = self.args.mask_targets == "soft"
        need_clean_logits = soft or self.args.ar_weight > 0
        clean_keep = (clean_targets != -100).any(0).nonzero().flatten()
        noisy_keep = (noisy_targets_all != -100).any(0).nonzero().flatten()
        if noisy_keep.numel() == 0:
            noisy_keep = torch.zeros(1, dtype=torch.long, device=targets_all.device)
        cache = _FrozenPrefixCache(config=unwrapped.config)
        with torch.no_grad():
            clean_out = model(
                input_ids=mars.input_ids[:, :length],
                attention_mask=clean_mask,
                position_ids=mars.position_ids[:, :length],
                cache=cache,
                use_cache=True,
                logits_to_keep=clean_keep if need_clean_logits and clean_keep.numel() else 1,
            )
        cache.frozen = True
        # The noisy pass only reads the cache, so gradient checkpointing may keep it (its recompute reads
        # the same clean keys/values); transformers drops caches of checkpointed layers otherwise.
        layers = [m for m in unwrapped.modules() if hasattr(m, "_can_checkpoint_with_cache")]
        for layer in layers:
            layer._can_checkpoint_with_cache = True
        try:
            outputs = model(
                input_ids=mars.input_ids[:, length:],
                attention_mask=noisy_mask,
                position_ids=mars.position_ids[:, length:],
                cache=cache,
                use_cache=True,
                logits_to_keep=noisy_keep,
            )
        finally:
            for layer in layers:
                del layer._can_checkpoint_with_cache
        logits = outputs.logits
        compute_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        logits = logits.to(compute_dtype)
        targets = noisy_targets_all[:, noisy_keep]
        is_target = targets != -100
        log_probs = logits.log_softmax(-1)
        if soft:
            # The base distribution at clean position p is the soft target of every noisy slot at p.
            base_logp = clean_out.logits.to(compute_dtype).log_softmax(-1)
            column = torch.full((length,), -1, dtype=torch.long, device=logits.device)
            column[clean_keep] = torch.arange(clean_keep.numel(), device=logits.device)
            positions = mars.position_ids[:, length:][:, noisy_keep]
            index = column[positions].clamp(min=0)
            target_logp = base_logp.gather(1, index[..., None].expand(-1, -1, base_logp.shape[-1]))
            per_target = -(target_logp.exp() * log_probs).sum(-1)
        else:
            per_target = -log_probs.gather(-1, targets.clamp(min=0)[..., None])[..., 0]
        noisy_sum = per_target[is_target].sum()
        clean_ce_sum = None
        clean_correct = None
        if need_clean_logits and clean_keep.numel():
            clean_logits = clean_out.logits.to(compute_dtype)
            kept_targets = clean_targets[:, clean_keep]
            clean_ce_sum = F.cross_entropy(
                clean_logits.flatten(0, 1), kept_targets.flatten(), ignore_index=-100, reduction="sum"
            )
            clean_correct = ((clean_logits.argmax(-1) == kept_targets) & (kept_targets != -100)).sum()
        num_targets = mars.num_targets
        denominator = num_items_in_batch if num_items_in_batch is not None else num_targets
        denominator = torch.as_tensor(denominator, device=logits.device).clamp(min=1)
        clean_term = clean_ce_sum if clean_ce_sum is not None else 0.0
        if self.args.clean_loss == "kl_to_base" and clean_ce_sum is not None:
            clean_term = clean_ce_sum * 0.0  # the clean stream *is* the base model: KL(base || model) = 0
        loss = (noisy_sum + self.args.ar_weight * clean_term) / denominator
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * (self.accelerator.num_processes // self.get_tp_size())
        with torch.no_grad():
            noisy_correct = ((logits.argmax(-1) == targets) & is_target).sum()
        kl_sum = logits.new_zeros(()) if self.args.clean_loss == "kl_to_base" else None
        self._log_mars_metrics(
            mode, inputs, num_targets, noisy_sum, noisy_correct, clean_ce_sum, clean_correct, kl_sum
        )
        if return_outputs:
            return loss, outputs
        return loss

    @torch.no_grad()
    def _log_mars_metrics(
        self, mode, inputs, num_targets, noisy_sum, noisy_correct, clean_sum, clean_correct, kl_sum
    ):
        zero = noisy_sum.new_zeros((), dtype=torch.float64)
        stats = torch.stack(
            [
                noisy_sum.detach().to(torch.float64),
                clean_sum.detach().to(torch.float64) if clean_sum is not None else zero,
                torch.as_tensor(num_targets, device=zero.device).to(torch.float64),
                noisy_correct.to(torch.float64),
                clean_correct.to(torch.float64) if clean_correct is not None else zero,
                (kl_sum.detach() if kl_sum is not None else zero).to(torch.float64),
            ]
        )
        # A plain all-reduce: gather_for_metrics would trim "duplicate" rows at the end of an epoch.
        stats = self.accelerator.reduce(stats, reduction="sum")
        count = max(stats[2].item(), 1.0)
        metrics = self._metrics[mode]
        metrics["mars/noisy_loss"].append(stats[0].item() / count)
        metrics["mars/noisy_accuracy"].append(stats[3].item() / count)
        if clean_sum is not None:  # the frozen-clean path skips the clean LM head when nothing needs it
            metrics["mars/clean_loss"].append(stats[1].item() / count)
            metrics["mean_token_accuracy"].append(stats[4].item() / count)
        if kl_sum is not None:
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
