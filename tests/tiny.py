"""Tiny random models and a real (word-level) tokenizer, built offline from configs.

Like transformers' own tests: no downloads. float64 so that exact token equality is meaningful.
"""

from __future__ import annotations

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

from mars_hf.models.mask_token import add_mask_token, set_mars_config
from mars_hf.tools.synthetic import word_level_chat_tokenizer

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = (
    "system user assistant the a an cat dog sat on mat is red blue green one two three four five "
    "six seven eight nine ten and or not yes no hello world print def return if else for in x y z"
).split()
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|> {{ message['role'] }} {{ message['content'] }} <|im_end|> "
    "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)
# Architectures every core test runs on (the issues ask for at least these four).
ARCHITECTURES = ["llama", "qwen2", "qwen3", "mistral"]
TINY_VOCAB = 64


def tiny_tokenizer(with_mask: bool = True) -> PreTrainedTokenizerFast:
    """A word-level tokenizer whose pad token *is* its EOS token, like SmolLM2's."""
    tokenizer = word_level_chat_tokenizer(
        SPECIAL_TOKENS + WORDS, CHAT_TEMPLATE, mask_token="<|mask|>" if with_mask else None
    )
    assert len(tokenizer) <= TINY_VOCAB
    return tokenizer


def tiny_config(arch: str = "llama", vocab_size: int = TINY_VOCAB, **overrides):
    common = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=2,
        pad_token_id=2,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    common.update(overrides)
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "qwen3":
        return Qwen3Config(head_dim=8, **common)
    if arch == "mistral":
        return MistralConfig(sliding_window=None, **common)
    raise ValueError(f"unknown tiny architecture {arch!r}")


def tiny_model(
    arch: str = "llama",
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    attn_implementation: str = "sdpa",
    block_size: int | None = 4,
    tokenizer: PreTrainedTokenizerFast | None = None,
    **config_overrides,
):
    """A random tiny causal LM; with ``block_size`` set it also carries a mask token and ``config.mars``."""
    torch.manual_seed(seed)
    config = tiny_config(arch, **config_overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    model.eval()
    if block_size is not None:
        tokenizer = tokenizer or tiny_tokenizer()
        mask_token_id = add_mask_token(model, tokenizer)
        set_mars_config(model, block_size=block_size, mask_token_id=mask_token_id)
    return model


def as_mars_class(model):
    """A copy of ``model`` built as its MARS class (``mars_class``): what a base model needs before PEFT wraps it
    for ``peft_model.generate(mars_threshold=...)`` (a PEFT model wraps a model, not a ``MARSModel``)."""
    from mars_hf.decoding.generation import mars_class

    copy = mars_class(type(model))(model.config).to(model.dtype).eval()
    copy.load_state_dict(model.state_dict())
    copy.generation_config = model.generation_config
    return copy
