"""``generate``'s default path is portable: no compiler, no native library loaded by hand, no private torch op,
no patched third-party method, no stack walk (docs/accelerators.md; the library rules of the product).

A fresh process loads two tiny MARS checkpoints (a plain one and one with a mask-gated adapter) through the public
loader and decodes them with default settings, with ``CC`` pointing nowhere and the compiler route, ``ctypes``
loading and the private oneDNN ops replaced by functions that raise. The modules that process imported from
mars_hf are then read with ``ast``, and must hold none of the constructs the rules forbid (the checker is shown
to find each of them in a snippet first).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import transformers
from peft.tuners.lora import LoraLayer

from mars_hf import hub
from tests.tiny import tiny_model, tiny_tokenizer

REPO = Path(__file__).resolve().parents[1]
# The accelerators' own modules may name the private oneDNN ops; nothing else on the default path may.
PRIVATE_OP_MODULES = ("mars_hf.decoding.cpu_kernels", "mars_hf.decoding.gated_kernel")
# Methods of the classes decoding works on: assigning one on an instance or a class replaces a library's method.
THIRD_PARTY_METHODS = frozenset(
    name
    for cls in (torch.nn.Module, transformers.PreTrainedModel, transformers.GenerationMixin, LoraLayer)
    for name in dir(cls)
    if callable(getattr(cls, name, None))
)
PROCESS_CALLS = {
    "subprocess": {"run", "Popen", "call", "check_call", "check_output", "getoutput", "getstatusoutput"},
    "os": {
        "system",
        "popen",
        "execv",
        "execvp",
        "execve",
        "spawnv",
        "spawnvp",
        "posix_spawn",
        "posix_spawnp",
    },
}
FRAME_CALLS = {"inspect": {"currentframe", "stack", "getouterframes", "getframeinfo"}}  # and sys._getframe


# ------------------------------------------------------------------------------------------- the checker


def _root_and_chain(node: ast.AST) -> tuple[str | None, list[str]]:
    """``a.b.c`` -> ``("a", ["b", "c"])``; anything not rooted at a name -> ``(None, [...])``."""
    chain = []
    while isinstance(node, ast.Attribute):
        chain.append(node.attr)
        node = node.value
    return (node.id if isinstance(node, ast.Name) else None), chain[::-1]


def _imported_names(tree: ast.Module) -> dict[str, str]:
    """Local name -> the module it came from, for every import of the file (any scope)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                names[alias.asname or alias.name.split(".")[0]] = (
                    alias.name if alias.asname else alias.name.split(".")[0]
                )
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                names[alias.asname or alias.name] = node.module
    return names


def violations(source: str, module: str) -> list[str]:
    """What in ``source`` (the text of ``module``) breaks the default path's rules, one line each."""
    tree = ast.parse(source)
    imported = _imported_names(tree)
    third_party = {name for name, origin in imported.items() if not origin.startswith("mars_hf")}
    found = []

    def flag(node, what):
        found.append(f"{module}:{node.lineno}: {what}")

    def check_target(node, target, name=None):
        name = name or (target.attr if isinstance(target, ast.Attribute) else None)
        if name is None:
            return
        root, _ = _root_and_chain(target) if isinstance(target, ast.Attribute) else (None, [])
        if name == "__class__":
            flag(node, "assigns __class__")
        elif name in THIRD_PARTY_METHODS:
            flag(node, f"assigns the method {name!r} of an object (a patched third-party method)")
        elif root in third_party:
            flag(node, f"assigns an attribute of the third-party {root!r} ({ast.unparse(target)})")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            modules = (
                [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            )
            for name in modules:
                if name == "ctypes" or name.startswith("ctypes."):
                    flag(node, "imports ctypes")
                if name.startswith("torch.utils.cpp_extension"):
                    flag(node, "imports torch's C++ extension builder")
        elif isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for leaf in ast.walk(target):
                    if isinstance(leaf, ast.Attribute) and isinstance(leaf.ctx, ast.Store):
                        check_target(node, leaf)
        elif isinstance(node, ast.Call):
            root, chain = _root_and_chain(node.func)
            origin = imported.get(root, root)
            if chain and origin in PROCESS_CALLS and chain[-1] in PROCESS_CALLS[origin]:
                flag(node, f"starts a process ({ast.unparse(node.func)})")
            if chain and origin in FRAME_CALLS and chain[-1] in FRAME_CALLS[origin]:
                flag(node, f"walks the call stack ({ast.unparse(node.func)})")
            if not chain and isinstance(node.func, ast.Name):  # from subprocess import run; run(...)
                origin = imported.get(node.func.id, "")
                if origin in PROCESS_CALLS and node.func.id in PROCESS_CALLS[origin]:
                    flag(node, f"starts a process ({node.func.id})")
            is_setattr = isinstance(node.func, ast.Name) and node.func.id == "setattr"
            is_setattr |= chain[-1:] == ["__setattr__"]
            if is_setattr and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
                name = node.args[1].value
                if name == "__class__" or name in THIRD_PARTY_METHODS:
                    flag(node, f"sets {name!r} through setattr (a patched method or class)")
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            root, chain = _root_and_chain(node)
            if root == "sys" and chain[:1] == ["_getframe"]:
                flag(node, "walks the call stack (sys._getframe)")
            is_private_op = root == "torch" and chain[:2] == ["ops", "mkldnn"] and len(chain) == 3
            if is_private_op and chain[2].startswith("_") and module not in PRIVATE_OP_MODULES:
                flag(node, f"calls the private op torch.ops.mkldnn.{chain[2]}")
    return found


SNIPPETS = {
    "import ctypes": "imports ctypes",
    "from ctypes import CDLL": "imports ctypes",
    "import subprocess\nsubprocess.run(['cc', 'x.c'])": "starts a process",
    "from subprocess import run\nrun(['gcc'])": "starts a process",
    "import os\nos.system('cc x.c')": "starts a process",
    "import sys\nframe = sys._getframe(1)": "walks the call stack",
    "import inspect\ninspect.currentframe()": "walks the call stack",
    "model.__class__ = Other": "assigns __class__",
    "module.forward = wrapped": "assigns the method 'forward'",
    "module._apply = partial(f, module)": "assigns the method '_apply'",
    "layer.register_buffer = keep": "assigns the method 'register_buffer'",
    "from peft.tuners.lora import LoraLayer\nLoraLayer.update_layer = ours": "assigns the method 'update_layer'",
    "import transformers\ntransformers.GenerationMixin.something = 1": "assigns an attribute of the third-party",
    "setattr(module, 'forward', wrapped)": "sets 'forward' through setattr",
    "object.__setattr__(model, '__class__', Other)": "sets '__class__' through setattr",
    "import torch\ntorch.ops.mkldnn._linear_pointwise(x, w, None, 'none', [], '')": "private op",
    "from torch.utils.cpp_extension import load_inline": "C++ extension builder",
}


@pytest.mark.parametrize("snippet, expected", list(SNIPPETS.items()))
def test_the_checker_finds_each_forbidden_construct(snippet, expected):
    found = violations(snippet, "mars_hf.decoding.example")
    assert len(found) == 1 and expected in found[0], found


def test_the_checker_passes_what_the_rules_allow():
    allowed = textwrap.dedent(
        """
        import torch
        import torch.nn.functional as F
        from transformers import DynamicCache
        self.window = 4
        model.generation_config = config
        row.tokens += [1]
        setattr(parent, name, stand_in)  # swapping a child module: nn.Module's public API
        x = torch.ops.aten.add(a, b)
        """
    )
    assert violations(allowed, "mars_hf.decoding.example") == []
    assert (
        violations("import torch\ntorch.ops.mkldnn._reorder_linear_weight(w, 4)", PRIVATE_OP_MODULES[0]) == []
    )


# --------------------------------------------------------------------------------- the default path, run

PROBE = r"""
import ctypes, json, os, subprocess, sys
import torch, transformers
# Third-party modules that load system libraries themselves when imported (torch.distributed loads libc):
# imported before the stand-ins below, which are for what mars_hf does.
import peft
import transformers.models.llama.modeling_llama

calls = []

def refuse(what):
    def refused(*args, **kwargs):
        calls.append(what)
        raise RuntimeError(f"{what} was called on generate's default path")
    return refused

class NoProcess(subprocess.Popen):
    def __init__(self, args, *rest, **kwargs):
        calls.append(f"process {args!r}")
        raise RuntimeError(f"a process ({args!r}) was started on generate's default path")

subprocess.Popen = NoProcess
ctypes.CDLL = refuse("ctypes.CDLL")
for op in ("_reorder_linear_weight", "_linear_pointwise", "_is_mkldnn_bf16_supported"):
    setattr(torch.ops.mkldnn, op, refuse(f"torch.ops.mkldnn.{op}"))
import torch.utils.cpp_extension as extension
extension.load = extension.load_inline = refuse("torch.utils.cpp_extension")

from transformers import AutoTokenizer
from mars_hf import AutoMARSModelForCausalLM

plain, gated, base = sys.argv[1:4]
report = {"calls": calls, "results": {}}
for name, folder, dtype, extra in (
    ("plain float32", plain, torch.float32, {}),
    ("plain bfloat16", plain, torch.bfloat16, {}),
    ("gated float32", gated, torch.float32, {"base_model_name_or_path": base}),
    ("gated bfloat16", gated, torch.bfloat16, {"base_model_name_or_path": base}),
):
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
        tokenizer.padding_side = "left"
        model = AutoMARSModelForCausalLM.from_pretrained(folder, dtype=dtype, **extra)
        inputs = tokenizer(["hello world the cat", "one two"], return_tensors="pt", padding=True)
        common = dict(max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        with torch.no_grad():
            stock = model.generate(**inputs, **common)
            outputs = {
                "tau": model.generate(**inputs, mars_threshold=0.6, **common),
                "tau 1": model.generate(**inputs, mars_threshold=1.0, **common),
                "verify": model.generate(**inputs, mars_acceptance="verify", **common),
            }
        report["results"][name] = {
            "new tokens": int(outputs["tau"].shape[1] - inputs["input_ids"].shape[1]),
            "tau 1 equals stock": torch.equal(outputs["tau 1"], stock),
            "verify equals stock": torch.equal(outputs["verify"], stock),
        }
    except Exception as error:
        report["results"][name] = {"error": f"{type(error).__name__}: {error}"}
kernel = sys.modules.get("mars_hf.decoding.gated_kernel")  # tried to build (with CC nowhere: failed)?
report["gated kernel tried"] = kernel is not None and (kernel._LIBRARY, kernel._FAILURE) != (None, None)
report["modules"] = sorted(name for name in sys.modules if name == "mars_hf" or name.startswith("mars_hf."))
print("REPORT " + json.dumps(report))
"""


@pytest.fixture(scope="module")
def default_path(tmp_path_factory):
    """What a fresh process did on the default path: ``{"calls", "results", "modules"}``."""
    from tests.test_gated_lora import gated_copy  # a gated PEFT model, as training leaves it

    folder = tmp_path_factory.mktemp("portable")
    tokenizer = tiny_tokenizer()
    base = tiny_model("llama", tokenizer=tokenizer, vocab_size=len(tokenizer), seed=1)
    for name in ("plain", "base"):
        base.save_pretrained(folder / name)
        tokenizer.save_pretrained(folder / name)
    hub.save_pretrained(
        gated_copy(base, tokenizer.mask_token_id), tokenizer, folder / "gated", base_model="x/base"
    )
    env = {
        **os.environ,
        "CC": "/nonexistent",
        "MARS_HF_HOME": str(folder / "home"),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO),
    }
    env.pop("MARS_HF_GATED_KERNEL", None)
    command = [sys.executable, "-c", PROBE, *(str(folder / name) for name in ("plain", "gated", "base"))]
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    lines = [line for line in result.stdout.splitlines() if line.startswith("REPORT ")]
    assert result.returncode == 0 and lines, result.stderr[-3000:]
    return json.loads(lines[-1][len("REPORT ") :])


@pytest.mark.slow
def test_generate_decodes_by_default_without_a_compiler_or_private_ops(default_path):
    """Defaults only, ``CC=/nonexistent``: every model decodes (τ = 1 and verify equal stock greedy), and neither a
    process, a hand-loaded library, torch's extension builder nor a private oneDNN op was called."""
    assert default_path["calls"] == [] and not default_path["gated kernel tried"]
    for name, result in default_path["results"].items():
        assert "error" not in result, (name, result)
        assert result["new tokens"] > 0 and result["tau 1 equals stock"] and result["verify equals stock"], (
            name
        )


@pytest.mark.slow
def test_the_modules_of_the_default_path_hold_no_forbidden_construct(default_path):
    """Every mars_hf module the default path imported, read with ``ast``: no ctypes, no process, no stack walk, no
    assignment to a third-party method or ``__class__``, no private oneDNN op outside the accelerators' modules."""
    modules = default_path["modules"]
    assert "mars_hf.decoding.generation" in modules and "mars_hf.models.modeling" in modules
    found = []
    for module in modules:
        path = Path(importlib.util.find_spec(module).origin)
        found += violations(path.read_text(encoding="utf-8"), module)
    assert found == [], "\n".join(found)
