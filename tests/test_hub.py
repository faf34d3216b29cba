"""Hub tooling: Hub-ready folders, model cards, push up to the HTTP boundary, loading every format.

Nothing here reaches the network: Hub ids resolve from a temporary HF cache laid out like the real
one (``models--org--name/{blobs,refs/main,snapshots/<sha>}``) with ``HF_HUB_OFFLINE=1``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import tomllib
import torch
from huggingface_hub import HfApi, ModelCard
from packaging.requirements import Requirement
from packaging.version import Version
from transformers import AutoModelForCausalLM

from mars_hf import hub
from mars_hf.decoding.generation import enable_mars
from mars_hf.hub.custom_generate import LIBRARY_FILES
from mars_hf.models.mask_token import add_mask_token, set_mars_config
from mars_hf.models.modeling import AutoMARSModelForCausalLM, load_mars_model, resolve_block_size
from tests.bare_venv import run_in_bare_venv
from tests.tiny import tiny_model, tiny_tokenizer

REPO_ROOT = Path(__file__).resolve().parents[1]
PAPER_REPO = "Xalphinions/MARS-Qwen2.5-0.5B-blk4"
FAKE_SHA = "0123456789abcdef0123456789abcdef01234567"
PROMPTS = ["hello world the cat", "one two"]
RESULTS = [
    {"tau": 1.0, "tokens_per_forward": 1.0, "quality": 0.412},
    {"tau": 0.9, "tokens_per_forward": 1.57, "quality": 0.405},
]


# ---------------------------------------------------------------------------------------------- helpers


def confident_model(arch="qwen2", **kwargs):
    """A tiny MARS model whose head is sharpened so that τ = 0.9 accepts several tokens per step."""
    model = tiny_model(arch, **kwargs)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(40.0)
    return model


def batch(tokenizer, prompts=PROMPTS):
    return tokenizer(prompts, return_tensors="pt", padding=True)


def mars_tokens(model, tokenizer, **kwargs):
    """Tokens from mars_hf's own generate (the reference for every other path)."""
    model = enable_mars(model)
    out = model.generate(**batch(tokenizer), max_new_tokens=12, do_sample=False, mars_threshold=0.9, **kwargs)
    return out.tolist()


def batch_json(tokenizer) -> str:
    """The left-padded test batch for a subprocess (tokenizers need not round-trip through a folder)."""
    return json.dumps({key: value.tolist() for key, value in batch(tokenizer).items()})


def put_in_hub_cache(folder: Path, cache: Path, repo_id: str, sha: str = FAKE_SHA) -> Path:
    """Lay ``folder`` out as huggingface_hub caches a downloaded repo: blobs + symlinked snapshot + refs/main."""
    root = cache / ("models--" + repo_id.replace("/", "--"))
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(sha)
    for file in sorted(p for p in folder.rglob("*") if p.is_file()):
        data = file.read_bytes()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = root / "snapshots" / sha / file.relative_to(folder)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    return root / "snapshots" / sha


def paper_format_folder(path: Path, model_type: str = "a2d-qwen2", arch: str = "qwen2") -> Path:
    """A replica of the paper's release: a2d-* model_type, `<|mask|>` only as an added token, no config.mars."""
    tokenizer = tiny_tokenizer(with_mask=False)
    tokenizer.add_tokens(["<|mask|>"], special_tokens=True)
    model = confident_model(arch, block_size=None)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    assert "mars" not in config
    config["model_type"] = model_type
    config["architectures"] = ["A2DQwen2LMHeadModel" if arch == "qwen2" else "A2DQwen3LMHeadModel"]
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def no_token(monkeypatch, tmp_path):
    """No HF_TOKEN, no OIDC, and an empty HF home: huggingface_hub finds no token anywhere."""
    import huggingface_hub.constants as constants

    for variable in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(variable, raising=False)
    home = tmp_path / "empty_hf_home"
    home.mkdir()
    monkeypatch.setenv("HF_HOME", str(home))
    # constants are read once at import; point them at the empty home too.
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(home / "token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(home / "stored_tokens"))


@pytest.fixture
def saved(tmp_path, tokenizer):
    model = confident_model()
    files = hub.save_pretrained(
        model,
        tokenizer,
        tmp_path / "ckpt",
        repo_id="someone/tiny-mars-blk4",
        base_model="HuggingFaceTB/SmolLM2-135M-Instruct",
        datasets=["openai/gsm8k"],
        training={"epochs": 3, "learning_rate": 1e-4},
        results=RESULTS,
        quality_metric="GSM8K accuracy",
    )
    return model, tmp_path / "ckpt", files


# ---------------------------------------------------------------------------------------------- folder + card


def test_saved_folder_has_weights_tokenizer_mars_config_and_custom_generate(saved, tokenizer):
    model, folder, files = saved
    assert files == hub.list_folder(folder)
    for expected in (
        "README.md",
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "custom_generate/generate.py",
        "custom_generate/requirements.txt",
    ):
        assert expected in files
    config = json.loads((folder / "config.json").read_text())
    assert config["mars"]["block_size"] == 4
    assert config["mars"]["mask_token_id"] == tokenizer.mask_token_id
    assert "format_version" in config["mars"]
    # custom_generate/ is the package's custom_generate_src/ and the library's modules (LIBRARY_FILES), byte for byte,
    # and nothing else.
    shipped = sorted(f.removeprefix("custom_generate/") for f in files if f.startswith("custom_generate/"))
    assert shipped == sorted([*hub.CUSTOM_GENERATE_FILES, "requirements.txt"])
    for name in hub.CUSTOM_GENERATE_FILES:
        source = LIBRARY_FILES.get(name, REPO_ROOT / "mars_hf/hub/custom_generate_src" / name)
        assert (folder / "custom_generate" / name).read_bytes() == source.read_bytes()
    reloaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
    for (name, a), (_, b) in zip(model.state_dict().items(), reloaded.state_dict().items()):
        assert torch.equal(a, b), name


def test_model_card_metadata_usage_and_results_table(saved):
    _, folder, _ = saved
    card = ModelCard.load(folder / "README.md")
    data = card.data.to_dict()
    assert data["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert data["library_name"] == "transformers"
    assert data["pipeline_tag"] == "text-generation"
    assert {"mars", "multi-token-prediction", "custom_generate"} <= set(data["tags"])
    assert data["datasets"] == ["openai/gsm8k"]
    assert data["license"] == "apache-2.0"
    text = card.text
    assert 'custom_generate="someone/tiny-mars-blk4"' in text and "trust_remote_code=True" in text
    assert 'load("someone/tiny-mars-blk4")' in text
    assert "| Mask token | `<\\|mask\\|>` (id 45) |" in text  # pipes escaped inside the table
    assert "| learning_rate | 0.0001 |" in text
    assert "| τ (`mars_threshold`) | tokens per forward | GSM8K accuracy |" in text
    assert "| 0.9 | 1.57 | 0.405 |" in text and "| 1.0 | 1 | 0.412 |" in text


def test_model_card_without_results_says_so(tmp_path, tokenizer):
    card = hub.render_model_card(
        repo_id="a/b", mars={"block_size": 8, "mask_token_id": 3}, mask_token="<|mask|>", architecture="X"
    )
    assert "No measurements were attached" in card.text
    assert "tokens per forward |" not in card.text
    with pytest.raises(ValueError, match="tokens_per_forward"):
        hub.render_model_card(
            repo_id="a/b",
            mars={"block_size": 8, "mask_token_id": 3},
            mask_token="<|mask|>",
            architecture="X",
            results=[{"tau": 0.9, "quality": 1.0}],
        )


def test_template_is_one_file_shared_by_checkout_and_package():
    packaged = REPO_ROOT / "mars_hf" / "templates" / hub.MODEL_CARD_TEMPLATE
    source = REPO_ROOT / "model_cards" / hub.MODEL_CARD_TEMPLATE
    assert packaged.resolve() == source.resolve()
    assert hub.model_card_template_path().resolve() == source.resolve()


@pytest.mark.slow
def test_wheel_ships_the_model_card_template(tmp_path):
    # Build from a copy so that setuptools' build/ and egg-info stay out of the checkout.
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO_ROOT / name, source / name)
    for name in ("mars_hf", "model_cards"):
        shutil.copytree(
            REPO_ROOT / name, source / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__")
        )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            ".",
        ],
        cwd=source,
        check=True,
    )
    (wheel,) = tmp_path.glob("mars_hf-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        content = archive.read(f"mars_hf/templates/{hub.MODEL_CARD_TEMPLATE}").decode()
    assert content == (REPO_ROOT / "model_cards" / hub.MODEL_CARD_TEMPLATE).read_text()


def test_overwrite_guard(saved, tokenizer):
    model, folder, files = saved
    with pytest.raises(FileExistsError, match="overwrite=True"):
        hub.save_pretrained(model, tokenizer, folder)
    (folder / "stale.bin").write_text("old")
    assert hub.save_pretrained(model, tokenizer, folder, overwrite=True) == hub.list_folder(folder)
    assert not (folder / "stale.bin").exists()


def test_custom_generate_requirements_are_the_ranges_pyproject_declares(tmp_path):
    """custom_generate/requirements.txt names the torch/transformers ranges mars-hf declares (and tests)."""
    declared = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    ranges = {Requirement(line).name: Requirement(line).specifier for line in declared}
    hub.write_custom_generate(tmp_path / "custom_generate")
    lines = (tmp_path / "custom_generate" / "requirements.txt").read_text().splitlines()
    assert lines == [f"torch{ranges['torch']}", f"transformers{ranges['transformers']}", "safetensors"]
    # the torch this suite runs on is inside the shipped range
    assert Version(torch.__version__.split("+")[0]) in ranges["torch"]


def test_custom_generate_must_be_self_contained(tmp_path):
    good = tmp_path / "good.py"
    good.write_text(
        "import os\nimport torch\nfrom transformers import GenerationMixin\nfrom .decoder import X\n"
    )
    hub.check_self_contained(good)
    for bad in (
        "import mars_hf\n",
        "from .mask_token import x\n",
        "import peft\n",
        "from trl import SFTConfig\n",
    ):
        (tmp_path / "bad.py").write_text(bad)
        with pytest.raises(ImportError, match="custom_generate"):
            hub.check_self_contained(tmp_path / "bad.py")


# ---------------------------------------------------------------------------------------------- push


def test_dry_run_lists_exactly_the_files_written(tmp_path, tokenizer, monkeypatch):
    no_token(monkeypatch, tmp_path)  # a dry run needs no token
    result = hub.push_to_hub(
        tiny_model("llama"), tokenizer, "someone/x", dry_run=True, save_dir=tmp_path / "out", base_model="a/b"
    )
    assert result.dry_run and result.commit is None
    assert result.files == hub.list_folder(tmp_path / "out")
    assert "custom_generate/generate.py" in result.files


def test_cli_dry_run_prints_exactly_the_files_written(saved, tmp_path, capsys, monkeypatch):
    from mars_hf.cli import main

    _, folder, _ = saved
    no_token(monkeypatch, tmp_path)
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"rows": RESULTS, "quality_metric": "pass@1"}))
    out_dir = tmp_path / "push_out"
    code = main(
        [
            "push",
            str(folder),
            "--repo-id",
            "someone/y",
            "--dry-run",
            "--output-dir",
            str(out_dir),
            "--results",
            str(results),
        ]
    )
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("Dry run: wrote") and "someone/y" in lines[0]
    listed = [line.strip() for line in lines[1:]]
    assert listed == hub.list_folder(out_dir)
    assert "| 0.9 | 1.57 | 0.405 |" in (out_dir / "README.md").read_text()


def test_example_script_dry_run(saved, tmp_path, capsys, monkeypatch):
    import importlib.util

    _, folder, _ = saved
    no_token(monkeypatch, tmp_path)
    spec = importlib.util.spec_from_file_location("push_example", REPO_ROOT / "examples" / "push_to_hub.py")
    example = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "push_example", example)  # dataclasses look their module up
    spec.loader.exec_module(example)
    out_dir = tmp_path / "example_out"
    args = example.PushArguments(
        model_name_or_path=str(folder),
        repo_id="someone/z",
        output_dir=str(out_dir),
        dry_run=True,
        base_model="a/b",
    )
    assert example.main(args) == 0
    listed = [line.strip() for line in capsys.readouterr().out.splitlines()[1:]]
    assert listed == hub.list_folder(out_dir)
    assert ModelCard.load(out_dir / "README.md").data.base_model == "a/b"


def test_push_to_hub_up_to_the_http_boundary(tmp_path, tokenizer, monkeypatch, capsys, caplog):
    secret = "hf_" + "x" * 34
    monkeypatch.setenv("HF_TOKEN", secret)
    calls = {}

    def fake_create_repo(self, repo_id, **kwargs):
        calls["create_repo"] = {"repo_id": repo_id, "token": self.token, **kwargs}
        return f"https://huggingface.co/{repo_id}"

    def fake_upload_folder(self, *, repo_id, folder_path, **kwargs):
        folder = Path(folder_path)
        calls["upload_folder"] = {"repo_id": repo_id, "token": self.token, **kwargs}
        calls["files"] = hub.list_folder(folder)
        calls["contents"] = b"".join(p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file())
        return "commit-info"

    monkeypatch.setattr(HfApi, "create_repo", fake_create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", fake_upload_folder)
    caplog.set_level(logging.DEBUG)
    result = hub.push_to_hub(
        tiny_model("qwen3"),
        tokenizer,
        "someone/tiny-mars",
        private=True,
        create_pr=True,
        commit_message="MARS blk4",
        base_model="Qwen/Qwen3-0.6B",
    )
    assert calls["create_repo"]["repo_id"] == "someone/tiny-mars"
    assert calls["create_repo"]["private"] is True and calls["create_repo"]["exist_ok"] is True
    upload = calls["upload_folder"]
    assert upload["repo_id"] == "someone/tiny-mars"
    assert upload["create_pr"] is True and upload["commit_message"] == "MARS blk4"
    assert calls["create_repo"]["token"] == upload["token"] == secret  # token from the environment
    assert calls["files"] == result.files
    assert {"README.md", "config.json", "model.safetensors", "custom_generate/generate.py"} <= set(
        result.files
    )
    assert result.commit == "commit-info"
    assert not result.folder.exists()  # the temporary folder is cleaned up
    # The token is never written or printed.
    assert secret.encode() not in calls["contents"]
    captured = capsys.readouterr()
    assert secret not in captured.out + captured.err + caplog.text


def test_cli_push_passes_its_options_to_the_hub_api(saved, monkeypatch, capsys):
    from mars_hf.cli import main

    _, folder, _ = saved
    monkeypatch.setenv("HF_TOKEN", "hf_" + "y" * 34)
    calls = {}
    monkeypatch.setattr(
        HfApi, "create_repo", lambda self, repo_id, **kw: calls.setdefault("create", (repo_id, kw))
    )

    def fake_upload(self, *, repo_id, folder_path, **kwargs):
        calls["upload"] = (repo_id, kwargs, hub.list_folder(folder_path))

    monkeypatch.setattr(HfApi, "upload_folder", fake_upload)
    argv = [
        "push",
        str(folder),
        "--repo-id",
        "someone/w",
        "--private",
        "--create-pr",
        "--commit-message",
        "hi",
    ]
    assert main(argv) == 0
    assert calls["create"] == ("someone/w", {"private": True, "exist_ok": True})
    repo_id, kwargs, files = calls["upload"]
    assert repo_id == "someone/w" and kwargs["create_pr"] is True and kwargs["commit_message"] == "hi"
    captured = capsys.readouterr()
    assert [line.strip() for line in captured.out.splitlines()[1:]] == files
    assert "y" * 34 not in captured.out + captured.err


def test_push_without_token_is_a_clear_error(tmp_path, tokenizer, monkeypatch, capsys):
    from mars_hf.cli import main

    no_token(monkeypatch, tmp_path)
    monkeypatch.setattr(HfApi, "upload_folder", lambda *a, **k: pytest.fail("must not upload"))
    with pytest.raises(hub.HubTokenError, match="hf auth login.*HF_TOKEN"):
        hub.push_to_hub(tiny_model("llama"), tokenizer, "someone/x")
    assert main(["push", str(tmp_path / "does-not-matter"), "--repo-id", "someone/x"]) == 2
    assert "No Hugging Face token found" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- errors


def test_save_refuses_a_model_without_mask_token_or_mars_metadata(tmp_path):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="add_mask_token"):
        hub.save_pretrained(model, tiny_tokenizer(with_mask=False), tmp_path / "a")
    with pytest.raises(ValueError, match="MARS metadata"):
        hub.save_pretrained(tiny_model("llama", block_size=None), tiny_tokenizer(), tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_load_errors_name_the_fix(tmp_path):
    plain = tmp_path / "plain-model"
    tiny_model("llama", block_size=None).save_pretrained(plain)
    tiny_tokenizer(with_mask=False).save_pretrained(plain)
    with pytest.raises(ValueError, match="no mask token"):
        load_mars_model(plain, block_size=4, enable=False)

    unknown_block = tmp_path / "masked-model"
    tiny_model("llama", block_size=None).save_pretrained(unknown_block)
    tiny_tokenizer().save_pretrained(unknown_block)
    with pytest.raises(ValueError, match=r"block size.*block_size=4"):
        load_mars_model(unknown_block, enable=False)
    model, _ = load_mars_model(unknown_block, block_size=2, enable=False)
    assert model.config.mars["block_size"] == 2

    with pytest.raises(OSError, match="neither"):
        load_mars_model(tmp_path / "empty", enable=False)


def test_block_size_sources_and_log_line(caplog):
    assert resolve_block_size({"block_size": 8}, "org/x-blk4", None) == (8, "from config.mars")
    assert resolve_block_size({}, "org/MARS-Qwen2.5-7B-blk8", None)[0] == 8
    assert resolve_block_size({}, "/cache/models--org--m-blk16/snapshots/abc", None)[0] == 16
    assert resolve_block_size({}, "org/plain", 3) == (3, "from the block_size argument")
    assert resolve_block_size({}, "org/blk4-not-a-suffix", 5)[0] == 5
    with caplog.at_level(logging.WARNING, logger="mars_hf.models.modeling"):
        assert resolve_block_size({}, "org/m-blk4", 8)[0] == 4
    assert "Ignoring block_size=8" in caplog.text


# ---------------------------------------------------------------------------------------------- loading


def test_paper_format_maps_onto_stock_classes(tmp_path, caplog):
    for model_type, arch in (("a2d-qwen2", "qwen2"), ("a2d-qwen3", "qwen3")):
        folder = paper_format_folder(tmp_path / f"MARS-{arch}-blk8", model_type, arch)
        with caplog.at_level(logging.INFO, logger="mars_hf.models.modeling"):
            model, tokenizer = load_mars_model(folder, enable=False)
        assert type(model).__name__ == f"{arch.capitalize()}ForCausalLM"
        assert model.config.mars["block_size"] == 8
        assert tokenizer.mask_token == "<|mask|>"
        assert model.config.mars["mask_token_id"] == tokenizer.convert_tokens_to_ids("<|mask|>")
        assert "from the 'blk8' suffix" in caplog.text
        reference = AutoModelForCausalLM.from_config(model.config, dtype=torch.float64)
        reference.load_state_dict(model.state_dict())
        ids = torch.tensor([[5, 6, 7, 8]])
        assert torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)


def test_paper_checkpoint_loads_by_hub_id_offline_and_decodes(tmp_path):
    folder = paper_format_folder(tmp_path / "src")
    cache = tmp_path / "hub_cache"
    put_in_hub_cache(folder, cache, PAPER_REPO)
    # Expected tokens: the same weights, loaded from the folder in this process.
    model, _ = load_mars_model(folder, block_size=4)
    tokenizer = tiny_tokenizer()  # same vocabulary, `<|mask|>` included; left padding for the batch
    expected = mars_tokens(model, tokenizer)
    script = textwrap.dedent(
        f"""
        import json, logging, sys, torch
        logging.basicConfig(level=logging.INFO, stream=sys.stderr)
        from mars_hf.hub import load
        model, tokenizer = load({PAPER_REPO!r})
        inputs = {{k: torch.tensor(v) for k, v in json.loads(sys.argv[1]).items()}}
        out = model.generate(**inputs, max_new_tokens=12, do_sample=False, mars_threshold=0.9)
        print(json.dumps({{"mars": model.config.mars, "cls": type(model).__name__, "mask": tokenizer.mask_token,
                           "mask_id": tokenizer.mask_token_id, "tokens": out.tolist()}}))
        """
    )
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "home")}
    run = subprocess.run(
        [sys.executable, "-c", script, batch_json(tokenizer)],
        env=env,
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["mars"]["block_size"] == 4 and result["cls"] == "MARSQwen2ForCausalLM"
    assert result["mask"] == "<|mask|>" and result["mars"]["mask_token_id"] == result["mask_id"]
    assert "from the 'blk4' suffix" in run.stderr
    assert result["tokens"] == expected


def make_lora_adapter(tmp_path, mode: str):
    """A base checkpoint without a mask token, and a MARS LoRA adapter trained (randomly perturbed) on it.

    mode: "trainable-token" (mask row trained through PEFT, saved by mars_hf), "custom-row" (mask rows
    set before LoRA by another initialisation than the mean, not trained by PEFT, saved by mars_hf:
    only mars_mask_token.safetensors can restore them) or "peft-only" (trainable token, saved by plain
    ``PeftModel.save_pretrained`` as a trainer does: no mars_config.json, no mask-row file).
    """
    from peft import LoraConfig, get_peft_model

    base_tokenizer = tiny_tokenizer(with_mask=False)
    base_dir = tmp_path / "base"
    confident_model("llama", block_size=None, vocab_size=len(base_tokenizer)).save_pretrained(base_dir)
    base_tokenizer.save_pretrained(base_dir)

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float64)
    tokenizer = tiny_tokenizer(with_mask=False)
    mask_token_id = add_mask_token(model, tokenizer)  # adds a row the base checkpoint does not have
    assert model.get_input_embeddings().weight.shape[0] == len(base_tokenizer) + 1
    set_mars_config(model, block_size=4, mask_token_id=mask_token_id)
    if mode == "custom-row":
        with torch.no_grad():
            model.get_input_embeddings().weight[mask_token_id] = model.get_input_embeddings().weight[5]
            model.get_output_embeddings().weight[mask_token_id].normal_()
    extra = {} if mode == "custom-row" else {"trainable_token_indices": {"embed_tokens": [mask_token_id]}}
    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM", **extra)
    peft_model = get_peft_model(model, config)
    torch.manual_seed(1)
    with torch.no_grad():
        for parameter in peft_model.parameters():
            if parameter.requires_grad:
                parameter.add_(0.3 * torch.randn_like(parameter))
    peft_model.eval()
    adapter_dir = tmp_path / "adapter-blk4"
    if mode == "peft-only":
        peft_model.save_pretrained(adapter_dir, save_embedding_layers=False)
        tokenizer.save_pretrained(adapter_dir)
    else:
        files = hub.save_pretrained(
            peft_model, tokenizer, adapter_dir, base_model="HuggingFaceTB/SmolLM2-135M"
        )
        assert {
            "adapter_config.json",
            "adapter_model.safetensors",
            "mars_config.json",
            "mars_mask_token.safetensors",
        } <= set(files)
        assert "model.safetensors" not in files and "config.json" not in files
        card = ModelCard.load(adapter_dir / "README.md")
        assert card.data.library_name == "peft" and "mars" in card.data.tags
    return peft_model, tokenizer, adapter_dir


@pytest.mark.parametrize("mode", ["trainable-token", "custom-row", "peft-only"])
def test_lora_adapter_loads_onto_base_and_decodes_like_merged(tmp_path, mode):
    peft_model, tokenizer, adapter_dir = make_lora_adapter(tmp_path, mode)
    merged = peft_model.merge_and_unload()
    expected = mars_tokens(merged, tokenizer)
    for merge in (False, True):
        gating = {"adapter_gating": "none"} if mode == "peft-only" else {}  # no record: say it is ungated
        loaded = AutoMARSModelForCausalLM.from_pretrained(adapter_dir, merge_adapter=merge, **gating)
        assert loaded.config.mars["block_size"] == 4
        assert type(loaded).__name__ == ("MARSLlamaForCausalLM" if merge else "PeftModelForCausalLM")
        assert tuple(loaded.get_input_embeddings().weight.shape) == (len(tokenizer), 32)
        out = loaded.generate(**batch(tokenizer), max_new_tokens=12, do_sample=False, mars_threshold=0.9)
        assert out.tolist() == expected
        # Exact logits where the mask token is read (input row) and scored (output row).
        ids = torch.tensor([[5, 6, 7] + [tokenizer.mask_token_id] * 4])
        with torch.no_grad():
            torch.testing.assert_close(
                loaded(input_ids=ids).logits, merged(input_ids=ids).logits, rtol=0, atol=1e-12
            )


def test_lora_adapter_repo_and_its_base_load_by_hub_id_offline(tmp_path, monkeypatch):
    import huggingface_hub.constants as constants

    peft_model, tokenizer, adapter_dir = make_lora_adapter(tmp_path, "custom-row")
    adapter_config = json.loads((adapter_dir / "adapter_config.json").read_text())
    adapter_config["base_model_name_or_path"] = "someone/base"  # as on the Hub
    (adapter_dir / "adapter_config.json").write_text(json.dumps(adapter_config))
    cache = tmp_path / "hub_cache"
    put_in_hub_cache(tmp_path / "base", cache, "someone/base")
    put_in_hub_cache(adapter_dir, cache, "someone/tiny-lora")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    model, loaded_tokenizer = hub.load("someone/tiny-lora", cache_dir=str(cache))
    assert model.config.mars["block_size"] == 4 and loaded_tokenizer.mask_token == "<|mask|>"
    out = model.generate(**batch(tokenizer), max_new_tokens=12, do_sample=False, mars_threshold=0.9)
    assert out.tolist() == mars_tokens(peft_model.merge_and_unload(), tokenizer)


# ---------------------------------------------------------------------------------------------- custom_generate


def test_custom_generate_folder_matches_mars_hf_in_process(saved, tokenizer):
    model, folder, _ = saved
    expected = mars_tokens(model, tokenizer)
    plain = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
    assert not hasattr(plain, "_mars_overrides")  # not touched by mars_hf
    out = plain.generate(
        **batch(tokenizer),
        max_new_tokens=12,
        do_sample=False,
        custom_generate=str(folder),
        trust_remote_code=True,
        mars_threshold=0.9,
    )
    assert out.tolist() == expected


BARE_VENV_SCRIPT = textwrap.dedent(
    """
    import importlib.util, json, sys
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, repo_id, batch = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    missing = {name: importlib.util.find_spec(name) is None for name in ("mars_hf", "peft", "trl")}
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.mask_token == "<|mask|>"
    inputs = {key: torch.tensor(value) for key, value in batch.items()}  # left-padded by the caller
    common = dict(max_new_tokens=12, do_sample=False)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
    result = {"missing": missing}
    result["local"] = model.generate(
        **inputs, custom_generate=folder, trust_remote_code=True, mars_threshold=0.9, **common
    ).tolist()
    result["hub_id"] = model.generate(
        **inputs, custom_generate=repo_id, trust_remote_code=True, mars_threshold=0.9, **common
    ).tolist()
    result["stock"] = model.generate(**inputs, **common).tolist()
    result["verify"] = model.generate(
        **inputs, custom_generate=folder, trust_remote_code=True, mars_acceptance="verify", **common
    ).tolist()
    torch.manual_seed(7)
    result["sampled"] = model.generate(
        **inputs, custom_generate=folder, trust_remote_code=True, mars_acceptance="verify", max_new_tokens=12,
        do_sample=True, temperature=40.0, top_k=40,
    ).tolist()
    # from_pretrained(trust_remote_code=True) installs custom_generate/ as model.generate.
    patched = AutoModelForCausalLM.from_pretrained(repo_id, dtype=torch.float64, trust_remote_code=True)
    result["patched_mars"] = patched.generate(**inputs, mars_threshold=0.9, **common).tolist()
    result["patched_stock"] = patched.generate(**inputs, **common).tolist()
    print(json.dumps(result))
    """
)


@pytest.mark.slow
def test_custom_generate_in_a_venv_with_only_torch_and_transformers(saved, tokenizer, tmp_path, bare_venv):
    model, folder, _ = saved
    model = enable_mars(model)
    expected = mars_tokens(model, tokenizer)
    greedy = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
    greedy_tokens = greedy.generate(**batch(tokenizer), max_new_tokens=12, do_sample=False).tolist()
    assert greedy_tokens != expected  # τ = 0.9 really accepts several tokens on this model
    repo_id = "someone/tiny-mars-blk4"
    cache = tmp_path / "hub_cache"
    put_in_hub_cache(folder, cache, repo_id)
    result = run_in_bare_venv(
        bare_venv,
        BARE_VENV_SCRIPT,
        [folder, repo_id, batch_json(tokenizer)],
        tmp_path,
        HF_HUB_CACHE=str(cache),
    )
    assert result["missing"] == {"mars_hf": True, "peft": True, "trl": True}
    assert result["local"] == expected
    assert result["hub_id"] == expected
    assert result["patched_mars"] == expected
    assert result["stock"] == greedy_tokens and result["patched_stock"] == greedy_tokens
    assert result["verify"] == greedy_tokens  # lossless
    torch.manual_seed(7)  # the seed contract: the same seed, mars_hf's sampled tokens
    sampled = model.generate(
        **batch(tokenizer),
        max_new_tokens=12,
        do_sample=True,
        temperature=40.0,
        top_k=40,
        mars_acceptance="verify",
    )
    assert result["sampled"] == sampled.tolist() != greedy_tokens
