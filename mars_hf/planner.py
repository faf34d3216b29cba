"""The step planner: what each row feeds in a step, chosen for expected tokens per unit of measured cost.

Why: a MARS step that feeds drafts and masks yields more tokens per forward, but a forward of more
columns costs more (``cost_model``), and on a CPU in float32 often more than the extra tokens are
worth. Verified decoding's output does not depend on what is fed (a draft is kept only if it is the
model's own choice), so the feed can be chosen freely, per step and per row:

- ``k`` of the row's drafts (a prefix; the rest are dropped), and
- ``m ≤ W`` masks, either as one group after the ``k`` drafts (*linear*: new drafts only if all ``k``
  are kept) or as a group after every kept-draft prefix (*quadratic*: ``(k + 1)·m`` masks), or none.

The objective (average-reward form of "tokens per unit cost", with ``λ`` the row's own recent rate,
at least 1 = stock decoding) is, summed over the rows of the forward::

    value(plan) = E[tokens now] + E[worth of the drafts it proposes] − λ · cost(step width)

- ``E[tokens now] = 1 + Σ_{j≤k} Π_{i≤j} p_i``: ``p_i``, the chance draft ``i`` is kept given the
  ones before it, is the draft's own (calibrated) probability rescaled by the row's observed
  acceptance at that offset (``AcceptanceStats``);
- the proposed drafts are worth ``H(m) = max_{m' ≤ m} [Σ_{j≤m'} Π_{i≤j} a_i − λ·(cost(1 + m') − 1)]``
  (their expected kept count minus what verifying them will cost; the next step may feed fewer), with
  ``a_i`` the row's observed conditional acceptance per offset; linear groups count with the
  probability that all ``k`` drafts are kept, quadratic ones always.

All rows of a batch share one padded width: ``choose`` tries each width the rows' plans can take, lets
every row fill it with its best plan that fits (the columns are paid for anyway) and keeps the width
with the best total. Threshold rows (τ) that opt in (``mars_planner=True``) choose only ``m``, valued
by their observed per-offset pass rates (this changes which tokens τ can accept: never more than ``m``
predictions past the first). Rows whose feed is fixed (an explicit ``mars_layout``, τ without the
planner) take part with their fixed width. Everything is a few small tensor operations per step:
``O(rows · W²)`` numbers, no Python loop over plans.

This file depends on torch only (it ships in a checkpoint's ``custom_generate/``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# row kinds
AUTO = "auto"  # verify rows the planner serves: drafts, linear or quadratic groups, or none
THRESHOLD = "threshold"  # τ rows that opted in: masks only (k = 0, linear)
FIXED = "fixed"  # anything else: one given width

_NEG = float("-inf")


@dataclass
class RowSpec:
    """What the planner needs to know about one row this step.

    Attributes:
        kind: ``AUTO``, ``THRESHOLD`` or ``FIXED``.
        base: columns the row feeds in any case (a prompt's left padding at its first step, then the
            real tokens not yet cached); for ``FIXED`` rows, their whole width.
        draft_probs: chance that each draft in hand is kept, given the ones before it (``AUTO``).
        future: chance that a new draft at offset ``i`` is kept (verify) or that a mask prediction
            passes τ (threshold), given the ones before it; ``W`` entries.
        gain: λ, the row's recent tokens per unit cost (>= 1).
        max_masks: masks per group at most (the window, the tokens left, the positions left).
        max_extra: drafts + masks at most (positions left before the model's limit).
        force_masks / force_drafts: a re-probe (see ``AcceptanceStats``): feed masks / every draft.
    """

    kind: str
    base: int
    draft_probs: list[float] = field(default_factory=list)
    future: list[float] = field(default_factory=list)
    gain: float = 1.0
    max_masks: int = 0
    max_extra: int = 0
    force_masks: bool = False
    force_drafts: bool = False


@dataclass(frozen=True)
class RowChoice:
    """The planner's choice for a row: ``drafts`` fed, ``masks`` per group, quadratic or linear."""

    drafts: int = 0
    masks: int = 0
    quadratic: bool = False

    @property
    def kind(self) -> str:
        if not self.masks:
            return "plain" if not self.drafts else "drafts"
        return "quadratic" if self.quadratic and self.drafts else "linear"


def plan_width(spec: RowSpec, choice: RowChoice) -> int:
    if spec.kind == FIXED:
        return spec.base
    groups = choice.drafts + 1 if choice.quadratic else 1
    return spec.base + choice.drafts + groups * choice.masks


def choose(specs: list[RowSpec], cost, window: int) -> tuple[int, list[RowChoice]]:
    """The step's width and each row's choice (``cost(n)``: relative cost of ``n`` columns per row).

    See the module docstring for the objective; ties go to the narrower width.
    """
    values, widths = _plan_grid(specs, cost, window)  # [R, P] each; invalid plans: -inf / huge
    order = widths.argsort(dim=1)
    sorted_widths = widths.gather(1, order)
    best, best_at = values.gather(1, order).cummax(dim=1)  # best value within each width
    valid = values > _NEG
    lowest = int(sorted_widths[:, 0].max())  # the narrowest width every row has a plan for
    candidates = torch.unique(widths[valid])
    candidates = candidates[candidates >= lowest]
    queries = candidates[None, :].expand(len(specs), -1).contiguous()
    index = torch.searchsorted(sorted_widths.contiguous(), queries, right=True) - 1
    per_row = best.gather(1, index)  # [R, C]
    gains = torch.tensor([s.gain for s in specs], dtype=torch.float64)
    step_cost = torch.tensor([cost(int(c)) for c in candidates], dtype=torch.float64)
    total = per_row.sum(0) - gains.sum() * step_cost
    pick = int(torch.argmax(total))
    width = int(candidates[pick])
    flat = order.gather(1, best_at.gather(1, index[:, pick : pick + 1])).squeeze(1).tolist()
    return width, [_decode(p, window) for p in flat]


def _plan_grid(specs: list[RowSpec], cost, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every plan of every row: value and width, ``[rows, 2 · (W + 1)²]`` (linear then quadratic,
    ``k`` major, ``m`` minor)."""
    rows, side = len(specs), window + 1
    f64 = torch.float64
    probs = torch.zeros(rows, window, dtype=f64)
    future = torch.zeros(rows, window, dtype=f64)
    for r, spec in enumerate(specs):
        if spec.draft_probs:
            probs[r, : len(spec.draft_probs)] = torch.tensor(spec.draft_probs[:window], dtype=f64)
        if spec.future:
            future[r, : len(spec.future)] = torch.tensor(spec.future[:window], dtype=f64)
    ones = torch.ones(rows, 1, dtype=f64)
    kept_all = torch.cat([ones, probs.cumprod(1)], 1)  # P(first k drafts kept), [R, W+1]
    now = kept_all.cumsum(1)  # 1 + E[drafts kept among the first k]
    reach = torch.cat([ones, future.cumprod(1)], 1)
    expected_new = reach.cumsum(1) - 1  # E[kept among m fresh drafts] (or passes for τ rows)
    gains = torch.tensor([s.gain for s in specs], dtype=f64)[:, None]
    extra_cost = torch.tensor([cost(1 + m) - cost(1) for m in range(side)], dtype=f64)[None, :]
    worth = (expected_new - gains * extra_cost).cummax(1).values  # H(m), >= 0 (m' = 0)

    k = torch.arange(side)[None, :, None]
    m = torch.arange(side)[None, None, :]
    linear = now[:, :, None] + kept_all[:, :, None] * worth[:, None, :]
    quadratic = now[:, :, None] + worth[:, None, :]
    base = torch.tensor([s.base for s in specs])[:, None, None]
    widths = torch.stack([base + k + m, base + k + (k + 1) * m], 1)  # [R, 2, W+1, W+1]
    values = torch.stack([linear, quadratic], 1).clone()
    allowed = _allowed(specs, side)
    threshold_rows = [r for r, s in enumerate(specs) if s.kind == THRESHOLD]
    if threshold_rows:
        values[threshold_rows, 0, 0, :] = 1 + expected_new[threshold_rows]
    fixed_rows = [r for r, s in enumerate(specs) if s.kind == FIXED]
    if fixed_rows:
        values[fixed_rows] = 0.0
        widths[fixed_rows] = base[fixed_rows][:, None]
    values = values.masked_fill(~allowed, _NEG)
    widths = widths.masked_fill(~allowed, torch.iinfo(torch.long).max // 4)
    return values.reshape(rows, -1), widths.reshape(rows, -1)


def _allowed(specs: list[RowSpec], side: int) -> torch.Tensor:
    """Which (shape, k, m) each row may take: drafts in hand, masks, positions, its kind, re-probes."""
    k = torch.arange(side)[:, None]
    m = torch.arange(side)[None, :]
    masks = []
    for spec in specs:
        if spec.kind == FIXED:
            one = torch.zeros(2, side, side, dtype=torch.bool)
            one[0, 0, 0] = True
            masks.append(one)
            continue
        drafts = len(spec.draft_probs) if spec.kind == AUTO else 0
        fits = (k <= drafts) & (m <= spec.max_masks) & (k + m <= max(spec.max_extra, 0))
        if spec.force_drafts and drafts:
            fits &= k == min(drafts, max(spec.max_extra, 0))
        if spec.force_masks and bool((fits & (m >= 1)).any()):
            fits &= m >= 1
        quadratic = fits & (k >= 1) & (m >= 1) if spec.kind == AUTO else torch.zeros_like(fits)
        masks.append(torch.stack([fits, quadratic]))
    return torch.stack(masks)


def _decode(index: int, window: int) -> RowChoice:
    side = window + 1
    shape, rest = divmod(index, side * side)
    k, m = divmod(rest, side)
    return RowChoice(drafts=k, masks=m, quadratic=bool(shape))


# --------------------------------------------------------------------------------------------------
# What a row has observed
# --------------------------------------------------------------------------------------------------


class AcceptanceStats:
    """A row's running acceptance per draft offset, its recent gain, and its re-probe schedule.

    Counts decay by ``DECAY`` per observation so that a row whose text changes character (a list, then
    prose) is re-estimated within a few dozen steps. ``PRIOR`` (weight ``PRIOR_WEIGHT``) is what an
    unobserved offset is assumed to keep. A row that feeds no masks learns nothing about its drafts, so
    after ``probe_every`` such steps it is made to feed masks once and then every draft they propose
    (the interval doubles, up to ``MAX_PROBE_EVERY``, while probes find nothing; resets when they do).
    """

    DECAY = 0.9
    PRIOR = 0.5
    PRIOR_WEIGHT = 1.0
    GAIN_DECAY = 0.8
    FIRST_PROBE_EVERY = 8
    MAX_PROBE_EVERY = 64

    def __init__(self, window: int):
        self.reached = [0.0] * window
        self.kept = [0.0] * window
        self.predicted = [0.0] * window  # sum of the drafts' own probabilities where they were reached
        self.gain = 1.0
        self.idle_steps = 0
        self.probe_every = self.FIRST_PROBE_EVERY
        self.probing = False  # masks were forced: their drafts are fed in full next step

    def future(self) -> list[float]:
        """Chance that a fresh draft (or mask prediction) at each offset is kept, given the earlier ones."""
        w, prior = self.PRIOR_WEIGHT, self.PRIOR
        return [(kept + w * prior) / (reached + w) for kept, reached in zip(self.kept, self.reached)]

    def calibrated(self, confidences: list[float]) -> list[float]:
        """The drafts' own probabilities rescaled by observed ÷ predicted acceptance at their offsets."""
        w = self.PRIOR_WEIGHT * self.PRIOR
        out = []
        for j, c in enumerate(confidences):
            scale = (self.kept[j] + w) / (self.predicted[j] + w) if j < len(self.kept) else 1.0
            out.append(min(1.0, max(0.0, c * scale)))
        return out

    def observe(self, fed: int, kept: int, confidences: list[float] | None = None) -> None:
        """``fed`` drafts (or mask predictions) were checked; the first ``kept`` were kept."""
        if fed <= 0:
            return
        for j in range(len(self.reached)):
            self.reached[j] *= self.DECAY
            self.kept[j] *= self.DECAY
            self.predicted[j] *= self.DECAY
        for j in range(min(kept + 1, fed, len(self.reached))):
            self.reached[j] += 1.0
            self.kept[j] += 1.0 if j < kept else 0.0
            if confidences is not None and j < len(confidences):
                self.predicted[j] += confidences[j]
        if kept:
            self.probe_every = self.FIRST_PROBE_EVERY
        elif self.probing:
            self.probe_every = min(2 * self.probe_every, self.MAX_PROBE_EVERY)

    def observe_step(self, tokens: int, cost: float, fed_masks: bool) -> None:
        """The row's gain (tokens per unit cost) and its steps without masks."""
        rate = tokens / max(cost, 1e-9)
        self.gain = self.GAIN_DECAY * self.gain + (1 - self.GAIN_DECAY) * rate
        self.idle_steps = 0 if fed_masks else self.idle_steps + 1

    def probe_due(self) -> bool:
        return self.idle_steps >= self.probe_every
