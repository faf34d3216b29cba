"""Training for a wall-clock budget: a learning rate that warms up and decays linearly *in time*.

Why: a step-based schedule needs the number of steps in advance, which depends on the machine (a 2-core
CPU and a GPU differ by two orders of magnitude); a time-based one reaches zero exactly when the budget
ends, on any machine. ``MARSConfig(max_train_minutes=...)`` turns it on in :class:`~mars_hf.MARSTrainer`;
the quickstart trains this way too.
"""

from __future__ import annotations

import time


class TimeBudget:
    """Learning-rate factor that warms up then decays linearly in *wall-clock time*, reaching 0 at the budget.

    Used as a ``LambdaLR`` factor: the clock starts at the first call, which ``LambdaLR`` makes when it is
    built (just before the first optimizer step; the data loader's first batch counts against the budget).
    """

    def __init__(self, seconds: float, warmup_fraction: float = 0.05):
        self.seconds = float(seconds)
        self.warmup = max(1e-9, warmup_fraction) * self.seconds
        self.start: float | None = None

    def elapsed(self) -> float:
        return 0.0 if self.start is None else time.monotonic() - self.start

    def spent(self) -> bool:
        return self.elapsed() >= self.seconds

    def __call__(self, step: int) -> float:
        if self.start is None:
            self.start = time.monotonic()
        t = self.elapsed()
        if t < self.warmup:
            return max(t / self.warmup, 0.02)
        return max(0.0, (self.seconds - t) / max(1e-9, self.seconds - self.warmup))


def stop_at_budget_callback(budget: TimeBudget):
    """A ``TrainerCallback`` that ends training (saving as the strategy says) once ``budget`` is spent."""
    from transformers import TrainerCallback

    class StopAtBudget(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if budget.spent():
                control.should_training_stop = True
            return control

    return StopAtBudget()
