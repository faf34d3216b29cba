"""What an item will cost before it runs: priors first, replaced by measurements as soon as there are any.

The unit is the seconds of one stock decoding step (a forward of the batch at one new token), measured per
model and batch by the probe; a configuration's step costs a *factor* times that, learnt from the decoding
groups that already ran (the largest seen, so that later estimates err on the side of skipping).
"""

from __future__ import annotations

from mars_hf.tools.gpu_check.random_models import parameter_count

# Costs assumed before anything is measured (seconds); replaced by measurements as soon as there are any.
PRIOR_FLEX_COMPILE_SECONDS = 60.0  # compiling flex attention's forward and backward kernels
PRIOR_MARS_STEP_FACTOR = 2.5  # a MARS step against a stock step of the same batch (more Python per step)
PRIOR_NONE_STEP_FACTOR = 4.0  # 'none' recomputes the whole sequence every step
PRIOR_BUILD_SECONDS_PER_BILLION = {"cuda": 8.0, "cpu": 60.0}


def configuration_kind(configuration) -> str:
    """What a step factor is learnt for: the label's first word (cursor, block, none, verify), or stock."""
    return "stock" if configuration.scheme == "stock" else configuration.label.split(" ")[0]


class CostEstimates:
    """Seconds per stock step (per model and batch) and step factors (per configuration kind)."""

    def __init__(self, args, device_type: str):
        self.args = args
        self.device_type = device_type
        self.step_seconds: dict[tuple[str, int], float] = {}
        self.factors: dict[str, float] = {}

    def build(self, shape: str) -> float:
        return parameter_count(shape) / 1e9 * PRIOR_BUILD_SECONDS_PER_BILLION[self.device_type] + 1.0

    def stock_steps(self, shape: str) -> dict[str, float]:
        """The probe's seconds per stock step of one model, by batch size (as the JSON keys them)."""
        return {str(b): s for (m, b), s in self.step_seconds.items() if m == shape}

    def factor(self, configuration) -> float:
        kind = configuration_kind(configuration)
        if kind in self.factors:
            return self.factors[kind]
        if configuration.scheme == "stock":
            return 1.0
        return PRIOR_NONE_STEP_FACTOR if configuration.scheme == "none" else PRIOR_MARS_STEP_FACTOR

    def learn_factor(self, configuration, seconds: float, forwards: int, stock_step: float) -> None:
        """A decoding run of ``forwards`` forwards took ``seconds``: its kind's factor is at least that."""
        kind = configuration_kind(configuration)
        factor = seconds / (forwards * stock_step)
        self.factors[kind] = max(self.factors.get(kind, 0.0), factor)

    def forwards(self, configuration, rate: float, new_tokens: int) -> float:
        """Forwards a configuration needs for ``new_tokens`` at agreement ``rate`` (threshold steps)."""
        if configuration.scheme == "stock":
            return new_tokens
        per_step = sum(rate**k for k in range(self.args.window + 1))
        forwards = new_tokens / per_step
        if configuration.scheme == "block":
            forwards += new_tokens / configuration.cache_block + 1
        return forwards + 1

    def decode(self, shape: str, rate: float, batch: int, configurations) -> float | None:
        step = self.step_seconds.get((shape, batch))
        if step is None:
            return None
        args = self.args
        total = 0.0
        for configuration in configurations:
            forwards = args.repeats * self.forwards(configuration, rate, args.max_new_tokens)
            forwards += args.warmup * self.forwards(configuration, rate, args.warmup_tokens)
            total += forwards * step * self.factor(configuration)
        return total

    def exactness(self, shape: str, batch: int, configurations) -> float | None:
        """Stock once plus every configuration, and (batch > 1) each row alone at batch 1."""
        step = self.step_seconds.get((shape, batch))
        if step is None:
            return None
        tokens = self.args.exactness_new_tokens
        estimate = tokens * step * (1 + sum(self.factor(c) for c in configurations))
        single = self.step_seconds.get((shape, 1), step)
        return estimate + (tokens * single * batch if batch > 1 else 0.0)

    def train_first(self, shape: str) -> float | None:
        """The first (sdpa) training item: forward + backward of B x 2L tokens against one decoding step,
        a rough prior."""
        step = self.step_seconds.get((shape, 1))
        if step is None:
            return None
        tokens = self.args.train_batch * 2 * self.args.train_length
        return 5.0 + (self.args.train_repeats + 1) * step * max(3.0, tokens / 256)

    def train_flex(self, sdpa_step: float) -> float:
        return PRIOR_FLEX_COMPILE_SECONDS + (self.args.train_repeats + 1) * 2 * sdpa_step

    def train_gated(self, sdpa_step: float) -> float:
        return 5.0 + (self.args.train_repeats + 1) * 2 * sdpa_step
