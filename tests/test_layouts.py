"""`layouts`: what a step feeds, where predictions sit, and the attention each column gets (docs/method.md §5-§6).

The packed mask is compared with a definition written out by hand, column by column.
"""

from __future__ import annotations

import torch

from mars_hf.decoding.layouts import idle_plan, pack, plan_row

MASK, PAD = 99, 0


def test_linear_plan_columns():
    plan = plan_row([5, 6], [7, 8, 9], window=2, mask_token_id=MASK, layout="linear")
    assert plan.tokens == [5, 6, 7, 8, 9, MASK, MASK]
    assert plan.positions == [0, 1, 2, 3, 4, 5, 6]
    assert plan.check_columns == [1, 2, 3, 4]  # after the fresh tokens, then after each draft
    assert plan.group_columns == {3: [5, 6]}  # one group, useful only if all three drafts are kept
    assert plan.causal


def test_quadratic_plan_columns():
    plan = plan_row([5], [7, 8], window=2, mask_token_id=MASK, layout="quadratic")
    assert plan.tokens == [5, 7, 8] + [MASK] * 6
    # group k continues from its anchor: after the fresh token and k drafts
    assert plan.positions == [0, 1, 2, 1, 2, 2, 3, 3, 4]
    assert plan.group_columns == {0: [3, 4], 1: [5, 6], 2: [7, 8]}
    assert plan.visible_real == [1, 2, 3, 1, 1, 2, 2, 3, 3]
    assert not plan.causal


def _allowed_by_definition(plan, cached, lead, width):
    """Which (query column, key column) pairs may attend, from the plan's meaning, column by column."""
    total = cached + width
    allowed = torch.zeros(width, total, dtype=torch.bool)
    n = len(plan.tokens)
    for q in range(width):
        allowed[q, cached + q] = True  # every column sees itself (padding stays finite)
        for k in range(lead, cached):  # and the row's real cached entries
            allowed[q, k] = True
        if q >= n or plan.group[q] == -2:
            continue  # padding sees nothing else of the chunk
        for j in range(n):
            if plan.group[j] == -1 and j < plan.visible_real[q]:  # real columns it may see
                allowed[q, cached + j] = True
            if plan.group[q] >= 0 and plan.group[j] == plan.group[q] and j <= q:  # its own group, causally
                allowed[q, cached + j] = True
    return allowed


def test_packed_mask_equals_the_definition():
    plans = [
        plan_row([5, 6], [7, 8], window=3, mask_token_id=MASK, layout="quadratic"),
        plan_row([4], [], window=3, mask_token_id=MASK, layout="linear"),
        plan_row([1, 2, 3], [9], window=2, mask_token_id=MASK, layout="linear"),
        idle_plan(PAD),
    ]
    cached, leads = [7, 3, 5, 6], [2, 0, 1, 0]
    step = pack(
        plans, cached, leads, min_width=1, dtype=torch.float64, device=torch.device("cpu"), pad_token_id=PAD
    )
    assert step.attention_mask.shape == (4, 1, step.width, max(cached) + step.width)
    for r, plan in enumerate(plans):
        got = step.attention_mask[r, 0] == 0
        expected = _allowed_by_definition(plan, cached[r], leads[r], step.width)
        # keys past this row's own columns belong to no one (stale): never visible
        assert torch.equal(got[:, : cached[r] + step.width], expected), r
        assert not got[:, cached[r] + step.width :].any()
        # position ids continue from the row's real cached count
        real = cached[r] - leads[r]
        assert step.position_ids[r, : len(plan.positions)].tolist() == [real + p for p in plan.positions]
    assert step.input_ids[1].tolist()[: len(plans[1].tokens)] == plans[1].tokens


def test_aligned_causal_rows_use_the_stock_path():
    """Same cache length and causal plans: a 2D padding mask (the model builds the causal mask, as for
    stock decoding), or none at all."""
    plans = [plan_row([5], [], 2, MASK, "linear"), plan_row([6], [], 2, MASK, "linear")]
    step = pack(
        plans, [4, 4], [0, 0], min_width=1, dtype=torch.float32, device=torch.device("cpu"), pad_token_id=PAD
    )
    assert step.attention_mask is None
    padded = pack(
        plans, [4, 4], [0, 0], min_width=5, dtype=torch.float32, device=torch.device("cpu"), pad_token_id=PAD
    )  # padding after every real column: hidden by the causal mask itself
    assert padded.attention_mask is None and padded.width == 5
    step = pack(
        plans, [4, 4], [2, 0], min_width=5, dtype=torch.float32, device=torch.device("cpu"), pad_token_id=PAD
    )
    assert step.attention_mask.tolist() == [[0, 0, 1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1, 0, 0]]
    assert step.input_ids.tolist() == [[5, MASK, MASK, PAD, PAD], [6, MASK, MASK, PAD, PAD]]


def test_padding_columns_stay_inside_the_position_table():
    """Padding columns take the position after the row's last column, but never one past the model's
    last position (an absolute-position embedding would index past its table); real columns keep theirs."""
    plans = [plan_row([5], [7], 2, MASK, "linear"), plan_row([6], [], 0, MASK, "linear")]
    step = pack(
        plans, [9, 9], [0, 0], min_width=6, dtype=torch.float64, device=torch.device("cpu"), pad_token_id=PAD,
        max_position=13,
    )  # fmt: skip
    assert step.position_ids.tolist() == [[9, 10, 11, 12, 12, 12], [9, 10, 10, 10, 10, 10]]
    unbounded = pack(
        plans, [9, 9], [0, 0], min_width=6, dtype=torch.float64, device=torch.device("cpu"), pad_token_id=PAD
    )
    assert unbounded.position_ids[0].tolist() == [9, 10, 11, 12, 13, 13]


def test_position_limit_and_layout_choices():
    from transformers import GPT2Config, LlamaConfig

    from mars_hf.decoding.layouts import LAYOUT_CHOICES, LAYOUTS, position_limit

    assert position_limit(GPT2Config(n_positions=40)) == 40
    assert position_limit(LlamaConfig(max_position_embeddings=128)) == 128
    assert LAYOUT_CHOICES == ("auto",) + LAYOUTS
