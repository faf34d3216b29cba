"""Keeping the quickstart's wall-clock promise on any machine.

Two rules, shared by every budgeted step (self-distillation, reference answers, evaluations):

* :class:`Deadline` stops a loop *before* it would overrun: the next item is assumed to take as long as
  the last one.
* Each step still does a minimum amount of work (4 prompts, one batch of 4) so that its table row means
  something. On a slow machine that minimum alone can overrun the budget several times (a 2-core AVX2
  CPU decodes a prompt with six decodings in ≈ 3 min). So the answer length is fitted to the budget:
  :func:`answer_length_that_fits` shortens the answers (never below :data:`MIN_NEW_TOKENS`) from a
  measured pace, instead of trusting a length chosen on another machine.
"""

from __future__ import annotations

import math
import time

# Answers are never cut shorter than this to fit a budget: below it agreement says little.
MIN_NEW_TOKENS = 16


class Deadline:
    """Stop before a budget would be overrun: the next item is assumed to take as long as the last one."""

    def __init__(self, minutes: float | None):
        self.seconds = math.inf if minutes is None else max(0.0, float(minutes)) * 60
        self.start = time.monotonic()
        self.last = 0.0

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        """Seconds still in the budget (``inf`` without one, never negative)."""
        return max(0.0, self.seconds - self.elapsed())

    def allows_another(self) -> bool:
        return self.elapsed() + self.last <= self.seconds

    def record(self, seconds: float) -> None:
        self.last = seconds


def answer_length_that_fits(
    seconds: float, seconds_per_token: float, max_new_tokens: int, floor: int = MIN_NEW_TOKENS
) -> int:
    """The longest answer length ≤ ``max_new_tokens`` whose minimum work fits in ``seconds``.

    ``seconds_per_token``: what one more new token costs the minimum work as a whole (every prompt and
    decoding of it), measured on this machine. Never below ``floor`` (nor above ``max_new_tokens``).
    """
    floor = min(floor, max_new_tokens)
    if math.isinf(seconds) or seconds_per_token <= 0:
        return max_new_tokens
    return max(floor, min(max_new_tokens, int(seconds / seconds_per_token)))
