"""Training faults of issue 52: nothing trained is lost to what runs after training, and bad data files
are refused by name (file, row, accepted formats) instead of a bare StopIteration / KeyError."""

from __future__ import annotations

import json

import pytest
import torch
from datasets import Dataset

from mars_hf import MARSConfig, MARSTrainer
from mars_hf.cli import build_parser
from mars_hf.commands.train import load_example_script
from mars_hf.training import calibration_fit
from tests.tiny import tiny_model, tiny_tokenizer


@pytest.fixture
def text_model(tmp_path):
    """A tiny llama whose vocabulary is its tokenizer's (so its greedy path is text), and 20 `text` rows of
    its own greedy continuation: rows a calibration fit can use."""
    tokenizer = tiny_tokenizer(with_mask=False)
    model = tiny_model("llama", block_size=None, dtype=torch.float32, vocab_size=len(tokenizer))
    path = tmp_path / "model"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    prompt = tokenizer("the cat sat", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        ids = model.generate(prompt, max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=2)
    ids = ids[0].tolist()
    special = set(tokenizer.all_special_ids)
    ids = ids[: next((i for i, t in enumerate(ids) if t in special), len(ids))]
    text = tokenizer.decode(ids)
    assert tokenizer(text)["input_ids"] == ids and len(ids) >= 8  # the text is exactly that path
    data = tmp_path / "text.jsonl"
    data.write_text("".join(json.dumps({"text": text}) + "\n" for _ in range(20)))
    return path, data


def train_args(model_dir, data, out):
    """The issue's reproduction (default calibration_holdout=0.05: one of the 20 rows)."""
    return [
        "--model_name_or_path", str(model_dir), "--dataset_name", str(data), "--block_size", "4",
        "--max_length", "64", "--max_steps", "3", "--report_to", "none", "--use_cpu", "true",
        "--save_strategy", "no", "--output_dir", str(out), "--learning_rate", "1e-6", "--bf16", "false",
    ]  # fmt: skip


def test_a_text_dataset_trains_saves_and_calibrates(text_model, tmp_path):
    model_dir, data = text_model
    out = tmp_path / "out"
    load_example_script().cli(train_args(model_dir, data, out))
    assert (out / "model.safetensors").is_file() and (out / "trainer_state.json").is_file()
    mars = json.loads((out / "config.json").read_text())["mars"]
    assert mars["block_size"] == 4
    assert mars["calibration"]["num_examples"] == 1 and mars["calibration"]["num_samples"][0] > 0


def test_a_failing_calibration_leaves_the_trained_model_saved(text_model, tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("injected calibration failure")

    monkeypatch.setattr(calibration_fit, "attach_calibration", broken)
    model_dir, data = text_model
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="injected"):
        load_example_script().cli(train_args(model_dir, data, out))
    assert (out / "model.safetensors").is_file() and (out / "trainer_state.json").is_file()
    mars = json.loads((out / "config.json").read_text())["mars"]
    assert mars["block_size"] == 4 and "calibration" not in mars


def test_calibration_reads_text_rows_only_when_asked():
    tokenizer = tiny_tokenizer()
    (ids,), (labels,) = calibration_fit.examples_from_records(
        tokenizer, [{"text": "the cat sat", "messages": None}], text_field="text"
    )
    assert ids == labels == tokenizer("the cat sat")["input_ids"]
    with pytest.raises(ValueError, match="'text'"):
        calibration_fit.examples_from_records(tokenizer, [{"foo": "x"}], text_field="text")


def test_an_empty_file_is_refused_by_name(text_model, tmp_path):
    model_dir, _ = text_model
    for content in ("", "\n  \n"):
        empty = tmp_path / "empty.jsonl"
        empty.write_text(content)
        with pytest.raises(ValueError, match=r"empty\.jsonl is empty.*'messages'.*'text'"):
            load_example_script().cli(train_args(model_dir, empty, tmp_path / "out"))


def test_a_row_without_a_format_is_refused_by_file_and_row(text_model, tmp_path):
    model_dir, _ = text_model
    data = tmp_path / "mixed.jsonl"
    rows = [{"text": "the cat"}, {"text": "a dog"}, {"foo": "x"}, {"text": "is red"}]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(ValueError, match=r"Row 2 of .*mixed\.jsonl .*\['foo'\].*'prompt' and 'completion'"):
        load_example_script().cli(train_args(model_dir, data, tmp_path / "out"))


def test_the_trainer_names_a_row_without_a_format(tmp_path):
    tokenizer = tiny_tokenizer()
    model = tiny_model("llama", tokenizer=tokenizer, dtype=torch.float32)
    rows = Dataset.from_list(
        [{"prompt": "the cat", "completion": "sat"}, {"prompt": "a dog", "completion": None}]
    )
    args = MARSConfig(output_dir=str(tmp_path), block_size=4, report_to="none", use_cpu=True, bf16=False)
    with pytest.raises(ValueError, match=r"Row 1 of the train dataset .*\['prompt'\].*'messages'"):
        MARSTrainer(model=model, args=args, train_dataset=rows, processing_class=tokenizer)


def test_train_takes_its_arguments_without_patching_argparse():
    """Issue 50: the `train` subparser is argparse's own (no `parse_known_args` assigned on it), and still
    hands every argument, `--help` included, to the script in order."""
    parser = build_parser()
    (action,) = [a for a in parser._actions if a.dest == "command"]
    train = action.choices["train"]
    assert "parse_known_args" not in vars(train)
    argv = ["--config", "r.yaml", "--block_size", "2", "-h", "--num_processes", "2", "--", "x"]
    assert parser.parse_args(["train", *argv]).script_args == argv
    assert parser.parse_args(["train"]).script_args == []


def test_train_drops_rows_that_hold_an_evaluation_prompt(text_model, tmp_path, monkeypatch):
    """`mars-hf train` keeps benchmark prompts out of training: a row quoting one is dropped before training
    (the trainer sees 19 of 20 + 1 rows), and `--exclude_evaluation_prompts false` keeps it."""
    from mars_hf.tools.bench.prompts import BUILTIN_PROMPTS

    model_dir, data = text_model
    leaked = json.dumps({"text": "Please answer: " + BUILTIN_PROMPTS[0]}) + "\n"
    data.write_text(data.read_text() + leaked)
    seen = {}
    original = MARSTrainer.__init__

    def record(self, *args, train_dataset=None, **kwargs):
        seen["rows"] = [row["text"] for row in train_dataset]
        original(self, *args, train_dataset=train_dataset, **kwargs)

    monkeypatch.setattr(MARSTrainer, "__init__", record)
    args = train_args(model_dir, data, tmp_path / "out") + ["--calibration_holdout", "0"]
    load_example_script().cli(args)
    assert len(seen["rows"]) == 20 and not any(BUILTIN_PROMPTS[0] in row for row in seen["rows"])
    load_example_script().cli(args + ["--exclude_evaluation_prompts", "false"])
    assert len(seen["rows"]) == 21


def test_a_null_text_is_named_as_null_not_as_no_field(text_model, tmp_path):
    """Issue 59, fault 6: ``{"text": null}`` was reported with "its fields: []" although the row has the field."""
    model_dir, _ = text_model
    data = tmp_path / "null.jsonl"
    data.write_text('{"text": "the cat"}\n{"text": null}\n')
    with pytest.raises(
        ValueError, match=r"Row 1 of .*null\.jsonl .*its fields: \[\]; null or absent: \['text'\]"
    ):
        load_example_script().cli(train_args(model_dir, data, tmp_path / "out"))


@pytest.mark.parametrize(
    "content, named",
    [
        (
            b'{"text": "the cat"}\n{"text": "a dog"\n{"text": "is red"}\n',
            r"bad\.jsonl, line 2, column \d+: not JSON",
        ),
        (
            b'{"text": "the cat"}\n{"text": "caf\xe9"}\n',
            r"bad\.jsonl, line 2: byte 0xe9 at column 14 is not UTF-8",
        ),
        (b'[{"text": "the cat"},\n {"text": "a dog"},,\n]\n', r"bad\.jsonl, line 2, column \d+: not JSON"),
    ],
    ids=["malformed line", "latin-1", "malformed array"],
)
def test_a_file_that_is_not_json_or_not_utf8_is_refused_by_file_and_line(
    text_model, tmp_path, content, named
):
    """Issue 59, fault 6: a malformed JSON line gave a raw ``DatasetGenerationError`` (pyarrow) traceback and a
    latin-1 file a raw ``UnicodeDecodeError``; both now name the file and the line."""
    model_dir, _ = text_model
    data = tmp_path / "bad.jsonl"
    data.write_bytes(content)
    with pytest.raises(ValueError, match=named):
        load_example_script().cli(train_args(model_dir, data, tmp_path / "out"))


def test_a_document_over_several_lines_and_a_bom_still_load(text_model, tmp_path):
    """What the ``json`` builder reads is not refused by the line check: a JSON array over several lines."""
    from mars_hf.scripts.train_mars import check_json_file

    data = tmp_path / "array.json"
    data.write_text('[\n  {"text": "the cat"},\n  {"text": "a dog"}\n]\n')
    check_json_file(str(data))
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b'\xef\xbb\xbf{"text": "the cat"}\n')
    check_json_file(str(bom))


def test_rows_of_several_formats_are_refused_with_their_counts(text_model, tmp_path):
    """Issue 59, fault 6: a jsonl of 5 ``text`` rows and 1 ``messages`` row trained on the one chat alone."""
    model_dir, _ = text_model
    data = tmp_path / "mixed.jsonl"
    rows = [{"text": f"the cat {i}"} for i in range(5)]
    rows.insert(
        3, {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a dog"}]}
    )
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(
        ValueError,
        match=r"mixed\.jsonl mixes training formats: 5 'text' \(first: row 0\), 1 'messages' \(first: row 3\)",
    ):
        load_example_script().cli(train_args(model_dir, data, tmp_path / "out"))
