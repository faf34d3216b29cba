"""`MARSBlockCache`: per-row offsets, in-place growth, no holes, and the size bound of docs/method.md §3."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache, Qwen2Config

from mars_hf.decoding.cache import BlockScheme, MARSBlockCache, MARSCacheLayer
from tests.test_generation import PROMPTS, SCHEMES, _batch, _generated, peaked_model
from tests.tiny import tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def test_rows_write_at_their_own_offsets():
    """Each row's entries land at its own offset; the returned view is every row up to the longest end."""
    torch.manual_seed(0)
    cache = MARSBlockCache(capacity=4, max_rows=3)
    reference = torch.zeros(3, 2, 64, 5, dtype=torch.float64)
    lengths = [0, 0, 0]
    for width, keep in [(6, [6, 4, 6]), (3, [1, 3, 2]), (2, [2, 0, 1]), (9, [9, 9, 9])]:
        keys = torch.randn(3, 2, width, 5, dtype=torch.float64)
        cache.begin_forward(lengths, width, torch.device("cpu"))
        k, v = cache.update(keys, keys * 2, 0)
        for r in range(3):
            reference[r, :, lengths[r] : lengths[r] + width] = keys[r]
        end = max(lengths) + width
        for r in range(3):  # the row's valid entries and the ones just written
            assert torch.equal(k[r, :, : lengths[r] + width], reference[r, :, : lengths[r] + width])
            assert torch.equal(v[r, :, : lengths[r] + width], 2 * reference[r, :, : lengths[r] + width])
        assert k.shape[2] == end
        lengths = [n + kept for n, kept in zip(lengths, keep)]
    layer = cache.layers[0]
    assert isinstance(layer, MARSCacheLayer)
    assert layer.num_allocations <= 1 + math.ceil(math.log2(layer.capacity / 4))
    # a row moved onto another's slot carries its entries
    cache.move_row(2, 0, lengths[2])
    cache.begin_forward([lengths[2], lengths[1]], 1, torch.device("cpu"))
    k, _ = cache.update(
        torch.zeros(2, 2, 1, 5, dtype=torch.float64), torch.zeros(2, 2, 1, 5, dtype=torch.float64), 0
    )
    assert torch.equal(k[0, :, : lengths[2]], reference[2, :, : lengths[2]])
    with pytest.raises(NotImplementedError, match="not cropped"):
        cache.crop(3)


def test_block_scheme_commits_c_at_a_time():
    scheme = BlockScheme(3)
    assert scheme.keep(prefilled=False, verified_fed=7) == 7  # the prompt at once
    scheme.begin_step([1, 4])
    assert not scheme.commit_step and scheme.participates(1) and not scheme.participates(4)
    assert scheme.keep(prefilled=True, verified_fed=2) == 0
    scheme.begin_step([3, 5])
    assert scheme.commit_step and scheme.participates(5) and scheme.keep(prefilled=True, verified_fed=5) == 3


def _instrument(model):
    """Record, for each forward, the cache entries it attends to and the data pointer of layer 0."""
    records = []

    def hook(module, args, kwargs):
        cache = kwargs.get("cache")
        if isinstance(cache, MARSBlockCache):
            layer = cache.layers[0]
            pointer = layer._key_buffer.data_ptr() if layer._key_buffer is not None else None
            records.append({"entries": cache._plan.end, "pointer": pointer})

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
            mars_cost_table={1: 1.0},  # no padding to a host-measured cheaper width: the bound below is exact
            return_dict_in_generate=True,
        )
    finally:
        handle.remove()
    assert len(records) == out.num_forwards > 2
    generated = int(out.accepted_counts.sum(0).max())
    # no holes: a forward attends over at most the longest row's tokens, one window of masks and the
    # CPU padding columns (docs/method.md §3's bound, without the holes a shared-length cache accumulates)
    for record in records:
        assert record["entries"] <= prompt_length + generated + window + 4
    assert len({tuple(step.tolist()) for step in out.accepted_counts}) > 1  # rows advanced unevenly
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
    "make_cache", [lambda config: MARSBlockCache(config), lambda config: MARSBlockCache()]
)
def test_user_supplied_caches_give_the_same_tokens(make_cache, tok):
    model = peaked_model("qwen3")
    encoded = _batch(tok)
    expected = model.generate(
        **encoded, max_new_tokens=14, do_sample=False, mars_threshold=0.5, mars_cache="none"
    )
    cache = make_cache(model.config)
    out = model.generate(
        **encoded,
        max_new_tokens=14,
        do_sample=False,
        mars_threshold=0.5,
        cache=cache,
        return_dict_in_generate=True,
    )
    assert torch.equal(out.sequences, expected) and out.cache is cache
    with pytest.raises(ValueError, match="empty cache"):
        model.generate(**encoded, max_new_tokens=4, mars_threshold=0.5, cache=cache)
    with pytest.raises(ValueError, match="cannot be cropped per row"):
        model.generate(**encoded, max_new_tokens=4, mars_threshold=0.5, cache=DynamicCache())


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
