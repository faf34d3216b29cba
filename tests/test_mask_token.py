import copy

import pytest
import torch

from mars_hf.models.embedded_model import embedded_model_dir
from mars_hf.models.mask_token import (
    MASK_PLACEMENTS,
    add_mask_token,
    find_unused_special_token,
    get_mars_config,
    set_mars_config,
)
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


# ---------------------------------------------------------------------------------- placement without resizing

SMOLLM2_UNUSED = ["<repo_name>", "<reponame>", "<file_sep>", "<filename>", "<gh_stars>", "<issue_start>"]


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_model_dir())


def smollm2_shaped(tokenizer):
    """A tiny Llama with SmolLM2-135M's vocabulary shape: 49152 tied rows, exactly the tokenizer's size."""
    return tiny_model(
        "llama", block_size=None, vocab_size=49152, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2
    )


def other_rows_mean(weight, token_id):
    keep = torch.ones(weight.shape[0], dtype=torch.bool)
    keep[token_id] = False
    return weight[keep].mean(0)


def test_smollm2_has_no_spare_row_but_unused_special_tokens(smollm2_tokenizer):
    """What the issue asked to check: SmolLM2's embedding has no spare row, but ids 3-16 are reserved
    code-pretraining markers that neither the chat template nor a named special token uses."""
    assert len(smollm2_tokenizer) == 49152 == smollm2_shaped(smollm2_tokenizer).get_input_embeddings().weight.shape[0]
    assert smollm2_tokenizer.mask_token is None
    assert find_unused_special_token(smollm2_tokenizer) == "<empty_output>"
    assert smollm2_tokenizer.convert_tokens_to_ids("<empty_output>") == 16
    for token in SMOLLM2_UNUSED:  # reserved, not chosen (the highest id is), but all candidates
        assert token not in smollm2_tokenizer.chat_template and token not in smollm2_tokenizer.all_special_tokens


@pytest.mark.parametrize("placement", ["keep_vocab_size", "reuse_token"])
def test_smollm2_keeps_its_vocabulary_by_reusing_an_unused_special_token(smollm2_tokenizer, placement):
    tokenizer = copy.deepcopy(smollm2_tokenizer)
    model = smollm2_shaped(tokenizer)
    old = model.get_input_embeddings().weight.detach().clone()
    mask_id = add_mask_token(model, tokenizer, placement=placement)
    weight = model.get_input_embeddings().weight
    assert mask_id == 16 and tokenizer.mask_token == "<empty_output>" and len(tokenizer) == 49152
    assert weight.shape[0] == 49152 == model.config.vocab_size
    torch.testing.assert_close(weight[mask_id], other_rows_mean(old, mask_id))
    others = [i for i in range(49152) if i != mask_id]
    assert torch.equal(weight[others], old[others])
    assert model.config.mars["base_vocab_size"] == 49152


def test_smollm2_explicit_reuse_and_the_errors_that_name_the_fix(smollm2_tokenizer):
    tokenizer = copy.deepcopy(smollm2_tokenizer)
    model = smollm2_shaped(tokenizer)
    assert add_mask_token(model, tokenizer, "<filename>", placement="reuse_token") == 6
    with pytest.raises(ValueError, match="no spare row.*reuse_token"):
        add_mask_token(smollm2_shaped(tokenizer), copy.deepcopy(smollm2_tokenizer), placement="spare_row")
    with pytest.raises(ValueError, match="has no such token"):
        add_mask_token(smollm2_shaped(tokenizer), copy.deepcopy(smollm2_tokenizer), "<nope>", placement="reuse_token")
    with pytest.raises(ValueError, match="placement must be one of"):
        add_mask_token(model, tokenizer, placement="resize")
    # The default still grows the vocabulary, and says so in config.mars.
    grown = smollm2_shaped(tokenizer)
    assert add_mask_token(grown, copy.deepcopy(smollm2_tokenizer)) == 49152
    assert grown.get_input_embeddings().weight.shape[0] == 49153 and grown.config.mars["base_vocab_size"] == 49152


@pytest.mark.parametrize("placement", ["spare_row", "keep_vocab_size"])
def test_qwen2_shaped_spare_row(placement):
    tokenizer = tiny_tokenizer(with_mask=False)
    model = tiny_model("qwen2", block_size=None)
    old = model.get_input_embeddings().weight.detach().clone()
    old_out = model.get_output_embeddings().weight.detach().clone()
    mask_id = add_mask_token(model, tokenizer, placement=placement)
    assert mask_id == len(tokenizer) - 1 < 64 and tokenizer.mask_token == "<|mask|>"
    assert model.get_input_embeddings().weight.shape[0] == 64 == model.config.vocab_size
    torch.testing.assert_close(model.get_input_embeddings().weight[mask_id], other_rows_mean(old, mask_id))
    torch.testing.assert_close(model.get_output_embeddings().weight[mask_id], other_rows_mean(old_out, mask_id))


def test_no_unused_token_and_no_spare_row_is_refused():
    tokenizer = tiny_tokenizer(with_mask=False)  # every special token is named or in the chat template
    model = tiny_model(block_size=None, vocab_size=len(tokenizer))
    with pytest.raises(ValueError, match="no unused special token.*placement='append'"):
        add_mask_token(model, tokenizer, placement="keep_vocab_size")


def test_mars_config_field_reaches_the_trainer(tmp_path):
    from datasets import Dataset

    from mars_hf.training.config import MARSConfig
    from mars_hf.training.trainer import MARSTrainer

    with pytest.raises(ValueError, match="mask_token_placement must be one of"):
        MARSConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False, mask_token_placement="x")
    assert set(MASK_PLACEMENTS) == {"append", "spare_row", "reuse_token", "keep_vocab_size"}
    tokenizer = tiny_tokenizer(with_mask=False)
    model = tiny_model(block_size=None, vocab_size=len(tokenizer))
    ids = tokenizer("the cat sat on the mat")["input_ids"] + [tokenizer.eos_token_id]
    args = MARSConfig(
        output_dir=str(tmp_path),
        report_to="none",
        use_cpu=True,
        bf16=False,
        block_size=2,
        mask_token="z",
        mask_token_placement="reuse_token",
    )
    trainer = MARSTrainer(
        model=model, args=args, train_dataset=Dataset.from_list([{"input_ids": ids}]), processing_class=tokenizer
    )
    assert trainer.mask_token_id == tokenizer.convert_tokens_to_ids("z")
    assert model.get_input_embeddings().weight.shape[0] == len(tokenizer)
