"""The two-stream batch and its mask against docs/method.md §1.1-1.3, checked by brute force."""

from __future__ import annotations

import pytest
import torch

from mars_hf.training.attention_mask import (
    build_mars_inputs,
    check_attn_implementation,
    dense_mars_mask,
    mars_attention_mask,
)
from tests.tiny import tiny_model

MASK_ID = 63


def make_batch(lengths, total, prompt_lengths, seed=0, vocab=40):
    """Right-padded batch: prompts unsupervised, responses supervised, padding id 2 (== EOS)."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, vocab, (len(lengths), total), generator=generator)
    attention_mask = torch.zeros_like(input_ids)
    labels = torch.full_like(input_ids, -100)
    for row, (length, prompt) in enumerate(zip(lengths, prompt_lengths)):
        attention_mask[row, :length] = 1
        labels[row, prompt:length] = input_ids[row, prompt:length]
        input_ids[row, length:] = 2
    return input_ids, attention_mask, labels


def spec_allowed(q_half, q_pos, k_half, k_pos, block_size):
    """§1.2 table, written out case by case."""
    bq, bk = q_pos // block_size, k_pos // block_size
    if q_half == "clean" and k_half == "clean":
        return k_pos <= q_pos
    if q_half == "noisy" and k_half == "noisy":
        return bq == bk and k_pos <= q_pos
    if q_half == "noisy" and k_half == "clean":
        return bk < bq
    return False  # clean -> noisy


CASES = [
    # (block_size, lengths, total, prompt lengths)
    (1, [7, 5], 7, [2, 3]),
    (2, [9, 4, 9], 9, [3, 1, 5]),
    (3, [11, 7], 11, [4, 2]),
    (4, [13, 9, 6], 13, [5, 5, 1]),
    (5, [7, 3], 7, [1, 0]),
]


@pytest.mark.parametrize("block_size,lengths,total,prompts", CASES)
def test_full_layout_matches_spec_table(block_size, lengths, total, prompts):
    input_ids, attention_mask, labels = make_batch(lengths, total, prompts, seed=block_size)
    inputs = build_mars_inputs(
        input_ids,
        attention_mask,
        labels,
        block_size=block_size,
        mask_token_id=MASK_ID,
        drop_target_free_blocks=False,
    )
    length = total
    assert inputs.input_ids.shape == (len(lengths), 2 * length)
    mask = dense_mars_mask(inputs)
    for row, real in enumerate(lengths):
        for i in range(2 * length):
            q_half, q_pos = ("clean", i) if i < length else ("noisy", i - length)
            x = input_ids[row, q_pos].item()
            # §1.1 tokens and positions
            expected_token = MASK_ID if (q_half == "noisy" and labels[row, q_pos] != -100) else x
            assert inputs.input_ids[row, i].item() == expected_token
            assert inputs.position_ids[row, i].item() == q_pos
            # §1.3 targets: next label of the same half
            expected_target = labels[row, q_pos + 1].item() if q_pos + 1 < real else -100
            assert inputs.shift_labels[row, i].item() == expected_target
            for j in range(2 * length):
                k_half, k_pos = ("clean", j) if j < length else ("noisy", j - length)
                if q_pos >= real:  # padded query: sees only itself
                    expected = i == j
                else:
                    expected = k_pos < real and spec_allowed(q_half, q_pos, k_half, k_pos, block_size)
                assert mask[row, 0, i, j].item() == expected, (row, q_half, q_pos, k_half, k_pos)


@pytest.mark.parametrize("block_size,lengths,total,prompts", CASES)
def test_dropped_layout_keeps_exactly_target_blocks(block_size, lengths, total, prompts):
    input_ids, attention_mask, labels = make_batch(lengths, total, prompts, seed=block_size + 10)
    full = build_mars_inputs(
        input_ids,
        attention_mask,
        labels,
        block_size=block_size,
        mask_token_id=MASK_ID,
        drop_target_free_blocks=False,
    )
    dropped = build_mars_inputs(
        input_ids, attention_mask, labels, block_size=block_size, mask_token_id=MASK_ID
    )
    length = total
    mask = dense_mars_mask(dropped)
    for row in range(len(lengths)):
        noisy = range(length, dropped.input_ids.shape[1])
        slots = [j for j in noisy if dropped.valid[row, j]]
        positions = [dropped.position_ids[row, j].item() for j in slots]
        # Same noisy (token, target) per position as the full layout, for exactly the blocks with a target.
        blocks_with_target = {
            p // block_size for p in range(length) if full.shift_labels[row, length + p].item() != -100
        }
        expected_positions = [p for p in range(lengths[row]) if p // block_size in blocks_with_target]
        assert positions == expected_positions
        for j, p in zip(slots, positions):
            assert dropped.input_ids[row, j] == full.input_ids[row, length + p]
            assert dropped.shift_labels[row, j] == full.shift_labels[row, length + p]
        # The mask on the compacted layout is still the §1.2 table on (half, position).
        width = dropped.input_ids.shape[1]
        for i in range(width):
            for j in range(width):
                if not dropped.valid[row, i]:
                    expected = i == j
                else:
                    q = (
                        "noisy" if dropped.is_noisy[row, i] else "clean",
                        dropped.position_ids[row, i].item(),
                    )
                    k = (
                        "noisy" if dropped.is_noisy[row, j] else "clean",
                        dropped.position_ids[row, j].item(),
                    )
                    expected = bool(dropped.valid[row, j]) and spec_allowed(*q, *k, block_size)
                assert mask[row, 0, i, j].item() == expected
    # Same target multiset, fewer noisy columns when prompts are long.
    assert full.num_targets == dropped.num_targets
    assert sorted(full.shift_labels[full.shift_labels != -100].tolist()) == sorted(
        dropped.shift_labels[dropped.shift_labels != -100].tolist()
    )


def test_dropping_shrinks_long_prompt_batches():
    input_ids, attention_mask, labels = make_batch([40, 30], 40, [32, 26])
    dropped = build_mars_inputs(input_ids, attention_mask, labels, block_size=4, mask_token_id=MASK_ID)
    # Row 0: targets at p = 31..38 -> blocks 7, 8, 9; row 1: p = 25..28 -> blocks 6, 7. Widest row: 3 blocks.
    assert dropped.input_ids.shape[1] - 40 == 12
    assert dropped.valid[1, 40:].sum() == 6  # block 7 of row 1 is cut by its length (30)


def test_left_padding_equals_right_padding():
    input_ids, attention_mask, labels = make_batch([9, 6], 9, [3, 2])
    left_ids, left_mask, left_labels = input_ids.clone(), attention_mask.clone(), labels.clone()
    left_ids[1] = torch.cat([input_ids[1, 6:], input_ids[1, :6]])
    left_mask[1] = torch.cat([attention_mask[1, 6:], attention_mask[1, :6]])
    left_labels[1] = torch.cat([labels[1, 6:], labels[1, :6]])
    for drop in (False, True):
        right = build_mars_inputs(
            input_ids,
            attention_mask,
            labels,
            block_size=4,
            mask_token_id=MASK_ID,
            drop_target_free_blocks=drop,
        )
        left = build_mars_inputs(
            left_ids,
            left_mask,
            left_labels,
            block_size=4,
            mask_token_id=MASK_ID,
            drop_target_free_blocks=drop,
        )
        for field in ("input_ids", "position_ids", "shift_labels", "valid", "is_noisy"):
            assert torch.equal(getattr(right, field), getattr(left, field)), field


def test_padding_is_read_from_the_attention_mask_not_token_ids():
    # A real trailing EOS (id 2 == pad id) must stay a real, supervised token.
    input_ids = torch.tensor([[5, 6, 7, 2, 2, 2], [5, 6, 2, 2, 2, 2]])
    attention_mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0]])
    labels = torch.where(attention_mask.bool(), input_ids, -100)
    inputs = build_mars_inputs(input_ids, attention_mask, labels, block_size=2, mask_token_id=MASK_ID)
    assert inputs.shift_labels[0, :6].tolist() == [6, 7, 2, 2, -100, -100]
    assert inputs.shift_labels[1, :6].tolist() == [6, 2, -100, -100, -100, -100]


def test_padded_rows_stay_finite_in_loss_and_gradient(arch):
    model = tiny_model(arch)
    model.train()
    input_ids, attention_mask, labels = make_batch([7, 3], 7, [2, 1])
    attention_mask[1, :] = 0  # a row that is padding only
    labels[1, :] = -100
    inputs = build_mars_inputs(input_ids, attention_mask, labels, block_size=4, mask_token_id=MASK_ID)
    mask = mars_attention_mask(inputs, "sdpa")
    logits = model(input_ids=inputs.input_ids, attention_mask=mask, position_ids=inputs.position_ids).logits
    assert torch.isfinite(logits).all()
    logits.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def _logits(model, input_ids, attention_mask, labels, block_size, implementation="sdpa", clean_change=None):
    inputs = build_mars_inputs(
        input_ids,
        attention_mask,
        labels,
        block_size=block_size,
        mask_token_id=MASK_ID,
        drop_target_free_blocks=False,
    )
    z = inputs.input_ids.clone()
    if clean_change is not None:  # change one token of the clean half only
        position, token = clean_change
        z[:, position] = token
    mask = mars_attention_mask(inputs, implementation, dtype=torch.float64)
    with torch.no_grad():
        return model(input_ids=z, attention_mask=mask, position_ids=inputs.position_ids).logits


@pytest.mark.parametrize("block_size", [2, 3, 4])
def test_no_leakage(arch, block_size):
    """Changing clean token p moves no noisy logit of blocks <= b(p) and no clean logit before p."""
    model = tiny_model(arch)
    length = 11
    input_ids, attention_mask, labels = make_batch([length], length, [3], seed=block_size)
    base = _logits(model, input_ids, attention_mask, labels, block_size)
    for p in range(length):
        token = 3 + (input_ids[0, p].item() - 3 + 7) % 37
        other = _logits(model, input_ids, attention_mask, labels, block_size, clean_change=(p, token))
        diff = (other - base).abs().amax(-1)[0]
        clean, noisy = diff[:length], diff[length:]
        for q in range(length):
            if q < p:
                assert clean[q].item() == 0.0, (p, q)
            else:
                assert clean[q].item() > 0, (p, q)  # sanity: the change is visible where it may be
            if q // block_size <= p // block_size:
                assert noisy[q].item() == 0.0, (p, q)
            else:
                assert noisy[q].item() > 0, (p, q)


def test_eager_equals_sdpa(arch):
    input_ids, attention_mask, labels = make_batch([9, 5], 9, [3, 2])
    sdpa = _logits(tiny_model(arch), input_ids, attention_mask, labels, 4, "sdpa")
    eager = _logits(
        tiny_model(arch, attn_implementation="eager"), input_ids, attention_mask, labels, 4, "eager"
    )
    valid = torch.cat([attention_mask, attention_mask], 1).bool()
    # eager runs its softmax in float32, hence the float32-level tolerance.
    torch.testing.assert_close(sdpa[valid], eager[valid], rtol=0, atol=1e-6)


@pytest.mark.slow
def test_flex_attention_block_mask_equals_sdpa():
    """flex_attention on CPU: float32, forward only, compiled on first use (~30 s)."""
    input_ids, attention_mask, labels = make_batch([9, 6], 9, [3, 2])
    results = {}
    for implementation in ("sdpa", "flex_attention"):
        model = tiny_model("llama", attn_implementation=implementation, dtype=torch.float32)
        inputs = build_mars_inputs(input_ids, attention_mask, labels, block_size=4, mask_token_id=MASK_ID)
        mask = mars_attention_mask(inputs, implementation)
        with torch.no_grad():
            results[implementation] = model(
                input_ids=inputs.input_ids, attention_mask=mask, position_ids=inputs.position_ids
            ).logits[inputs.valid]
    torch.testing.assert_close(results["sdpa"], results["flex_attention"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("implementation", ["flash_attention_2", "flash_attention_3", "paged|sdpa", None])
def test_unsupported_attention_backend_is_refused(implementation):
    config = type("Config", (), {"_attn_implementation": implementation})()
    with pytest.raises(ValueError, match='attn_implementation="sdpa"'):
        check_attn_implementation(config)


def test_bad_block_size_is_refused():
    input_ids, attention_mask, labels = make_batch([5], 5, [1])
    with pytest.raises(ValueError, match="block_size"):
        build_mars_inputs(input_ids, attention_mask, labels, block_size=0, mask_token_id=MASK_ID)
