"""Mask-gated LoRA (docs/method.md §7) and the frozen-clean training path.

Exactness is asserted bit for bit (``torch.equal``) where the spec promises the base model's own
numbers (real positions), and to float64 round-off where two computations are only mathematically
equal (frozen-clean vs two-stream training, PEFT vs the torch-only loader).
"""

from __future__ import annotations

import collections
import copy
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import LoraLayer

from mars_hf import hub
from mars_hf.decoding import gated_lora
from mars_hf.decoding.generation import mars_generate
from mars_hf.models import gated_peft
from mars_hf.models.modeling import load_mars_model
from mars_hf.training.attention_mask import build_mars_inputs, mars_attention_mask
from mars_hf.training.config import MARSConfig
from mars_hf.training.trainer import MARSTrainer
from tests.bare_venv import run_in_bare_venv
from tests.tiny import ARCHITECTURES, as_mars_class, tiny_model, tiny_tokenizer

REPO_ROOT = Path(__file__).resolve().parents[1]


def lora_config(**overrides):
    settings = dict(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False)
    settings.update(overrides)
    return LoraConfig(**settings)


def gated_copy(base, mask_token_id, seed=1):
    """A PEFT LoRA (random, non-zero B) on a copy of ``base``, gated to mask positions."""
    torch.manual_seed(seed)
    peft_model = get_peft_model(copy.deepcopy(base), lora_config())
    gated_peft.gate_peft_model(peft_model, mask_token_id)
    return peft_model.eval()


def random_ids(tokenizer, batch=2, length=9, seed=0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, len(tokenizer), (batch, length), generator=generator)
    return ids.masked_fill(ids == tokenizer.mask_token_id, 5)


# ---------------------------------------------------------------------------------------------- the gate


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_real_positions_are_the_base_model_bit_for_bit(arch, tokenizer):
    base = tiny_model(arch)
    mask = tokenizer.mask_token_id
    gated = gated_copy(base, mask)
    ungated = get_peft_model(copy.deepcopy(base), lora_config()).eval()
    real = random_ids(tokenizer)
    with_masks = torch.cat([real, torch.full((2, 4), mask)], dim=1)  # the MARS window layout
    with torch.no_grad():
        for ids in (real, with_masks):
            expected = base(input_ids=ids, use_cache=True)
            got = gated(input_ids=ids, use_cache=True)
            n = real.shape[1]
            assert torch.equal(got.logits[:, :n], expected.logits[:, :n])
            for layer_got, layer_expected in zip(got.cache.layers, expected.cache.layers):
                assert torch.equal(layer_got.keys[:, :, :n], layer_expected.keys[:, :, :n])
                assert torch.equal(layer_got.values[:, :, :n], layer_expected.values[:, :, :n])
        # The masks do get the adapter (and an ungated LoRA changes real tokens: the check can fail).
        assert not torch.allclose(
            gated(input_ids=with_masks).logits[:, n:], base(input_ids=with_masks).logits[:, n:]
        )
        assert not torch.allclose(ungated(input_ids=real).logits, base(input_ids=real).logits)


def test_two_stream_clean_half_is_the_base_model(tokenizer):
    base = tiny_model("qwen2")
    gated = gated_copy(base, tokenizer.mask_token_id)
    ids = random_ids(tokenizer, length=12)
    mars = build_mars_inputs(ids, None, None, block_size=4, mask_token_id=tokenizer.mask_token_id)
    mask = mars_attention_mask(mars, "sdpa")
    kwargs = dict(input_ids=mars.input_ids, attention_mask=mask, position_ids=mars.position_ids)
    with torch.no_grad():
        got, expected = gated(**kwargs).logits, base(**kwargs).logits
    assert torch.equal(got[:, : mars.clean_length], expected[:, : mars.clean_length])
    assert not torch.allclose(got[:, mars.clean_length :], expected[:, mars.clean_length :])


def test_inputs_embeds_is_refused_not_silently_ungated(tokenizer):
    base = tiny_model("llama")
    gated = gated_copy(base, tokenizer.mask_token_id)
    ids = random_ids(tokenizer)
    with torch.no_grad():
        gated(input_ids=ids)
        embeds = base.get_input_embeddings()(torch.cat([ids, ids], 1))
        with pytest.raises(RuntimeError, match="input_ids"):
            gated(inputs_embeds=embeds)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tau_1_decoding_is_the_base_models_greedy_output(arch, tokenizer):
    base = tiny_model(arch)
    with torch.no_grad():
        base.get_output_embeddings().weight.mul_(40.0)  # confident masks, so τ < 1 accepts drafts
    gated = gated_copy(as_mars_class(base), tokenizer.mask_token_id)  # the PEFT model's base has MARS generate
    inputs = tokenizer(["hello world the cat", "one two"], return_tensors="pt", padding=True)
    common = dict(max_new_tokens=16, do_sample=False)
    expected = base.generate(**inputs, **common)
    assert torch.equal(gated.generate(**inputs, **common), expected)
    assert torch.equal(gated.generate(**inputs, mars_threshold=1.0, **common), expected)
    out = gated.generate(**inputs, mars_acceptance="verify", return_dict_in_generate=True, **common)
    assert torch.equal(out.sequences, expected)


def test_merging_is_refused_everywhere(tmp_path, tokenizer):
    base = tiny_model("llama")
    gated = gated_copy(base, tokenizer.mask_token_id)
    for merge in (gated.merge_and_unload, gated.merge_adapter, gated.base_model.merge_and_unload):
        with pytest.raises(gated_lora.MergeRefusedError, match="cannot be merged"):
            merge()
    layer = next(m for m in gated.modules() if isinstance(m, LoraLayer))
    assert isinstance(layer.lora_variant["default"], gated_peft.MaskGatedLoraVariant)
    with pytest.raises(gated_lora.MergeRefusedError):
        layer.merge()
    assert gated.get_base_model().config.mars["adapter_gating"] == "mask"
    hub.save_pretrained(gated, tokenizer, tmp_path / "ckpt", base_model="someone/base")
    with pytest.raises(gated_lora.MergeRefusedError, match="cannot be merged"):
        load_mars_model(tmp_path / "ckpt", merge_adapter=True, base_model_name_or_path=str(tmp_path / "base"))


def test_only_plain_linear_lora_can_be_gated(tokenizer):
    base = tiny_model("llama")
    dora = get_peft_model(copy.deepcopy(base), lora_config(use_dora=True))
    with pytest.raises(ValueError, match="only plain LoRA"):
        gated_peft.gate_peft_model(dora, tokenizer.mask_token_id)
    saved = get_peft_model(
        copy.deepcopy(base), lora_config(target_modules=["q_proj"], modules_to_save=["v_proj"])
    )
    with pytest.raises(ValueError, match="modules_to_save"):
        gated_peft.gate_peft_model(saved, tokenizer.mask_token_id)


# ---------------------------------------------------------------------------------------------- training


def chat_dataset(tokenizer, n=6):
    rows = []
    words = "the cat sat on the mat one two three four five six seven".split()
    for i in range(n):
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": " ".join(words[i : i + 3])}],
            add_generation_prompt=True,
            tokenize=True,
        )
        prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
        answer = tokenizer(" ".join(words[(i + 2) % 5 : (i + 2) % 5 + 5 + i % 3]))["input_ids"]
        ids = prompt + list(answer) + [tokenizer.eos_token_id]
        rows.append({"input_ids": ids, "labels": [-100] * len(prompt) + ids[len(prompt) :]})
    return Dataset.from_list(rows)


def make_trainer(tmp_path, tokenizer, model, method, peft_config=None, **config):
    """``method``: "gated" (``peft_config``, default a random r = 4 LoRA) or "mask_row"."""
    args = MARSConfig(
        output_dir=str(tmp_path / "out"),
        report_to="none",
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=3,
        block_size=config.pop("block_size", 2),
        save_strategy="no",
        **config,
    )
    if method == "gated" and peft_config is None:
        peft_config = lora_config(init_lora_weights=False)
    trainer = MARSTrainer(
        model=model,
        args=args,
        train_dataset=chat_dataset(tokenizer),
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    if method == "mask_row":
        trainer.train_mask_row_only()
    return trainer


def loss_and_grads(trainer, batch):
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(trainer.model, dict(batch))
    loss.backward()
    grads = {name: p.grad.clone() for name, p in trainer.model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def collated(trainer, n=3):
    return trainer.data_collator([trainer.train_dataset[i] for i in range(n)])


@pytest.mark.parametrize(
    "arch,method,checkpointing",
    [(arch, method, False) for arch in ARCHITECTURES for method in ("gated", "mask_row")]
    + [("qwen2", "gated", True), ("llama", "mask_row", True)],
)
def test_frozen_clean_training_equals_the_two_stream_loss_and_gradients(
    tmp_path, arch, method, checkpointing
):
    tokenizer = tiny_tokenizer()
    model = tiny_model(arch, block_size=None)
    ar_weight = 0.5 if method == "gated" else 0.0
    trainer = make_trainer(
        tmp_path,
        tokenizer,
        model,
        method,
        ar_weight=ar_weight,
        adapter_gating="mask" if method == "gated" else None,
        gradient_checkpointing=checkpointing,
    )
    if checkpointing:  # recomputes layers in backward (only in training mode)
        trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        trainer.model.train()
        layer = next(m for m in trainer.model.modules() if hasattr(m, "_can_checkpoint_with_cache"))
        assert layer.gradient_checkpointing
    else:
        trainer.model.eval()
    batch = collated(trainer)
    assert trainer._use_frozen_clean("sdpa")
    frozen_loss, frozen_grads = loss_and_grads(trainer, batch)
    trainer.args.frozen_clean_stream = False
    two_loss, two_grads = loss_and_grads(trainer, batch)
    assert frozen_grads.keys() == two_grads.keys() and frozen_grads
    torch.testing.assert_close(frozen_loss, two_loss, rtol=1e-12, atol=1e-12)
    for name in two_grads:
        torch.testing.assert_close(frozen_grads[name], two_grads[name], rtol=1e-9, atol=1e-12, msg=name)
    assert any(g.abs().sum() > 0 for g in two_grads.values())


def test_frozen_clean_is_refused_when_the_clean_stream_trains(tmp_path):
    tokenizer = tiny_tokenizer()
    model = tiny_model("llama", block_size=None)
    trainer = make_trainer(tmp_path, tokenizer, model, "full", frozen_clean_stream=True)
    with pytest.raises(ValueError, match="shared weights are trained"):
        trainer.compute_loss(trainer.model, dict(collated(trainer)))
    trainer.args.frozen_clean_stream = None
    assert not trainer._use_frozen_clean("sdpa")  # auto: two-stream for full fine-tuning


def test_soft_targets_are_the_base_distribution(tmp_path):
    tokenizer = tiny_tokenizer()
    base = tiny_model("qwen2", block_size=None)
    trainer = make_trainer(
        tmp_path,
        tokenizer,
        copy.deepcopy(base),
        "gated",
        adapter_gating="mask",
        mask_targets="soft",
        ar_weight=0.0,
    )
    batch = collated(trainer)
    loss = trainer.compute_loss(trainer.model, dict(batch))
    # Slow reference: the two-stream forward's noisy logits against the base model's softmax at each position.
    mars = build_mars_inputs(
        batch["input_ids"],
        batch["attention_mask"],
        batch["labels"],
        block_size=2,
        mask_token_id=trainer.mask_token_id,
    )
    kwargs = dict(
        input_ids=mars.input_ids,
        attention_mask=mars_attention_mask(mars, "sdpa"),
        position_ids=mars.position_ids,
    )
    with torch.no_grad():
        logits = trainer.model(**kwargs).logits
        base_model = trainer.model.get_base_model()
        with trainer.model.disable_adapter():
            pass
        clean = base(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    total, count = 0.0, 0
    length = mars.clean_length
    for b in range(logits.shape[0]):
        for j in range(length, logits.shape[1]):
            if mars.shift_labels[b, j] == -100:
                continue
            p = mars.position_ids[b, j]
            q = clean[b, p].softmax(-1)
            total += -(q * logits[b, j].log_softmax(-1)).sum()
        count += int((mars.shift_labels[b, :length] != -100).sum())
    del base_model
    torch.testing.assert_close(
        loss.detach(), torch.as_tensor(total / count, dtype=loss.dtype), rtol=1e-9, atol=1e-10
    )
    hard = make_trainer(
        tmp_path, tokenizer, copy.deepcopy(base), "gated", adapter_gating="mask", ar_weight=0.0
    )
    assert not torch.isclose(hard.compute_loss(hard.model, dict(batch)).detach(), loss.detach())


# ---------------------------------------------------------------------------------------------- save / load


@pytest.fixture
def trained_gated(tmp_path):
    """A gated adapter trained a few steps by MARSTrainer (base without a mask token), saved by hub."""
    tokenizer = tiny_tokenizer(with_mask=False)
    base_dir = tmp_path / "base"
    base = tiny_model("llama", block_size=None, vocab_size=len(tokenizer) + 4, tie_word_embeddings=True)
    with torch.no_grad():
        base.get_output_embeddings().weight.mul_(30.0)
    base.save_pretrained(base_dir)
    tokenizer.save_pretrained(base_dir)
    model = type(base).from_pretrained(base_dir, dtype=torch.float64)
    trainer = make_trainer(
        tmp_path,
        tokenizer,
        model,
        "gated",
        adapter_gating="mask",
        max_steps=3,
        learning_rate=5e-2,
        ar_weight=0.0,
    )
    trainer.train()
    peft_model = trainer.model.eval()
    files = hub.save_pretrained(peft_model, tokenizer, tmp_path / "ckpt", base_model="someone/base")
    return peft_model, tokenizer, base_dir, tmp_path / "ckpt", files


def test_saved_gated_adapter_is_small_and_says_what_it_is(trained_gated):
    _, _, _, folder, files = trained_gated
    assert {
        "adapter_model.safetensors",
        "adapter_config.json",
        "mars_config.json",
        "mars_mask_token.safetensors",
        "custom_generate/gated_lora.py",
    } <= set(files)
    assert "model.safetensors" not in files
    assert json.loads((folder / "mars_config.json").read_text())["adapter_gating"] == "mask"
    card = (folder / "README.md").read_text()
    assert "mask-gated LoRA adapter" in card and "cannot be merged" in card
    assert "safetensors" in (folder / "custom_generate" / "requirements.txt").read_text()


def window_logits(model, ids, mask_id):
    x = torch.cat([ids, torch.full((ids.shape[0], 3), mask_id)], 1)
    with torch.no_grad():
        return model(input_ids=x).logits


def test_round_trip_mars_hf_and_torch_only_loader(trained_gated, tmp_path):
    from transformers import AutoModelForCausalLM

    peft_model, tokenizer, base_dir, folder, _ = trained_gated
    mask_id = tokenizer.mask_token_id
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    expected = window_logits(peft_model, ids, mask_id)
    loaded, loaded_tokenizer = load_mars_model(
        folder, base_model_name_or_path=str(base_dir), merge_adapter="auto"
    )
    assert gated_lora.is_gated(loaded) and loaded.config.mars["adapter_gating"] == "mask"
    assert loaded_tokenizer.mask_token_id == mask_id
    torch.testing.assert_close(window_logits(loaded, ids, mask_id), expected, rtol=1e-12, atol=1e-10)

    plain = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float64)
    reference = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float64)
    assert gated_lora.attach_shipped_adapter(plain, folder) is True
    assert gated_lora.attach_shipped_adapter(plain, folder) is False  # idempotent
    assert (
        plain.config.mars["adapter_gating"] == "mask" and mask_id in plain.generation_config.suppress_tokens
    )
    got = window_logits(plain, ids, mask_id)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-10)
    # Real positions: the base model exactly, except the tied mask token's own (suppressed) output column.
    reference.resize_token_embeddings(plain.get_input_embeddings().weight.shape[0])
    with torch.no_grad():
        base_logits = reference(input_ids=ids).logits
    keep = [i for i in range(got.shape[-1]) if i != mask_id]
    assert torch.equal(got[:, :4, keep], base_logits[:, :, keep])
    assert set(dict(plain.state_dict())) == set(dict(reference.state_dict()))  # hooks, not new weights


def test_round_trip_from_an_offline_hub_cache(trained_gated, tmp_path, monkeypatch):
    import huggingface_hub.constants as constants

    from tests.test_hub import put_in_hub_cache

    peft_model, tokenizer, base_dir, folder, _ = trained_gated
    cache = tmp_path / "hub_cache"
    put_in_hub_cache(base_dir, cache, "someone/base")
    config = json.loads((folder / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = "someone/base"
    (folder / "adapter_config.json").write_text(json.dumps(config))
    put_in_hub_cache(folder, cache, "someone/gated-blk2")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    model, _ = hub.load("someone/gated-blk2", cache_dir=str(cache))
    ids = torch.tensor([[5, 6, 7, 8]])
    torch.testing.assert_close(
        window_logits(model, ids, tokenizer.mask_token_id),
        window_logits(peft_model, ids, tokenizer.mask_token_id),
        rtol=1e-12,
        atol=1e-10,
    )


NO_MARS_SCRIPT = textwrap.dedent(
    """
    import importlib, json, sys
    for name in ("mars_hf", "peft", "trl"):
        sys.modules[name] = None  # import fails, find_spec says "not installed"
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder, base = sys.argv[1], sys.argv[2]
    sys.path.insert(0, folder)  # custom_generate/ as a package, as transformers loads it: siblings resolve
    module = importlib.import_module("custom_generate.gated_lora")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float64)
    inputs = tokenizer(["hello world the cat"], return_tensors="pt")
    greedy = model.generate(**inputs, max_new_tokens=10, do_sample=False).tolist()
    assert module.attach_shipped_adapter(model, folder)
    ids = torch.cat([inputs["input_ids"], torch.full((1, 3), tokenizer.mask_token_id)], 1)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    result = {"greedy_before": greedy, "greedy_after": model.generate(**inputs, max_new_tokens=10, do_sample=False).tolist(),
              "mask_logits": logits[0, -3:].tolist()}
    print(json.dumps(result))
    """
)


def test_shipped_gate_runs_without_mars_hf_or_peft(trained_gated, tmp_path):
    peft_model, tokenizer, base_dir, folder, _ = trained_gated
    script = tmp_path / "run.py"
    script.write_text(NO_MARS_SCRIPT)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}
    run = subprocess.run(
        [sys.executable, str(script), str(folder), str(base_dir)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["greedy_after"] == result["greedy_before"]  # one-token decoding: the base model
    ids = tokenizer(["hello world the cat"], return_tensors="pt")["input_ids"]
    expected = window_logits(peft_model, ids, tokenizer.mask_token_id)[0, -3:]
    torch.testing.assert_close(
        torch.tensor(result["mask_logits"], dtype=torch.float64), expected, rtol=1e-10, atol=1e-9
    )


def test_custom_generate_applies_the_gated_adapter(trained_gated):
    """generate(custom_generate=<checkpoint>) on the plain base model decodes like the PEFT model."""
    from transformers import AutoModelForCausalLM

    peft_model, tokenizer, base_dir, folder, _ = trained_gated
    inputs = tokenizer(["hello world the cat", "one two"], return_tensors="pt", padding=True)
    common = dict(max_new_tokens=12, do_sample=False, mars_threshold=0.5)
    expected = peft_model.generate(**inputs, custom_generate=mars_generate, **common)
    plain = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float64)
    out = plain.generate(
        **inputs, custom_generate=str(folder), trust_remote_code=True, mars_checkpoint=str(folder), **common
    )
    assert torch.equal(out, expected)


BARE_VENV_GATED = textwrap.dedent(
    """
    import importlib.util, json, sys
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, base, batch = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    missing = {name: importlib.util.find_spec(name) is None for name in ("mars_hf", "peft", "trl")}
    tokenizer = AutoTokenizer.from_pretrained(folder)
    inputs = {key: torch.tensor(value) for key, value in batch.items()}
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float64)
    common = dict(max_new_tokens=12, do_sample=False)
    greedy = model.generate(**inputs, **common).tolist()
    out = {"missing": missing, "greedy": greedy}
    remote = dict(custom_generate=folder, trust_remote_code=True, mars_checkpoint=folder)
    out["tau"] = model.generate(**inputs, **remote, mars_threshold=0.5, **common).tolist()
    out["verify"] = model.generate(**inputs, **remote, mars_acceptance="verify", **common).tolist()
    print(json.dumps(out))
    """
)


@pytest.mark.slow
def test_gated_checkpoint_through_custom_generate_in_a_bare_venv(trained_gated, tmp_path, bare_venv):
    """torch + transformers only: the base model + custom_generate=<gated checkpoint> decodes like mars_hf."""
    peft_model, tokenizer, base_dir, folder, _ = trained_gated
    inputs = tokenizer(["hello world the cat", "one two"], return_tensors="pt", padding=True)
    common = dict(max_new_tokens=12, do_sample=False)
    expected_tau = peft_model.generate(
        **inputs, custom_generate=mars_generate, mars_threshold=0.5, **common
    ).tolist()
    base_greedy = peft_model.generate(**inputs, **common).tolist()
    batch = json.dumps({key: value.tolist() for key, value in inputs.items()})
    result = run_in_bare_venv(bare_venv, BARE_VENV_GATED, [folder, base_dir, batch], tmp_path)
    assert result["missing"] == {"mars_hf": True, "peft": True, "trl": True}
    assert result["tau"] == expected_tau
    assert result["verify"] == base_greedy == result["greedy"]


# ---------------------------------------------------------------------------------------------- the lean shipped forward


def shipped_gated(tmp_path, arch, tokenizer, dtype=torch.float64, lora_dtype=None, kernel=None):
    """(base model, the same base with the saved gated adapter attached, the PEFT gated model, checkpoint).

    ``kernel``: the gated delta's form on CPU (``c``: the C kernel of gated_kernel, ``torch``: torch ops)."""
    from transformers import AutoModelForCausalLM

    base = tiny_model(arch)
    base_dir = tmp_path / f"base-{arch}"
    base.save_pretrained(base_dir)
    tokenizer.save_pretrained(base_dir)
    peft_model = gated_copy(base, tokenizer.mask_token_id)
    folder = tmp_path / f"ckpt-{arch}"
    hub.save_pretrained(peft_model, tokenizer, folder, base_model="someone/base")
    plain = AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype)
    assert gated_lora.attach_shipped_adapter(plain, folder, lora_dtype=lora_dtype, kernel=kernel)
    return AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype), plain, peft_model, folder


def decode_steps(model, tokenizer):
    """A prefix with a cache, then one step whose rows hold masks at different places, then a plain step."""
    mask = tokenizer.mask_token_id
    prefix = random_ids(tokenizer, batch=2, length=7, seed=3)
    step = torch.tensor([[5, mask, mask, mask], [6, 7, mask, mask]])
    plain = torch.tensor([[8], [9]])
    outs = []
    with torch.no_grad():
        first = model(input_ids=prefix, use_cache=True)
        cache = first.cache
        outs.append(first.logits)
        outs.append(model(input_ids=step, cache=cache, use_cache=True).logits)
        cache.crop(-(step.shape[1] - 1))  # keep the window's first (real) token, as decoding does
        outs.append(model(input_ids=plain, cache=cache, use_cache=True).logits)
    return outs, step != mask


@pytest.mark.parametrize("kernel", ["c", "torch"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_shipped_forward_equals_the_base_at_real_positions_and_the_reference_at_masks(
    arch, kernel, tokenizer, tmp_path
):
    """Real positions: the base model bit for bit (prefix, window, plain step after it). Masks: the PEFT gate."""
    base, shipped, peft_model, _ = shipped_gated(tmp_path, arch, tokenizer, kernel=kernel)
    got, real = decode_steps(shipped, tokenizer)
    expected, _ = decode_steps(base, tokenizer)
    reference, _ = decode_steps(peft_model, tokenizer)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[2], expected[2])
    assert torch.equal(got[1][real], expected[1][real])
    for ours, slow in zip(got, reference):
        torch.testing.assert_close(ours, slow, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(got[1][~real], expected[1][~real])  # the masks do get the adapter


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize(
    "kernel, lora_dtype, stored",
    [
        ("torch", None, torch.float32),  # float32 LoRA arithmetic, added then rounded once
        ("torch", torch.bfloat16, torch.bfloat16),  # bf16 addmm in place
        ("c", None, torch.bfloat16),  # bf16 matrices, float32 arithmetic, rounded once
        ("c", torch.float32, torch.float32),
    ],
    ids=["torch-float32-lora", "torch-bf16-lora", "c-bf16-matrices", "c-float32-matrices"],
)
def test_shipped_forward_in_bfloat16_keeps_the_base_models_bits_at_real_positions(
    arch, kernel, lora_dtype, stored, tokenizer, tmp_path
):
    """bf16 model: whatever form and precision the adapter runs in, real positions keep the base's bits."""
    base, shipped, peft_model, _ = shipped_gated(
        tmp_path, arch, tokenizer, dtype=torch.bfloat16, lora_dtype=lora_dtype, kernel=kernel
    )
    assert shipped.model.layers[0].self_attn.q_proj.mars_lora_A.dtype == stored
    got, real = decode_steps(shipped, tokenizer)
    expected, _ = decode_steps(base, tokenizer)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[2], expected[2])
    assert torch.equal(got[1][real], expected[1][real])
    assert not torch.equal(got[1][~real], expected[1][~real])
    reference, _ = decode_steps(peft_model, tokenizer)  # float64: bf16 round-off only
    torch.testing.assert_close(got[1][~real].double(), reference[1][~real], rtol=0.05, atol=0.1)


@pytest.mark.parametrize("kernel", ["c", "torch"])
def test_shipped_adapter_shares_one_projection_per_input_and_skips_plain_steps(
    kernel, tokenizer, tmp_path, monkeypatch
):
    _, shipped, _, _ = shipped_gated(tmp_path, "llama", tokenizer, kernel=kernel)
    attention = shipped.model.layers[0].self_attn
    mlp = shipped.model.layers[0].mlp
    # q, k and v read one input: one stacked A on q_proj; gate/up likewise; o and down alone.
    name = "mars_lora_A"  # (ranks, inputs), read by both forms
    assert attention.q_proj.mars_lora_A.shape[0] == 3 * 4 and name not in attention.k_proj._buffers
    assert mlp.gate_proj.mars_lora_A.shape[0] == 2 * 4 and mlp.down_proj.mars_lora_A.shape[0] == 4
    products = []  # one entry per x @ A.T actually computed
    original = gated_lora._SharedInput.adapt_group

    def counting(self, *args):
        products.append(tuple(self.leader._buffers[name].shape))
        return original(self, *args)

    monkeypatch.setattr(gated_lora._SharedInput, "adapt_group", counting)
    with torch.no_grad():
        shipped(input_ids=random_ids(tokenizer))
        assert products == []  # no mask in the forward: no adapter arithmetic at all
        shipped(input_ids=torch.tensor([[5, 6, tokenizer.mask_token_id]]))
    assert products == [(12, 32), (4, 32), (8, 32), (4, 64)] * 2  # q/k/v, o, gate/up, down in 2 blocks
    assert gated_lora.is_gated(shipped) and shipped._mars_mask_gate.current().kept == {}  # nothing kept alive


@pytest.mark.parametrize("kernel", ["c", "torch"])
def test_each_base_layer_runs_once_per_forward(kernel, tokenizer, tmp_path, monkeypatch):
    """The first layer of a sibling group called in a forward runs its siblings' base layers too; the
    siblings take those outputs instead of computing them again."""
    _, shipped, _, _ = shipped_gated(tmp_path, "llama", tokenizer, kernel=kernel)
    adapted = [m for m in shipped.modules() if "_mars_adapter" in m.__dict__]
    runs, linear = collections.Counter(), torch.nn.functional.linear

    def counting(x, weight, bias=None):
        runs[weight.data_ptr()] += 1
        return linear(x, weight, bias)

    with torch.no_grad():
        reference = shipped(input_ids=torch.tensor([[5, 6, tokenizer.mask_token_id, 7]])).logits
        monkeypatch.setattr(torch.nn.functional, "linear", counting)
        logits = shipped(input_ids=torch.tensor([[5, 6, tokenizer.mask_token_id, 7]])).logits
    assert [runs[m.weight.data_ptr()] for m in adapted] == [1] * len(adapted) and len(adapted) == 14
    assert torch.equal(logits, reference)


@pytest.mark.parametrize("kernel", ["c", "torch"])
def test_shared_projection_is_recomputed_when_siblings_get_different_inputs(kernel, tokenizer):
    """The q/k/v grouping is a guess from the names: a module feeding them different tensors stays exact."""

    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(10, 6, dtype=torch.float64)
            self.q_proj = torch.nn.Linear(6, 5, dtype=torch.float64)
            self.k_proj = torch.nn.Linear(6, 3, bias=False, dtype=torch.float64)

        def get_input_embeddings(self):
            return self.embed

        def forward(self, ids):
            x = self.embed(ids)
            return self.q_proj(x), self.k_proj(x * 2)

    torch.manual_seed(0)
    model = Odd()
    pairs = {
        name: {"A": torch.randn(2, 6, dtype=torch.float64), "B": torch.randn(out, 2, dtype=torch.float64)}
        for name, out in (("q_proj", 5), ("k_proj", 3))
    }
    gate = gated_lora.install_mask_gate(model, 9, reset_per_forward=True)
    ids = torch.tensor([[1, 9, 2, 9]])
    with torch.no_grad():
        x = model.embed(ids)
        expected = [model.q_proj(x), model.k_proj(x * 2)]
        is_mask = (ids == 9).reshape(-1, 1).double()
        for out, (name, xin) in zip(expected, (("q_proj", x), ("k_proj", x * 2))):
            delta = xin.reshape(-1, 6) @ pairs[name]["A"].T @ pairs[name]["B"].T * 0.5
            out.add_((delta * is_mask).view_as(out))
        gated_lora._install_adapter(model, pairs, 0.5, gate, kernel=kernel)
        got = model(ids)
    for ours, slow in zip(got, expected):
        torch.testing.assert_close(ours, slow, rtol=1e-12, atol=1e-12)


def test_shipped_gate_refuses_inputs_embeds_even_after_an_input_ids_forward(tokenizer, tmp_path):
    _, shipped, _, _ = shipped_gated(tmp_path, "qwen2", tokenizer)
    ids = random_ids(tokenizer)
    with torch.no_grad():
        shipped(input_ids=ids)  # same number of positions as below: a stale gate would be accepted
        embeds = shipped.get_input_embeddings()(ids)  # and this call records the ids again
        with pytest.raises(RuntimeError, match="input_ids"):
            shipped(inputs_embeds=embeds)


def test_shipped_adapter_follows_the_model_to_another_dtype(tokenizer, tmp_path):
    base, shipped, _, _ = shipped_gated(tmp_path, "mistral", tokenizer)
    shipped.to(torch.float32)
    base.to(torch.float32)
    got, real = decode_steps(shipped, tokenizer)
    expected, _ = decode_steps(base, tokenizer)
    assert got[1].dtype == torch.float32 and torch.equal(got[1][real], expected[1][real])


def test_shipped_loader_applies_an_ungated_adapter_everywhere(tmp_path):
    """custom_generate/ also attaches a plain (ungated) MARS LoRA: the delta at every position, like PEFT's merge."""
    from transformers import AutoModelForCausalLM

    from tests.test_hub import make_lora_adapter

    peft_model, tokenizer, adapter_dir = make_lora_adapter(tmp_path, "custom-row")  # LoRA on q_proj, v_proj
    merged = peft_model.merge_and_unload()
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float64)
    assert gated_lora.attach_shipped_adapter(plain, adapter_dir) and not gated_lora.is_gated(plain)
    ids = torch.tensor([[5, 6, 7, tokenizer.mask_token_id, tokenizer.mask_token_id], [8, 9, 10, 11, 12]])
    with torch.no_grad():
        torch.testing.assert_close(
            plain(input_ids=ids).logits, merged(input_ids=ids).logits, rtol=0, atol=1e-12
        )


# ---------------------------------------------------------------------------------------------- loading refusals


def drop_gate_marker(folder):
    """The folder as a checkpoint saved before adapter_config.json carried gate_token_id (and its own peft_type)."""
    config = json.loads((folder / "adapter_config.json").read_text())
    del config[gated_lora.GATE_TOKEN_KEY]
    config["peft_type"] = "LORA"
    (folder / "adapter_config.json").write_text(json.dumps(config))


def test_gated_checkpoint_without_its_gating_record_is_refused_not_loaded_ungated(tokenizer, tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    _, _, _, folder = shipped_gated(tmp_path, "llama", tokenizer)
    base_dir = tmp_path / "base-llama"
    drop_gate_marker(
        folder
    )  # an older checkpoint: only mars_config.json and the mask-row file record the gate
    (folder / "mars_config.json").unlink()
    refused = r"(gated to mask positions|has the MARS mask-row file).*no mars_config.json.*Restore"
    for load in (
        lambda: load_mars_model(folder, base_model_name_or_path=str(base_dir)),
        lambda: load_mars_model(
            folder, block_size=2, base_model_name_or_path=str(base_dir)
        ),  # the advice
        lambda: gated_lora.attach_shipped_adapter(AutoModelForCausalLM.from_pretrained(base_dir), folder),
    ):
        with pytest.raises(ValueError, match=refused):
            load()
    # A checkpoint saved before the mask-row file repeated the gating: refused all the same.
    rows = folder / "mars_mask_token.safetensors"
    save_file(load_file(rows), rows)
    with pytest.raises(ValueError, match="has the MARS mask-row file.*no mars_config.json"):
        load_mars_model(folder, block_size=2, base_model_name_or_path=str(base_dir))


def test_gating_record_that_contradicts_the_mask_rows_is_refused(tokenizer, tmp_path):
    _, _, _, folder = shipped_gated(tmp_path, "llama", tokenizer)
    mars = json.loads((folder / "mars_config.json").read_text())
    del mars["adapter_gating"]
    (folder / "mars_config.json").write_text(json.dumps(mars))
    base = str(tmp_path / "base-llama")
    with pytest.raises(
        ValueError,
        match=r"adapter_config.json says the adapter is gated to token \d+ .* says adapter_gating=None",
    ):
        load_mars_model(folder, base_model_name_or_path=base)
    drop_gate_marker(folder)
    with pytest.raises(ValueError, match=r"says adapter_gating='mask' but mars_config.json says None"):
        load_mars_model(folder, base_model_name_or_path=base)


def test_load_refuses_a_gate_that_does_not_hold_real_positions(tokenizer, tmp_path, monkeypatch):
    """The load-time check can fail: a gate that opens at every position changes real tokens."""
    from transformers import AutoModelForCausalLM

    _, _, _, folder = shipped_gated(tmp_path, "qwen3", tokenizer)
    record = gated_lora.MaskGate.record

    def open_everywhere(self, module, args, kwargs):
        record(self, module, args, kwargs)
        forward = self.current()
        forward.gate = torch.ones(forward.rows, 1, dtype=module.weight.dtype)

    monkeypatch.setattr(gated_lora.MaskGate, "record", open_everywhere)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "base-qwen3", dtype=torch.float64)
    with pytest.raises(RuntimeError, match="differ from the base model"):
        gated_lora.attach_shipped_adapter(plain, folder)
