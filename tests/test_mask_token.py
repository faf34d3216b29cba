import pytest
import torch

from mars_hf.mask_token import add_mask_token, get_mars_config, set_mars_config
from tests.tiny import tiny_model, tiny_tokenizer


def test_reuses_existing_mask_token():
    tokenizer = tiny_tokenizer(with_mask=True)
    model = tiny_model(block_size=None)
    before = len(tokenizer)
    assert add_mask_token(model, tokenizer) == tokenizer.convert_tokens_to_ids("<|mask|>")
    assert len(tokenizer) == before


def test_adds_mask_token_without_resizing_when_rows_are_spare():
    tokenizer = tiny_tokenizer(with_mask=False)
    model = tiny_model(block_size=None)
    rows = model.get_input_embeddings().weight.shape[0]
    mask_id = add_mask_token(model, tokenizer)
    assert tokenizer.mask_token == "<|mask|>" and mask_id == len(tokenizer) - 1
    assert model.get_input_embeddings().weight.shape[0] == rows


def test_resizes_and_initialises_new_row_to_mean():
    tokenizer = tiny_tokenizer(with_mask=False)
    model = tiny_model(block_size=None, vocab_size=len(tokenizer))
    old = model.get_input_embeddings().weight.detach().clone()
    mask_id = add_mask_token(model, tokenizer)
    weight = model.get_input_embeddings().weight
    assert weight.shape[0] == len(tokenizer) == old.shape[0] + 1
    torch.testing.assert_close(weight[mask_id], old.mean(0))
    torch.testing.assert_close(weight[: old.shape[0]], old)
    out = model.get_output_embeddings().weight
    assert out.shape[0] == len(tokenizer)


def test_mars_config_roundtrip_and_errors(tmp_path):
    model = tiny_model(block_size=None)
    with pytest.raises(ValueError, match="config.mars"):
        get_mars_config(model)
    with pytest.raises(ValueError, match="block_size"):
        set_mars_config(model, block_size=0, mask_token_id=3)
    set_mars_config(model, block_size=8, mask_token_id=5)
    model.save_pretrained(tmp_path)
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert get_mars_config(reloaded)["block_size"] == 8
    assert get_mars_config(reloaded)["mask_token_id"] == 5
