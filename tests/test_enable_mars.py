"""``enable_mars`` follows the library rules (../shared/PRODUCT.md, "Library rules"): it returns the same model
under the MARS class and changes neither the object it was given nor any class; no module of the package assigns
an object's ``__class__`` or a library's ``generate``/``forward``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model

from mars_hf.decoding.generation import MARSGenerationMixin, enable_mars, mars_generate
from tests.tiny import tiny_model, tiny_tokenizer

PACKAGE = Path(__file__).resolve().parents[1] / "mars_hf"
FORBIDDEN_TARGETS = {"__class__", "generate", "forward"}


def test_enable_mars_returns_the_same_model_under_the_mars_class_and_leaves_the_object_given():
    tokenizer = tiny_tokenizer()
    model = tiny_model("llama", seed=3, tokenizer=tokenizer)
    plain_class = type(model)
    inputs = tokenizer(["hello world the cat", "one two"], return_tensors="pt", padding=True)
    common = dict(max_new_tokens=10, do_sample=False)
    stock = model.generate(**inputs, **common)

    mars = enable_mars(model, block_size=3)
    assert type(model) is plain_class and not isinstance(model, MARSGenerationMixin)
    assert isinstance(mars, plain_class) and isinstance(mars, MARSGenerationMixin)
    assert type(mars).__name__ == plain_class.__name__  # save_pretrained records the same architecture
    # one state: the same weights, modules and flags, whichever object changes them
    assert mars.get_input_embeddings().weight is model.get_input_embeddings().weight
    assert dict(mars.named_parameters()).keys() == dict(model.named_parameters()).keys()
    mars.train()
    assert model.training
    model.eval()
    assert not mars.training
    assert mars._mars_overrides["block_size"] == 3
    # the MARS model decodes with MARS (τ = 1 and verify are stock greedy); the object given keeps stock generate
    assert torch.equal(mars.generate(**inputs, mars_threshold=1.0, **common), stock)
    assert torch.equal(mars.generate(**inputs, mars_acceptance="verify", **common), stock)
    assert torch.equal(mars.generate(**inputs, **common), stock)
    with pytest.raises(ValueError, match="mars_threshold"):
        model.generate(**inputs, mars_threshold=1.0, **common)
    assert enable_mars(mars) is mars


def test_enable_mars_refuses_a_peft_model_and_names_the_ways_that_work():
    tokenizer = tiny_tokenizer()
    base = tiny_model("llama", seed=3, tokenizer=tokenizer)
    peft_model = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False))
    with pytest.raises(TypeError, match=r"enable_mars\(base_model\).*custom_generate=mars_hf.mars_generate"):
        enable_mars(peft_model)
    inputs = tokenizer(["hello world the cat"], return_tensors="pt")
    common = dict(max_new_tokens=8, do_sample=False)
    stock = peft_model.generate(**inputs, **common)
    through_peft = peft_model.generate(**inputs, custom_generate=mars_generate, mars_threshold=1.0, **common)
    assert torch.equal(through_peft, stock)


def forbidden_assignments(source: str, filename: str = "<source>") -> list[str]:
    """Every ``x.__class__ = ...``, ``x.generate = ...`` or ``x.forward = ...`` (``self`` aside: an object's own
    attribute), and every ``setattr(x, "<one of those>", ...)``, as ``file:line``."""
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
                and not (isinstance(target.value, ast.Name) and target.value.id == "self")
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
    ):
        assert forbidden_assignments(mutant), mutant
    assert not forbidden_assignments("self.generate = generate\nview.__dict__ = model.__dict__")


def test_no_module_of_the_package_swaps_a_class_or_assigns_a_method():
    found = [
        hit
        for path in sorted(PACKAGE.rglob("*.py"))
        for hit in forbidden_assignments(path.read_text(), str(path.relative_to(PACKAGE.parent)))
    ]
    assert found == []
