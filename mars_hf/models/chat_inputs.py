"""A batch of chat prompts as ``generate`` takes them: chat template applied, left-padded.

`mars-hf generate`, the benchmark and the examples decode user prompts the same way; this is the one
definition they share (a decoder-only model continues from the last position, so padding goes left).
"""

from __future__ import annotations


def chat_inputs(tokenizer, prompts: list[str], system: str | None = None) -> dict:
    """Chat-template each prompt (after an optional system message) and left-pad them into one batch.

    The tokenizer's ``padding_side`` is switched to left only for this call, so a caller's tokenizer
    is left as it was. Returns only ``input_ids`` and ``attention_mask``."""
    texts = []
    for prompt in prompts:
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": prompt}
        ]
        texts.append(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    padding_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        encoded = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    finally:
        tokenizer.padding_side = padding_side
    return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}
