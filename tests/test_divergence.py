"""Divergences from stock greedy are found at the right token and judged by the right logit gap.

The gap `compare_with_reference` measures with one uncached forward of the shared prefix is checked against
stock `generate`'s own logits at that step (float64: the two agree to rounding), on a left-padded batch, so a
prompt read with its padding would give another gap.
"""

import argparse

import pytest
import torch

from mars_hf.commands.bench import _float32_reference
from mars_hf.tools.bench import BenchConfiguration, RunMeasurement, count_generated_tokens, prepare_inputs
from mars_hf.tools.bench.divergences import add_divergences, format_divergences
from mars_hf.tools.divergence import (
    compare,
    compare_with_reference,
    first_difference,
    prompt_rows,
    tie_tolerance,
)
from tests.tiny import tiny_model, tiny_tokenizer

PROMPTS = ["the cat sat on the mat", "one two", "hello world print x"]
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def stock_run():
    tokenizer = tiny_tokenizer()
    model = tiny_model("llama", tokenizer=tokenizer)
    inputs = prepare_inputs(tokenizer, PROMPTS, len(PROMPTS))
    assert (inputs["attention_mask"] == 0).any()  # left padding is there to be stripped
    output = model.generate(
        **inputs,
        do_sample=False,
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,  # every row runs to the limit: a row may stop early in the test's edits
        pad_token_id=tokenizer.pad_token_id,
        return_dict_in_generate=True,
        output_logits=True,
    )
    new = output.sequences[:, inputs["input_ids"].shape[1] :]
    lengths = count_generated_tokens(new, [tokenizer.eos_token_id]).tolist()
    stock_tokens = [row[:n] for row, n in zip(new.tolist(), lengths)]
    logits = torch.stack(output.logits, dim=1)  # [batch, new, vocab]
    return model, inputs, stock_tokens, logits


def edited(stock_tokens, logits, position=2):
    """Row 0 as stock's; row 1 takes stock's runner-up token at ``position`` (then its own tail); row 2 stops
    after ``position`` tokens."""
    runner_up = int(logits[1, position].topk(2).indices[1])
    row1 = stock_tokens[1][:position] + [runner_up] + [5] * (NEW_TOKENS - position - 1)
    return [stock_tokens[0], row1, stock_tokens[2][:position]], runner_up


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 4, 3]) == 1
    assert first_difference([1, 2, 3], [1, 2]) == 2  # stopped earlier
    assert first_difference([1, 2], [1, 2, 3]) == 2  # ran on


def test_tie_tolerance_is_bf16_spacings_at_the_logits_magnitude():
    assert tie_tolerance(3.0, spacings=1) == 2.0**-6  # 3.0 in [2, 4): bf16 spacing 2^(1 - 7)
    assert tie_tolerance(-20.0, spacings=4) == 4 * 2.0**-3  # |−20| in [16, 32)
    assert tie_tolerance(0.0, spacings=1) > 0


def test_compare_tells_near_ties_from_real_differences():
    logits = torch.zeros(4, 3, 10)
    logits[:, 1, 5] = 3.0  # stock picks 5 at position 1
    logits[1, 1, 6] = 3.0 - 2**-6  # row 1: token 6 within one bf16 spacing of it (spacing 2^-6 at 3.0)
    logits[2, 1, 7] = 1.0  # row 2: token 7 far below
    stock = [[1, 5, 2], [1, 5, 2], [1, 5, 2], [1, 5, 2]]
    other = [[1, 5, 2], [1, 6, 4], [1, 7, 4], [1, 5]]  # identical, near tie, real difference, stopped early
    asked = []

    def logits_at(row, position):
        asked.append((row, position))
        return logits[row, position]

    result = compare(stock, other, logits_at)
    assert asked == [(1, 1), (2, 1)]  # only rows that differ at a token are looked up, there
    assert result["rows_identical"] == 1 and result["rows"] == 4
    assert result["near_tie_flips"] == 1 and result["other_differences"] == 2
    flip = next(d for d in result["differences"] if d["row"] == 1)
    assert flip["position"] == 1 and flip["gap"] == pytest.approx(2**-6) and flip["near_tie"]
    assert compare(stock, other, logits_at, spacings=0)["near_tie_flips"] == 0


def test_the_gap_is_the_reference_logits_at_the_first_differing_token(stock_run):
    model, inputs, stock_tokens, logits = stock_run
    tokens, runner_up = edited(stock_tokens, logits)
    prompts = prompt_rows([inputs])
    assert [len(p) for p in prompts] == inputs["attention_mask"].sum(dim=1).tolist()
    result = compare_with_reference(model, prompts, stock_tokens, tokens)
    assert result["rows"] == 3 and result["rows_identical"] == 1
    by_row = {d["row"]: d for d in result["differences"]}
    assert set(by_row) == {1, 2}
    flip = by_row[1]
    assert flip["position"] == 2 and flip["other_token"] == runner_up
    assert flip["stock_token"] == stock_tokens[1][2]
    expected_gap = float(logits[1, 2, flip["stock_token"]] - logits[1, 2, runner_up])
    assert expected_gap > 0  # greedy took the stock token
    assert flip["gap"] == pytest.approx(expected_gap, abs=1e-9)
    assert flip["near_tie"] == (expected_gap <= tie_tolerance(float(logits[1, 2, flip["stock_token"]])))
    assert by_row[2]["gap"] is None and not by_row[2]["near_tie"]  # stopped earlier: not a token flip
    assert result["mean_agreeing_prefix"] == pytest.approx((1 + 2 / NEW_TOKENS + 2 / NEW_TOKENS) / 3)
    # the threshold decides: a huge tolerance calls the flip a near tie, none calls it a real difference
    wide = compare_with_reference(model, prompts, stock_tokens, tokens, spacings=10**9)
    assert (wide["near_tie_flips"], wide["other_differences"]) == (1, 1)
    strict = compare_with_reference(model, prompts, stock_tokens, tokens, spacings=0)
    assert (strict["near_tie_flips"], strict["other_differences"]) == (0, 2)


def test_identical_rows_need_no_reference_forward(stock_run):
    _, inputs, stock_tokens, _ = stock_run
    result = compare_with_reference(None, prompt_rows([inputs]), stock_tokens, stock_tokens)
    assert result["rows_identical"] == 3 and result["differences"] == []


def _measurement(tokens):
    return RunMeasurement(seconds=1.0, new_tokens=tokens, forwards_per_batch=[1], counted_forwards=1)


def test_the_bench_judges_lossless_rows_only_and_loads_the_reference_once(stock_run):
    model, inputs, stock_tokens, logits = stock_run
    tokens, _ = edited(stock_tokens, logits)
    configurations = [
        BenchConfiguration("stock"),
        BenchConfiguration("cursor", tau=1.0, window=2),
        BenchConfiguration("cursor", tau=0.5, window=2),
        BenchConfiguration("cursor", window=2, layout="auto"),
    ]
    outputs = [stock_tokens, tokens, tokens, stock_tokens]
    measurements = {c: [_measurement(t)] for c, t in zip(configurations, outputs)}
    rows = [
        {"batch": 3, "scheme": c.scheme, "tau": c.tau, "acceptance": "verify" if c.verify else None,
         "layout": c.layout, "window": c.window}
        for c in configurations
    ]  # fmt: skip
    rows[0]["acceptance"] = "stock"
    loads = []

    def reference():
        loads.append(1)
        return model

    add_divergences(rows, measurements, [inputs], reference)
    assert len(loads) == 1  # only τ = 1 differs among the lossless rows
    assert "divergences" not in rows[0] and "divergences" not in rows[2]  # stock itself; τ < 1 may differ
    assert rows[1]["divergences"]["rows_identical"] == 1 and rows[1]["divergences"]["gap_dtype"] == "float64"
    assert rows[3]["divergences"]["rows_identical"] == 3 and rows[3]["divergences"]["gap_dtype"] is None
    lines = format_divergences({"rows": rows}, lambda row: f"tau={row['tau']}")
    assert len(lines) == 3 and lines[2].startswith("tau=1.0: 1 of 3 identical")
    assert "stopped apart" in lines[2]
    rows[1]["divergences"] = rows[3]["divergences"]
    assert format_divergences({"rows": rows}, str)[-1].endswith("none (all 2 lossless rows identical)")


def test_the_command_measures_a_bf16_models_gaps_on_a_float32_copy(tmp_path):
    tokenizer = tiny_tokenizer()
    model = tiny_model("qwen2", dtype=torch.float32, tokenizer=tokenizer)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    args = argparse.Namespace(model=str(tmp_path), block_size=4)
    assert _float32_reference(model, args) is None  # a float32 model measures its own gaps
    load = _float32_reference(model.to(torch.bfloat16), args)
    reference = load()
    assert load() is reference  # loaded once
    assert next(reference.parameters()).dtype == torch.float32
    name, weight = next(iter(model.named_parameters()))
    assert torch.equal(dict(reference.named_parameters())[name].to(torch.bfloat16), weight)


def test_the_quickstart_judges_a_lossless_row_only_where_it_differs(stock_run):
    from mars_hf.evaluation.runs import DecodingRun, format_table
    from mars_hf.tools.quickstart.evaluate import SUMMARY_COLUMNS, judge_divergences

    model, inputs, stock_tokens, logits = stock_run
    tokens, _ = edited(stock_tokens, logits)
    prompts = prompt_rows([inputs])
    loads = []

    def reference():
        loads.append(1)
        return model

    rows = []
    for label, outputs in (("verify", tokens), ("mars@0.9", tokens), ("mars@1", stock_tokens)):
        row = {"label": label}
        judge_divergences(row, DecodingRun(label, None, outputs=outputs), prompts, stock_tokens, reference)
        rows.append(row)
    assert len(loads) == 1  # only the verify row is lossless and differs
    assert (rows[0]["near_tie_flips"], rows[0]["other_differences"]) == (
        sum(d["near_tie"] for d in rows[0]["divergences"]),
        2 - sum(d["near_tie"] for d in rows[0]["divergences"]),
    )
    assert {d["row"] for d in rows[0]["divergences"]} == {1, 2}
    assert "near_tie_flips" not in rows[1] and "near_tie_flips" not in rows[2]
    assert "near-tie flips" in format_table(rows, SUMMARY_COLUMNS)
    assert "near-tie flips" not in format_table(
        rows[1:], SUMMARY_COLUMNS
    )  # shown only where something differed


def test_a_run_that_only_stops_apart_needs_no_reference(stock_run):
    from mars_hf.tools.divergence import judge_against_stock

    _, inputs, stock_tokens, _ = stock_run
    shorter = [stock_tokens[0], stock_tokens[1], stock_tokens[2][:3]]

    def reference():
        raise AssertionError("no token differs, so no gap is measured")

    result = judge_against_stock(reference, prompt_rows([inputs]), stock_tokens, shorter)
    assert result["rows_identical"] == 2 and result["other_differences"] == 1 and result["gap_dtype"] is None
