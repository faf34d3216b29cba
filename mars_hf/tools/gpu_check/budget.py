"""The check's time budget: a clock, a deadline, checks between runs and a timer that interrupts."""

from __future__ import annotations

import signal
import time


class BudgetExceeded(BaseException):
    """Raised (by the deadline timer or a check between runs) when the budget is spent. A BaseException,
    like KeyboardInterrupt, so that no ``except Exception`` inside a library swallows it."""


class Budget:
    """Wall-clock budget with a hard deadline: `check` between runs, and a timer that interrupts.

    The timer's exception is raised when the main thread next runs Python, so a single long C++ call
    (one forward or backward: milliseconds on a GPU, seconds for a large model on a CPU) finishes first.
    ``clock`` (seconds, default ``time.monotonic``) can be replaced, e.g. by one that charges a fixed cost
    per generated token so that where a run stops does not depend on the machine's speed (the tests); the
    timer only runs on the real clock, a replaced one is read by the checks between runs alone.
    """

    def __init__(
        self, seconds: float, reserve: float | None = None, start: float | None = None, clock=time.monotonic
    ):
        self.seconds = float(seconds)
        self.clock = clock
        # Room for the JSON and for the one C++ call (a forward, a backward) an interrupt has to wait for.
        reserve = min(3.0, 0.05 * self.seconds) if reserve is None else reserve
        self.start = clock() if start is None else start
        self.deadline = self.start + max(0.0, self.seconds - reserve)
        self._timer = False

    def elapsed(self) -> float:
        return self.clock() - self.start

    def remaining(self) -> float:
        return self.deadline - self.clock()

    def check(self) -> None:
        if self.remaining() <= 0:
            raise BudgetExceeded(f"the budget of {self.seconds:g} s is spent")

    def arm(self) -> None:
        """Interrupt whatever runs at the deadline (main thread, Unix); `disarm` when done."""
        if not hasattr(signal, "setitimer") or self.clock is not time.monotonic:
            return
        try:
            signal.signal(signal.SIGALRM, self._ring)
        except ValueError:  # not the main thread: the checks between runs still stop the run
            return
        signal.setitimer(signal.ITIMER_REAL, max(0.01, self.remaining()))
        self._timer = True

    def disarm(self) -> None:
        if self._timer:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            self._timer = False

    def _ring(self, signum, frame):
        raise BudgetExceeded(f"interrupted at the deadline of the {self.seconds:g} s budget")
