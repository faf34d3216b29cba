"""Random Qwen2 models of real shapes (the weights are random, the shapes are the real ones) and their prompts."""

from __future__ import annotations

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from mars_hf.decoding.generation import mars_class
from mars_hf.models.mask_token import set_mars_config, suppress_mask_token

# Shapes of the Qwen2.5 family (their config.json values; the weights are random). The mask token is the
# first unused embedding row past the real tokenizer's 151665 tokens, where `add_mask_token` would put it.
MODEL_SHAPES = {
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        eos_token_id=2,
        pad_token_id=2,
        mask_token_id=511,
    ),
    "qwen2.5-0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        eos_token_id=151645,
        pad_token_id=151643,
        mask_token_id=151665,
    ),
    "qwen2.5-1.5b": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        eos_token_id=151645,
        pad_token_id=151643,
        mask_token_id=151665,
    ),
    "qwen2.5-7b": dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
        eos_token_id=151645,
        pad_token_id=151643,
        mask_token_id=151665,
    ),
}


def parameter_count(shape: str) -> int:
    """Parameters of a shape, from its config alone (what a build will allocate)."""
    values = MODEL_SHAPES[shape]
    h, i, n, v = (values[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size"))
    return n * (4 * h * h + 3 * h * i) + v * h * (1 if values["tie_word_embeddings"] else 2)


def build_model(shape: str, *, dtype: torch.dtype, device, seed: int, attn_implementation: str = "sdpa"):
    """A random Qwen2 model of the named shape on ``device`` with a mask token and ``config.mars``."""
    if shape not in MODEL_SHAPES:
        raise ValueError(f"Unknown model shape {shape!r}; choose from {list(MODEL_SHAPES)}.")
    values = dict(MODEL_SHAPES[shape])
    mask_token_id = values.pop("mask_token_id")
    config = Qwen2Config(bos_token_id=None, use_sliding_window=False, **values)
    torch.manual_seed(seed)
    with torch.device(device):  # built as its MARS class: generate(mars_threshold=...) decodes with MARS
        model = mars_class(Qwen2ForCausalLM)._from_config(
            config, dtype=dtype, attn_implementation=attn_implementation
        )
    model.eval()
    set_mars_config(model, block_size=4, mask_token_id=mask_token_id)
    model.generation_config.eos_token_id = values["eos_token_id"]
    model.generation_config.pad_token_id = values["pad_token_id"]
    suppress_mask_token(model)  # as every MARS checkpoint does (MARSTrainer writes it)
    return model


def ordinary_token_ids(model) -> torch.Tensor:
    """Ids the forced predictions and the prompts use: every row except EOS, pad and the mask token."""
    vocab = model.get_output_embeddings().weight.shape[0]
    special = {model.config.eos_token_id, model.config.pad_token_id, model.config.mars["mask_token_id"]}
    return torch.tensor([i for i in range(3, min(vocab, 32768)) if i not in special], dtype=torch.long)


def make_prompts(model, batch: int, length: int, seed: int, device) -> dict:
    """``batch`` random prompts of ordinary tokens, left-padded; row ``i`` is ``(7 i) mod 16`` shorter
    than ``length`` so that rows sit at different positions (and so follow different forced patterns)."""
    ordinary = ordinary_token_ids(model)
    generator = torch.Generator().manual_seed(seed + 1000 + batch)
    pad = int(model.config.pad_token_id)
    input_ids = torch.full((batch, length), pad, dtype=torch.long)
    attention_mask = torch.zeros((batch, length), dtype=torch.long)
    for row in range(batch):
        n = length - (7 * row) % min(16, max(1, length // 2))
        input_ids[row, length - n :] = ordinary[torch.randint(len(ordinary), (n,), generator=generator)]
        attention_mask[row, length - n :] = 1
    return {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device)}
