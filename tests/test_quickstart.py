"""The quickstart pipeline end to end at toy scale: a tiny model, a handful of prompts, a few steps."""

import json

import pytest
import torch

from mars_hf.quickstart import QuickstartConfig, TimeBudget, run_quickstart, summary, verify_available
from tests.tiny import tiny_model, tiny_tokenizer


@pytest.fixture
def tiny_model_dir(tmp_path):
    tokenizer = tiny_tokenizer()
    model = tiny_model("llama", seed=1, tokenizer=tokenizer, dtype=torch.float32)
    folder = tmp_path / "tiny-base"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def _toy_config(tiny_model_dir, tmp_path, **settings) -> QuickstartConfig:
    """A quickstart small enough for a unit test: 6 training prompts, 3 held-out, 6 new tokens."""
    toy = dict(
        model_name_or_path=tiny_model_dir,
        output_dir=str(tmp_path / "out"),
        num_train_prompts=6,
        num_eval_prompts=3,
        max_new_tokens=6,
        batch_size=2,
        bf16=False,
        cache_dir=str(tmp_path / "cache"),
        progress=False,
    )
    return QuickstartConfig(**{**toy, **settings})


@pytest.mark.parametrize("method", ["gated_lora", "lora", "full", "mask_row"])
def test_quickstart_end_to_end_toy(tiny_model_dir, tmp_path, method):
    config = _toy_config(
        tiny_model_dir,
        tmp_path,
        distill_batch_size=4,
        max_steps=2,
        method=method,
        lora_r=4,
        lora_alpha=8,
        thresholds=(1.0, 0.5, 0.0),
        track_every=1,
    )
    results = run_quickstart(config)
    out = tmp_path / "out"
    saved = json.loads((out / "results.json").read_text())
    assert saved["evaluation"] == json.loads(json.dumps(results["evaluation"]))
    labels = [row["label"] for row in saved["evaluation"]]
    assert labels == ["stock", "mars@1", "mars@0.5", "mars@0"] + (["verify"] if verify_available() else [])
    assert saved["machine"]["bf16"] is False  # set explicitly by the toy config
    by_label = {row["label"]: row for row in saved["evaluation"]}
    if method in ("gated_lora", "mask_row"):  # the base model exactly, by construction
        assert by_label["stock"]["agreement"] == 1.0 and by_label["mars@1"]["agreement"] == 1.0
    if "verify" in by_label:
        assert by_label["verify"]["agreement"] == by_label["stock"]["agreement"]
    for row in saved["evaluation"]:
        assert row["tokens_per_forward"] >= 1.0 - 1e-9
        assert 0.0 <= row["agreement"] <= 1.0
        assert row["seconds"] > 0 and row["speedup_vs_stock"] > 0
    by_label = {row["label"]: row for row in saved["evaluation"]}
    assert by_label["stock"]["tokens_per_forward"] == 1.0
    assert by_label["mars@1"]["tokens_per_forward"] <= 1.0 + 1e-9  # τ = 1: one token per step
    assert by_label["mars@0"]["tokens_per_forward"] > 1.0  # τ = 0 accepts every prediction
    assert saved["training"]["steps"] == 2
    assert [point["step"] for point in saved["training"]["curve"]] == [0, 1, 2]
    assert saved["training"]["teacher_forced"]["tokens_per_step@1"] == 1.0
    assert saved["data"]["train_prompts"] == 6 and saved["data"]["eval_prompts"] == 3
    png = (out / "pareto.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000
    checkpoint = out / "checkpoint"
    if method == "gated_lora":  # the adapter, not a copy of the model
        assert (
            not (checkpoint / "config.json").exists() and (checkpoint / "adapter_model.safetensors").exists()
        )
        mars = json.loads((checkpoint / "mars_config.json").read_text())
        assert mars["adapter_gating"] == "mask"
    else:
        mars = json.loads((checkpoint / "config.json").read_text())["mars"]
    assert mars["block_size"] == config.block_size
    assert "stock" in summary(results) and "tokens/forward" in summary(results)

    # A rerun reuses the cached self-distillation and reference.
    again = run_quickstart(config)
    assert again["data"]["self_distill_cached"] and again["data"]["reference_cached"]
    assert not results["data"]["self_distill_cached"]


def test_time_budget_schedule_warms_up_and_ends_at_zero(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("mars_hf.quickstart.time.monotonic", lambda: clock[0])
    budget = TimeBudget(seconds=100.0, warmup_fraction=0.1)
    assert budget(0) == pytest.approx(0.02)  # starts the clock
    clock[0] = 105.0
    assert budget(1) == pytest.approx(0.5)
    clock[0] = 110.0
    assert budget(2) == pytest.approx(1.0)
    clock[0] = 155.0
    assert budget(3) == pytest.approx(0.5)
    clock[0] = 250.0
    assert budget(4) == 0.0


def test_mask_row_only_training_leaves_every_other_weight_unchanged(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    config = _toy_config(
        tiny_model_dir,
        tmp_path,
        max_steps=3,
        method="mask_row",
        learning_rate=0.1,
        clean_loss="ce",
        ar_weight=0.0,
        thresholds=(1.0,),
    )
    results = run_quickstart(config)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "checkpoint").state_dict()
    mask_id = json.loads((tmp_path / "out" / "checkpoint" / "config.json").read_text())["mars"][
        "mask_token_id"
    ]
    changed_rows = []
    for name, tensor in base.items():
        if "embed_tokens" in name:
            diff = (trained[name] != tensor).any(-1).nonzero().flatten().tolist()
            changed_rows += diff
        else:
            assert torch.equal(trained[name], tensor), name
    assert changed_rows == [mask_id]
    by_label = {row["label"]: row for row in results["evaluation"]}
    assert by_label["stock"]["agreement"] == 1.0 and by_label["mars@1"]["agreement"] == 1.0


def test_trained_model_runs_in_its_own_dtype_after_bf16_training(tiny_model_dir):
    """bf16 autocast training must not leave the returned model's forward under autocast (session-2 bug:
    the quickstart then evaluated agreement with the float32 base model in bf16)."""
    import copy

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mars_hf.data import self_distill
    from mars_hf.quickstart import train_mars

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    prompts = ["count one two", "say three four", "list five six", "add one one"]
    dataset = self_distill(model, tokenizer, prompts, max_new_tokens=6, batch_size=4, progress=False)
    config = QuickstartConfig(max_steps=1, batch_size=2, method="mask_row", bf16=True, progress=False)
    trained, _ = train_mars(model, tokenizer, dataset, config, work_dir=str(tiny_model_dir) + "-work")
    plain = copy.deepcopy(trained)
    plain.forward = type(plain).forward.__get__(plain)  # the class's own forward, no wrapper
    ids = torch.tensor([dataset[0]["input_ids"]])
    with torch.no_grad():
        assert torch.equal(trained(input_ids=ids).logits, plain(input_ids=ids).logits)


def test_precision_is_chosen_by_measurement(monkeypatch, caplog):
    """bf16 only where it measures faster; an explicit setting wins; the choice is logged."""
    import logging

    from mars_hf import quickstart

    rates = {torch.float32: 100.0, torch.bfloat16: 20.0}  # a CPU without native bf16 (5x slower)
    monkeypatch.setattr(quickstart, "_matmul_rate", lambda dtype, seconds: rates[dtype])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    threads = torch.get_num_threads()
    try:
        with caplog.at_level(logging.INFO, logger="mars_hf.quickstart"):
            info = quickstart.choose_precision_and_threads(QuickstartConfig())
        assert info["bf16"] is False and "float32" in caplog.text and "0.20×" in caplog.text
        rates[torch.bfloat16] = 300.0  # native bf16 (AVX512-BF16 / AMX)
        assert quickstart.choose_precision_and_threads(QuickstartConfig())["bf16"] is True
        assert quickstart.choose_precision_and_threads(QuickstartConfig(bf16=False))["bf16"] is False
        assert quickstart.choose_precision_and_threads(QuickstartConfig(num_threads=1))["threads"] == 1
    finally:
        torch.set_num_threads(threads)


def test_distillation_and_evaluation_stay_inside_their_budgets(tiny_model_dir, tmp_path):
    """A spent budget stops after the first batch / the first 4 prompts; a rerun reuses cached batches."""
    config = _toy_config(
        tiny_model_dir,
        tmp_path,
        num_train_prompts=6,
        distill_batch_size=2,
        distill_minutes=0.0,
        num_eval_prompts=5,
        eval_minutes=0.0,
        max_steps=1,
        method="gated_lora",
        lora_r=4,
        thresholds=(1.0,),
    )
    results = run_quickstart(config)
    assert results["data"]["train_prompts"] == 2 and results["data"]["train_prompts_requested"] == 6
    assert len(results["samples"]) == 3 and results["data"]["eval_prompts"] == 4
    assert all(row["num_tokens"] > 0 for row in results["evaluation"])
    again = run_quickstart(QuickstartConfig(**{**config.__dict__, "distill_minutes": None}))
    assert not again["data"]["self_distill_cached"]  # the other two batches were new
    assert run_quickstart(QuickstartConfig(**{**config.__dict__, "distill_minutes": None}))["data"][
        "self_distill_cached"
    ]
