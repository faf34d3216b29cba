"""``enable_mars`` and the MARS classes follow the library rules (../shared/PRODUCT.md, "Library rules").

``enable_mars`` returns a ``MARSModel`` that owns the model, as ``get_peft_model`` returns a ``PeftModel``: one
object, one state, settings of its own, nothing written into the model. Every class a MARS model has is importable
by its name (``mars_class(LlamaForCausalLM)`` is ``mars_classes.MARSLlamaForCausalLM``), so MARS models round-trip
through pickle, ``torch.save``, ``copy.deepcopy`` and spawned processes. No module of the package assigns an
object's ``__class__`` or ``__dict__``, or a library's ``generate``/``forward``.
"""

from __future__ import annotations

import ast
import copy
import io
import multiprocessing
import pickle
from pathlib import Path

import pytest
import torch
import transformers
from peft import LoraConfig, get_peft_model
from transformers import LlamaForCausalLM, Qwen2ForCausalLM

from mars_hf import AutoMARSModelForCausalLM
from mars_hf.decoding import mars_classes
from mars_hf.decoding.enable import MARSModel
from mars_hf.decoding.generation import MARSGenerationMixin, enable_mars, mars_class, mars_generate
from tests.tiny import tiny_model, tiny_tokenizer

PACKAGE = Path(__file__).resolve().parents[1] / "mars_hf"
FORBIDDEN_TARGETS = {"__class__", "__dict__", "generate", "forward"}
COMMON = dict(max_new_tokens=10, do_sample=False)


def prompts(tokenizer):
    return tokenizer(["hello world the cat", "one two"], return_tensors="pt", padding=True)


def test_enable_mars_returns_a_wrapper_that_owns_the_model_and_writes_nothing_into_it():
    tokenizer = tiny_tokenizer()
    model = tiny_model("llama", seed=3, tokenizer=tokenizer)
    plain_class, attributes = type(model), dict(model.__dict__)
    inputs = prompts(tokenizer)
    stock = model.generate(**inputs, **COMMON)

    mars = enable_mars(model, block_size=3)
    assert isinstance(mars, MARSModel) and isinstance(mars, torch.nn.Module)
    assert mars.get_base_model() is model and mars.__dict__ is not model.__dict__
    assert type(model) is plain_class and not isinstance(model, MARSGenerationMixin)
    assert model.__dict__.keys() == attributes.keys() and "_mars_overrides" not in model.__dict__
    assert mars.mars_settings == {"block_size": 3} and model.config.mars["block_size"] == 4
    assert mars.config is model.config and mars.get_input_embeddings() is model.get_input_embeddings()
    assert [p for p in mars.parameters()] == [p for p in model.parameters()]
    mars.train()
    assert model.training
    mars.eval()
    config = copy.deepcopy(model.generation_config)
    mars.generation_config = config  # an attribute of the model is set on the model
    assert model.generation_config is config and "generation_config" not in mars.__dict__
    calls = []
    hook = mars.register_forward_pre_hook(lambda *_: calls.append(1))  # the model's forwards, stock ones too
    mars.generate(**inputs, max_new_tokens=2, do_sample=False)
    hook.remove()
    assert len(calls) == 2
    # greedy τ = 1 and verify through the wrapper are stock greedy (float64); without MARS keywords: stock
    assert torch.equal(mars.generate(**inputs, mars_threshold=1.0, **COMMON), stock)
    assert torch.equal(mars.generate(**inputs, mars_acceptance="verify", **COMMON), stock)
    assert torch.equal(mars.generate(**inputs, **COMMON), stock)
    assert torch.equal(mars(**inputs).logits, model(**inputs).logits)
    with pytest.raises(ValueError, match="mars_threshold"):  # the model keeps its stock generate
        model.generate(**inputs, mars_threshold=1.0, **COMMON)


def forwards_for(mars_model, inputs, max_new_tokens=24) -> int:
    """Forwards of the base model while ``mars_model`` decodes ``max_new_tokens`` tokens accepting every mask."""
    calls = []
    hook = mars_model.get_base_model().register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        mars_model.generate(**inputs, mars_threshold=0.0, max_new_tokens=max_new_tokens, do_sample=False)
    finally:
        hook.remove()
    return len(calls)


def test_two_wrappers_of_one_model_keep_their_own_settings():
    """The probe of the issue: a second enable_mars(m, block_size=8) made the first one decode with W = 8."""
    tokenizer = tiny_tokenizer()
    model = tiny_model("llama", seed=3, tokenizer=tokenizer)
    inputs = tokenizer(["hello world the cat"], return_tensors="pt")
    narrow = enable_mars(model, block_size=2, layout="linear")
    alone = forwards_for(narrow, inputs)
    wide = enable_mars(model, block_size=8, layout="linear")
    assert narrow.mars_settings["block_size"] == 2 and wide.mars_settings["block_size"] == 8
    assert forwards_for(narrow, inputs) == alone
    assert forwards_for(wide, inputs) < alone
    rewrapped = enable_mars(narrow, acceptance="verify")  # a new object; the one given keeps its settings
    assert rewrapped is not narrow and rewrapped.get_base_model() is model
    assert rewrapped.mars_settings == {"block_size": 2, "layout": "linear", "acceptance": "verify"}
    assert narrow.mars_settings == {"block_size": 2, "layout": "linear"}


def test_enable_mars_refuses_a_peft_model_and_names_the_ways_that_work():
    tokenizer = tiny_tokenizer()
    base = tiny_model("llama", seed=3, tokenizer=tokenizer)
    peft_model = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False))
    with pytest.raises(TypeError, match=r"AutoMARSModelForCausalLM.*custom_generate=mars_hf.mars_generate"):
        enable_mars(peft_model)
    inputs = tokenizer(["hello world the cat"], return_tensors="pt")
    common = dict(max_new_tokens=8, do_sample=False)
    stock = peft_model.generate(**inputs, **common)
    through_peft = peft_model.generate(**inputs, custom_generate=mars_generate, mars_threshold=1.0, **common)
    assert torch.equal(through_peft, stock)


# ---------------------------------------------------------------------------------------------- the MARS classes


def test_a_mars_class_is_named_for_what_it_is_and_found_by_that_name():
    built = mars_class(LlamaForCausalLM)
    assert built.__name__ == built.__qualname__ == "MARSLlamaForCausalLM"
    assert built.__module__ == "mars_hf.decoding.mars_classes" and mars_classes.MARSLlamaForCausalLM is built
    assert mars_class(LlamaForCausalLM) is built and mars_class(built) is built
    assert mars_classes.MARSQwen2ForCausalLM is mars_class(Qwen2ForCausalLM)  # built on demand, by name
    with pytest.raises(AttributeError, match="not a transformers class"):
        mars_classes.MARSNoSuchModelForCausalLM  # noqa: B018
    for name, cls in mars_classes._CLASSES.items():  # no generated class is named like a stock one
        assert cls.__name__ == name and getattr(transformers, name, None) is None


def test_a_mars_class_saves_the_stock_architecture(tmp_path):
    tokenizer = tiny_tokenizer()
    tiny_model("llama", tokenizer=tokenizer).save_pretrained(tmp_path / "ckpt")
    tokenizer.save_pretrained(tmp_path / "ckpt")
    loaded = AutoMARSModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    assert type(loaded) is mars_classes.MARSLlamaForCausalLM
    loaded.save_pretrained(tmp_path / "again")
    saved = transformers.AutoConfig.from_pretrained(tmp_path / "again")
    assert saved.architectures == ["LlamaForCausalLM"] and loaded.config.architectures == ["LlamaForCausalLM"]


def mars_models(tmp_path):
    """(a MARSModel, a model of a MARS class, the prompts, stock greedy for them)."""
    tokenizer = tiny_tokenizer()
    model = tiny_model("llama", seed=3, tokenizer=tokenizer)
    model.save_pretrained(tmp_path / "ckpt")
    tokenizer.save_pretrained(tmp_path / "ckpt")
    inputs = prompts(tokenizer)
    stock = model.generate(**inputs, **COMMON)
    loaded = AutoMARSModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.float64)
    return enable_mars(model, block_size=3), loaded, inputs, stock


def decodes_like(model, inputs, stock) -> bool:
    return torch.equal(model.generate(**inputs, mars_threshold=1.0, **COMMON), stock)


def torch_round_trip(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("how", ["pickle", "torch.save", "deepcopy"])
def test_mars_models_round_trip(how, tmp_path):
    wrapper, loaded, inputs, stock = mars_models(tmp_path)
    trip = {
        "pickle": lambda m: pickle.loads(pickle.dumps(m)),
        "torch.save": torch_round_trip,
        "deepcopy": copy.deepcopy,
    }[how]
    wrapper_copy, loaded_copy = trip(wrapper), trip(loaded)
    assert type(wrapper_copy) is MARSModel and type(loaded_copy) is type(loaded)
    assert (
        wrapper_copy.mars_settings == {"block_size": 3}
        and wrapper_copy.mars_settings is not wrapper.mars_settings
    )
    assert wrapper_copy.get_base_model() is not wrapper.get_base_model()
    assert decodes_like(wrapper_copy, inputs, stock) and decodes_like(loaded_copy, inputs, stock)


def _decode_in_a_fresh_process(payload: bytes, saved: str, inputs: dict) -> list:
    """Runs in a spawned process: the MARS class is not built there until unpickling asks for it by name."""
    from mars_hf.decoding import mars_classes as classes

    assert "MARSLlamaForCausalLM" not in classes._CLASSES
    wrapper, loaded = pickle.loads(payload)
    from_disk = torch.load(saved, weights_only=False)
    return [m.generate(**inputs, mars_threshold=1.0, **COMMON).tolist() for m in (wrapper, loaded, from_disk)]


def test_mars_models_cross_into_a_spawned_process(tmp_path):
    wrapper, loaded, inputs, stock = mars_models(tmp_path)
    torch.save(loaded, tmp_path / "model.pt")
    payload = pickle.dumps((wrapper, loaded))
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        outputs = pool.apply(_decode_in_a_fresh_process, (payload, str(tmp_path / "model.pt"), dict(inputs)))
    assert outputs == [stock.tolist()] * 3


def test_mars_models_go_through_accelerate(tmp_path):
    """``Accelerator.prepare`` keeps a MARS model what it is (it decodes as before), ``unwrap_model`` gives the same
    object back, and ``save_model`` writes weights a fresh MARS model loads to the same decoding."""
    from accelerate import Accelerator

    wrapper, loaded, inputs, stock = mars_models(tmp_path)
    accelerator = Accelerator(cpu=True)
    for model in (wrapper, loaded):
        prepared = accelerator.prepare(model)
        assert accelerator.unwrap_model(prepared) is model
        assert decodes_like(prepared, inputs, stock)
    accelerator.save_model(loaded, tmp_path / "accelerate", safe_serialization=True)
    fresh = AutoMARSModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.float64)
    with torch.no_grad():
        for parameter in fresh.parameters():
            parameter.add_(1.0)  # so that only what save_model wrote can make it decode like stock again
    assert not decodes_like(fresh, inputs, stock)
    from safetensors.torch import load_file

    state = {}
    for shard in sorted((tmp_path / "accelerate").glob("*.safetensors")):
        state.update(load_file(shard))
    missing, unexpected = fresh.load_state_dict(state, strict=False)
    assert not unexpected and all("lm_head" in name for name in missing)  # tied to the embeddings
    assert decodes_like(fresh, inputs, stock)


def forbidden_assignments(source: str, filename: str = "<source>") -> list[str]:
    """Every ``x.__class__ = ...``, ``x.__dict__ = ...``, ``x.generate = ...`` or ``x.forward = ...`` (``self``'s
    ``generate``/``forward`` aside: an object's own attribute), and every ``setattr(x, "<one of those>", ...)``, as
    ``file:line``."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:
            if (
                isinstance(target, ast.Attribute)
                and target.attr in FORBIDDEN_TARGETS
                and not (
                    target.attr in ("generate", "forward")
                    and isinstance(target.value, ast.Name)
                    and target.value.id == "self"
                )
            ):
                found.append(f"{filename}:{node.lineno}")
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "setattr"
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in FORBIDDEN_TARGETS
        ):
            found.append(f"{filename}:{node.lineno}")
    return found


def test_the_walk_catches_class_swaps_and_method_assignments():
    for mutant in (
        "model.__class__ = mars_class(type(model))",
        "model.generate = functools.partial(custom, model=model)",
        "peft_model.base_model.model.forward = wrapped",
        "setattr(model, '__class__', cls)",
        "setattr(view, '__dict__', model.__dict__)",
    ):
        assert forbidden_assignments(mutant), mutant
    assert forbidden_assignments("view.__dict__ = model.__dict__")  # one state seen through two objects
    assert not forbidden_assignments("self.generate = generate")


def test_no_module_of_the_package_swaps_a_class_or_assigns_a_method():
    found = [
        hit
        for path in sorted(PACKAGE.rglob("*.py"))
        for hit in forbidden_assignments(path.read_text(), str(path.relative_to(PACKAGE.parent)))
    ]
    assert found == []


@pytest.mark.slow
def test_the_shipped_model_pickles_and_torch_saves(monkeypatch):
    """``AutoMARSModelForCausalLM.from_pretrained("embedded-mars")``: gated adapter, hooks and all."""
    from transformers import AutoTokenizer

    from mars_hf import embedded_mars_checkpoint

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = AutoMARSModelForCausalLM.from_pretrained("embedded-mars", dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(embedded_mars_checkpoint())
    ids = tokenizer(["Name three colours."], return_tensors="pt")
    settings = dict(mars_acceptance="verify", mars_cost_table={1: 1.0, 9: 1.4, 10: 4.0}, **COMMON)
    expected = model.generate(**ids, **settings)
    for copied in (pickle.loads(pickle.dumps(model)), torch_round_trip(model)):
        assert type(copied) is mars_classes.MARSLlamaForCausalLM
        assert torch.equal(copied.generate(**ids, **settings), expected)
