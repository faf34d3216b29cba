"""The mask-gated LoRA through PEFT's extension point, per-thread gate records, and the loading faults.

PEFT side: ``MaskGatedLoraConfig`` / ``MaskGatedLoraLinear`` / ``MaskGatedLoraVariant``
(mars_hf/models/gated_peft.py). Faults of issue 52: 2 (a gated adapter that lost its MARS files), 3 (LoRA
factors whose ranks disagree), 6 (two threads decoding on one gated model), 12 (an adapter on the wrong base).
"""

from __future__ import annotations

import json
import shutil
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from peft import PeftModel
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from mars_hf.decoding import gated_lora
from mars_hf.decoding.generation import enable_mars
from mars_hf.models.gated_peft import (
    MaskGatedLoraConfig,
    MaskGatedLoraLinear,
    MaskGatedLoraVariant,
    gate_peft_model,
    load_gated_peft_model,
)
from mars_hf.models.modeling import load_mars_model
from tests.test_gated_lora import (  # noqa: F401  (trained_gated, chat_dataset: a fixture and what it needs)
    chat_dataset,
    decode_steps,
    drop_gate_marker,
    gated_copy,
    random_ids,
    shipped_gated,
    trained_gated,
    window_logits,
)
from tests.tiny import as_mars_class, tiny_model

MARS_FILES = ("mars_config.json", "mars_mask_token.safetensors")


def plain_base(tmp_path, arch="llama"):
    return AutoModelForCausalLM.from_pretrained(tmp_path / f"base-{arch}", dtype=torch.float64)


def assert_gated_like(model, base, reference, tokenizer):
    """Real positions: ``base`` bit for bit; every position: ``reference`` (the PEFT model saved) to round-off."""
    got, real = decode_steps(model, tokenizer)
    expected, _ = decode_steps(base, tokenizer)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[2], expected[2])
    assert torch.equal(got[1][real], expected[1][real])
    assert not torch.allclose(got[1][~real], expected[1][~real])  # the masks do get the adapter
    for ours, slow in zip(got, decode_steps(reference, tokenizer)[0]):
        torch.testing.assert_close(ours, slow, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------- PEFT's route


def test_a_gated_checkpoint_loads_with_peft_and_the_registered_config(tokenizer, tmp_path):
    base, _, peft_model, folder = shipped_gated(tmp_path, "qwen2", tokenizer)
    mask = tokenizer.mask_token_id
    assert json.loads((folder / "adapter_config.json").read_text())[gated_lora.GATE_TOKEN_KEY] == mask
    config = MaskGatedLoraConfig.from_pretrained(folder)
    assert type(config) is MaskGatedLoraConfig and config.gate_token_id == mask
    loaded = PeftModel.from_pretrained(plain_base(tmp_path, "qwen2"), folder, config=config)
    layers = [m for m in loaded.modules() if isinstance(m, LoraLayer)]
    assert layers and all(isinstance(m, MaskGatedLoraLinear) for m in layers)
    assert all(isinstance(m.lora_variant["default"], MaskGatedLoraVariant) for m in layers)
    with pytest.raises(RuntimeError, match="gate_peft_model"), torch.no_grad():  # PEFT alone has no gate yet
        loaded(input_ids=torch.tensor([[5, mask]]))
    assert gate_peft_model(loaded) == len(layers)
    assert_gated_like(loaded, base, peft_model, tokenizer)


def test_an_older_checkpoint_gets_its_gate_token_from_mars_config(tokenizer, tmp_path):
    base, _, peft_model, folder = shipped_gated(tmp_path, "llama", tokenizer)
    drop_gate_marker(folder)
    assert MaskGatedLoraConfig.from_pretrained(folder).gate_token_id == tokenizer.mask_token_id
    assert_gated_like(load_gated_peft_model(plain_base(tmp_path), folder), base, peft_model, tokenizer)
    (folder / "mars_config.json").unlink()
    with pytest.raises(ValueError, match="no mars_config.json"):
        MaskGatedLoraConfig.from_pretrained(folder)


def test_peft_and_mars_hf_loaders_agree_on_a_trained_adapter(trained_gated):  # noqa: F811
    """Tied embeddings, a mask token the base lacks, PEFT's trainable-token rows: both loaders, one model."""
    peft_model, tokenizer, base_dir, folder, _ = trained_gated
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    expected = window_logits(peft_model, ids, tokenizer.mask_token_id)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float64)
    through_peft = load_gated_peft_model(base, folder)
    ours, _ = load_mars_model(folder, base_model_name_or_path=str(base_dir))
    for model in (through_peft, ours):
        torch.testing.assert_close(
            window_logits(model, ids, tokenizer.mask_token_id), expected, rtol=1e-12, atol=1e-10
        )


def test_the_variant_refuses_every_merge_and_leaves_the_weights_alone(tokenizer, tmp_path):
    _, _, _, folder = shipped_gated(tmp_path, "llama", tokenizer)
    loaded = load_gated_peft_model(plain_base(tmp_path), folder)
    layer = next(m for m in loaded.modules() if isinstance(m, LoraLayer))
    weights = {name: p.clone() for name, p in loaded.named_parameters()}
    before, _ = decode_steps(loaded, tokenizer)
    for merge in (
        loaded.merge_and_unload,
        loaded.merge_adapter,
        layer.merge,
        lambda: layer.merge(safe_merge=True),
    ):
        with pytest.raises(gated_lora.MergeRefusedError, match="cannot be merged"):
            merge()
    assert all(torch.equal(p, weights[name]) for name, p in loaded.named_parameters())
    after, _ = decode_steps(loaded, tokenizer)
    assert all(torch.equal(a, b) for a, b in zip(after, before))


def test_no_method_of_torch_or_peft_is_replaced(tokenizer, tmp_path):
    """PEFT's route and the lean loader extend at extension points: no module or PEFT model carries an
    instance attribute in place of a method."""
    _, shipped, peft_model, folder = shipped_gated(tmp_path, "llama", tokenizer)
    loaded = load_gated_peft_model(plain_base(tmp_path), folder)
    methods = {
        "forward",
        "_apply",
        "register_buffer",
        "merge",
        "unmerge",
        "merge_and_unload",
        "merge_adapter",
    }
    for model in (shipped, peft_model, loaded):
        for name, module in [("", model), *model.named_modules()]:
            assert not methods & set(vars(module)), (name, methods & set(vars(module)))
        assert gated_lora.is_gated(model)


def test_gating_a_plain_lora_makes_its_saved_config_say_so(tokenizer, tmp_path):
    peft_model = gated_copy(tiny_model("llama"), tokenizer.mask_token_id)
    assert type(peft_model.peft_config["default"]) is MaskGatedLoraConfig
    peft_model.save_pretrained(tmp_path / "adapter")
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["peft_type"] == gated_lora.MARS_PEFT_TYPE  # plain PEFT refuses it (test_plain_peft_refusal.py)
    assert saved[gated_lora.GATE_TOKEN_KEY] == tokenizer.mask_token_id


# ---------------------------------------------------------------------------------------------- threads (fault 6)


@pytest.mark.parametrize("loader, kernel", [("peft", None), ("mars_hf", "torch"), ("mars_hf", "c")])
def test_two_threads_decoding_on_one_gated_model_each_get_their_own_output(
    loader, kernel, tokenizer, tmp_path
):
    """Batches of different sizes (so their forwards have different row counts) decoded with masks in every
    forward, in two threads at once on one model, with the interpreter switching threads as often as it can:
    each call gives what it gives alone (with the opt-in C kernel too, whose per-group call is locked)."""
    _, shipped, peft_model, folder = shipped_gated(tmp_path, "llama", tokenizer, kernel=kernel)
    model = (
        load_gated_peft_model(as_mars_class(plain_base(tmp_path)), folder)
        if loader == "peft"
        else enable_mars(shipped)
    )
    jobs = [["hello world the cat", "one two"], ["the dog sat on"], ["red blue", "yes no", "a cat"]]
    inputs = [tokenizer(prompts, return_tensors="pt", padding=True) for prompts in jobs]
    common = dict(max_new_tokens=10, do_sample=False, mars_threshold=0.5)
    expected = [model.generate(**batch, **common) for batch in inputs]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        with ThreadPoolExecutor(2) as pool:
            got = list(pool.map(lambda i: model.generate(**inputs[i % 3], **common), range(6)))
    finally:
        sys.setswitchinterval(interval)
    for i, out in enumerate(got):
        assert torch.equal(out, expected[i % 3]), i


def test_checkpointed_layers_recomputed_in_another_thread_use_their_forwards_gate(tokenizer):
    """Autograd may run a backward (and the checkpointed layers it recomputes) in a thread of its own, as CUDA
    does: the recomputation reads the record of the forward it belongs to."""
    peft_model = gated_copy(tiny_model("qwen2"), tokenizer.mask_token_id).train()
    peft_model.get_base_model().gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": False}
    )
    ids = torch.cat([random_ids(tokenizer), torch.full((2, 3), tokenizer.mask_token_id)], dim=1)

    def grads(backward_in_thread: bool) -> dict:
        peft_model.zero_grad(set_to_none=True)
        loss = peft_model(input_ids=ids).logits[:, -3:].square().mean()
        if backward_in_thread:
            worker = threading.Thread(target=loss.backward)
            worker.start()
            worker.join()
        else:
            loss.backward()
        return {name: p.grad.clone() for name, p in peft_model.named_parameters() if p.grad is not None}

    same, other = grads(False), grads(True)
    assert same and same.keys() == other.keys()
    for name in same:
        torch.testing.assert_close(other[name], same[name], rtol=1e-12, atol=1e-14, msg=name)


# ---------------------------------------------------------------------------------------------- faults 2, 3, 12


def test_a_gated_adapter_that_lost_its_mars_files_still_loads_gated(tokenizer, tmp_path):
    """Issue 52, fault 2: mars_config.json and the mask-row file gone, `-blk2` in the name or block_size=2
    passed: the adapter's own config says it is gated, so it loads gated (real positions: the base model)."""
    base, _, peft_model, folder = shipped_gated(tmp_path, "llama", tokenizer)
    for name in MARS_FILES:
        (folder / name).unlink()
    named = folder.rename(tmp_path / "gated-blk2")
    base_dir = str(tmp_path / "base-llama")
    for model, _ in (
        load_mars_model(named, base_model_name_or_path=base_dir),
        load_mars_model(named, block_size=2, base_model_name_or_path=base_dir),
    ):
        assert gated_lora.is_gated(model) and model.config.mars["block_size"] == 2
        assert_gated_like(model, base, peft_model, tokenizer)


def test_an_adapter_with_no_gating_record_is_refused_unless_told_how_it_was_trained(tokenizer, tmp_path):
    base, _, peft_model, folder = shipped_gated(tmp_path, "llama", tokenizer)
    for name in MARS_FILES:
        (folder / name).unlink()
    kept = shutil.copytree(folder, tmp_path / "with-marker")
    drop_gate_marker(folder)  # saved before adapters said so themselves, then stripped of mars_hf's files
    named = folder.rename(tmp_path / "gated-blk2")
    base_dir = str(tmp_path / "base-llama")
    for kwargs in ({}, {"block_size": 2}):
        with pytest.raises(
            ValueError, match="no record of how it was trained.*adapter_gating='none'.*'mask'"
        ):
            load_mars_model(named, base_model_name_or_path=base_dir, **kwargs)
    with pytest.raises(ValueError, match="no record of how it was trained"):
        gated_lora.attach_shipped_adapter(plain_base(tmp_path), named)
    gated, _ = load_mars_model(named, base_model_name_or_path=base_dir, adapter_gating="mask")
    assert_gated_like(gated, base, peft_model, tokenizer)
    ungated, _ = load_mars_model(named, base_model_name_or_path=base_dir, adapter_gating="none")
    ids = random_ids(tokenizer)
    with torch.no_grad():  # what was asked for: the LoRA at every position
        assert not torch.allclose(ungated(input_ids=ids).logits, base(input_ids=ids).logits)
    with pytest.raises(ValueError, match="records adapter_gating='mask', not the adapter_gating='none'"):
        load_mars_model(kept, block_size=2, base_model_name_or_path=base_dir, adapter_gating="none")


def cut_rank(folder, module: str, rows: int) -> None:
    path = folder / "adapter_model.safetensors"
    tensors = load_file(path)
    key = f"base_model.model.{module}.lora_A.weight"
    tensors[key] = tensors[key][:rows].clone()
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.mark.parametrize("kernel", ["c", "torch"])
def test_lora_factors_whose_ranks_disagree_are_refused_naming_the_layer(kernel, tokenizer, tmp_path):
    """Issue 52, fault 3: layer 0's q_proj lora_A cut to 2 rows, lora_B keeps rank 4 (the C kernel read past its
    buffer, the torch form failed with a bare matmul error): refused at attach time, whatever kernel runs."""
    _, _, _, folder = shipped_gated(tmp_path, "llama", tokenizer)
    cut_rank(folder, "model.layers.0.self_attn.q_proj", 2)
    refused = r"model\.layers\.0\.self_attn\.q_proj do not agree: lora_A is \[2, 32\] and lora_B is \[32, 4\].*damaged"
    for load in (
        lambda: gated_lora.attach_shipped_adapter(plain_base(tmp_path), folder, kernel=kernel),
        lambda: load_mars_model(folder, base_model_name_or_path=str(tmp_path / "base-llama")),
        lambda: load_gated_peft_model(plain_base(tmp_path), folder),
    ):
        with pytest.raises(ValueError, match=refused):
            load()


def test_gating_checks_the_factors_of_every_peft_layer(tokenizer):
    peft_model = gated_copy(tiny_model("llama"), tokenizer.mask_token_id)
    layer = peft_model.get_base_model().model.layers[1].mlp.down_proj
    layer.lora_B["default"].weight = torch.nn.Parameter(layer.lora_B["default"].weight[:, :3].clone())
    with pytest.raises(
        ValueError,
        match=r"layers\.1\.mlp\.down_proj do not agree: lora_A is \[4, 64\] and lora_B is \[32, 3\]",
    ):
        gate_peft_model(peft_model)


def test_an_adapter_on_the_wrong_base_says_so_and_names_both_bases(tokenizer, tmp_path):
    """Issue 52, fault 12: it failed with "shape mismatch: value tensor of shape [32] ..." while writing the
    mask row."""
    _, _, _, folder = shipped_gated(tmp_path, "llama", tokenizer)
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(
        json.dumps({**config, "base_model_name_or_path": "someone/base"})
    )
    other_dir = tmp_path / "other-base"
    tiny_model("llama", hidden_size=48, num_attention_heads=4).save_pretrained(other_dir)
    tokenizer.save_pretrained(other_dir)
    refused = r"does not fit this model: .*names its base 'someone/base' .*the model given is '.*other-base'"
    for load in (
        lambda: load_mars_model(folder, base_model_name_or_path=str(other_dir)),
        lambda: gated_lora.attach_shipped_adapter(AutoModelForCausalLM.from_pretrained(other_dir), folder),
        lambda: load_gated_peft_model(AutoModelForCausalLM.from_pretrained(other_dir), folder),
    ):
        with pytest.raises(ValueError, match=refused):
            load()


def test_the_shipped_forward_without_masks_is_the_base_layer_and_keeps_nothing(tokenizer, tmp_path):
    """A forward without masks adds nothing and keeps no product for siblings in the thread's record."""
    base, shipped, _, _ = shipped_gated(tmp_path, "mistral", tokenizer)
    ids = random_ids(tokenizer)
    with torch.no_grad():
        assert torch.equal(shipped(input_ids=ids).logits, base(input_ids=ids).logits)
    record = shipped._mars_mask_gate.current()
    assert record.gate is None and record.kept == {}
