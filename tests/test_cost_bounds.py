"""Cost curves that name impossible widths (issue 52, fault 8): a given ``mars_cost_table`` or a curve file
under ``MARS_HF_COST_CACHE`` whose sizes are huge, nonsensical or nested past the parser's limit.

Before: a curve that called a huge width cheap (``{"sizes": [1, 100000000], ...}``, ``{..., 500: 1.0}``) padded
every step that carried a mask to that many columns (hung > 40 s at 10⁸); deeply nested JSON raised an
uncaught ``RecursionError``. Now a step is never padded past the widest plan of the window, a bad argument is a
``ValueError`` that names the key and the fix, and a bad file is ignored with a warning (measured again,
rewritten). The checks read the chosen widths, never the time (the old code ran the same cases, wide).
"""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import torch

from mars_hf.decoding import cost_model
from mars_hf.decoding.cost_model import CostTable
from mars_hf.decoding.generation import enable_mars
from mars_hf.decoding.memory import PlannerMemory
from tests.test_generation import _batch
from tests.tiny import tiny_model, tiny_tokenizer

WINDOW = 4  # tiny_model's block size


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def _fake_measure(model, *, batch, sizes, mask_token_id, **_):
    """The probe on a mocked clock: a fixed curve over the sizes asked for (no forward is timed)."""
    sizes = tuple(sorted(set(sizes) | {1}))
    return CostTable(sizes, tuple(1.0 + 0.3 * (n - 1) for n in sizes), "measured", batch, 1e-3)


def test_padding_never_goes_past_the_windows_widest_plan():
    table = CostTable.from_mapping({1: 1.0, 2: 1.4, 500: 1.0})
    assert table.cost(300) < table.cost(3)  # the curve calls 500 columns cheaper than 3
    assert table.padded_width(3) == 3  # default bound: the widest probed width (64)
    narrow = dataclasses.replace(CostTable.from_mapping({1: 1.0, 3: 2.0, 4: 1.5, 9: 1.2}), widest=4)
    assert narrow.padded_width(3) == 4 and narrow.padded_width(5) == 5  # 9 is cheaper, but past the bound
    assert dataclasses.replace(narrow, widest=64).padded_width(5) == 9
    given = cost_model.cost_table(
        None, batch_size=4, window=2, mask_token_id=0, given={1: 1.0, 2: 1.4, 500: 1.0}
    )
    assert given.widest == cost_model.candidate_widths(2)[-1] == 9 and given.batch == 4


def test_a_given_curve_that_calls_a_huge_width_cheap_decodes_within_the_window(tok):
    model = enable_mars(tiny_model("llama", seed=3))
    encoded = _batch(tok)
    stock = model.generate(**encoded, max_new_tokens=8, do_sample=False)
    out = model.generate(
        **encoded, max_new_tokens=8, do_sample=False, mars_acceptance="verify", return_dict_in_generate=True,
        mars_cost_table={1: 1.0, 2: 1.4, 500: 1.0},
    )  # fmt: skip
    assert torch.equal(out.sequences, stock)
    prompt = encoded.input_ids.shape[1]
    widest = cost_model.candidate_widths(WINDOW)[-1]
    assert max(out.forward_widths.tolist()) <= max(prompt + 2 * WINDOW, widest), out.forward_widths.tolist()


@pytest.mark.parametrize(
    "bad, named",
    [
        ({1: 1.0, 100_000_000: 1.0}, "100000000"),
        ({1: 1.0, 4097: 1.0}, "4097"),
        ({1: 1.0, float("inf"): 2.0}, "inf"),
        ({1: 1.0, float("nan"): 2.0}, "nan"),
        ({1: 1.0, "two": 1.2}, "'two'"),
        ({1: 1.0, (2,): 1.2}, "(2,)"),
        ({1: 1.0, 2: True}, "True"),
        ({1: 1.0, 2: "1.2"}, "'1.2'"),
        ({1: 1e-300, 2: 1e300}, "overflow"),
    ],
)
def test_a_cost_table_argument_with_an_impossible_width_or_cost_names_the_key(bad, named):
    with pytest.raises(ValueError, match="mars_cost_table") as error:
        CostTable.from_mapping(bad)
    assert named in str(error.value) and "e.g." in str(error.value)


def test_generate_refuses_a_huge_width_before_decoding(tok):
    model = enable_mars(tiny_model("llama", seed=3))
    with pytest.raises(ValueError, match=r"`mars_cost_table` key 100000000 .*from 1 to 4096"):
        model.generate(
            **_batch(tok),
            max_new_tokens=4,
            mars_acceptance="verify",
            mars_cost_table={1: 1.0, 100_000_000: 1.0},
        )


def test_a_cost_table_saved_as_json_keeps_its_integer_keys():
    """A ``GenerationConfig`` written to JSON turns ``{2: 1.05}`` into ``{"2": 1.05}``: read as the same curve."""
    table = CostTable.from_mapping(json.loads(json.dumps({1: 1.0, 2: 1.05, 5: 1.3})))
    assert table.as_dict() == {1: 1.0, 2: 1.05, 5: 1.3}
    deep = [1.0]
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(ValueError, match="mars_cost_table"):  # a nested value is named, not printed whole
        CostTable.from_mapping({1: 1.0, 2: deep})


def _nested(depth: int) -> str:
    return '{"sizes": ' + "[" * depth + "]" * depth + ', "costs": [1.0]}'


DAMAGED = {
    "a huge width": json.dumps({"sizes": [1, 2, 100_000_000], "costs": [1.0, 1.3, 0.5]}),
    "a width the probe never times": json.dumps({"sizes": [1, 2, 500], "costs": [1.0, 1.3, 0.5]}),
    "nested past the parser's limit": _nested(5000),
    "lists of two lengths": json.dumps({"sizes": [1, 2, 3], "costs": [1.0, 1.3]}),
    "a repeated width": json.dumps({"sizes": [1, 2, 2], "costs": [1.0, 1.3, 1.4]}),
    "sizes that are no list": json.dumps({"sizes": {"1": 1}, "costs": [1.0]}),
    "widths as strings": json.dumps({"sizes": ["1", "2"], "costs": [1.0, 1.3]}),
    "a file far larger than a curve": json.dumps({"sizes": [1, 2], "costs": [1.0, 1.3]}) + " " * 70_000,
}


@pytest.mark.parametrize("damage", sorted(DAMAGED))
def test_a_damaged_curve_file_is_ignored_with_a_warning_and_rewritten(damage, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(cost_model.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(cost_model, "measure", _fake_measure)
    mask = tiny_model("qwen2", seed=9).config.mars["mask_token_id"]
    first = cost_model.cost_table(tiny_model("qwen2", seed=9), batch_size=1, window=2, mask_token_id=mask, memory=PlannerMemory())
    (path,) = tmp_path.iterdir()
    path.write_text(DAMAGED[damage])
    with caplog.at_level(logging.WARNING, logger="mars_hf.decoding.cost_model"):
        again = cost_model.cost_table(tiny_model("qwen2", seed=9), batch_size=1, window=2, mask_token_id=mask, memory=PlannerMemory())
    assert "Ignoring the MARS cost table" in caplog.text
    assert again.source == "measured" and again.as_dict() == first.as_dict()
    assert json.loads(path.read_text())["sizes"] == list(first.sizes)  # measured again, rewritten whole


def test_a_curve_file_with_a_huge_width_decodes_within_the_window(tok, tmp_path, monkeypatch, caplog):
    """End to end: the file that once padded every step to its width is ignored; output = stock greedy."""
    monkeypatch.setenv(cost_model.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(cost_model, "measure", _fake_measure)
    encoded = _batch(tok)
    model = enable_mars(tiny_model("llama", seed=3))
    stock = model.generate(**encoded, max_new_tokens=8, do_sample=False)
    model.generate(
        **encoded, max_new_tokens=8, do_sample=False, mars_acceptance="verify", mars_cost_probe=True
    )  # writes the curve
    (path,) = tmp_path.iterdir()
    path.write_text(json.dumps({"sizes": [1, 2, 500], "costs": [1.0, 1.4, 0.5]}))
    fresh = enable_mars(tiny_model("llama", seed=3))  # another object: the curve comes from disk
    with caplog.at_level(logging.WARNING, logger="mars_hf.decoding.cost_model"):
        out = fresh.generate(
            **encoded,
            max_new_tokens=8,
            do_sample=False,
            mars_acceptance="verify",
            mars_cost_probe=True,
            return_dict_in_generate=True,
        )
    assert torch.equal(out.sequences, stock) and "Ignoring the MARS cost table" in caplog.text
    assert (
        max(out.forward_widths.tolist()) < 500
        and out.cost_curve
        == _fake_measure(
            None, batch=4, sizes=cost_model.probe_sizes(cost_model.candidate_widths(WINDOW)), mask_token_id=0
        ).as_dict()
    )


def _special_file(kind: str, path) -> None:
    import os

    if kind == "a FIFO":
        os.mkfifo(path)  # nothing ever writes: a blocking open waits forever
    elif kind == "a symlink to /dev/zero":
        os.symlink("/dev/zero", path)  # getsize reads 0; a plain read never ends
    else:
        os.mkdir(path)


@pytest.mark.parametrize("kind", ["a FIFO", "a symlink to /dev/zero", "a folder"])
def test_a_curve_path_that_is_no_regular_file_is_ignored_with_a_warning(kind, tmp_path, monkeypatch, caplog):
    """Issue 59, fault 1: a FIFO at the curve's path hung ``cost_table`` forever and a symlink to /dev/zero was
    read without limit (MemoryError). Now only a regular file is read, at most the cap, anything else ignored
    with a warning and measured again. Run in a thread with a deadline, so that a hang fails the test."""
    import threading

    monkeypatch.setenv(cost_model.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(cost_model, "measure", _fake_measure)
    mask = tiny_model("qwen2", seed=9).config.mars["mask_token_id"]
    cost_model.cost_table(tiny_model("qwen2", seed=9), batch_size=1, window=2, mask_token_id=mask, memory=PlannerMemory())
    (path,) = tmp_path.iterdir()
    path.unlink()
    _special_file(kind, path)
    result = {}
    model = tiny_model("qwen2", seed=9)

    def read():
        result["table"] = cost_model.cost_table(model, batch_size=1, window=2, mask_token_id=mask, memory=PlannerMemory())

    with caplog.at_level(logging.WARNING, logger="mars_hf.decoding.cost_model"):
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(timeout=60)
    assert not reader.is_alive(), f"reading {kind} at the curve's path hung"
    assert result["table"].source == "measured"
    assert "Ignoring the MARS cost table" in caplog.text and "not a regular file" in caplog.text
