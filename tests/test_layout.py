"""The package's shape: imports point downward, tests never skip (what custom_generate/ ships: tests/test_custom_generate.py).

Layers (a module imports only from its own layer or below): decoding → models → training / evaluation /
hub / serving → tools → commands / scripts → cli.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _code_report():
    spec = importlib.util.spec_from_file_location("code_report", REPO / "tools" / "code_report.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("code_report", module)
    spec.loader.exec_module(module)
    return module


def test_no_module_imports_from_a_higher_layer():
    report = _code_report()
    assert report.upward_imports() == []


def test_the_upward_import_check_catches_one(tmp_path, monkeypatch):
    """The check above can fail: a decoding module importing serving is reported."""
    report = _code_report()
    package = tmp_path / "mars_hf"
    (package / "decoding").mkdir(parents=True)
    (package / "decoding" / "bad.py").write_text("def f():\n    from mars_hf.serving import app\n")
    monkeypatch.setattr(report, "ROOT", tmp_path)
    monkeypatch.setattr(report, "PACKAGE", package)
    assert report.upward_imports() == ["mars_hf/decoding/bad.py:2 imports mars_hf.serving"]


def test_no_test_skips_itself():
    """A test runs or fails: no skip markers, no skips decided at run time, no expected failures."""
    offenders = []
    for path in sorted((REPO / "tests").glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in {"skip", "skipif", "importorskip", "xfail"}:
                if isinstance(node.value, (ast.Name, ast.Attribute)) and "pytest" in ast.unparse(node.value):
                    offenders.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    assert offenders == []
