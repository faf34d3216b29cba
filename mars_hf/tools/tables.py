"""Plain-text tables of the tools' results (`mars-hf bench`, `mars-hf gpu-check`): one way to lay them out.

A table is a list of `Column`s (header, width, which value, its format) over result rows; a missing value
prints ``-``. The planner's choices and the decoder's cost curve, which both tools report for their MARS
rows, are written as text here too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass


def fmt(value, spec: str = "") -> str:
    """``value`` formatted by ``spec``, or ``-`` where there is none."""
    return "-" if value is None else format(value, spec)


@dataclass(frozen=True)
class Column:
    """One column: ``value`` is a row key or a function of the row; ``spec`` its format; ``suffix`` follows
    a present value (``x`` after a speed-up); ``align`` is ``>`` (numbers) or ``<`` (text)."""

    header: str
    width: int
    value: str | Callable[[dict], object]
    spec: str = ""
    suffix: str = ""
    align: str = ">"

    def cell(self, row: dict) -> str:
        value = row.get(self.value) if isinstance(self.value, str) else self.value(row)
        text = fmt(value, self.spec) + ("" if value is None else self.suffix)
        return format(text, f"{self.align}{self.width}")

    def title(self) -> str:
        return format(self.header, f"{self.align}{self.width}")


def fixed_width_table(
    columns: Sequence[Column], rows: Iterable[dict], group: Callable[[dict], object] | None = None
) -> list[str]:
    """The header, a rule as wide as it, and a line per row; a blank line wherever ``group(row)`` changes."""
    header = " ".join(column.title() for column in columns)
    lines = [header, "-" * len(header)]
    previous = None
    for index, row in enumerate(rows):
        key = group(row) if group else None
        if index and key != previous:
            lines.append("")
        previous = key
        lines.append(" ".join(column.cell(row) for column in columns))
    return lines


def planner_choices(row: dict) -> tuple[str, str]:
    """``(widths, plans)`` of one MARS row as text: forwards by columns per row (``width:count``) and the
    planner's choices per row-step (``name count``)."""
    widths = " ".join(f"{w}:{n}" for w, n in row["width_histogram"].items())
    plans = ", ".join(f"{k} {n}" for k, n in sorted((row.get("plan_counts") or {}).items()))
    return widths, plans


def cost_curve_text(curve: dict) -> str:
    """The decoder's cost curve as ``columns per row:relative cost`` pairs."""
    return ", ".join(f"{n}:{float(c):.2f}" for n, c in curve.items())
