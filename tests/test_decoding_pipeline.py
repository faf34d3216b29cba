"""The decoding core reads as a pipeline (docs/verified_decoding.md, "The decoder, in parts").

- One verify step, from ``generate`` to the kept tokens, runs through five modules: ``generation`` →
  ``decoder`` → ``planner`` → ``drafts`` → ``acceptance``; whatever else it calls is a helper that makes no
  decision and calls none of the five (checked by profiling a real step, and by reading the helpers' imports).
- The decoder alone changes a row's state (an ``ast`` walk; the walk is shown to catch a mutant first).
- Drafts are immutable values; the settings travel whole (no loose keyword per setting).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
from pathlib import Path

import pytest
import torch

from mars_hf.decoding.decoder import MARSBatchDecoder
from mars_hf.decoding.drafts import CHAINED, MASKS, Drafts
from mars_hf.decoding.generation import enable_mars
from mars_hf.decoding.planner import StepPlanner
from mars_hf.decoding.settings import MARSDecodingSettings
from tests.tiny import tiny_model, tiny_tokenizer

DECODING = Path(__file__).resolve().parents[1] / "mars_hf" / "decoding"
PIPELINE = ("generation", "decoder", "planner", "drafts", "acceptance")
# what the five call: each makes no decision of a step, and calls none of the five
HELPERS = (
    "layouts",
    "cost_model",
    "memory",
    "stats",
    "sampling",
    "rules",
    "processing",
    "cache",
    "calibration",
    "settings",
    "cpu_kernels",
    "home",
)
# the entry of a model enable_mars wrapped (MARSModel: its generate, its forward delegating to the model's)
ENTRIES = ("enable",)
# a row's state, as the decoder keeps it between steps
ROW_FIELDS = {"tokens", "drafts", "committed", "prefilled", "finished", "tau", "window", "floor", "noise"}


def _decoding_modules_called(fn) -> set[str]:
    """The ``mars_hf.decoding`` modules whose functions run while ``fn()`` runs."""
    seen: set[str] = set()

    def profile(frame, event, arg):
        if event == "call":
            name = frame.f_globals.get("__name__", "")
            if name.startswith("mars_hf.decoding."):
                seen.add(name.rsplit(".", 1)[-1])

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen


def test_a_verify_step_runs_through_five_modules():
    """``generate`` with verify, prompt lookup and the planner on a tiny float64 model: the modules its steps
    run in are the five and helpers only, and each of the five runs."""
    torch.manual_seed(0)
    model = enable_mars(tiny_model("llama", dtype=torch.float64), block_size=3)
    tok = tiny_tokenizer()
    encoded = tok(["the cat sat on the mat the cat sat on"], return_tensors="pt")
    stock = model.generate(**encoded, max_new_tokens=12, do_sample=False)

    def verify():
        out = model.generate(
            **encoded,
            max_new_tokens=12,
            do_sample=False,
            mars_acceptance="verify",
            prompt_lookup_num_tokens=3,
            mars_cost_table={1: 1.0},
        )
        assert torch.equal(out, stock)

    called = _decoding_modules_called(verify)
    assert set(PIPELINE) <= called, called
    others = called - set(PIPELINE) - set(ENTRIES)
    assert others <= set(HELPERS), others - set(HELPERS)


def _imports(module: str) -> set[str]:
    tree = ast.parse((DECODING / f"{module}.py").read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            names.add(node.module)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mars_hf.decoding."):
            names.add(node.module.rsplit(".", 1)[-1])
    return names


def test_helpers_never_call_into_the_pipeline():
    """The helpers a step calls import none of the five (``settings`` only reads their constants)."""
    for helper in HELPERS:
        if helper == "settings":
            continue
        assert not _imports(helper) & set(PIPELINE), (helper, _imports(helper) & set(PIPELINE))


def row_state_writes(source: str) -> list[str]:
    """Assignments (plain, augmented, or through a mutating call) to a row field of anything but ``self``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in {"append", "extend", "insert", "pop", "clear"}:
                targets = [node.func.value]
        for target in targets:
            for sub in ast.walk(target):
                if (
                    isinstance(sub, ast.Attribute)
                    and sub.attr in ROW_FIELDS
                    and not (isinstance(sub.value, ast.Name) and sub.value.id == "self")
                ):
                    found.append(ast.unparse(sub))
    return found


def test_the_row_check_finds_a_mutant():
    assert row_state_writes("def plan(row):\n    row.drafts = row.drafts[:2]\n") == ["row.drafts"]
    assert row_state_writes("def keep(rows, i):\n    rows[i].tokens += [3]\n") == ["rows[i].tokens"]
    assert row_state_writes("def keep(row):\n    row.tokens.append(3)\n") == ["row.tokens"]
    assert row_state_writes("def fine(self, row):\n    self.window = row.window\n") == []


def test_only_the_decoder_changes_a_row():
    """Every module of ``mars_hf/decoding`` but ``decoder.py`` reads rows and never writes them."""
    for path in sorted(DECODING.glob("*.py")):
        if path.name == "decoder.py":
            continue
        assert row_state_writes(path.read_text()) == [], path.name
    assert row_state_writes((DECODING / "decoder.py").read_text())  # the decoder does write them


def test_drafts_are_immutable_values():
    chain = Drafts((5, 6, 7, 8), (0.9, 0.8), CHAINED)
    with pytest.raises(dataclasses.FrozenInstanceError):
        chain.tokens = (1,)
    assert chain.first(9) is chain
    assert chain.first(3) == Drafts((5, 6, 7), (0.9, 0.8), CHAINED)
    assert chain.first(2) == Drafts((5, 6), (0.9, 0.8), MASKS)  # cut inside its mask part: the masks' own
    assert chain.tokens == (5, 6, 7, 8)


def test_the_settings_travel_whole():
    """The decoder and the planner take one ``MARSDecodingSettings``, not a keyword per setting; a bad value is
    refused where the settings are made, naming the keyword."""
    setting_names = {field.name for field in dataclasses.fields(MARSDecodingSettings)}
    for cls in (MARSBatchDecoder, StepPlanner):
        parameters = set(inspect.signature(cls).parameters)
        assert "settings" in parameters and not parameters & (setting_names - {"settings"}), (cls, parameters)
    with pytest.raises(ValueError, match="mars_layout"):
        MARSDecodingSettings(window=2, mask_token_id=1, layout="diagonal")
    with pytest.raises(ValueError, match="mars_cpu_kernels"):
        MARSDecodingSettings(window=2, mask_token_id=1, cpu_kernels="fast")
    with pytest.raises(TypeError, match="MARSDecodingSettings"):
        MARSBatchDecoder(tiny_model("llama"), {"window": 2}, max_rows=1, max_length=8, pad_token_id=0)
