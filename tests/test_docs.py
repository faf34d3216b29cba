"""Guide pages tell what is, not how it came to be: no issue numbers, "waves" or commit hashes; and every speed
figure they quote is one docs/numbers.md holds (with its command, revision and machine there).

The guide pages are README.md and docs/*.md; the lab notebook (docs/lab/) and docs/numbers.md (each figure with
the revision it was measured on) keep their history. A link's target is an address, not prose, so an anchor
derived from a numbers.md heading may hold a revision.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GUIDE_PAGES = [ROOT / "README.md"] + sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "numbers.md")
HISTORY = {
    "an issue number": re.compile(r"\bissues?\s+#?\d+|\bfault\s+\d+ of issue", re.IGNORECASE),
    "a wave": re.compile(r"\bwaves?\b", re.IGNORECASE),
    "a commit hash": re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b"),
}
LINK_TARGET = re.compile(r"\]\([^)]*\)")


def history_in(text: str) -> list[str]:
    prose = LINK_TARGET.sub("]()", text)
    return [
        f"{what}: {match.group(0)!r}"
        for what, pattern in HISTORY.items()
        for match in pattern.finditer(prose)
    ]


def test_the_check_finds_history():
    for text in (
        "as issue 50 asked",
        "Issue #12",
        "this wave's code",
        "since a8d82ae",
        "at 00c4f22dae4795e3",
    ):
        assert history_in(text), text
    assert not history_in("[numbers](numbers.md#v7-a8d82ae-and-after), 1234567 tokens, a defaced cafe")


@pytest.mark.parametrize("page", GUIDE_PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_guide_pages_carry_no_history(page):
    assert history_in(page.read_text(encoding="utf-8")) == []


def test_stale_speed_claims_are_gone():
    """Figures no row of docs/numbers.md holds."""
    assert "1.5–2× stock" not in (ROOT / "docs" / "quickstart.md").read_text(encoding="utf-8")
    assert "extraction at batch 4: 1.8×" not in (ROOT / "docs" / "embedded_mars.md").read_text(
        encoding="utf-8"
    )


# A measured ratio as the guide pages write it: "1.27×", or a range "0.95–1.04×". Rules with a space before the
# sign ("1.05 × their cost") are thresholds, not measurements. The paper's own figures (method.md, paragraphs
# marked *Paper*) are cited from the paper, not measured here.
SPEED_FIGURE = re.compile(r"(?<![\d.])(\d+\.\d+)(?:–(\d+\.\d+))?×")
NUMBERS = ROOT / "docs" / "numbers.md"


def unsourced_figures(text: str, numbers: str) -> list[str]:
    """Speed figures of ``text`` (outside *Paper* paragraphs) that ``numbers`` does not hold."""
    missing = []
    for paragraph in re.split(r"\n\s*\n", text):
        if "*Paper" in paragraph:
            continue
        for match in SPEED_FIGURE.finditer(paragraph):
            for value in filter(None, match.groups()):
                if not re.search(rf"(?<![\d.]){re.escape(value)}(?![\d])", numbers):
                    missing.append(match.group(0))
    return missing


def test_the_check_finds_unsourced_figures():
    numbers = "| verify | 1.43 | 1.27× |\nran 0.95–1.04× stock"
    assert unsourced_figures("verify ran 1.27× stock, 0.95–1.04× at batch 4", numbers) == []
    assert unsourced_figures("verify ran 2.1× stock", numbers) == ["2.1×"]
    assert unsourced_figures("verify ran 1.27–1.9× stock", numbers) == ["1.27–1.9×"]
    assert unsourced_figures("a 11.27× gain", numbers) == ["11.27×"]
    assert unsourced_figures("*Paper*: 1.71× at batch 4,\n1.60× at batch 8", numbers) == []
    assert unsourced_figures("*Paper*: 1.71×\n\nours: 1.60×", numbers) == ["1.60×"]


@pytest.mark.parametrize("page", GUIDE_PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_speed_figure_comes_from_numbers_md(page):
    assert unsourced_figures(page.read_text(encoding="utf-8"), NUMBERS.read_text(encoding="utf-8")) == []
