"""Load-adaptive τ: trade a little quality for throughput while requests wait, give it back when they don't.

Lower τ accepts more tokens per forward (docs/method.md §2), so a server whose queue grows can clear it
faster without swapping models. The controller maps *pressure* — how full the waiting queue is
relative to the batch, and how long the oldest request has waited — to a τ in ``[tau_min, tau_max]``.
It lowers τ at once when pressure rises (waiting requests are the cost being fought) and raises it
back gradually (``raise_per_second``) so that τ does not flap when the queue drains between bursts.
It is called by the scheduler between steps; a request that pins its τ or asks for verify is not
touched by it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ControllerConfig:
    """Operator settings of the τ controller (``mars-hf serve --tau-min/--tau-max/...``)."""

    tau_min: float = field(default=0.7, metadata={"help": "Lowest τ the controller may choose."})
    tau_max: float = field(
        default=0.95, metadata={"help": "τ at low load (1.0: ordinary decoding, one token per step)."}
    )
    enabled: bool = field(default=True, metadata={"help": "False: τ stays at tau_max whatever the load."})
    queue_high: int | None = field(
        default=None,
        metadata={"help": "Waiting requests that count as full pressure (default: the number of slots)."},
    )
    wait_high_s: float = field(
        default=2.0, metadata={"help": "Seconds the oldest request has waited that count as full pressure."}
    )
    raise_per_second: float = field(
        default=0.25,
        metadata={"help": "How fast τ climbs back towards tau_max as load falls (τ per second)."},
    )

    def __post_init__(self):
        if not 0.0 <= self.tau_min <= self.tau_max <= 1.0:
            raise ValueError(
                f"Need 0 <= tau_min <= tau_max <= 1, got tau_min={self.tau_min}, tau_max={self.tau_max}."
            )
        if self.wait_high_s <= 0 or self.raise_per_second <= 0:
            raise ValueError("wait_high_s and raise_per_second must be > 0.")
        if self.queue_high is not None and self.queue_high < 1:
            raise ValueError("queue_high must be >= 1.")


class TauController:
    """Chooses the τ in force for unpinned rows from the queue depth and the oldest wait."""

    def __init__(self, config: ControllerConfig, slots: int, clock=None):
        """``clock``: a time source (seconds) used instead of the caller's ``now``, so that a test can
        arrange how much time passes between updates (the scheduler passes ``time.monotonic()``)."""
        self.config = config
        self.clock = clock
        self.queue_high = config.queue_high or max(1, slots)
        self.tau = config.tau_max
        self.pressure = 0.0
        self._last_time: float | None = None

    def target(self, queue_depth: int, oldest_wait_s: float) -> float:
        """τ for a given load, without the gradual raise."""
        config = self.config
        if not config.enabled:
            return config.tau_max
        self.pressure = min(1.0, max(queue_depth / self.queue_high, oldest_wait_s / config.wait_high_s))
        return config.tau_max - (config.tau_max - config.tau_min) * self.pressure

    def update(self, queue_depth: int, oldest_wait_s: float, now: float) -> float:
        """Advance the controller to time ``now`` (seconds, monotonic) and return the τ in force."""
        target = self.target(queue_depth, oldest_wait_s)
        now = self.clock() if self.clock is not None else now
        dt = 0.0 if self._last_time is None else max(0.0, now - self._last_time)
        self._last_time = now
        if target <= self.tau:
            self.tau = target
        else:
            self.tau = min(target, self.tau + self.config.raise_per_second * dt)
        return self.tau
