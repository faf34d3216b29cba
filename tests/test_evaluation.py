"""Evaluation: HumanEval helpers, the local `evaluate` metrics, and decoding measurements on a tiny model.

The code executor itself is tested in tests/test_code_exec.py."""

import pytest
import torch

from mars_hf.evaluation.metrics import load_metric
from mars_hf.evaluation.runs import (
    evaluate_humaneval,
    format_table,
    measure_decoding,
    summarize_runs,
    truncate_completion,
)
from mars_hf.training.data import chat_prompt_ids
from tests.tiny import tiny_model, tiny_tokenizer


def test_truncate_completion_stops_at_next_top_level_statement():
    text = "    return x + 1\n\n\ndef other():\n    pass\n"
    assert truncate_completion(text) == "    return x + 1\n\n"
    assert truncate_completion("    y = 2\n    return y\n") == "    y = 2\n    return y\n"


# ----------------------------------------------------------------------------------------------- metrics
def test_token_agreement_metric_matches_hand_computation():
    metric = load_metric("token_agreement")
    predictions = [[1, 2, 3, 4], [5, 6], [7, 8, 9]]
    references = [[1, 2, 0, 4], [5, 6, 7, 8], [7, 8, 9]]
    scores = metric.compute(predictions=predictions, references=references)
    # matches: 3 + 2 + 3 = 8 over max lengths 4 + 4 + 3 = 11
    assert scores["agreement"] == pytest.approx(8 / 11)
    assert scores["exact_match"] == pytest.approx(1 / 3)
    assert scores["prefix_agreement"] == pytest.approx((2 / 4 + 2 / 4 + 3 / 3) / 3)


def test_tokens_per_forward_metric():
    metric = load_metric("tokens_per_forward")
    scores = metric.compute(predictions=[10, 30], references=[10, 15])
    assert scores["tokens_per_forward"] == pytest.approx(40 / 25)
    assert scores["mean_tokens_per_forward"] == pytest.approx((1.0 + 2.0) / 2)
    with pytest.raises(ValueError, match="at least one forward"):
        metric.compute(predictions=[1], references=[0])


# --------------------------------------------------------------------------------------- decoding runs
@pytest.fixture
def tiny():
    tokenizer = tiny_tokenizer()
    return tiny_model("qwen2", seed=2, tokenizer=tokenizer), tokenizer


def test_measure_decoding_stock_matches_generate_and_tau_one_matches_stock(tiny):
    model, tokenizer = tiny
    prompts = ["the cat sat", "hello world and yes", "one two"]
    prompt_ids = [chat_prompt_ids(tokenizer, prompt) for prompt in prompts]
    runs = measure_decoding(model, tokenizer, prompt_ids, [None, 1.0, 0.0], max_new_tokens=7, progress=False)
    for ids, output in zip(prompt_ids, runs["stock"].outputs):
        x = torch.tensor([ids])
        plain = model.generate(
            input_ids=x,
            attention_mask=torch.ones_like(x),
            do_sample=False,
            max_new_tokens=7,
            pad_token_id=tokenizer.pad_token_id,
        )[0, x.shape[1] :].tolist()
        if tokenizer.eos_token_id in plain:
            plain = plain[: plain.index(tokenizer.eos_token_id) + 1]
        assert output == plain
    assert runs["mars@1"].outputs == runs["stock"].outputs
    assert runs["stock"].num_forwards == runs["stock"].num_tokens
    rows = {row["label"]: row for row in summarize_runs(runs, references=runs["stock"].outputs)}
    assert rows["stock"]["agreement"] == 1.0 and rows["mars@1"]["agreement"] == 1.0
    assert rows["mars@1"]["tokens_per_forward"] <= 1.0
    assert rows["mars@0"]["tokens_per_forward"] > 1.0  # τ = 0 accepts every prediction
    assert rows["stock"]["speedup_vs_stock"] == pytest.approx(1.0)
    table = format_table(list(rows.values()))
    assert "mars@0" in table and "tokens/forward" in table


def test_evaluate_humaneval_plumbing_on_tiny_model(tiny):
    model, tokenizer = tiny
    rows = evaluate_humaneval(
        model,
        tokenizer,
        [None, 1.0],
        limit=2,
        max_new_tokens=4,
        timeout=10,
        reference_model=model,
        progress=False,
    )
    assert [row["label"] for row in rows] == ["reference", "stock", "mars@1"]
    for row in rows:
        assert row["num_problems"] == 2 and 0.0 <= row["pass@1"] <= 1.0
        assert row["execution_guards"]["private_tmp"] is True
    assert rows[1]["agreement"] == 1.0 and rows[2]["agreement"] == 1.0


def _slow_acceptance(model, ids, labels, tau, block_size, mask_token_id):
    """Per block start: run the model causally on [prefix ; B masks] (plain decoding input) and accept."""
    steps, hits, accepted_total = [], 0, 0
    length = len(ids)
    for start in range(block_size, length, block_size):
        if labels[start] == -100:
            continue
        x = torch.tensor([ids[:start] + [mask_token_id] * block_size])
        probs = model(input_ids=x).logits[0, start:].softmax(-1)  # logits at the masks
        accepted = 1
        for j in range(block_size):
            target = start + j + 1
            if target >= length or labels[target] == -100 or probs[j].max() < tau:
                break
            accepted += 1
            accepted_total += 1
            hits += int(probs[j].argmax() == ids[target])
        steps.append(accepted)
    return steps, hits, accepted_total


@pytest.mark.parametrize("block_size", [2, 3])
def test_teacher_forced_acceptance_equals_plain_causal_decoding_inputs(block_size):
    from mars_hf.evaluation.runs import teacher_forced_acceptance

    tokenizer = tiny_tokenizer()
    model = tiny_model("llama", seed=5, tokenizer=tokenizer, block_size=block_size)
    mask_id = tokenizer.mask_token_id
    torch.manual_seed(0)
    sequences = [torch.randint(3, 40, (n,)).tolist() for n in (17, 23)]
    labels = [[-100] * 5 + seq[5:] for seq in sequences]
    # A tiny random model is never confident: lower τ so that some masks get accepted.
    taus = (0.0, 0.05, 1.0)
    stats = teacher_forced_acceptance(model, sequences, labels, taus)
    for tau in taus:
        steps, hits, accepted = [], 0, 0
        for seq, lab in zip(sequences, labels):
            s, h, a = _slow_acceptance(model, seq, lab, tau, block_size, mask_id)
            steps += s
            hits += h
            accepted += a
        assert stats[f"tokens_per_step@{tau:g}"] == pytest.approx(sum(steps) / len(steps))
        if accepted:
            assert stats[f"accepted_correct@{tau:g}"] == pytest.approx(hits / accepted)
    assert stats["tokens_per_step@1"] == 1.0
    assert stats["tokens_per_step@0"] > 1.0


def test_mars_hf_eval_command_on_a_saved_checkpoint(tmp_path, capsys):
    import json

    from mars_hf.cli import main

    tokenizer = tiny_tokenizer()
    model = tiny_model("mistral", seed=4, tokenizer=tokenizer, dtype=torch.float32)
    folder = tmp_path / "ckpt"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    out = tmp_path / "eval.json"
    argv = [
        "eval", str(folder), "--base-model", str(folder), "--thresholds", "1.0,0.0", "--max-new-tokens", "5",
        "--humaneval-limit", "1", "--held-out", "2", "--quiet", "--output", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    results = json.loads(out.read_text())
    assert [row["label"] for row in results["humaneval"]] == ["reference", "stock", "mars@1", "mars@0"]
    held = {row["label"]: row for row in results["held_out"]["rows"]}
    assert held["stock"]["agreement"] == 1.0 and held["mars@1"]["agreement"] == 1.0
    assert held["mars@0"]["tokens_per_forward"] > 1.0
    assert "pass@1" in capsys.readouterr().out


def test_suppress_mask_token_keeps_a_tied_mask_row_out_of_the_output():
    """A trained mask row of a tied-embedding model can win the output argmax; suppression stops that only."""
    from mars_hf.models.mask_token import suppress_mask_token

    tokenizer = tiny_tokenizer()
    model = tiny_model("llama", seed=6, tokenizer=tokenizer, tie_word_embeddings=True)
    reference = tiny_model("llama", seed=6, tokenizer=tokenizer, tie_word_embeddings=True)
    mask_id = tokenizer.mask_token_id
    x = torch.tensor([chat_prompt_ids(tokenizer, "the cat sat")])
    kwargs = dict(attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=8, pad_token_id=2)
    with torch.no_grad():  # make the mask row dominate the (tied) output layer
        hidden = model.model(input_ids=x).last_hidden_state[0, -1]
        model.get_input_embeddings().weight[mask_id] = 50 * hidden / hidden.norm()
    assert mask_id in model.generate(input_ids=x, **kwargs)[0, x.shape[1] :].tolist()
    assert suppress_mask_token(model) and not suppress_mask_token(model)
    out = model.generate(input_ids=x, **kwargs)[0, x.shape[1] :].tolist()
    assert mask_id not in out
    assert out == reference.generate(input_ids=x, **kwargs)[0, x.shape[1] :].tolist()
