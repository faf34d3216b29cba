"""Comma-separated option values (``--batch-sizes 1,4,8``), shared by the subcommands that take lists."""

from __future__ import annotations


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def words(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]
