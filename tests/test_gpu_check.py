"""`mars-hf gpu-check --tiny`: the JSON schema, the budget stop, and that forced acceptance yields its rates."""

from __future__ import annotations

import json
import time

import pytest
import torch

from mars_hf.cli import main
from mars_hf.tools.gpu_check import estimates, format_table, run_gpu_check, runner, tiny_arguments
from mars_hf.tools.gpu_check.budget import Budget, BudgetExceeded
from mars_hf.tools.gpu_check.forced_acceptance import ForcedAcceptance
from mars_hf.tools.gpu_check.random_models import build_model, make_prompts, ordinary_token_ids

ROW_KEYS = {
    "model",
    "rate",
    "batch",
    "label",
    "scheme",
    "acceptance",
    "layout",
    "tau",
    "window",
    "cache_block",
    "tokens_per_forward",
    "predicted_tokens_per_forward",
    "expected_tokens_per_step",
    "tokens_per_s",
    "speedup",
    "efficiency",
    "same_as_stock",
    "num_forwards",
    "seconds",
    "peak_memory_mb",
}


@pytest.fixture(scope="module")
def tiny_model():
    return build_model("tiny", dtype=torch.float32, device="cpu", seed=0)


def test_forced_logits_follow_the_pattern(tiny_model):
    """Real tokens predict correct[p + 1] at p ~ 1; masks do where the pattern agrees, else a wrong token at
    ~0.62 (below τ = 0.9); with the forcing off the model is the plain random model again."""
    model = tiny_model
    forcer = ForcedAcceptance(model, rate=0.5, seed=3)
    try:
        mask = model.config.mars["mask_token_id"]
        ordinary = ordinary_token_ids(model)
        prompt = ordinary[:6][None]
        window = 8
        ids = torch.cat([prompt, torch.full((1, window), mask)], dim=1)
        positions = torch.arange(ids.shape[1])[None] + 5  # not starting at 0: positions, not indices, count
        with torch.no_grad():
            probs = model(input_ids=ids, position_ids=positions).logits.float().softmax(-1)[0]
            cut = model(input_ids=ids, position_ids=positions, logits_to_keep=3).logits.float().softmax(-1)[0]
        torch.testing.assert_close(cut, probs[-3:])
        agree_seen = disagree_seen = 0
        for index in range(ids.shape[1]):
            target = int(positions[0, index]) + 1
            correct = int(forcer.correct_cpu[target])
            top_p, top = probs[index].max(-1)
            if index < prompt.shape[1] or bool(forcer.agree_cpu[target]):
                assert int(top) == correct and float(top_p) > 0.999
                agree_seen += index >= prompt.shape[1]
            else:
                assert int(top) != correct and 0.55 < float(top_p) < 0.7
                disagree_seen += 1
        assert agree_seen and disagree_seen  # the window saw both cases
        forcer.enabled = False
        with torch.no_grad():
            plain = model(input_ids=ids, position_ids=positions).logits.float().softmax(-1)[0]
        assert float(plain.max()) < 0.5
    finally:
        forcer.remove()


def test_forced_threshold_decoding_accepts_the_simulated_counts(tiny_model):
    """The decoder's forward count equals the pattern's simulation, row by row (batch 1 and a ragged batch)."""
    model = tiny_model
    forcer = ForcedAcceptance(model, rate=0.7, seed=1)
    try:
        for batch in (1, 3):
            inputs = make_prompts(model, batch, 12, seed=0, device="cpu")
            out = model.generate(
                **inputs,
                max_new_tokens=30,
                do_sample=False,
                mars_threshold=0.9,
                mars_block_size=4,
                return_dict_in_generate=True,
            )
            stock = model.generate(**inputs, max_new_tokens=30, do_sample=False)
            assert torch.equal(out.sequences, stock)
            last = (inputs["attention_mask"].sum(1) - 1).tolist()
            steps = forcer.simulate_steps(last, 30, 4)
            assert out.num_forwards == max(steps)
            expected = [int(c) for c in (out.accepted_counts > 0).sum(0)]
            assert expected == steps
    finally:
        forcer.remove()


@pytest.mark.parametrize("rate", [0.4, 0.8])
def test_forced_pattern_has_the_chosen_rate(tiny_model, rate):
    """Over a long run the pattern accepts 1 + r + … + r^W tokens per step (the agreements are i.i.d.)."""
    forcer = ForcedAcceptance(tiny_model, rate=rate, seed=0)
    try:
        assert float(forcer.agree_cpu.float().mean()) == pytest.approx(rate, abs=0.01)
        tokens = 20000
        for window in (4, 8):
            steps = forcer.simulate_steps([10, 123], tokens, window)
            for count in steps:
                assert tokens / count == pytest.approx(forcer.expected_tokens_per_step(window), rel=0.03)
    finally:
        forcer.remove()


def test_exactness_measures_gaps_on_a_float32_copy_without_the_forcing_hooks():
    from mars_hf.tools.gpu_check.exactness import float32_reference

    model = build_model("tiny", dtype=torch.bfloat16, device="cpu", seed=0)
    forcer = ForcedAcceptance(model, rate=1.0)
    try:
        reference = float32_reference(model)
        weights = dict(model.named_parameters())
        for name, tensor in reference.named_parameters():
            assert tensor.dtype == torch.float32 and torch.equal(tensor, weights[name].float()), name
        ids = make_prompts(model, 1, 12, 0, "cpu")["input_ids"]
        forcer.enabled = False  # the unforced model, computed in float32, is what the reference computes
        upcast = model.float()(input_ids=ids).logits
        assert torch.allclose(reference(input_ids=ids).logits, upcast, atol=1e-5)
        assert float32_reference(model) is model  # (now float32) a float32 model measures its own gaps
    finally:
        forcer.remove()


def test_budget_timer_interrupts():
    """The real timer of a 0.3 s budget interrupts a loop of sleeps; the loop's 60 s only catch a timer that
    never rings (a hang guard, not a measurement)."""
    budget = Budget(0.3, reserve=0.0)
    guard = time.monotonic() + 60
    budget.arm()
    try:
        with pytest.raises(BudgetExceeded):
            while time.monotonic() < guard:
                time.sleep(0.05)
    finally:
        budget.disarm()
    with pytest.raises(BudgetExceeded):
        budget.check()


class TokenClock:
    """Seconds that pass only by generation: each new token a `generate` call asks for costs ``cost``,
    whatever the configuration, the machine or the forwards the decoder makes (its cost-curve probe
    included), so that where a budget runs out is arranged by the test, the same on any host."""

    def __init__(self, cost: float = 1.0):
        self.now = 0.0
        self.cost = cost

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def token_clock(monkeypatch):
    """A `TokenClock` charged by every `generate` of every model the check builds (training is free)."""
    clock = TokenClock()

    def build(*args, **kwargs):
        model = build_model(*args, **kwargs)
        generate = model.generate

        def charged(*args, **kwargs):
            output = generate(*args, **kwargs)
            config = kwargs.get("generation_config") or model.generation_config
            clock.now += clock.cost * kwargs.get("max_new_tokens", config.max_new_tokens)
            return output

        model.generate = charged
        return model

    monkeypatch.setattr(runner, "build_model", build)  # where the check builds the models it decodes with
    return clock


def test_injected_clock_drives_the_budget_and_no_timer_runs():
    clock = TokenClock()
    budget = Budget(10, reserve=1.0, clock=clock)
    budget.arm()  # a replaced clock has no real deadline: nothing may ring
    try:
        time.sleep(0.05)
        budget.check()
        clock.now = 8.9
        budget.check()
        assert budget.elapsed() == pytest.approx(8.9) and budget.remaining() == pytest.approx(0.1)
        clock.now = 9.0
        with pytest.raises(BudgetExceeded):
            budget.check()
    finally:
        budget.disarm()


def _run(tmp_path, *extra):
    out = tmp_path / "check.json"
    code = main(["gpu-check", "--tiny", "--out", str(out), *extra])
    assert code == 0
    return json.loads(out.read_text())


def test_tiny_run_schema_and_forced_rates(tmp_path, capsys):
    # A budget no host runs out of, so that every item runs; the wall-clock bound only catches a hang.
    start = time.monotonic()
    result = _run(tmp_path, "--budget-seconds", "100000", "--rates", "0.5,0.9", "--repeats", "1")
    assert time.monotonic() - start < 3600
    table = capsys.readouterr().out
    assert "DECODING" in table and "SKIPPED" in table and "TRAINING" in table
    assert {"schema_version", "environment", "arguments", "budget", "models", "rows", "exactness"} <= set(
        result
    )
    assert result["budget"]["elapsed_seconds"] <= 100000 and result["budget"]["stopped"] is None
    assert not [item for item in result["items"] if item["status"] == "error"]
    rows = result["rows"]
    assert rows, result["skipped"]
    for row in rows:
        assert ROW_KEYS <= set(row), ROW_KEYS - set(row)
        assert row["same_as_stock"] == 1.0  # only correct tokens are ever accepted
        assert row["peak_memory_mb"] is None  # CPU
    cursor = [r for r in rows if r["scheme"] in ("cursor", "none")]
    assert {r["rate"] for r in cursor if r["batch"] == 1} == {0.5, 0.9}
    for row in cursor:
        # exactly what the pattern implies (its long-run rate is checked in the next test)
        assert row["tokens_per_forward"] == pytest.approx(row["predicted_tokens_per_forward"], rel=1e-9)
    high = [r for r in cursor if r["rate"] == 0.9 and r["batch"] == 1]
    low = [r for r in cursor if r["rate"] == 0.5 and r["batch"] == 1]
    assert high[0]["tokens_per_forward"] > low[0]["tokens_per_forward"] + 0.5
    stock = [r for r in rows if r["scheme"] == "stock"]
    assert all(r["tokens_per_forward"] == 1.0 and r["speedup"] == 1.0 for r in stock)
    # every verify layout decodes every group, and only keeps drafts the model confirms
    verify_rows = [r for r in rows if r["acceptance"] == "verify"]
    groups = {(r["rate"], r["batch"]) for r in rows}
    assert {(r["rate"], r["batch"], r["layout"]) for r in verify_rows} == {
        (rate, batch, layout) for rate, batch in groups for layout in ("auto", "linear", "quadratic")
    }
    for row in verify_rows:
        assert row["draft_acceptance"] is None or 0.0 <= row["draft_acceptance"] <= 1.0
    for entry in result["skipped"]:
        assert "failed" not in entry["reason"], entry
    # exactness in bf16 against stock, and the training step
    assert result["exactness"] and all(e["rows"] >= 1 for e in result["exactness"])
    assert any(e["label"] == "stock, each row alone" for e in result["exactness"])
    assert all(
        e["rows_identical"] + e["near_tie_flips"] + e["other_differences"] >= e["rows"]
        for e in result["exactness"]
    )
    for e in result["exactness"]:  # gaps measured in float32 wherever a row differed
        assert e["gap_dtype"] == ("float32" if e["rows_identical"] < e["rows"] else None)
    training = {t.get("variant") or t["comparison"]: t for t in result["training"]}
    assert training["sdpa"]["loss"] > 0 and training["sdpa"]["grad_norm"] > 0
    # the gated adapter's frozen clean stream: the same loss and gradients as its two-stream path, cheaper
    assert training["gated frozen-clean"]["frozen_clean_stream"]
    assert not training["gated two-stream"]["frozen_clean_stream"]
    comparison = training["gated frozen-clean vs gated two-stream"]
    assert comparison["same_gradient_names"] and comparison["grad_rel_diff"] < 1e-5
    assert comparison["loss_abs_diff"] < 1e-5


def test_tiny_budget_skips_and_says_so(tmp_path, token_clock):
    """Each generated token costs 1 s: the probe's 6 generations of 8 tokens spend 48 of a 60 s budget (3 s
    of it reserved), and every later item's estimate (hundreds of tokens) is larger than the 9 s left."""
    out = tmp_path / "check.json"
    result = run_gpu_check(tiny_arguments(), 60, out=str(out), clock=token_clock)
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert [(i["item"], i["status"]) for i in result["items"]] == [
        ("tiny: build", "ran"),
        ("tiny: probe", "ran"),
    ]
    assert result["items"][1]["seconds"] == 48.0 and result["budget"]["elapsed_seconds"] == 48.0
    assert result["budget"]["stopped"] is None and not result["rows"]
    budget_skips = {s["item"]: s["reason"] for s in result["skipped"] if "of the budget left" in s["reason"]}
    assert {f"tiny: decode rate={r:g} batch={b}" for r in (0.4, 0.8) for b in (1, 2)} <= set(budget_skips)
    assert {"tiny: exactness batch=1", "tiny: exactness batch=3", "tiny: train sdpa"} <= set(budget_skips)
    assert all(reason.endswith("9.0 s of the budget left") for reason in budget_skips.values())
    table = format_table(result)
    assert "tiny: decode rate=0.4 batch=1: estimated" in table and "of the budget left" in table


def test_budget_spent_inside_an_item_stops_it_between_runs(tmp_path, token_clock, monkeypatch):
    """Priors that underestimate MARS steps let the first decode group (estimated 41 s) start with 165 s
    left (the probe spent 32 of 197); its runs cost 8 (warm-up) or 32 s each, far more in all, so the
    check before a run stops it once the deadline has passed, and the rest is skipped as spent."""
    monkeypatch.setattr(estimates, "PRIOR_MARS_STEP_FACTOR", 0.01)
    monkeypatch.setattr(estimates, "PRIOR_NONE_STEP_FACTOR", 0.01)
    args = tiny_arguments(rates=[0.5, 0.9], batch_sizes=[1], parts=["decode"], repeats=1)
    result = run_gpu_check(args, 200, clock=token_clock)
    statuses = [(i["item"], i["status"]) for i in result["items"]]
    assert statuses == [
        ("tiny: build", "ran"),
        ("tiny: probe", "ran"),
        ("tiny: decode rate=0.5 batch=1", "interrupted"),
    ]
    assert "the budget of 200 s is spent" in result["budget"]["stopped"]
    assert result["items"][1]["seconds"] == 32.0
    assert 197 <= token_clock.now <= 197 + 32  # stopped by the first check past the deadline
    skipped = {s["item"]: s["reason"] for s in result["skipped"]}
    assert skipped["tiny: decode rate=0.9 batch=1"] == "the budget was spent before it"
    assert "stopped" in format_table(result)
