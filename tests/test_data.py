"""Self-distillation: the dataset holds exactly the model's greedy output, and cut responses carry no EOS;
where a generation ends (EOS ids, trimming at the first EOS)."""

from types import SimpleNamespace

import pytest
import torch

from mars_hf.models.eos import eos_token_ids, pad_token_id, trim_at_eos
from mars_hf.training.data import chat_prompt_ids, self_distill
from mars_hf.training.prompts import held_out_prompts, is_held_out, training_prompts
from tests.tiny import tiny_model, tiny_tokenizer

PROMPTS = [
    "the cat sat on the mat",
    "hello",
    "print x if y else z and the dog is red",
    "one two three",
    "def x return y",
]


def _greedy_one_by_one(model, tokenizer, prompt, max_new_tokens, eos_ids):
    ids = torch.tensor([chat_prompt_ids(tokenizer, prompt)])
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=eos_ids,
    )
    response = []
    for token in out[0, ids.shape[1] :].tolist():  # the slow obvious trim, independent of trim_at_eos
        response.append(token)
        if token in eos_ids:
            break
    return response


@pytest.fixture
def model_with_frequent_eos():
    """A tiny float64 model where a token it often emits also counts as EOS, so some answers end and some are cut."""
    tokenizer = tiny_tokenizer()
    model = tiny_model("llama", seed=3, tokenizer=tokenizer)
    seen_in = {}  # token -> how many prompts' answers contain it
    for prompt in PROMPTS:
        for token in set(_greedy_one_by_one(model, tokenizer, prompt, 12, [tokenizer.eos_token_id])):
            seen_in[token] = seen_in.get(token, 0) + 1
    some = {token: n for token, n in seen_in.items() if 0 < n < len(PROMPTS)}
    frequent = max(some, key=lambda token: (some[token], token))
    model.generation_config.eos_token_id = sorted({tokenizer.eos_token_id, frequent})
    return model, tokenizer


def test_self_distill_equals_greedy_generate_per_prompt(model_with_frequent_eos):
    model, tokenizer = model_with_frequent_eos
    eos_ids = model.generation_config.eos_token_id
    max_new_tokens = 12
    dataset = self_distill(
        model, tokenizer, PROMPTS, max_new_tokens=max_new_tokens, batch_size=2, progress=False
    )
    assert len(dataset) == len(PROMPTS)
    assert set(dataset.column_names) >= {"messages", "input_ids", "completion_mask", "ends_with_eos"}
    ended = []
    for row, prompt in zip(dataset, PROMPTS):
        expected = _greedy_one_by_one(model, tokenizer, prompt, max_new_tokens, eos_ids)
        prompt_ids = chat_prompt_ids(tokenizer, prompt)
        assert row["input_ids"] == prompt_ids + expected, prompt
        assert row["completion_mask"] == [0] * len(prompt_ids) + [1] * len(expected)
        assert row["labels"] == [-100] * len(prompt_ids) + expected
        assert row["ends_with_eos"] == (expected[-1] in eos_ids)
        if not row["ends_with_eos"]:  # cut at the limit: no EOS anywhere in the response
            assert len(expected) == max_new_tokens and not set(expected) & set(eos_ids)
        assert row["messages"][0] == {"role": "user", "content": prompt}
        assert row["messages"][-1]["role"] == "assistant"
        assert row["messages"][-1]["content"] == tokenizer.decode(expected, skip_special_tokens=True)
        ended.append(row["ends_with_eos"])
    assert any(ended) and not all(ended), "the fixture should give both ended and cut responses"


def test_self_distill_batching_does_not_change_outputs(model_with_frequent_eos):
    model, tokenizer = model_with_frequent_eos
    one = self_distill(model, tokenizer, PROMPTS, max_new_tokens=8, batch_size=1, progress=False)
    many = self_distill(model, tokenizer, PROMPTS, max_new_tokens=8, batch_size=4, progress=False)
    assert one["input_ids"] == many["input_ids"]


def test_trainer_collator_pads_only_responses_that_end_with_eos(model_with_frequent_eos, tmp_path):
    """Contract with MARSTrainer: EOS block padding goes to ended responses only, never to cut ones."""
    from mars_hf.training.config import MARSConfig
    from mars_hf.training.trainer import MARSTrainer

    model, tokenizer = model_with_frequent_eos
    tokenizer.eos_token = tokenizer.convert_ids_to_tokens(model.generation_config.eos_token_id[-1])
    dataset = self_distill(model, tokenizer, PROMPTS, max_new_tokens=9, batch_size=5, progress=False)
    args = MARSConfig(output_dir=str(tmp_path), block_size=4, max_steps=1, report_to="none", use_cpu=True)
    trainer = MARSTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    examples = [trainer.train_dataset[i] for i in range(len(dataset))]
    seen = set()
    for example, row in zip(examples, dataset):
        padded = trainer.data_collator.pad_example(dict(example))
        added = len(padded["input_ids"]) - len(row["input_ids"])
        if row["ends_with_eos"] and tokenizer.eos_token_id == row["input_ids"][-1]:
            assert len(padded["input_ids"]) % 4 == 0
            assert padded["input_ids"][len(row["input_ids"]) :] == [tokenizer.eos_token_id] * added
            assert padded["labels"][len(row["input_ids"]) :] == [tokenizer.eos_token_id] * added  # supervised
            seen.add("ended" if added else "ended on a block boundary")
        else:
            assert added == 0
            seen.add("cut" if not row["ends_with_eos"] else "other eos")
    assert {"ended", "cut"} <= seen, seen  # both sides of the contract are exercised (a real pad, a cut row)
    batch = trainer.data_collator(examples)
    labels = batch["labels"]
    for i, row in enumerate(dataset):  # prompt tokens are never supervised; response tokens are
        n_prompt = row["completion_mask"].index(1)
        assert (labels[i, :n_prompt] == -100).all()
        assert labels[i, n_prompt : len(row["input_ids"])].tolist() == row["input_ids"][n_prompt:]


def test_prompt_splits_are_disjoint_and_deterministic():
    train = training_prompts(400)
    held = held_out_prompts(40)
    assert len(set(train)) == 400 and len(set(held)) == 40
    assert not set(train) & set(held)
    assert all(is_held_out(p) for p in held) and not any(is_held_out(p) for p in train)
    assert training_prompts(400) == train  # fixed seed
    for n in (1, 7, 50, 399):  # a smaller draw is a prefix of a larger one: asking for more only adds prompts
        assert training_prompts(n) == train[:n], n
    assert held_out_prompts(10) == held[:10]
    with pytest.raises(ValueError, match="templates only produce"):
        held_out_prompts(10**6)


def test_eos_ids_join_the_generation_config_and_the_tokenizer():
    tokenizer = tiny_tokenizer()
    model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[5, 7]))
    assert eos_token_ids(model, tokenizer) == {5, 7, tokenizer.eos_token_id}
    model.generation_config.eos_token_id = 9
    assert eos_token_ids(model, tokenizer) == {9, tokenizer.eos_token_id}
    no_eos = SimpleNamespace(eos_token_id=None, pad_token_id=None)
    assert eos_token_ids(model, no_eos) == {9}
    assert pad_token_id(no_eos, {9, 4}) == 4  # no pad token: the smallest EOS id
    assert pad_token_id(tokenizer, {9, 4}) == tokenizer.pad_token_id
    model.generation_config.eos_token_id = None
    with pytest.raises(ValueError, match="define no EOS token; set `tokenizer.eos_token`"):
        eos_token_ids(model, no_eos)


@pytest.mark.parametrize(
    "tokens,expected",
    [([1, 7, 2, 5], [1, 7]), ([5], [5]), ([1, 2], [1, 2]), ([], []), ([1, 2, 5, 5], [1, 2, 5])],
)
def test_trim_at_eos_keeps_everything_up_to_and_including_the_first_eos(tokens, expected):
    assert trim_at_eos(tokens, {5, 7}) == expected
    assert trim_at_eos(iter(tokens), {5, 7}) == expected


def test_sampled_self_distill_is_seeded_varied_and_greedy_at_a_tiny_temperature():
    """temperature > 0 samples the answers: the same seed gives the same rows, they differ from greedy,
    and as the temperature goes to 0 the samples become the greedy answers (the obvious limit)."""
    tokenizer = tiny_tokenizer()
    model = tiny_model("llama", seed=3, tokenizer=tokenizer)
    greedy = self_distill(model, tokenizer, PROMPTS, max_new_tokens=8, batch_size=2, progress=False)

    def sampled(temperature, seed=0):
        torch.manual_seed(seed)
        return self_distill(
            model, tokenizer, PROMPTS, max_new_tokens=8, batch_size=2, progress=False, temperature=temperature
        )

    assert sampled(1.5)["input_ids"] == sampled(1.5)["input_ids"]
    assert sampled(1.5)["input_ids"] != greedy["input_ids"]
    assert sampled(1.5, seed=1)["input_ids"] != sampled(1.5)["input_ids"]
    assert sampled(1e-4)["input_ids"] == greedy["input_ids"]
    rows = sampled(1.5)
    for ids, labels, mask in zip(rows["input_ids"], rows["labels"], rows["completion_mask"]):
        assert len(ids) == len(labels) == len(mask)
        assert [t for t, m in zip(ids, mask) if m] == [t for t in labels if t != -100]


def test_sampling_keywords_are_checked():
    from mars_hf.training.data import sampling_kwargs

    assert sampling_kwargs(None)["do_sample"] is False and sampling_kwargs(0.0)["do_sample"] is False
    assert sampling_kwargs(0.7, 0.9) == {"do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": None}
    with pytest.raises(ValueError, match="temperature"):
        sampling_kwargs(-1.0)
    with pytest.raises(ValueError, match="top_p"):
        sampling_kwargs(0.7, 0.0)


def test_distill_command_skips_excluded_prompts_and_writes_rounds_of_samples(tmp_path):
    """`mars-hf distill`: greedy rows are the model's answers to the training-split prompts; a second run
    with --exclude-prompts-from never answers those prompts, and --samples-per-prompt writes each
    remaining prompt once per round."""
    import json

    from mars_hf.cli import main

    tokenizer = tiny_tokenizer()
    folder = tmp_path / "tiny"
    tiny_model("llama", seed=3, tokenizer=tokenizer, dtype=torch.float32).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    common = ["--model", str(folder), "--num-prompts", "6", "--max-new-tokens", "4", "--batch-size", "4"]
    greedy = tmp_path / "greedy.jsonl"
    assert main(["distill", "--out", str(greedy), *common, "--device", "cpu"]) == 0
    greedy_rows = [json.loads(line) for line in greedy.read_text().splitlines()]
    prompts = [row["messages"][0]["content"] for row in greedy_rows]
    assert prompts == training_prompts(6, seed=0)
    kept_apart = tmp_path / "kept_apart.jsonl"
    kept_apart.write_text("".join(json.dumps(row) + "\n" for row in greedy_rows[:2]))
    sampled = tmp_path / "sampled.jsonl"
    argv = ["distill", "--out", str(sampled), *common, "--temperature", "1.5", "--samples-per-prompt", "3"]
    assert main([*argv, "--exclude-prompts-from", str(kept_apart)]) == 0
    sampled_prompts = [json.loads(line)["messages"][0]["content"] for line in sampled.read_text().splitlines()]
    assert sampled_prompts == prompts[2:] * 3
    with pytest.raises(ValueError, match="temperature"):
        main(["distill", "--out", str(tmp_path / "x.jsonl"), *common, "--samples-per-prompt", "2"])
