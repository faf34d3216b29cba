"""What the wheel ships: package-data names only what exists."""

import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def package_data_patterns() -> list[str]:
    block = (REPO_ROOT / "pyproject.toml").read_text().split("[tool.setuptools.package-data]")[1].split("\n[")[0]
    return re.findall(r'"([^"]+)"', block)


def test_every_package_data_pattern_matches_a_file():
    package = REPO_ROOT / "mars_hf"
    empty = [pattern for pattern in package_data_patterns() if not any(p.is_file() for p in package.glob(pattern))]
    assert not empty, f"pyproject.toml package-data names patterns that match no file: {empty}"
