"""A mask-gated adapter is loaded right or refused (library rules: never silently wrong).

Saved as a plain PEFT LoRA, a gated adapter would load through PEFT's own loaders with its delta at every position.
mars_hf saves it under a ``peft_type`` PEFT does not know (``gated_lora.MARS_PEFT_TYPE``): PEFT's loaders refuse it,
in a process that never imports mars_hf, with an error that names mars_hf; mars_hf's loaders read the new form and
the older one (peft_type ``LORA`` with ``gate_token_id``), real positions bit for bit the base model's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import AutoModelForCausalLM

from mars_hf import hub
from mars_hf.decoding import gated_lora
from mars_hf.hub.custom_generate_src import gated_lora as slim_gated_lora
from mars_hf.models.embedded_model import embedded_mars_checkpoint
from mars_hf.models.gated_peft import MaskGatedLoraConfig, load_gated_peft_model
from mars_hf.models.modeling import load_mars_model
from mars_hf.models.rank_reduction import reduce_adapter_rank
from tests.test_gated_lora import decode_steps, gated_copy
from tests.tiny import tiny_model, tiny_tokenizer

PLAIN_LOADERS = (
    "PeftModel.from_pretrained",
    "AutoPeftModelForCausalLM.from_pretrained",
    "model.load_adapter",
)

# Run by a fresh interpreter: peft + transformers only. Prints one JSON line {loader: "LOADED" or the error}.
PLAIN_PEFT_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from peft import AutoPeftModelForCausalLM, PeftModel
    from transformers import AutoModelForCausalLM

    adapter, base = sys.argv[1], sys.argv[2]
    loaders = {
        "PeftModel.from_pretrained": lambda: PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(base), adapter
        ),
        "AutoPeftModelForCausalLM.from_pretrained": lambda: AutoPeftModelForCausalLM.from_pretrained(adapter),
        "model.load_adapter": lambda: AutoModelForCausalLM.from_pretrained(base).load_adapter(adapter),
    }
    outcome = {}
    for name, load in loaders.items():
        try:
            load()
            outcome[name] = "LOADED"
        except Exception as error:  # what the user sees: the type and the text
            outcome[name] = f"{type(error).__name__}: {error}"
    outcome["mars_hf imported"] = any(module.split(".")[0] == "mars_hf" for module in sys.modules)
    print(json.dumps(outcome))
    """
)


def plain_peft_outcome(adapter, base, tmp_path) -> dict:
    script = tmp_path / "plain_peft.py"
    script.write_text(PLAIN_PEFT_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    run = subprocess.run(
        [sys.executable, str(script), str(adapter), str(base)],
        cwd=tmp_path,  # not the checkout: nothing of mars_hf on the path by accident
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    outcome = json.loads(run.stdout.strip().splitlines()[-1])
    assert outcome.pop("mars_hf imported") is False
    return outcome


def save_tiny_gated(tmp_path, tokenizer):
    """(base folder, the base model, the PEFT gated model, the adapter folder as mars_hf saves it)."""
    base = tiny_model("llama")
    base_dir = tmp_path / "base"
    base.save_pretrained(base_dir)
    tokenizer.save_pretrained(base_dir)
    peft_model = gated_copy(base, tokenizer.mask_token_id)
    peft_model.peft_config["default"].base_model_name_or_path = str(base_dir)  # AutoPeft finds the base
    folder = tmp_path / "gated"
    hub.save_pretrained(peft_model, tokenizer, folder, base_model="someone/base")
    return base_dir, AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float64), peft_model, folder


def as_older_form(folder, to):
    """``folder`` as mars_hf saved it before the peft_type of its own: peft_type LORA with gate_token_id."""
    import shutil

    shutil.copytree(folder, to)
    config = json.loads((to / "adapter_config.json").read_text())
    config["peft_type"] = "LORA"
    (to / "adapter_config.json").write_text(json.dumps(config))
    return to


@pytest.fixture(scope="module")
def tiny_outcome(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("plain_peft_tiny")
    base_dir, _, _, folder = save_tiny_gated(tmp_path, tiny_tokenizer())
    assert json.loads((folder / "adapter_config.json").read_text())["peft_type"] == gated_lora.MARS_PEFT_TYPE
    return plain_peft_outcome(folder, base_dir, tmp_path)


@pytest.fixture(scope="module")
def shipped_outcome(tmp_path_factory):
    """The shipped embedded-mars folder. PEFT reads adapter_config.json before it touches any base model, so a
    tiny base stands in for the embedded SmolLM2 (were the folder read, it would not fit it: still no load)."""
    tmp_path = tmp_path_factory.mktemp("plain_peft_shipped")
    base_dir = tmp_path / "base"
    tiny_model("llama").save_pretrained(base_dir)
    return plain_peft_outcome(embedded_mars_checkpoint(), base_dir, tmp_path)


@pytest.mark.parametrize("loader", PLAIN_LOADERS)
def test_plain_peft_refuses_a_tiny_gated_adapter_naming_mars_hf(tiny_outcome, loader):
    said = tiny_outcome[loader]
    assert said != "LOADED" and "mars_hf" in said and "AutoMARSModelForCausalLM" in said, said


@pytest.mark.parametrize("loader", PLAIN_LOADERS)
def test_plain_peft_refuses_the_shipped_embedded_mars_naming_mars_hf(shipped_outcome, loader):
    said = shipped_outcome[loader]
    assert said != "LOADED" and "mars_hf" in said and "AutoMARSModelForCausalLM" in said, said


def test_the_shipped_folder_is_saved_in_the_refused_form():
    config = json.loads((embedded_mars_checkpoint() / "adapter_config.json").read_text())
    assert config["peft_type"] == gated_lora.MARS_PEFT_TYPE and config[gated_lora.GATE_TOKEN_KEY] == 49152


def assert_real_positions_are_the_base(model, base, tokenizer):
    got, real = decode_steps(model, tokenizer)
    expected, _ = decode_steps(base, tokenizer)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[2], expected[2])
    assert torch.equal(got[1][real], expected[1][real])
    assert not torch.allclose(got[1][~real], expected[1][~real])  # the masks do get the adapter


@pytest.mark.parametrize("form", ["new", "older"])
def test_mars_hf_loaders_read_both_forms_gated(form, tmp_path):
    tokenizer = tiny_tokenizer()
    base_dir, base, _, folder = save_tiny_gated(tmp_path, tokenizer)
    if form == "older":
        folder = as_older_form(folder, tmp_path / "older")
    config = MaskGatedLoraConfig.from_pretrained(folder)
    assert config.gate_token_id == tokenizer.mask_token_id and config.peft_type == "LORA"
    ours, _ = load_mars_model(folder, base_model_name_or_path=str(base_dir))
    through_peft = load_gated_peft_model(
        AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float64), folder
    )
    # the loader a checkpoint's custom_generate/ runs
    slim = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float64)
    assert slim_gated_lora.attach_shipped_adapter(slim, folder)
    for model in (ours, through_peft, slim):
        assert_real_positions_are_the_base(model, base, tokenizer)


def test_saving_again_writes_the_new_form(tmp_path):
    """A gated adapter saved by PEFT's own save_pretrained, or rank-reduced from an older folder, gets the
    peft_type plain PEFT refuses; an ungated one keeps LORA."""
    tokenizer = tiny_tokenizer()
    _, _, peft_model, folder = save_tiny_gated(tmp_path, tokenizer)
    peft_model.save_pretrained(tmp_path / "again")
    again = json.loads((tmp_path / "again" / "adapter_config.json").read_text())
    assert again["peft_type"] == gated_lora.MARS_PEFT_TYPE
    reduce_adapter_rank(as_older_form(folder, tmp_path / "older"), tmp_path / "reduced", rank=2)
    reduced = json.loads((tmp_path / "reduced" / "adapter_config.json").read_text())
    assert reduced["peft_type"] == gated_lora.MARS_PEFT_TYPE
    assert gated_lora.saved_adapter_config({"peft_type": "LORA", "r": 4}) == {"peft_type": "LORA", "r": 4}


def test_a_new_form_adapter_that_lost_its_gate_token_and_mars_config_is_refused(tmp_path):
    tokenizer = tiny_tokenizer()
    base_dir, _, _, folder = save_tiny_gated(tmp_path, tokenizer)
    config = json.loads((folder / "adapter_config.json").read_text())
    del config[gated_lora.GATE_TOKEN_KEY]
    (folder / "adapter_config.json").write_text(json.dumps(config))
    (folder / "mars_config.json").unlink()
    (folder / "mars_mask_token.safetensors").unlink()
    with pytest.raises(ValueError, match="MARS_MASK_GATED_LORA.*names no gate_token_id"):
        load_mars_model(folder, base_model_name_or_path=str(base_dir))
