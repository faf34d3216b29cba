"""Module sizes, longest functions and import directions of the ``mars_hf`` package.

Run from the repository root: ``python tools/code_report.py [--top 20]``. Prints what a reader of the tree
would want to know first (how big each room is, which functions do not fit on a screen, which imports point
the wrong way) so the shape of the code can be compared before and after a change.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mars_hf"

# Lower layers never import higher ones: commands -> tools -> serving/evaluation/hub/training -> models -> decoding.
LAYERS = {
    "decoding": 0,
    "models": 1,
    "training": 2,
    "evaluation": 2,
    "hub": 2,
    "serving": 2,
    "tools": 3,
    "scripts": 4,
    "commands": 4,
    "cli": 5,
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path) -> list[tuple[int, str, bool]]:
    """``(line, absolute module, inside a function)`` for every import in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                found.extend((child.lineno, alias.name, in_function) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    name = ".".join(base + ([child.module] if child.module else []))
                else:
                    name = child.module or ""
                if child.module is None or name == "mars_hf":  # ``from . import x``: the names are modules
                    found.extend((child.lineno, f"{name}.{alias.name}", in_function) for alias in child.names)
                else:
                    found.append((child.lineno, name, in_function))
            visit(child, nested)

    visit(tree, False)
    return found


def layer_of(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "mars_hf" or len(parts) < 2:
        return None
    return LAYERS.get(parts[1])


def upward_imports() -> list[str]:
    """``file:line imports module`` for every import from a higher layer than the importing file's."""
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        own = layer_of(module_name(path))
        if own is None:
            continue
        for line, module, _ in imported_modules(path):
            other = layer_of(module)
            if other is not None and other > own:
                problems.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    return problems


def function_lengths() -> list[tuple[int, str]]:
    lengths = []
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                kind = "class" if isinstance(node, ast.ClassDef) else "def"
                lengths.append((node.end_lineno - node.lineno + 1, f"{kind} {module_name(path)}.{node.name}"))
    return sorted(lengths, reverse=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=20, help="How many modules and functions to list.")
    args = parser.parse_args(argv)

    sizes = sorted(
        ((len(p.read_text(encoding="utf-8").splitlines()), module_name(p)) for p in PACKAGE.rglob("*.py")),
        reverse=True,
    )
    by_package = Counter()
    for lines, name in sizes:
        parts = name.split(".")
        by_package[parts[1] if len(parts) > 2 else "(top level)"] += lines
    print(f"{len(sizes)} modules, {sum(n for n, _ in sizes)} lines")
    print("\nLines by subpackage:")
    for name, lines in by_package.most_common():
        print(f"  {lines:6d}  {name}")
    print(f"\nLargest {args.top} modules:")
    for lines, name in sizes[: args.top]:
        print(f"  {lines:6d}  {name}")
    print(f"\nLongest {args.top} functions and classes (lines):")
    for lines, name in function_lengths()[: args.top]:
        print(f"  {lines:6d}  {name}")
    lazy = sum(
        1
        for p in PACKAGE.rglob("*.py")
        for _, module, inside in imported_modules(p)
        if inside and module.startswith("mars_hf")
    )
    print(f"\nImports of mars_hf modules inside functions: {lazy}")
    upward = upward_imports()
    print(f"Upward imports: {len(upward)}")
    for problem in upward:
        print(f"  {problem}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
