"""`MARSDataCollator`: pads each example that really ends with EOS to a whole number of blocks (docs/method.md §1.5).

The padding teaches the masks to predict EOS past the end; an example cut at ``max_length`` is left as
it is so it never learns a false end.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# Largest chat-template tail (e.g. "\n" after "<|im_end|>") still treated as part of a real end.
_MAX_TEMPLATE_TAIL = 4


def chat_template_eos_tail(tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """Token ids a chat template puts after the assistant turn's EOS (SmolLM2/ChatML: the newline)."""
    if not getattr(tokenizer, "chat_template", None) or tokenizer.eos_token_id is None:
        return ()
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hi"}]
    try:
        ids = tokenizer.apply_chat_template(messages, tokenize=True)
    except Exception as error:  # a template that needs more than two plain messages: no tail known
        logger.warning(
            "The chat template does not render a plain user/assistant pair (%s: %s), so the tokens it puts "
            "after EOS are unknown: only examples whose very last token is EOS get padded to whole blocks.",
            type(error).__name__,
            error,
        )
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

    The padding tokens are EOS and *supervised* (docs/method.md §1.5: the masks learn to predict EOS past
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
