"""lm-evaluation-harness with MARS (mars_hf/evaluation/lm_eval_harness.py): what lm-eval hands `generate` arrives right.

The reference for every generation is a direct, unbatched `model.generate` call on the same float64 weights,
cut at the first stop string the way lm-eval cuts its outputs.
"""

import importlib.util
import json
import re

import pytest
import torch
from lm_eval.api.instance import Instance
from lm_eval.models.utils_hf import stop_sequences_criteria

from mars_hf.cli import main as cli_main
from mars_hf.evaluation.lm_eval_harness import MARSLM, TASKS_DIR
from mars_hf.evaluation.runs import StopOnSequences
from tests.tiny import tiny_model, tiny_tokenizer

PROMPTS = ["the cat sat", "hello world and yes one two three", "one", "is the dog red or blue"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lm_eval") / "ckpt"
    tokenizer = tiny_tokenizer()
    tiny_model("llama", seed=3, tokenizer=tokenizer, dtype=torch.float64).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def lm(checkpoint):
    return MARSLM(pretrained=str(checkpoint), dtype="float64", device="cpu", batch_size=len(PROMPTS))


def requests(gen_kwargs, task="t"):
    return [
        Instance("generate_until", {}, (prompt, dict(gen_kwargs)), i, metadata=(task, i, 1))
        for i, prompt in enumerate(PROMPTS)
    ]


def direct(lm, prompt, max_new_tokens, until, **mars):
    """One prompt, no padding, plain generate; returns (text cut at the first stop string, tokens, forwards)."""
    ids = torch.tensor([lm.tok_encode(prompt)])
    out = lm.model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
        pad_token_id=lm.tokenizer.pad_token_id, return_dict_in_generate=True, **mars,
    )  # fmt: skip
    new = out.sequences[0, ids.shape[1] :].tolist()
    eos = lm.tokenizer.eos_token_id
    tokens = new[: new.index(eos) + 1] if eos in new else new
    text = lm.tok_decode(tokens)
    for stop in until:
        text = text.split(stop)[0]
    forwards = int(out.num_forwards) if mars else len(tokens)
    return text, tokens, forwards


@pytest.mark.parametrize("tau", [None, 1.0, 0.0])
def test_batched_left_padded_generation_equals_direct_generate(lm, tau):
    """Left padding, max_length (from max_gen_toks), pad_token_id and the stop strings, against one-by-one runs.

    τ = 0 accepts every mask prediction, so several tokens land per step and stop strings fall inside windows.
    """
    until = ["dog", "blue"]
    gen = {"until": until, "max_gen_toks": 9, "do_sample": False}
    mars = {} if tau is None else {"mars_threshold": tau}
    lm.mars_stats = {}
    outputs = lm.generate_until(requests({**gen, **mars}))
    expected = [direct(lm, p, 9, until, **mars)[0] for p in PROMPTS]
    assert outputs == expected
    assert len({len(lm.tok_encode(p)) for p in PROMPTS}) > 1  # the batch really was padded


@pytest.mark.parametrize("batch_size", [1, len(PROMPTS)])
def test_verified_decoding_through_lm_eval_is_stock_greedy(checkpoint, batch_size):
    """mars_acceptance=verify (lossless): the same text as stock decoding, stop strings and padding included."""
    lm = MARSLM(pretrained=str(checkpoint), dtype="float64", device="cpu", batch_size=batch_size)
    gen = {"until": ["dog", "blue"], "max_gen_toks": 9, "do_sample": False}
    stock = lm.generate_until(requests(gen, task="stock"))
    assert lm.generate_until(requests({**gen, "mars_acceptance": "verify"}, task="verify")) == stock
    assert stock == [direct(lm, p, 9, ["dog", "blue"])[0] for p in PROMPTS]
    verify = lm.mars_stats["verify"]
    assert verify.num_generations == len(PROMPTS) and verify.tokens_per_forward >= 1.0


def test_tau_one_equals_stock_decoding_through_lm_eval(lm):
    gen = {"until": ["sat"], "max_gen_toks": 8, "do_sample": False}
    assert lm.generate_until(requests({**gen, "mars_threshold": 1.0})) == lm.generate_until(requests(gen))


def test_model_args_give_defaults_and_gen_kwargs_win(checkpoint):
    lm = MARSLM(pretrained=str(checkpoint), dtype="float64", device="cpu", batch_size=2, mars_threshold=0.0)
    gen = {"until": ["zzz"], "max_gen_toks": 8, "do_sample": False}
    assert lm.generate_until(requests(gen)) == [direct(lm, p, 8, [], mars_threshold=0.0)[0] for p in PROMPTS]
    assert lm.generate_until(requests({**gen, "mars_threshold": 1.0})) == [
        direct(lm, p, 8, [])[0] for p in PROMPTS
    ]


def test_tokens_per_forward_is_counted_per_task_like_direct_calls(lm):
    gen = {"until": ["zzz"], "max_gen_toks": 7, "do_sample": False, "mars_threshold": 0.0}
    lm.mars_stats = {}
    lm.generate_until(requests(gen, task="a") + requests({**gen, "max_gen_toks": 3}, task="b"))
    for task, budget in (("a", 7), ("b", 3)):
        runs = [direct(lm, p, budget, [], mars_threshold=0.0) for p in PROMPTS]
        stats = lm.mars_stats[task]
        assert stats.num_tokens == sum(len(tokens) for _, tokens, _ in runs)
        assert stats.num_forwards == sum(forwards for _, _, forwards in runs)  # batched = one by one
        assert stats.num_generations == len(PROMPTS) and stats.tokens_per_forward > 1.0
    lm.mars_stats = {}
    lm.generate_until(requests({**gen, "mars_threshold": 1.0}, task="c"))
    assert lm.mars_stats["c"].tokens_per_forward == 1.0


def test_stop_criterion_is_stateless_unlike_lm_evals_own():
    """MARS looks at provisional window tokens that may be rejected: a criterion must not remember them."""
    tokenizer = tiny_tokenizer()
    prompt = tokenizer(["the"], return_tensors="pt").input_ids
    provisional = torch.cat([prompt, tokenizer(["cat dog"], return_tensors="pt").input_ids], dim=1)
    ours = StopOnSequences(tokenizer, ["dog"], prompt.shape[1], skip_special_tokens=False)
    assert ours(provisional).tolist() == [True] and ours(provisional[:, :-1]).tolist() == [False]
    theirs = stop_sequences_criteria(tokenizer, ["dog"], prompt.shape[1], 1)
    theirs(provisional, None)
    assert bool(theirs(provisional[:, :-1], None)[0])  # lm-eval's stays "done" after the rejected token


def test_offline_local_json_task_end_to_end(checkpoint, tmp_path):
    """The documented offline route for any benchmark: a task YAML over local data_files, via `mars-hf eval --tasks`."""
    data = tmp_path / "words.jsonl"
    data.write_text("".join(json.dumps({"q": p, "a": "blue"}) + "\n" for p in PROMPTS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "tiny_words.yaml").write_text(
        "task: tiny_words\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\noutput_type: generate_until\ndoc_to_text: '{{q}}'\ndoc_to_target: '{{a}}'\n"
        "generation_kwargs:\n  until: ['dog']\n  max_gen_toks: 6\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
    )
    out = tmp_path / "results.json"
    argv = ["eval", str(checkpoint), "--tasks", "tiny_words", "--include-path", str(tasks), "--thresholds", "1.0,0.0",
            "--batch-size", "2", "--verify", "--output", str(out)]  # fmt: skip
    assert cli_main(argv) == 0
    rows = {row["label"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"stock", "mars@1", "mars@0", "verify"}
    assert rows["verify"]["exact_match,none"] == rows["stock"]["exact_match,none"]
    assert all(
        row["documents"] == len(PROMPTS) and 0.0 <= row["exact_match,none"] <= 1.0 for row in rows.values()
    )
    assert rows["stock"]["exact_match,none"] == rows["mars@1"]["exact_match,none"]
    assert rows["stock"]["tokens_per_forward"] == rows["mars@1"]["tokens_per_forward"] == 1.0
    assert rows["mars@0"]["tokens_per_forward"] > 1.0


def test_humaneval_task_ships_offline_and_scores_canonical_solutions():
    from mars_hf.evaluation.lm_eval_harness import task_manager

    spec = importlib.util.spec_from_file_location(
        "humaneval_utils", TASKS_DIR / "humaneval_mars" / "utils.py"
    )
    utils = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(utils)
    problems = utils.load_humaneval_dataset(limit_problems=3)["test"]
    assert len(problems) == 3
    for problem in problems:
        tests = f"{problem['test']}\ncheck({problem['entry_point']})"
        right = [[problem["prompt"] + problem["canonical_solution"]]]
        assert utils.pass_at_1([tests], right) == 1.0
        assert utils.pass_at_1([tests], [[problem["prompt"] + "    return None\n"]]) == 0.0
    assert "humaneval_mars" in task_manager(tasks=["humaneval_mars"]).all_tasks


def test_mars_hf_eval_tasks_humaneval_on_tiny_model(checkpoint, tmp_path, capfd, monkeypatch):
    """Run outside a git repository (lm-eval's `git describe` used to print `fatal: ...` there); the
    table names each column once."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "he.json"
    argv = ["eval", str(checkpoint), "--tasks", "humaneval_mars", "--limit", "2", "--thresholds", "0.0",
            "--max-new-tokens", "6", "--confirm-run-unsafe-code", "--output", str(out)]  # fmt: skip
    assert cli_main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [row["label"] for row in rows] == ["stock", "mars@0"]
    assert all(0.0 <= row["pass_at_1,create_test"] <= 1.0 and row["documents"] == 2 for row in rows)
    printed = capfd.readouterr()
    header = next(line for line in printed.out.splitlines() if line.split()[:2] == ["task", "decoding"])
    assert header.split().count("documents") == 1 and "tokens/forward" in header
    assert "fatal" not in printed.err and "not a git repository" not in printed.err


def test_mars_kwargs_in_gen_kwargs_are_refused(checkpoint):
    argv = ["eval", str(checkpoint), "--tasks", "humaneval_mars", "--gen-kwargs", "mars_threshold=0.5"]
    with pytest.raises(ValueError, match="thresholds"):
        cli_main(argv)


@pytest.mark.slow
def test_embedded_model_humaneval_a_few_problems(tmp_path):
    """SmolLM2-135M with a fresh mask token (block size 2): τ = 1 scores exactly what stock decoding scores."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mars_hf.models.embedded_model import resolve_model_path
    from mars_hf.models.mask_token import add_mask_token, set_mars_config

    source = resolve_model_path("embedded")
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(source)
    set_mars_config(model, block_size=2, mask_token_id=add_mask_token(model, tokenizer))
    folder = tmp_path / "smollm2-mars"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    out = tmp_path / "embedded.json"
    argv = ["eval", str(folder), "--tasks", "humaneval_mars", "--limit", "3", "--thresholds", "1.0,0.5",
            "--max-new-tokens", "96", "--batch-size", "3", "--confirm-run-unsafe-code", "--output", str(out)]  # fmt: skip
    assert cli_main(argv) == 0
    rows = {row["label"]: row for row in json.loads(out.read_text())["rows"]}
    assert rows["mars@1"]["pass_at_1,create_test"] == rows["stock"]["pass_at_1,create_test"]
    assert rows["mars@1"]["tokens_per_forward"] == 1.0
    assert rows["mars@0.5"]["tokens_per_forward"] >= 1.0


@pytest.mark.slow
def test_lm_eval_command_line_with_the_registered_model(checkpoint, capsys):
    """`python -m mars_hf.evaluation.lm_eval_harness run ...`: lm-eval's own CLI, MARS gen_kwargs, tokens per forward printed."""
    from mars_hf.evaluation.lm_eval_harness import cli_evaluate

    cli_evaluate(["--tasks-dir"])
    assert capsys.readouterr().out.strip() == str(TASKS_DIR)
    cli_evaluate(["run", "--model", "mars-hf", "--model_args", f"pretrained={checkpoint},dtype=float64",
                  "--tasks", "humaneval_mars", "--include_path", str(TASKS_DIR), "--limit", "1",
                  "--gen_kwargs", "mars_threshold=0.0,max_gen_toks=4", "--confirm_run_unsafe_code",
                  "--device", "cpu"])  # fmt: skip
    out = capsys.readouterr().out
    assert "pass_at_1" in out and "humaneval_mars" in out
    assert re.search(r"mars-hf humaneval_mars: [0-9.]+ tokens per forward", out)
