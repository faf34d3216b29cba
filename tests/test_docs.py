"""Guide pages tell what is, not how it came to be: no issue numbers, "waves" or commit hashes.

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
