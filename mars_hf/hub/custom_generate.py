"""``custom_generate/``: a small, self-contained MARS decoder copied into every checkpoint, for users without mars_hf.

``model.generate(custom_generate=<repo>, trust_remote_code=True, mars_threshold=...)`` runs
``custom_generate/generate.py`` with its sibling modules beside it (transformers resolves the relative import of
a sibling file both for local folders and Hub repos). The files are ``mars_hf/hub/custom_generate_src/`` and the
library's own modules, verbatim (``LIBRARY_FILES``): the acceptance rules' primitives (``rules.py``), the logits
processors at provisional prefixes (``processing.py``), the seed contract (``sampling.py``) and the confidence
calibration (``calibration.py``). Together: τ and
verified decoding (greedy and sampled, same seed contract as mars_hf), a cropped ``DynamicCache``, the gated
adapter in torch; no planner, kernels or probes, so that a reader can audit what ``trust_remote_code`` runs.
Every shipped file is checked to import only torch, transformers, safetensors, the standard library and the
other shipped files.
"""

from __future__ import annotations

import ast
import importlib.metadata
import os
import shutil
import sys
from pathlib import Path

SOURCE_DIR = Path(__file__).resolve().parent / "custom_generate_src"
# The files copied into ``custom_generate/`` (same names there).
CUSTOM_GENERATE_FILES = (
    "generate.py", "decoder.py", "rules.py", "processing.py", "sampling.py", "calibration.py",
    "gated_lora.py",
)  # fmt: skip
# Shipped files that are the library's own modules, copied verbatim (one set of rules, not two copies kept equal).
LIBRARY_FILES = {
    name: Path(__file__).resolve().parent.parent / "decoding" / name
    for name in ("rules.py", "processing.py", "sampling.py", "calibration.py")
}
# What custom_generate/ may import: transformers checks requirements.txt, Python the rest.
ALLOWED_IMPORTS = {"torch", "transformers", "safetensors", "__future__"}
# The packages of requirements.txt whose ranges are mars-hf's own (pyproject.toml). safetensors has no
# range of ours: transformers requires it, with the range it needs.
PINNED_REQUIREMENTS = ("torch", "transformers")
# custom_generate/ stays small enough to audit (docs/hub.md); tests/test_custom_generate.py holds it to this.
MAX_LINES = 1500


def custom_generate_requirements() -> str:
    """``requirements.txt`` of ``custom_generate/``: torch and transformers with the ranges mars-hf declares.

    Read from the installed package's metadata (built from pyproject.toml), so the shipped ranges are the
    tested ones and cannot drift from them.
    """
    from packaging.requirements import Requirement

    try:
        declared = importlib.metadata.requires("mars-hf") or []
    except importlib.metadata.PackageNotFoundError as error:
        raise importlib.metadata.PackageNotFoundError(
            "mars-hf is not installed, so the torch/transformers ranges for custom_generate/requirements.txt "
            "cannot be read; install it (`pip install -e .` in a checkout)."
        ) from error
    specs = {}
    for line in declared:
        requirement = Requirement(line)
        if requirement.marker is None and requirement.name in PINNED_REQUIREMENTS:
            specs[requirement.name] = str(requirement.specifier)
    missing = [name for name in PINNED_REQUIREMENTS if name not in specs]
    if missing:
        raise ValueError(f"mars-hf's installed metadata declares no {missing}; reinstall mars-hf.")
    return "".join(f"{name}{specs[name]}\n" for name in PINNED_REQUIREMENTS) + "safetensors\n"


def shipped_source(name: str) -> Path:
    """Where the shipped file ``name`` comes from: the library's own module (``LIBRARY_FILES``), else
    ``custom_generate_src/``."""
    return LIBRARY_FILES.get(name, SOURCE_DIR / name)


def write_custom_generate(target: str | os.PathLike) -> list[str]:
    """Copy the shipped files into ``target`` after checking they need only torch/transformers."""
    target = Path(target)
    sources = [shipped_source(name) for name in CUSTOM_GENERATE_FILES]
    for source in sources:
        if not source.is_file():
            raise FileNotFoundError(f"{source} is missing; the package's custom_generate_src/ is incomplete.")
        check_self_contained(source)
    requirements = custom_generate_requirements()
    if target.name == "custom_generate" and target.is_dir():  # an older mars-hf's files must not linger
        for stale in target.glob("*.py"):
            if stale.name not in CUSTOM_GENERATE_FILES:
                stale.unlink()
    target.mkdir(parents=True, exist_ok=True)
    for source in sources:
        shutil.copyfile(source, target / source.name)
    (target / "requirements.txt").write_text(requirements)
    return sorted(p.name for p in target.iterdir())


def check_self_contained(source: Path) -> None:
    """Raise unless ``source`` imports only torch, transformers, safetensors, stdlib and shipped siblings."""
    allowed_relative = {Path(name).stem for name in CUSTOM_GENERATE_FILES}
    tree = ast.parse(Path(source).read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                if node.module is None or node.module.split(".")[0] not in allowed_relative:
                    raise ImportError(
                        f"{source.name} line {node.lineno} imports from .{node.module or ''}: custom_generate/ only "
                        f"ships {sorted(allowed_relative)}, so a shipped file may import only from those."
                    )
                continue
            modules = [node.module or ""]
        else:
            continue
        for module in modules:
            top = module.split(".")[0]
            if top not in ALLOWED_IMPORTS and top not in sys.stdlib_module_names:
                raise ImportError(
                    f"{source.name} line {node.lineno} imports {module!r}: custom_generate/ must import only "
                    "torch, transformers, safetensors and the standard library."
                )
