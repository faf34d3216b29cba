"""`embedded-mars`: the MARS model shipped inside the package, loaded by name, offline; `--dtype auto`.

The resolver is tested on a tiny gated checkpoint (monkeypatched folder and base); the last tests run
on the real shipped folder, `mars_hf/models/embedded_mars/`, and its real base, the embedded SmolLM2.
"""

import fnmatch
import json
import logging
import re
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

import mars_hf
from mars_hf import hub
from mars_hf.cli import main
from mars_hf.decoding import gated_lora
from mars_hf.models import embedded_model, precision
from mars_hf.models.embedded_model import EMBEDDED_MARS_DIR, EMBEDDED_MODEL_NAME, resolve_model_path
from mars_hf.models.gated_peft import gate_peft_model
from mars_hf.models.mask_token import add_mask_token, set_mars_config
from mars_hf.models.modeling import AutoMARSModelForCausalLM, load_mars_model
from tests.tiny import tiny_model, tiny_tokenizer

REPO_ROOT = Path(__file__).resolve().parents[1]
ELSEWHERE = "/home/someone-else/.cache/mars_hf/" + EMBEDDED_MODEL_NAME  # what training recorded


@pytest.fixture(scope="module")
def tiny_shipped(tmp_path_factory):
    """A tiny base (no mask token) and a mask-gated LoRA adapter for it, saved like the shipped one,
    whose adapter_config.json names a base path from another machine."""
    root = tmp_path_factory.mktemp("embedded")
    tokenizer = tiny_tokenizer(with_mask=False)
    base = tiny_model("llama", block_size=None, vocab_size=len(tokenizer) + 4)
    with torch.no_grad():
        base.get_output_embeddings().weight.mul_(25)
    base.save_pretrained(root / "base")
    tokenizer.save_pretrained(root / "base")
    model = AutoModelForCausalLM.from_pretrained(root / "base", dtype=torch.float64)
    mask_id = add_mask_token(model, tokenizer)
    set_mars_config(model, block_size=4, mask_token_id=mask_id, adapter_gating="mask")
    torch.manual_seed(3)
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False
    )
    peft_model = get_peft_model(model, config)
    gate_peft_model(peft_model, mask_id)
    folder = root / "embedded_mars"
    hub.save_pretrained(
        peft_model.eval(), tokenizer, folder, base_model="HuggingFaceTB/SmolLM2-135M-Instruct"
    )
    adapter_config = json.loads((folder / "adapter_config.json").read_text())
    adapter_config["base_model_name_or_path"] = ELSEWHERE
    (folder / "adapter_config.json").write_text(json.dumps(adapter_config))
    return root / "base", folder, peft_model


@pytest.fixture
def shipped(tiny_shipped, monkeypatch):
    base_dir, folder, peft_model = tiny_shipped
    monkeypatch.setattr(embedded_model, "EMBEDDED_MARS_DIR", folder)
    monkeypatch.setattr(embedded_model, "embedded_model_dir", lambda: base_dir)
    return base_dir, folder, peft_model


def _window_logits(model, ids, mask_id):
    with torch.no_grad():
        return model(input_ids=torch.cat([ids, torch.full((ids.shape[0], 3), mask_id)], 1)).logits


def test_loaded_by_name_on_the_embedded_base_whatever_path_was_recorded(shipped, monkeypatch):
    base_dir, folder, peft_model = shipped
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert mars_hf.embedded_mars_checkpoint() == folder
    assert resolve_model_path("embedded-mars") == str(folder)
    model = AutoMARSModelForCausalLM.from_pretrained("embedded-mars", dtype=torch.float64)
    tokenizer = AutoTokenizer.from_pretrained(mars_hf.embedded_mars_checkpoint())
    mask_id = tokenizer.mask_token_id
    assert mask_id is not None and model.config.mars["mask_token_id"] == mask_id
    assert model.config.mars["adapter_gating"] == "mask" and gated_lora.is_gated(model)
    ids = torch.tensor([[5, 6, 7, 8]])
    expected = _window_logits(peft_model, ids, mask_id)
    torch.testing.assert_close(_window_logits(model, ids, mask_id), expected, rtol=1e-12, atol=1e-10)
    # the folder itself (as `--model <folder>` passes it) resolves the same base
    again, _ = load_mars_model(str(folder), dtype=torch.float64)
    torch.testing.assert_close(_window_logits(again, ids, mask_id), expected, rtol=1e-12, atol=1e-10)


def test_generate_command_with_model_embedded_mars(shipped, capsys):
    base_dir, folder, _ = shipped
    code = main(["generate", "the cat sat", "--model", "embedded-mars", "--max-new-tokens", "6",
                 "--dtype", "float64", "--tau", "1.0"])  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out.strip()
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float64)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "the cat sat"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
    )["input_ids"]
    out = base.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=2)
    new = out[0, len(prompt) :].tolist()
    if tokenizer.eos_token_id in new:
        new = new[: new.index(tokenizer.eos_token_id) + 1]
    assert (
        printed == tokenizer.decode(new, skip_special_tokens=True).strip()
    )  # τ = 1 of a gated adapter: the base


def test_a_recorded_base_that_exists_or_is_another_model_is_kept(tmp_path):
    assert embedded_model.resolve_adapter_base(str(tmp_path), "someone/base") == "someone/base"
    assert embedded_model.resolve_adapter_base(str(tmp_path), str(tmp_path)) == str(tmp_path)
    assert embedded_model.resolve_adapter_base(str(tmp_path), "/nowhere/OtherModel") == "/nowhere/OtherModel"


def test_a_missing_shipped_folder_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setattr(embedded_model, "EMBEDDED_MARS_DIR", tmp_path / "embedded_mars")
    with pytest.raises(FileNotFoundError, match="Reinstall mars-hf"):
        mars_hf.embedded_mars_checkpoint()


# ------------------------------------------------------------------------------------ --dtype auto
def test_choose_dtype(monkeypatch):
    assert precision.choose_dtype("float64") == (torch.float64, "--dtype float64")
    assert precision.choose_dtype("auto", hidden_size=576, device="cuda:0")[0] == torch.float32
    assert precision.choose_dtype("auto", hidden_size=32)[0] == torch.float32
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: False)
    assert precision.choose_dtype("auto", hidden_size=576)[0] == torch.float32
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: True)
    monkeypatch.setattr(precision, "bf16_speedup", lambda *args: 1.6)
    dtype, why = precision.choose_dtype("auto", hidden_size=576, intermediate_size=1536)
    assert dtype == torch.bfloat16 and "1.60" in why
    monkeypatch.setattr(precision, "bf16_speedup", lambda *args: 0.9)
    assert precision.choose_dtype("auto", hidden_size=576)[0] == torch.float32
    with pytest.raises(ValueError, match="dtype must be one of"):
        precision.choose_dtype("int8")


def test_auto_dtype_is_logged_and_generate_keeps_the_models_dtype(shipped, caplog, monkeypatch):
    from mars_hf.tools.loading import load_model_and_tokenizer

    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: True)
    monkeypatch.setattr(precision, "bf16_speedup", lambda *args: 2.0)
    monkeypatch.setattr(precision, "MIN_AUTO_HIDDEN_SIZE", 8)  # the tiny model counts as large here
    with caplog.at_level(logging.INFO, logger="mars_hf.models.precision"):
        model, tokenizer, trained = load_model_and_tokenizer("embedded-mars", dtype="auto")
    assert trained and next(model.parameters()).dtype == torch.bfloat16
    assert "bfloat16" in caplog.text and "probe 2.00" in caplog.text
    ids = torch.tensor([[5, 6, 7]])
    model.generate(ids, max_new_tokens=3, mars_acceptance="verify", pad_token_id=2)
    assert next(model.parameters()).dtype == torch.bfloat16


def test_dtype_flag_on_every_command():
    from mars_hf.cli import build_parser

    parser = build_parser()
    for argv in (["generate", "x"], ["bench"], ["serve", "m"], ["eval", "m"]):
        assert parser.parse_args(argv).dtype == "auto"
        assert parser.parse_args([*argv, "--dtype", "bfloat16"]).dtype == "bfloat16"


# ------------------------------------------------------------------------------- the real shipped model
def test_the_shipped_folder_is_package_data():
    block = (
        (REPO_ROOT / "pyproject.toml").read_text().split("[tool.setuptools.package-data]")[1].split("\n[")[0]
    )
    patterns = re.findall(r'"([^"]+)"', block)
    files = [
        p.relative_to(REPO_ROOT / "mars_hf").as_posix() for p in EMBEDDED_MARS_DIR.rglob("*") if p.is_file()
    ]
    needed = {"adapter_model.safetensors", "adapter_config.json", "mars_config.json", "README.md"}
    assert {f"models/embedded_mars/{name}" for name in needed} <= set(files)
    assert all(any(fnmatch.fnmatch(f, pattern) for pattern in patterns) for f in files)
    size = sum(p.stat().st_size for p in EMBEDDED_MARS_DIR.rglob("*") if p.is_file())
    assert size < 100 * 2**20  # tens of MB at most


def test_the_shipped_model_loads_offline_by_name_and_stays_the_base_model(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = mars_hf.embedded_mars_checkpoint()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoMARSModelForCausalLM.from_pretrained("embedded-mars", dtype=torch.float32)
    assert tokenizer.mask_token_id == model.config.mars["mask_token_id"]
    assert model.config.mars["adapter_gating"] == "mask"
    base = AutoModelForCausalLM.from_pretrained(
        embedded_model.embedded_model_dir(), dtype=torch.float32
    ).eval()
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name three primary colours."}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
    )["input_ids"]
    ids = torch.tensor([prompt])
    common = dict(max_new_tokens=24, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    stock = base.generate(ids, **common)
    # verify on a fixed cost curve: in float32 the widths fed are part of what this equality sees, and
    # a measured curve would make them this host's
    for kwargs in (
        {"mars_threshold": 1.0},
        {"mars_acceptance": "verify", "mars_cost_table": {1: 1.0, 9: 1.4, 10: 4.0}},
    ):
        out = model.generate(ids, **common, **kwargs)
        assert torch.equal(out[:, : stock.shape[1]], stock), kwargs


def test_calibrate_embedded_mars_writes_mars_config_and_decoding_applies_it(shipped, tmp_path, monkeypatch):
    import shutil

    from mars_hf.decoding.decoder import MARSBatchDecoder
    from mars_hf.decoding.settings import MARSDecodingSettings

    base_dir, folder, _ = shipped
    copy = tmp_path / "embedded_mars"
    shutil.copytree(folder, copy)
    monkeypatch.setattr(embedded_model, "EMBEDDED_MARS_DIR", copy)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float64)
    tokenizer = AutoTokenizer.from_pretrained(copy)
    rows = []  # the base model's own greedy answers: what a gated adapter's clean stream says
    for text in ["the cat sat", "one two three", "is the dog red", "hello world", "x y z", "yes no"]:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        out = base.generate(torch.tensor([prompt]), max_new_tokens=14, min_new_tokens=14, do_sample=False)
        answer = out[0, len(prompt) :].tolist()
        rows.append({"input_ids": prompt + answer, "labels": [-100] * len(prompt) + answer})
    data = tmp_path / "held_out.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert main(["calibrate", "embedded-mars", "--data", str(data), "--dtype", "float32"]) == 0
    record = json.loads((copy / "mars_config.json").read_text())["calibration"]
    assert record["num_examples"] == 6 and sum(record["num_samples"]) > 0
    assert "calibration" not in json.loads((folder / "mars_config.json").read_text())  # only the copy
    model = AutoMARSModelForCausalLM.from_pretrained("embedded-mars", dtype=torch.float64)
    assert model.config.mars["calibration"] == record
    mask = model.config.mars["mask_token_id"]
    decoder = MARSBatchDecoder(
        model, MARSDecodingSettings(window=4, mask_token_id=mask), max_rows=1, max_length=32, pad_token_id=2
    )
    assert decoder.calibration is not None
