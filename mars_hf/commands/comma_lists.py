"""Comma-separated option values (``--batch-sizes 1,4,8``), shared by the subcommands that take lists.

Blank items (``"1, ,2"``, a trailing comma) are skipped; spaces around an item are allowed.
"""

from __future__ import annotations


def words(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def floats(text: str) -> list[float]:
    return [float(x) for x in words(text)]


def ints(text: str) -> list[int]:
    return [int(x) for x in words(text)]
