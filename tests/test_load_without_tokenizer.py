"""A MARS model saved without a tokenizer loads: ``config.mars`` holds the mask token id.

Before, ``AutoMARSModelForCausalLM.from_pretrained`` of such a folder failed inside transformers ("Couldn't
instantiate the backend tokenizer"). Now the model loads, ``load_mars_model`` returns None for the tokenizer, and
what truly needs one (decoding text prompts, calibration, evaluation, the vLLM export) says why.
"""

from __future__ import annotations

import pytest
import torch

from mars_hf import AutoMARSModelForCausalLM
from mars_hf.models.modeling import load_mars_model
from mars_hf.tools.loading import load_model_and_tokenizer
from tests.tiny import tiny_model


def test_a_model_saved_without_a_tokenizer_loads_and_decodes(tmp_path):
    model = tiny_model("llama", block_size=3)
    model.save_pretrained(tmp_path / "ckpt")  # no tokenizer beside it
    loaded = AutoMARSModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.float64)
    assert loaded.config.mars["mask_token_id"] == model.config.mars["mask_token_id"]
    assert loaded.config.mars["block_size"] == 3
    ids = torch.tensor([[5, 6, 7, 8]])
    common = dict(max_new_tokens=6, do_sample=False, pad_token_id=2)
    expected = model.generate(ids, **common)
    assert torch.equal(loaded.generate(ids, mars_threshold=1.0, **common), expected)
    again, tokenizer = load_mars_model(tmp_path / "ckpt")
    assert tokenizer is None and again.config.mars["mask_token_id"] == model.config.mars["mask_token_id"]


def test_what_needs_a_tokenizer_says_why(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path / "ckpt")
    with pytest.raises(ValueError, match=r"saved without a tokenizer, and decoding text prompts needs one"):
        load_model_and_tokenizer(str(tmp_path / "ckpt"))


def test_no_tokenizer_and_no_mask_id_in_config_mars_names_the_fix(tmp_path):
    model = tiny_model("llama")
    model.config.mars = {"block_size": 4}
    model.save_pretrained(tmp_path / "ckpt")
    with pytest.raises(ValueError, match=r"has no tokenizer and its config has no `mars.mask_token_id`"):
        AutoMARSModelForCausalLM.from_pretrained(tmp_path / "ckpt")
