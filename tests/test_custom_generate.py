"""A checkpoint's ``custom_generate/``: small, self-contained, and the same tokens as mars_hf.

The shipped files (``mars_hf/hub/custom_generate_src/``) run through transformers' string form of
``custom_generate`` on a plain ``AutoModelForCausalLM``; mars_hf's own ``generate`` is the reference. Tiny
float64 models, a left-padded batch of two. (In a venv without mars_hf: tests/test_hub.py, slow.)
"""

from __future__ import annotations

import ast
import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, GenerationConfig, StoppingCriteria, StoppingCriteriaList

from mars_hf import hub
from mars_hf.decoding import sampling as mars_sampling
from mars_hf.decoding.generation import enable_mars
from mars_hf.hub.custom_generate import (
    CUSTOM_GENERATE_FILES,
    LIBRARY_FILES,
    MAX_LINES,
    SOURCE_DIR,
    check_self_contained,
    write_custom_generate,
)
from mars_hf.models.modeling import load_mars_model
from tests.test_hub import batch, confident_model
from tests.tiny import tiny_model, tiny_tokenizer

COMMON = dict(max_new_tokens=12)
# Flat enough that the seed decides the text (the confident model's head is sharpened 40x).
SAMPLING = dict(do_sample=True, temperature=40.0, top_k=40, top_p=0.95)
TAU_SETTINGS = {
    "tau=1": dict(mars_threshold=1.0),
    "tau=0.9": dict(mars_threshold=0.9),
    "tau=0.5": dict(mars_threshold=0.5),
    "verify": dict(mars_acceptance="verify"),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(mars_hf's model, a plain transformers copy of the saved checkpoint, the checkpoint folder, tokenizer)."""
    tokenizer = tiny_tokenizer()
    model = confident_model()  # qwen2: τ = 0.9 accepts several tokens a step on it
    folder = tmp_path_factory.mktemp("slim") / "ckpt"
    hub.save_pretrained(model, tokenizer, folder, base_model="tiny")
    plain = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
    return enable_mars(model), plain, folder, tokenizer


def slim(plain, folder, inputs, **kwargs):
    return plain.generate(**inputs, custom_generate=str(folder), trust_remote_code=True, **kwargs)


def seeded(generate, seed: int):
    torch.manual_seed(seed)
    return generate()


# ---------------------------------------------------------------------------------------------- the files


def test_shipped_files_are_few_small_and_self_contained(tmp_path):
    """Every shipped .py counts toward the line budget; none imports beyond torch/transformers/safetensors, and
    none reaches a compiler, native code or the call stack."""
    own = {p.name for p in SOURCE_DIR.glob("*.py")} - {"__init__.py"}
    assert own == set(CUSTOM_GENERATE_FILES) - set(LIBRARY_FILES)
    target = tmp_path / "custom_generate"
    assert write_custom_generate(target) == sorted([*CUSTOM_GENERATE_FILES, "requirements.txt"])
    lines = sum(len((target / name).read_text().splitlines()) for name in CUSTOM_GENERATE_FILES)
    assert lines <= MAX_LINES == 1500, f"custom_generate/ has {lines} lines"
    for name in CUSTOM_GENERATE_FILES:
        check_self_contained(target / name)
        tree = ast.parse((target / name).read_text())
        used = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
        used |= {
            alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
        }
        assert not used & {"_getframe", "ctypes", "subprocess", "cpp_extension", "f_back"}, name


def test_writing_over_an_older_release_removes_its_files(tmp_path):
    target = tmp_path / "custom_generate"
    target.mkdir()
    (target / "gated_kernel.py").write_text("import ctypes\n")
    write_custom_generate(target)
    assert not (target / "gated_kernel.py").exists()


def test_the_rules_processing_seeds_and_calibration_are_the_librarys_own_modules(tmp_path):
    """custom_generate/rules.py, processing.py, sampling.py and calibration.py are mars_hf/decoding's own modules,
    copied verbatim (the acceptance rules' primitives, the logits processors at provisional prefixes, the keyed
    draws and the calibrated confidence have one implementation), nothing of those names is kept apart in
    custom_generate_src/, and the shipped decoder chooses, checks and proposes with the library's processing."""
    from mars_hf.decoding import calibration as mars_calibration
    from mars_hf.decoding import processing as mars_processing
    from mars_hf.decoding import rules as mars_rules

    target = tmp_path / "custom_generate"
    write_custom_generate(target)
    assert set(LIBRARY_FILES) == {"rules.py", "processing.py", "sampling.py", "calibration.py"}
    for module in (mars_sampling, mars_rules, mars_processing, mars_calibration):
        name = Path(module.__file__).name
        assert (target / name).read_bytes() == Path(module.__file__).read_bytes(), name
        assert not (SOURCE_DIR / name).exists()
    # the rules' loops are the library's ScoreProcessing methods, not a shipped acceptance.py of its own
    assert not (target / "acceptance.py").exists()
    shipped = (target / "decoder.py").read_text()
    assert "from .rules import" in shipped and "def confidence" not in shipped and "def choose" not in shipped
    for method in ("chosen", "checked", "proposed"):  # what the library's acceptance and drafts run too
        assert f"self.processing.{method}(" in shipped
    assert "_by_prefix" not in shipped and "class Calibration" not in shipped


# ---------------------------------------------------------------------------------------------- same tokens


@pytest.mark.parametrize("settings", TAU_SETTINGS.values(), ids=TAU_SETTINGS.keys())
def test_greedy_tokens_are_mars_hfs(saved, settings):
    model, plain, folder, tokenizer = saved
    inputs = batch(tokenizer)
    expected = model.generate(**inputs, **COMMON, do_sample=False, return_dict_in_generate=True, **settings)
    out = slim(plain, folder, inputs, **COMMON, do_sample=False, return_dict_in_generate=True, **settings)
    assert out.sequences.tolist() == expected.sequences.tolist()
    stock = plain.generate(**inputs, **COMMON, do_sample=False)
    if settings.get("mars_acceptance") == "verify" or settings["mars_threshold"] == 1.0:
        assert torch.equal(out.sequences, stock)  # lossless
    else:  # τ < 1 takes the same steps as mars_hf's fixed window, keeping mask predictions
        assert out.num_forwards == expected.num_forwards and not torch.equal(out.sequences, stock)
        if settings["mars_threshold"] == 0.5:
            assert out.num_forwards < out.sequences.shape[1] - inputs["input_ids"].shape[1]


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "mistral"])
def test_other_architectures(arch, tmp_path):
    tokenizer = tiny_tokenizer()
    model = confident_model(arch)
    hub.save_pretrained(model, tokenizer, tmp_path / "ckpt", base_model="tiny")
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.float64)
    for settings in (dict(mars_threshold=0.5), dict(mars_acceptance="verify")):
        expected = enable_mars(model).generate(**batch(tokenizer), **COMMON, do_sample=False, **settings)
        assert torch.equal(
            slim(plain, tmp_path / "ckpt", batch(tokenizer), **COMMON, do_sample=False, **settings), expected
        )


@pytest.mark.parametrize("settings", TAU_SETTINGS.values(), ids=TAU_SETTINGS.keys())
def test_sampling_with_a_seed_gives_mars_hfs_tokens(saved, settings):
    """The seed contract: the same seed gives mars_hf's tokens, whatever this copy feeds; another seed other ones."""
    model, plain, folder, tokenizer = saved
    inputs = batch(tokenizer)
    expected = seeded(lambda: model.generate(**inputs, **COMMON, **SAMPLING, **settings), 7)
    out = seeded(lambda: slim(plain, folder, inputs, **COMMON, **SAMPLING, **settings), 7)
    assert out.tolist() == expected.tolist()
    other = seeded(lambda: slim(plain, folder, inputs, **COMMON, **SAMPLING, **settings), 8)
    assert other.tolist() != out.tolist()


def test_sampled_verify_is_sampled_one_token_decoding(saved):
    """Keyed draws make a sampled draft's check an exact match: verify samples the text τ = 1 samples."""
    _, plain, folder, tokenizer = saved
    inputs = batch(tokenizer)
    one = seeded(lambda: slim(plain, folder, inputs, **COMMON, **SAMPLING, mars_threshold=1.0), 3)
    verified = seeded(lambda: slim(plain, folder, inputs, **COMMON, **SAMPLING, mars_acceptance="verify"), 3)
    assert torch.equal(one, verified)


class StopAfter(StoppingCriteria):
    """Ends a row at its first ``token`` (a criterion transformers does not know: checked token by token)."""

    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


@pytest.mark.parametrize(
    "settings", [dict(mars_threshold=0.3), dict(mars_acceptance="verify")], ids=["tau", "verify"]
)
def test_processors_eos_and_stopping_criteria_as_mars_hf(saved, settings):
    """Prefix-dependent processors (repetition penalty, min length), suppressed tokens, EOS and a stopping
    criterion, greedy and sampled."""
    model, plain, folder, tokenizer = saved
    inputs = batch(tokenizer)
    options = dict(
        max_new_tokens=16, repetition_penalty=1.4, min_new_tokens=3, eos_token_id=tokenizer.eos_token_id
    )
    prompt = inputs["input_ids"].shape[1]
    suppressed = slim(plain, folder, inputs, **options, do_sample=False, **settings)[1, prompt + 6].item()
    options["suppress_tokens"] = [suppressed]
    stop_token = slim(plain, folder, inputs, **options, do_sample=False, **settings)[0, prompt + 4].item()
    for sampling in (dict(do_sample=False), SAMPLING):
        kwargs = {
            **options,
            **sampling,
            **settings,
            "stopping_criteria": StoppingCriteriaList([StopAfter(stop_token)]),
        }
        expected = seeded(lambda kwargs=kwargs: model.generate(**inputs, **kwargs), 4)
        out = seeded(lambda kwargs=kwargs: slim(plain, folder, inputs, **kwargs), 4)
        assert out.tolist() == expected.tolist()
        assert suppressed not in out[:, prompt:].flatten().tolist()
        if not sampling["do_sample"]:  # row 0 ends at its first stop token
            generated = out[0, prompt:].tolist()
            end = generated.index(stop_token) + 1
            assert end < 16 and set(generated[end:]) <= {tokenizer.pad_token_id}, generated


def test_scores_logits_and_streamer_as_mars_hf(saved):
    model, plain, folder, tokenizer = saved

    class Recorder:
        def __init__(self):
            self.items = []

        def put(self, value):
            self.items.append(value.tolist())

        def end(self):
            self.items.append("end")

    for prompts in (["hello world the cat"], ["hello world the cat", "one two"]):
        inputs = batch(tokenizer, prompts)
        kwargs = dict(**COMMON, do_sample=False, mars_threshold=0.7, return_dict_in_generate=True)
        kwargs.update(output_scores=True, output_logits=True)
        theirs, ours = Recorder(), Recorder()
        expected = model.generate(**inputs, streamer=theirs, **kwargs)
        out = slim(plain, folder, inputs, streamer=ours, **kwargs)
        assert torch.equal(out.sequences, expected.sequences) and ours.items == theirs.items
        assert (
            len(out.scores) == len(expected.scores) == out.sequences.shape[1] - inputs["input_ids"].shape[1]
        )
        assert all(torch.equal(a, b) for a, b in zip(out.scores, expected.scores))
        assert all(torch.equal(a, b) for a, b in zip(out.logits, expected.logits))


def test_from_pretrained_with_trust_remote_code_installs_it_as_generate(saved):
    model, _, folder, tokenizer = saved
    patched = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64, trust_remote_code=True)
    inputs = batch(tokenizer)
    expected = model.generate(**inputs, **COMMON, do_sample=False, mars_threshold=0.5)
    assert torch.equal(patched.generate(**inputs, **COMMON, do_sample=False, mars_threshold=0.5), expected)
    # τ in a GenerationConfig, as `transformers serve` sends it
    config = GenerationConfig(**COMMON, do_sample=False, mars_threshold=0.5)
    assert torch.equal(patched.generate(**inputs, generation_config=config), expected)
    stock = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).generate(
        **inputs, **COMMON, do_sample=False
    )
    assert torch.equal(patched.generate(**inputs, **COMMON, do_sample=False), stock)


def test_what_it_leaves_to_mars_hf_is_refused_or_named(saved, caplog):
    _, plain, folder, tokenizer = saved
    inputs = batch(tokenizer)
    for kwargs, match in (
        (dict(mars_threshold=0.5, mars_planner=True), "mars_planner"),
        (dict(mars_acceptance="verify", prompt_lookup_num_tokens=3), "Prompt lookup"),
        (dict(mars_acceptance="verify", assistant_model=plain), "assistant_model"),
        (dict(mars_block_size=2), r"only apply to MARS decoding"),
        (
            dict(generation_config=GenerationConfig(mars_treshold=0.9)),
            r"unknown MARS settings \['mars_treshold'\]",
        ),
        (dict(mars_threshold=1.5), r"\[0, 1\]"),
        (dict(mars_threshold=0.5, mars_block_size=0), "integer >= 1"),
    ):
        with pytest.raises(ValueError, match=match):
            slim(plain, folder, inputs, **COMMON, do_sample=False, **kwargs)
    # settings that change only speed are named in a warning and leave the tokens as they are
    stock = plain.generate(**inputs, **COMMON, do_sample=False)
    with caplog.at_level(logging.WARNING):
        out = slim(
            plain,
            folder,
            inputs,
            **COMMON,
            do_sample=False,
            mars_acceptance="verify",
            mars_layout="quadratic",
        )
    assert torch.equal(out, stock) and "mars_layout" in caplog.text


# ---------------------------------------------------------------------------------------------- a gated adapter


def write_gated_adapter(folder, base, tokenizer, rank: int = 4) -> None:
    """A mask-gated LoRA checkpoint in the files mars_hf saves (PEFT's adapter files, mars_config.json, the
    trained mask rows), with random non-zero factors, and its custom_generate/."""
    folder.mkdir(parents=True)
    generator = torch.Generator().manual_seed(1)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    tensors = {}
    for name, module in base.named_modules():
        if name.rpartition(".")[2] in targets:
            for part, shape in (
                ("lora_A", (rank, module.in_features)),
                ("lora_B", (module.out_features, rank)),
            ):
                tensors[f"base_model.model.{name}.{part}.weight"] = 0.3 * torch.randn(
                    *shape, generator=generator
                )
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = dict(
        peft_type="LORA", task_type="CAUSAL_LM", r=rank, lora_alpha=2 * rank, target_modules=targets
    )
    (folder / "adapter_config.json").write_text(json.dumps(config))
    mask = tokenizer.mask_token_id
    (folder / "mars_config.json").write_text(
        json.dumps(dict(block_size=4, mask_token_id=mask, adapter_gating="mask"))
    )
    rows = base.get_input_embeddings().weight.shape[0]
    hidden = base.config.hidden_size
    mask_rows = dict(
        ids=torch.tensor([mask]),
        num_embeddings=torch.tensor(rows),
        input_embeddings=torch.randn(1, hidden, generator=generator),
        output_embeddings=torch.randn(1, hidden, generator=generator),
    )
    save_file(
        mask_rows, str(folder / "mars_mask_token.safetensors"), metadata={"mars_adapter_gating": "mask"}
    )
    tokenizer.save_pretrained(folder)
    write_custom_generate(folder / "custom_generate")


def test_gated_adapter_checkpoint_on_its_base_model(tmp_path):
    """The base model + mars_checkpoint=<gated checkpoint>: mars_hf's tokens, real positions the base's bit for bit."""
    tokenizer = tiny_tokenizer()
    base = tiny_model("llama", block_size=None)  # a real base: no mask token, no config.mars
    base.save_pretrained(tmp_path / "base")
    folder = tmp_path / "gated"
    write_gated_adapter(folder, base, tokenizer)
    reference, _ = load_mars_model(
        folder, base_model_name_or_path=str(tmp_path / "base"), dtype=torch.float64
    )
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float64)
    inputs = batch(tokenizer)
    greedy = plain.generate(**inputs, **COMMON, do_sample=False)
    with pytest.raises(ValueError, match="mars_checkpoint="):  # transformers does not say which repo it ran
        slim(plain, folder, inputs, **COMMON, do_sample=False, mars_threshold=0.5)
    for settings in (dict(mars_threshold=0.0), dict(mars_threshold=0.5), dict(mars_acceptance="verify")):
        expected = reference.generate(**inputs, **COMMON, do_sample=False, **settings)
        out = slim(plain, folder, inputs, **COMMON, do_sample=False, mars_checkpoint=str(folder), **settings)
        assert out.tolist() == expected.tolist(), settings
        assert torch.equal(out, greedy) == (
            settings.get("mars_threshold") != 0.0
        )  # τ = 0 keeps the masks' tokens
    mask = tokenizer.mask_token_id
    ids = torch.cat([inputs["input_ids"][:1], torch.full((1, 3), mask)], dim=1)
    with torch.no_grad():
        got, expected = plain(input_ids=ids).logits, base(input_ids=ids).logits
    real, others = (
        ids.shape[1] - 3,
        [i for i in range(got.shape[-1]) if i != mask],
    )  # the mask row's own output moves
    assert torch.equal(got[:, :real, others], expected[:, :real, others])
    assert not torch.allclose(got[:, real:], expected[:, real:])  # the masks do see the adapter
    assert set(plain.state_dict()) == set(base.state_dict())  # hooks and buffers, no new weights
    with pytest.raises(ValueError, match="already carries the adapter"):
        slim(plain, folder, inputs, **COMMON, mars_threshold=0.5, mars_checkpoint=str(tmp_path / "base"))


def test_a_gated_adapter_without_its_record_is_refused(tmp_path):
    """Without mars_config.json a gated adapter would run at every position: refused, naming the file."""
    tokenizer = tiny_tokenizer()
    base = tiny_model("llama", block_size=None)
    base.save_pretrained(tmp_path / "base")
    write_gated_adapter(tmp_path / "gated", base, tokenizer)
    (tmp_path / "gated" / "mars_config.json").unlink()
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float64)
    with pytest.raises(ValueError, match="no mars_config.json"):
        slim(
            plain,
            tmp_path / "gated",
            batch(tokenizer),
            **COMMON,
            mars_threshold=0.5,
            mars_checkpoint=str(tmp_path / "gated"),
        )
