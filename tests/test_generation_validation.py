"""Bad MARS settings are refused by name wherever they are set (keywords, a call's or the model's
GenerationConfig), and a window wider than the tokens to generate is capped, not allocated."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
import torch
from transformers import GenerationConfig

import mars_hf.decoding.generation as generation
from mars_hf.decoding.generation import enable_mars, generate
from mars_hf.decoding.settings import MARS_KEYWORDS, MAX_DRAFT_TOKENS, MARSDecodingSettings
from tests.tiny import tiny_model, tiny_tokenizer

MAX_NEW = 8


@pytest.fixture(scope="module")
def model():
    return enable_mars(tiny_model("llama", tokenizer=tiny_tokenizer()))


@pytest.fixture(scope="module")
def inputs():
    ids = torch.tensor([[2, 2, 5, 6, 7], [8, 9, 10, 11, 12]])
    return {"input_ids": ids, "attention_mask": (torch.arange(5) >= torch.tensor([[2], [0]])).long()}


def _generate(model, inputs, **kwargs):
    kwargs = {"max_new_tokens": MAX_NEW, "do_sample": False, **kwargs}
    return model.generate(**inputs, **kwargs)


@pytest.mark.parametrize(
    "tau", ["0.9", "fast", b"0.9", True, [0.9, "0.9"], torch.tensor([True, False]), {"tau": 0.9}, object()]
)
def test_threshold_that_is_not_numbers_is_refused_by_name(model, inputs, tau):
    """A string τ used to raise torch's "new(): invalid data type 'str'"; a bool was read as τ = 1."""
    with pytest.raises(TypeError, match=r"`mars_threshold` \(τ\) must be a real number"):
        _generate(model, inputs, mars_threshold=tau)
    with pytest.raises(TypeError, match=r"`mars_threshold` \(τ\) must be a real number"):
        _generate(model, inputs, generation_config=GenerationConfig(mars_threshold=tau, max_new_tokens=2))


def test_threshold_string_error_says_how_to_write_it(model, inputs):
    with pytest.raises(TypeError, match=r"write mars_threshold=0\.9, a number, not the string '0\.9'"):
        _generate(model, inputs, mars_threshold="0.9")


def test_numeric_thresholds_of_every_container_decode_alike(model, inputs):
    expected = _generate(model, inputs, mars_threshold=0.5)
    for tau in (
        np.float64(0.5),
        torch.tensor(0.5),
        [0.5, 0.5],
        (0.5, 0.5),
        torch.tensor([0.5, 0.5]),
        np.array([0.5, 0.5]),
    ):
        assert torch.equal(_generate(model, inputs, mars_threshold=tau), expected), tau


@pytest.mark.parametrize("window", ["4", "abc", float("nan"), float("inf"), True, 0, -3, 2.5, [4]])
def test_window_that_is_not_a_whole_number_is_refused_by_name(model, inputs, window):
    """'abc', NaN and inf used to surface int()'s own errors (or OverflowError); True was read as W = 1."""
    with pytest.raises(ValueError, match=r"`mars_block_size` \(the window W\) must be an integer >= 1"):
        _generate(model, inputs, mars_threshold=0.5, mars_block_size=window)


@pytest.fixture
def decoder_windows(monkeypatch):
    """The W each decoder is built with; a window past max_new_tokens fails at once (it used to run for minutes)."""
    real = generation.MARSBatchDecoder
    windows = []

    def spy(model, settings, **kwargs):
        windows.append(settings.window)
        assert settings.window <= MAX_NEW, (
            f"decoder built with W = {settings.window} for {MAX_NEW} new tokens"
        )
        return real(model, settings, **kwargs)

    monkeypatch.setattr(generation, "MARSBatchDecoder", spy)
    return windows


@pytest.mark.parametrize("settings", [{"mars_threshold": 0.0}, {"mars_acceptance": "verify"}])
def test_window_is_capped_by_max_new_tokens_and_decodes_the_same(model, inputs, decoder_windows, settings):
    """W = 10⁶ tried a 128 TB buffer and W = 5000 for 8 tokens took 35 s; capped, they decode as W = 8."""
    expected = _generate(model, inputs, mars_block_size=MAX_NEW, **settings)
    start = time.monotonic()
    for window in (MAX_NEW + 1, 5000, 10**6):
        assert torch.equal(_generate(model, inputs, mars_block_size=window, **settings), expected), window
    assert time.monotonic() - start < 600  # hang guard only
    assert decoder_windows == [MAX_NEW] * 4
    shorter = _generate(model, inputs, mars_block_size=10**6, max_new_tokens=3, **settings)
    assert torch.equal(shorter, expected[:, : inputs["input_ids"].shape[1] + 3])
    assert decoder_windows[-1] == 3


def test_model_wide_window_is_bounded_by_the_position_limit():
    """enable_mars / config.mars set W for every call (and for the server), where no max_new_tokens caps it."""
    model = tiny_model("llama", tokenizer=tiny_tokenizer())  # 256 positions
    with pytest.raises(
        ValueError,
        match=r"`block_size` \(the window W\) = 1000000 must be below the model's position limit \(256\)",
    ):
        model = enable_mars(model, block_size=10**6)
    assert "_mars_overrides" not in model.__dict__  # nothing is written into the model
    with pytest.raises(ValueError, match=r"must be below the model's position limit \(256\)"):
        model = enable_mars(model, block_size=256)
    with pytest.raises(ValueError, match=r"`block_size` \(the window W\) must be an integer >= 1"):
        model = enable_mars(model, block_size="8")
    model.config.mars["block_size"] = 4096
    with pytest.raises(ValueError, match=r"config.mars\['block_size'\]`\) = 4096 must be below"):
        model = enable_mars(model)
    model.config.mars["block_size"] = 4
    assert enable_mars(model, block_size=255).mars_settings["block_size"] == 255


@pytest.mark.parametrize(
    "config_kwargs,match",
    [
        ({"mars_acceptance": "bogus"}, r"`mars_acceptance` must be one of .*got 'bogus' \(set in the call's"),
        ({"mars_cache": "disk"}, r"`mars_cache` must be one of .*got 'disk'"),
        ({"mars_layout": "cubic"}, r"`mars_layout` must be one of .*got 'cubic'"),
        (
            {"mars_block_size": "4"},
            r"`mars_block_size` \(the window W\) \(set in the call's `generation_config`\)",
        ),
        ({"mars_cache_block": 0}, r"`mars_cache_block` \(C\)"),
        ({"mars_mask_token_id": -1}, r"`mars_mask_token_id` must be a token id"),
        ({"mars_treshold": 0.9}, r"unknown MARS settings \['mars_treshold'\]"),
        ({"mars_block_size": 4}, r"sets \['mars_block_size'\], which only apply to MARS decoding"),
        ({"mars_acceptance": "entropy"}, r"sets \['mars_acceptance'\], which only apply to MARS decoding"),
    ],
)
def test_generation_config_mars_settings_are_checked_like_keywords(model, inputs, config_kwargs, match):
    """Without τ or verify such a config used to decode stock without a word (keywords were refused)."""
    config = GenerationConfig(max_new_tokens=2, do_sample=False, **config_kwargs)
    with pytest.raises(ValueError, match=match):
        model.generate(**inputs, generation_config=config)
    with pytest.raises(ValueError, match=match):  # the custom_generate/ entry point of a checkpoint
        generate(model, **inputs, generation_config=config)


def test_models_own_generation_config_is_checked_too(inputs):
    model = enable_mars(tiny_model("llama", tokenizer=tiny_tokenizer()))
    model.generation_config.mars_acceptance = "bogus"
    with pytest.raises(ValueError, match=r"got 'bogus' \(set in the model's `generation_config`\)"):
        model.generate(**inputs, max_new_tokens=2, do_sample=False)
    # a valid model-wide default (τ given per call) is not stray
    model.generation_config.mars_acceptance = "probability"
    stock = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert torch.equal(model.generate(**inputs, max_new_tokens=4, do_sample=False, mars_threshold=1.0), stock)


def test_plain_generation_config_still_decodes_stock(model, inputs):
    config = GenerationConfig(max_new_tokens=4, do_sample=False, pad_token_id=2)
    expected = model.generate(**inputs, max_new_tokens=4, do_sample=False, pad_token_id=2)
    assert torch.equal(model.generate(**inputs, generation_config=config), expected)


def test_settings_are_resolved_once_keywords_first_then_generation_config_then_the_model():
    """One frozen object holds every MARS setting of a call; the decoder's window is capped by the
    tokens to generate, and one-token decoding under the block scheme runs as cursor decoding."""
    model = enable_mars(
        tiny_model("llama", tokenizer=tiny_tokenizer()), acceptance="entropy", cache="block", cache_block=3
    )
    unset = dict.fromkeys(MARS_KEYWORDS)
    config = GenerationConfig(mars_cache="none", mars_threshold=0.7, max_new_tokens=MAX_NEW)
    settings = MARSDecodingSettings.resolve(
        model,
        {**unset, "mars_threshold": [0.5, 2.0], "mars_block_size": 50},
        config,
        batch_size=2,
        max_new_tokens=5,
    )
    assert settings.thresholds == (0.5, 2.0)  # the keyword, not the config's 0.7; entropy allows τ > 1
    assert (settings.window, settings.acceptance, settings.cache, settings.cache_block) == (
        5,
        "entropy",
        "none",
        3,
    )
    assert settings.mask_token_id == model.config.mars["mask_token_id"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.window = 2
    one_token = MARSDecodingSettings.resolve(
        model,
        {**unset, "mars_threshold": 1.0, "mars_acceptance": "margin"},
        None,
        batch_size=1,
        max_new_tokens=4,
    )
    assert one_token.one_token_per_step and (one_token.cache, one_token.decoder_cache) == ("block", "cursor")
    with pytest.raises(ValueError, match=r"`mars_acceptance` must be one of .*got 'bogus'"):
        MARSDecodingSettings.resolve(
            model,
            {**unset, "mars_threshold": 0.5, "mars_acceptance": "bogus"},
            None,
            batch_size=1,
            max_new_tokens=4,
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bool])
def test_token_ids_that_are_not_integers_are_refused(model, inputs, dtype):
    """Fault 14 of issue 52: float ``input_ids`` were truncated silently (7.9 -> 7); stock ``generate``
    raises in the embedding. MARS refuses them before decoding, naming the fix; so does a row's prompt."""
    ids = inputs["input_ids"].to(dtype)
    bad = {**inputs, "input_ids": ids if dtype == torch.bool else ids + 0.9}
    for kwargs in ({"mars_threshold": 0.5}, {"mars_acceptance": "verify"}):
        with pytest.raises(TypeError, match=r"`input_ids` must hold integer token ids.*\.long\(\)"):
            _generate(model, bad, **kwargs)
    mask = model.config.mars["mask_token_id"]
    decoder = generation.MARSBatchDecoder(
        model, MARSDecodingSettings(window=4, mask_token_id=mask), max_rows=1, max_length=16, pad_token_id=2
    )
    settings = generation.RowSettings(threshold=0.5)
    with pytest.raises(TypeError, match="integer token ids"):
        decoder.add_row(torch.tensor([5.9, 7.9]), settings)
    for prompt in ([5, 7.9], [5, True], np.array([5.0, 7.0])):
        with pytest.raises(TypeError, match="must be integers"):
            decoder.add_row(prompt, settings)
    decoder.add_row(np.array([5, 7]), settings)  # integer ids of any integer type are fine


@pytest.mark.parametrize("count", [MAX_DRAFT_TOKENS + 1, 10**9])
def test_a_draft_count_past_the_limit_is_refused_by_name_before_anything_is_allocated(model, inputs, count):
    """Issue 59, fault 2: ``prompt_lookup_num_tokens=10**9`` with verify sized each row's statistics at 10**9
    entries (MemoryError, or minutes of allocation); ``num_assistant_tokens`` too. Now both are refused above
    :data:`MAX_DRAFT_TOKENS`, naming the keyword and the limit; the limit itself decodes."""
    limit = rf"`{{}}` = {count} is above the {MAX_DRAFT_TOKENS} drafts .* pass at most {MAX_DRAFT_TOKENS}"
    with pytest.raises(ValueError, match=limit.format("prompt_lookup_num_tokens")):
        _generate(model, inputs, mars_acceptance="verify", prompt_lookup_num_tokens=count)
    assistant = tiny_model("qwen2", seed=1, block_size=None)
    with pytest.raises(ValueError, match=limit.format("num_assistant_tokens")):
        _generate(model, inputs, mars_threshold=0.5, assistant_model=assistant, num_assistant_tokens=count)
    mask = model.config.mars["mask_token_id"]
    with pytest.raises(ValueError, match=limit.format("prompt_lookup_num_tokens")):  # a server's own settings
        MARSDecodingSettings(
            window=4, mask_token_id=mask, acceptance="verify", prompt_lookup_num_tokens=count
        )
    from mars_hf.decoding.decoder import RowSettings

    with pytest.raises(ValueError, match=limit.format("prompt_lookup_num_tokens")):  # a row built directly
        RowSettings(acceptance="verify", prompt_lookup_num_tokens=count)
    stock = _generate(model, inputs)
    at_limit = _generate(model, inputs, mars_acceptance="verify", prompt_lookup_num_tokens=MAX_DRAFT_TOKENS)
    assert torch.equal(at_limit, stock)


def test_sizes_past_the_models_positions_are_capped_or_refused(model, inputs):
    """Issue 59, fault 2, the other sizes: a per-call W was capped by ``max_new_tokens`` alone, so
    ``mars_block_size=10**9, max_new_tokens=10**9`` sized each row's statistics at 10**9; now also by the
    model's positions (no step feeds more masks than the positions left; a wider W decodes the same, above). A
    cache block C past the positions (a static cache is sized for it) is refused by name."""
    keywords = {**dict.fromkeys(MARS_KEYWORDS), "mars_threshold": 0.5, "mars_block_size": 10**9}
    huge = MARSDecodingSettings.resolve(model, keywords, None, batch_size=2, max_new_tokens=10**9)
    assert huge.window == 255  # the tiny model has 256 positions
    with pytest.raises(ValueError, match=r"`mars_cache_block` \(C\) = 1000000000 is above .* limit \(256\)"):
        _generate(model, inputs, mars_threshold=0.5, mars_cache="block", mars_cache_block=10**9)


@pytest.mark.parametrize("assistant_vocab", [40, 600])
def test_a_draft_model_with_another_vocabulary_is_refused_naming_the_fix(model, inputs, assistant_vocab):
    """Issue 59, fault 4: a draft model of another vocabulary raised a raw ``IndexError`` (its ids indexed past
    the target's embeddings, or the target's past its own) or drafted wrong tokens. Refused as transformers
    refuses it without ``tokenizer`` / ``assistant_tokenizer``, saying MARS has no universal assisted decoding."""
    assistant = tiny_model("qwen2", seed=1, block_size=None, vocab_size=assistant_vocab)
    for kwargs in ({"mars_threshold": 0.5}, {"mars_acceptance": "verify"}):
        with pytest.raises(
            ValueError, match=r"`assistant_model` has another vocabulary.*`assistant_tokenizer`"
        ):
            _generate(model, inputs, assistant_model=assistant, num_assistant_tokens=3, **kwargs)
    stock = _generate(model, inputs)
    same = tiny_model("qwen2", seed=1, block_size=None)  # the target's vocabulary, no mask token
    assert torch.equal(_generate(model, inputs, assistant_model=same, mars_acceptance="verify"), stock)
    # a target whose mask token was appended (a row more than the draft model's) still takes the draft model
    tokenizer = tiny_tokenizer(with_mask=False)
    base = len(tokenizer)
    grown = enable_mars(tiny_model("llama", vocab_size=base, tokenizer=tokenizer))
    draft = tiny_model("qwen2", seed=1, block_size=None, vocab_size=base)
    assert grown.get_input_embeddings().weight.shape[0] == base + 1
    ids = {"input_ids": torch.tensor([[5, 6, 7, 5, 6]])}
    assert torch.equal(
        _generate(grown, ids, assistant_model=draft, mars_acceptance="verify"), _generate(grown, ids)
    )


def test_one_dimensional_input_ids_are_refused_naming_the_shape(model, inputs):
    """Issue 59, fault 5: 1-D ``input_ids`` failed in transformers' preparation with ``IndexError: tuple index
    out of range`` (stock ``generate`` does too: it does not accept them). MARS names the shape and the fix,
    whether the ids come as ``input_ids=``, ``inputs=`` or positionally; a row's 1-D prompt stays fine."""
    row = inputs["input_ids"][1]
    with pytest.raises(IndexError):  # stock: no 1-D support to mirror
        model.generate(input_ids=row, max_new_tokens=2, do_sample=False)
    for kwargs in ({"mars_threshold": 0.5}, {"mars_acceptance": "verify"}):
        with pytest.raises(
            ValueError, match=r"input_ids must be \[batch, length\], got shape \[5\].*input_ids\[None\]"
        ):
            model.generate(input_ids=row, max_new_tokens=2, **kwargs)
        with pytest.raises(ValueError, match=r"input_ids must be \[batch, length\], got shape \[\]"):
            model.generate(row[0], max_new_tokens=2, **kwargs)
        with pytest.raises(ValueError, match=r"input_ids must be \[batch, length\], got shape \[1, 1, 5\]"):
            model.generate(inputs=row[None, None], max_new_tokens=2, **kwargs)
    assert _generate(model, {"input_ids": row[None]}, mars_threshold=0.5).shape == (1, 5 + MAX_NEW)
