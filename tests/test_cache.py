"""`MARSBlockCache`: in-place growth, O(1) discard, per-row holes, and the size bound of MARS_SPEC §3."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache, Qwen2Config
from transformers.cache_utils import DynamicLayer

from mars_hf.cache import MARSBlockCache, MARSCacheLayer, MARSRowState
from tests.test_generation import PROMPTS, SCHEMES, _batch, _generated, peaked_model
from tests.tiny import tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def test_layer_matches_dynamic_layer_through_updates_and_crops():
    torch.manual_seed(0)
    ours, stock = MARSCacheLayer(capacity=4), DynamicLayer()
    for new, crop in [(5, 0), (3, -2), (7, -7), (1, 0), (6, -3), (9, -1)]:
        keys, values = (
            torch.randn(2, 3, new, 8, dtype=torch.float64),
            torch.randn(2, 3, new, 8, dtype=torch.float64),
        )
        k1, v1 = ours.update(keys, values)
        k2, v2 = stock.update(keys, values)
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
        ours.crop(crop)
        stock.crop(crop)
        assert ours.get_seq_length() == stock.get_seq_length()
        assert torch.equal(ours.keys, stock.keys)
    assert ours.num_allocations <= 1 + math.ceil(math.log2(40 / 4))


def test_row_state_positions_follow_real_tokens():
    rows = MARSRowState(batch_size=2, device=torch.device("cpu"))
    # prompt: row 0 left-padded by two
    mask, positions = rows.stage(4, torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]], dtype=torch.bool))
    assert positions.tolist() == [[0, 0, 0, 1], [0, 1, 2, 3]]
    rows.commit(4)
    # a chunk [tokens ; hole ; 2 masks]: row 0 fed 1 token (a hole), row 1 fed 2
    valid = torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    mask, positions = rows.stage(4, valid)
    assert positions.tolist() == [[2, 2, 3, 4], [4, 5, 6, 7]]
    assert mask.tolist() == [[0, 0, 1, 1, 1, 0, 1, 1], [1] * 8]
    rows.commit(2)  # keep the real columns, drop the two masks
    assert rows.real_counts.tolist() == [3, 6] and rows.committed == 6
    mask, positions = rows.stage(1)
    assert positions.tolist() == [[3], [6]] and mask.shape == (2, 7)


def _instrument(model):
    """Record, for each forward, the cache entries it attends to and the data pointer of layer 0."""
    records = []

    def hook(module, args, kwargs):
        cache = kwargs.get("cache")
        if isinstance(cache, MARSBlockCache):
            layer = cache.layers[0]
            pointer = layer._key_buffer.data_ptr() if layer._key_buffer is not None else None
            records.append(
                {
                    "entries": cache.get_seq_length() + kwargs["input_ids"].shape[1],
                    "mask": kwargs.get("attention_mask"),
                    "pointer": pointer,
                }
            )

    return records, model.register_forward_pre_hook(hook, with_kwargs=True)


@pytest.mark.parametrize("scheme", ["cursor", "block"])
@pytest.mark.parametrize("window", [2, 4])
def test_cache_size_bound_and_no_per_step_copy(scheme, window, tok):
    model = peaked_model("llama")
    encoded = _batch(tok)
    prompt_length = encoded.input_ids.shape[1]
    records, handle = _instrument(model)
    try:
        out = model.generate(
            **encoded,
            max_new_tokens=20,
            do_sample=False,
            mars_threshold=0.6,
            mars_block_size=window,
            mars_cache=scheme,
            mars_cache_block=3,
            return_dict_in_generate=True,
        )
    finally:
        handle.remove()
    assert len(records) == out.num_forwards > 2
    generated = int(out.accepted_counts.sum(0).max())
    holes_seen = 0
    for record in records:
        if record["mask"] is not None:
            # holes: hidden columns after the (left-padded) prompt, for the row with most of them
            holes_seen = max(holes_seen, int((record["mask"][:, prompt_length:] == 0).sum(1).max()))
        assert record["entries"] <= prompt_length + generated + holes_seen + window
    if scheme == "cursor":
        assert holes_seen > 0, "rows must accept different counts for this test to mean anything"
    # one buffer per layer, allocated once and written in place: no per-step copy or reallocation
    cache = out.cache
    assert isinstance(cache, MARSBlockCache)
    layers = model.config.num_hidden_layers
    pointers = [r["pointer"] for r in records[1:]]
    changes = sum(a != b for a, b in zip(pointers, pointers[1:]))
    growths = cache.num_allocations // layers - 1
    assert changes == growths <= (1 if scheme == "cursor" else 0)
    if growths == 0:
        assert cache.num_copied_entries == 0


def test_buffer_grows_geometrically(tok):
    model = peaked_model("qwen2")
    encoded = _batch(tok)
    cache = MARSBlockCache(model.config, capacity=4)
    out = model.generate(
        **encoded,
        max_new_tokens=24,
        do_sample=False,
        mars_threshold=0.6,
        cache=cache,
        return_dict_in_generate=True,
    )
    assert out.cache is cache and out.num_forwards > 4
    final = cache.layers[0].capacity
    growths = cache.num_allocations // model.config.num_hidden_layers
    assert growths <= 1 + math.ceil(math.log2(final / 4))
    assert growths < out.num_forwards  # never once per step


@pytest.mark.parametrize(
    "make_cache",
    [lambda config: MARSBlockCache(config), lambda config: MARSBlockCache(), lambda config: DynamicCache()],
)
def test_user_supplied_caches_give_the_same_tokens(make_cache, tok):
    model = peaked_model("qwen3")
    encoded = _batch(tok)
    expected = model.generate(
        **encoded, max_new_tokens=14, do_sample=False, mars_threshold=0.5, mars_cache="none"
    )
    out = model.generate(
        **encoded, max_new_tokens=14, do_sample=False, mars_threshold=0.5, cache=make_cache(model.config)
    )
    assert torch.equal(out, expected)
    with pytest.raises(ValueError, match="empty cache"):
        filled = DynamicCache()
        model(**encoded, cache=filled, use_cache=True)
        model.generate(**encoded, max_new_tokens=4, mars_threshold=0.5, cache=filled)


@pytest.mark.parametrize("cache_block", [1, 2, 5, 16])
def test_block_commit_granularity_does_not_change_tokens(cache_block, tok):
    model = peaked_model("llama")
    encoded = _batch(tok)
    kwargs = dict(max_new_tokens=17, do_sample=False, mars_threshold=0.5, return_dict_in_generate=True)
    expected = model.generate(**encoded, mars_cache="none", **kwargs)
    out = model.generate(**encoded, mars_cache="block", mars_cache_block=cache_block, **kwargs)
    prompt_length = encoded.input_ids.shape[1]
    assert _generated(out, prompt_length, tok.pad_token_id, out.accepted_counts) == _generated(
        expected, prompt_length, tok.pad_token_id, expected.accepted_counts
    )
    assert len(PROMPTS) == out.sequences.shape[0] and set(SCHEMES) == {"cursor", "block", "none"}


def test_sliding_window_layers_are_rejected():
    config = Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=0,
    )
    with pytest.raises(ValueError, match="mars_cache='none'"):
        MARSBlockCache(config)
