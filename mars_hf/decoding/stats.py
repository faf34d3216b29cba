"""What the planner has observed: per row, how often drafts at each offset are kept (``AcceptanceStats``,
``SourceStats`` for prompt lookup and a draft model); per batch, whether drafting pays at all
(``DraftingFloor``). The planner (``planner.py``) owns these; rows never hold them.
"""

from __future__ import annotations

from dataclasses import dataclass


class AcceptanceStats:
    """A row's running acceptance per draft offset, its recent gain, its re-probe schedule, and what its
    drafting steps gave (for the :class:`DraftingFloor`).

    What fresh drafts will be worth (``future``) comes from the drafts the row's masks proposed lately
    (their own probabilities, rescaled by observed ÷ predicted acceptance), so masks whose drafts are
    never worth checking stop being fed although those drafts were never checked; τ rows, which have
    no drafts, use their observed pass rates.

    Counts decay by ``DECAY`` per observation so that a row whose text changes character (a list, then
    prose) is re-estimated within a few dozen steps. ``PRIOR`` (weight ``PRIOR_WEIGHT``) is what an
    unobserved offset is assumed to keep. A row that feeds no masks learns nothing about its drafts, so
    after ``probe_every`` such steps it is made to feed masks once and then every draft they propose
    (:meth:`start_probe`; stretched by ``probe_spacing`` where extra columns are dear). The interval
    doubles with every probe, up to ``MAX_PROBE_EVERY``, and resets only when the row feeds masks of
    the planner's own choosing *and* its drafting steps have paid (:meth:`drafting_pays`): a probe whose
    drafts were kept but did not make masks worth their columns (good drafts on a steep curve) found
    nothing to feed, and neither did masks that only filled columns a companion of a batch paid for (at
    batch 4 those reset every row's interval after each probe, so re-probes never spread out there).

    Each step but the prompt's leaves ``last_sample``: its tokens, its measured cost relative to a plain
    step of the same batch, and whether the row drafted (masks fed or mask drafts checked by the
    planner's choice, not by a forced re-probe), which the batch's :class:`DraftingFloor` pools; the row
    keeps its drafting steps' as exponential averages with a half-life of ``DraftingFloor.HALF_LIFE``.
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
        self.proposed = [0.0] * window  # sum of the own probabilities of the drafts proposed lately
        self.proposals = [0.0] * window
        self.gain = 1.0
        self.idle_steps = 0
        self.probe_every = self.FIRST_PROBE_EVERY
        self.probing = False  # masks were forced: their drafts are fed in full next step
        self.steps = 0  # steps observed (``observe_step``), the prompt's included
        self.last_sample: tuple[int, float, bool] | None = None  # the last step's (tokens, cost, drafted)
        self.drafted_tokens = 0.0  # exponential sums over the row's drafting steps
        self.drafted_cost = 0.0
        self.drafted_steps = 0
        self._checked = False  # mask drafts were checked since the last ``observe_step``

    def inherit(self, other: AcceptanceStats) -> None:
        """Start from what ``other`` (the masks of an earlier row of the same model) observed: its acceptance per
        offset, its gain and its re-probe schedule (how far apart probes had grown, and the plain steps since the
        last: probes stay due across calls, so masks that start to pay are found again), not its drafting
        record. Why: a row that starts from the prior drafts in its first steps until its own rejections teach
        it otherwise, and re-probes every ``FIRST_PROBE_EVERY`` steps, on every call anew."""
        size = len(self.reached)
        for name in ("reached", "kept", "predicted", "proposed", "proposals"):
            values = getattr(other, name)[:size]
            setattr(self, name, values + [0.0] * (size - len(values)))
        self.gain = other.gain
        self.probe_every, self.idle_steps = other.probe_every, other.idle_steps

    def future(self) -> list[float]:
        """Chance that a fresh draft (or mask prediction) at each offset is kept, given the earlier ones."""
        w, prior = self.PRIOR_WEIGHT, self.PRIOR
        out = []
        for j, (kept, reached) in enumerate(zip(self.kept, self.reached)):
            count = self.proposals[j]
            if count > 0:  # drafts proposed here: their own (rescaled) probabilities
                scaled = self.calibrated([self.proposed[j] / count], offset=j)[0]
                out.append((count * scaled + w * prior) / (count + w))
            else:
                out.append((kept + w * prior) / (reached + w))
        return out

    def propose(self, confidences: list[float]) -> None:
        """The masks proposed drafts with these own probabilities (fed or not later)."""
        for j in range(len(self.proposed)):
            self.proposed[j] *= self.DECAY
            self.proposals[j] *= self.DECAY
        for j, c in enumerate(confidences[: len(self.proposed)]):
            self.proposed[j] += c
            self.proposals[j] += 1.0

    def calibrated(self, confidences: list[float], offset: int = 0) -> list[float]:
        """The drafts' own probabilities rescaled by observed ÷ predicted acceptance at their offsets
        (``confidences[i]`` is at offset ``offset + i``)."""
        w = self.PRIOR_WEIGHT * self.PRIOR
        out = []
        for i, c in enumerate(confidences):
            j = offset + i
            scale = (self.kept[j] + w) / (self.predicted[j] + w) if j < len(self.kept) else 1.0
            out.append(min(1.0, max(0.0, c * scale)))
        return out

    def observe(self, fed: int, kept: int, confidences: list[float] | None = None) -> None:
        """``fed`` drafts (or mask predictions) were checked; the first ``kept`` were kept."""
        if fed <= 0:
            return
        self._checked = True
        for j in range(len(self.reached)):
            self.reached[j] *= self.DECAY
            self.kept[j] *= self.DECAY
            self.predicted[j] *= self.DECAY
        for j in range(min(kept + 1, fed, len(self.reached))):
            self.reached[j] += 1.0
            self.kept[j] += 1.0 if j < kept else 0.0
            if confidences is not None and j < len(confidences):
                self.predicted[j] += confidences[j]

    def start_probe(self) -> None:
        """Masks were forced on this row: their drafts are fed in full next step; the next probe waits
        twice as long unless the planner feeds masks of its own accord, where drafting pays, before it."""
        self.probing = True
        self.probe_every = min(2 * self.probe_every, self.MAX_PROBE_EVERY)

    def observe_step(self, tokens: int, cost: float, fed_masks: bool, forced: bool = False) -> None:
        """The row's gain (tokens per unit cost), its steps without masks and its drafting record
        (``cost``: the step's measured cost relative to a plain step of the same batch)."""
        rate = tokens / max(cost, 1e-9)
        self.gain = self.GAIN_DECAY * self.gain + (1 - self.GAIN_DECAY) * rate
        self.idle_steps = 0 if fed_masks else self.idle_steps + 1
        checked, self._checked = self._checked, False
        self.steps += 1
        if self.steps == 1:  # the prompt's step: plain decoding pays for the prompt too
            self.last_sample = None
            return
        drafted = bool(fed_masks or checked) and not forced
        self.last_sample = (tokens, cost, drafted)
        if not drafted:
            return
        decay = DraftingFloor.DECAY
        self.drafted_tokens = decay * self.drafted_tokens + tokens
        self.drafted_cost = decay * self.drafted_cost + cost
        self.drafted_steps += 1
        if fed_masks and self.drafting_pays():
            self.probe_every = self.FIRST_PROBE_EVERY

    def drafting_pays(self) -> bool:
        """The row's own drafting steps (at least ``DraftingFloor.EVIDENCE``) gave more tokens than their
        cost by ``DraftingFloor.MARGIN``."""
        return (
            self.drafted_steps >= DraftingFloor.EVIDENCE
            and self.drafted_tokens >= (1.0 + DraftingFloor.MARGIN) * self.drafted_cost
        )

    def probe_due(self, spacing: float = 1.0) -> bool:
        """Masks are due again (``spacing``: see ``probe_spacing``)."""
        return self.idle_steps >= self.probe_every * spacing


class DraftingFloor:
    """A batch's floor: plain one-column steps of the same rows, on the same kernels, at the batch size it
    runs (one per measured curve of the caller's ``PlannerMemory``, shared by later calls given it:
    ``planner.drafting_floor``).

    Why: the planner's per-step estimates can be wrong in ways no single step shows (a draft's calibrated
    probability a little above how often such drafts are kept, future checks that cost more than a row's
    share of a batch's width), and at batch 4 on a steep CPU curve verify ran below one-token decoding.
    So the floor keeps what the batch's drafting steps actually gave: over every row-step that drafted
    (``AcceptanceStats.last_sample``), the tokens and the measured cost ratio of that forward over a plain
    forward of the same batch (the cost curve of the batch's own bucket), as exponential averages with a
    half-life of ``HALF_LIFE`` drafting steps, pooled over the rows (a row's own kept drafts swing from 0
    to W step to step while every row pays the batch's width: judged alone, a row of a batch that paid
    often looked as if it did not). While it is *open* the planner feeds what its estimates say pays;
    *closed*, it feeds plain steps only (``choose(..., drafting=False)``) and forces no re-probe.

    The rule (tokens ÷ cost of the drafting steps, ``T/C``):

    - a batch with no evidence *explores*: it drafts as the planner's estimates say; after
      ``FIRST_LOOK`` drafting steps it closes if ``T < EARLY·C`` (far below plain), and after
      ``EVIDENCE`` it is *established* if ``T ≥ (1 + MARGIN)·C``, else it closes;
    - an established batch closes when ``T < C`` (below plain; a ratio near the margin, re-tested
      every step, would close on estimation noise);
    - a closed batch re-opens to explore afresh after ``FIRST_WAIT`` to twice that many steps (at a
      multiple of the wait), and every closing that follows exploration doubles the wait, up to
      ``MAX_WAIT``; a batch established for ``HALF_LIFE`` drafting steps goes back to ``FIRST_WAIT``.

    The loss this exploration can cost against plain steps is bounded: at most ``EVIDENCE`` drafting
    steps per exploration (``FIRST_LOOK`` where drafting is far below plain), explorations at least
    ``MAX_WAIT`` steps apart once they keep failing, so where drafting never pays the loss tends to
    ``EVIDENCE · (cost(widest) − 1) / MAX_WAIT`` of plain decoding's time (< 2 % where the widest planned
    step costs 1.5× one column), on top of the first exploration's ``EVIDENCE · (cost(widest) − 1)`` steps.
    """

    HALF_LIFE = 16  # drafting steps: long enough that runs of kept and rejected drafts average out
    DECAY = 0.5 ** (1.0 / HALF_LIFE)
    MARGIN = 0.05  # drafting must beat plain steps by this share of their cost to be established
    FIRST_LOOK = 8  # drafting steps before a batch far below plain (``EARLY``) is closed
    EARLY = 0.9
    EVIDENCE = 16  # drafting steps before it is judged at 1 + MARGIN
    FIRST_WAIT = 32
    MAX_WAIT = 512

    def __init__(self):
        self.tokens = 0.0  # exponential sums over the batch's drafting steps (each row-step's tokens, cost)
        self.cost = 0.0
        self.drafting_steps = 0  # batch steps with a drafting row since the floor last opened
        self.steps = 0  # batch steps observed
        self.established = False
        self.closed_until: int | None = None
        self.wait = self.FIRST_WAIT

    @property
    def open(self) -> bool:
        """The planner may feed drafts and masks (else plain steps only)."""
        return self.closed_until is None

    def observe(self, stats) -> None:
        """A step ran; ``stats``: the ``AcceptanceStats`` of the rows the planner served in it."""
        self.steps += 1
        if not self.open:
            if self.steps >= self.closed_until:  # explore afresh
                self.closed_until, self.tokens, self.cost, self.drafting_steps = None, 0.0, 0.0, 0
            return
        samples = [s.last_sample for s in stats if s.last_sample is not None]
        if not any(drafted for _, _, drafted in samples):
            return
        # every row of a drafting step counts, drafting or not: a row that rides along pays the width too
        self.tokens = self.DECAY * self.tokens + sum(tokens for tokens, _, _ in samples) / len(samples)
        self.cost = self.DECAY * self.cost + sum(cost for _, cost, _ in samples) / len(samples)
        self.drafting_steps += 1
        if self.drafting_steps < self.FIRST_LOOK:
            return
        if self.established:
            least = 1.0
        elif self.drafting_steps < self.EVIDENCE:
            least = self.EARLY
        else:
            least = 1.0 + self.MARGIN
        if self.tokens < least * self.cost:
            self.closed_until = (self.steps // self.wait + 2) * self.wait
            if not self.established:  # an exploration that failed: the next one waits twice as long
                self.wait = min(2 * self.wait, self.MAX_WAIT)
            self.established = False
            return
        if self.drafting_steps >= self.EVIDENCE:
            self.established = True
            if self.drafting_steps >= self.EVIDENCE + self.HALF_LIFE:
                self.wait = self.FIRST_WAIT


PROBE_SHARE = 0.025  # re-probes that find nothing may cost at most this share of decoding time


def probe_spacing(cost) -> float:
    """How much further apart than ``AcceptanceStats.probe_every`` steps re-probes go on this cost curve.

    A probe is two wider steps (one mask, then its draft), ``2·(cost(2) − 1)`` more than two plain
    steps: free on a flat curve (an accelerator), 1.4 steps' worth where two columns cost 1.7× one
    (a memory-bound CPU in float32). Spaced so that probes finding nothing never cost more than
    ``PROBE_SHARE`` of the steps between them, worthless drafts decode at stock speed everywhere.
    """
    extra = 2.0 * max(0.0, cost(2) - 1.0)
    return max(1.0, extra / (PROBE_SHARE * AcceptanceStats.FIRST_PROBE_EVERY))


class SourceStats(AcceptanceStats):
    """A draft source's acceptance per offset (prompt lookup's, a draft model's). Its prior is
    optimistic: a source is only observed when fed, and a verbatim n-gram match's continuation is
    usually the model's own on input-grounded text (a row whose lookups fail drops below the masks
    within two or three tries)."""

    PRIOR = 0.8

    def future(self) -> list[float]:
        """Offsets not yet reached lean on the first offset's estimate, not on the prior: a row whose
        lookups fail at once must not keep valuing the unobserved tail of its chains at 0.8."""
        w = self.PRIOR_WEIGHT
        first = (self.kept[0] + w * self.PRIOR) / (self.reached[0] + w)
        tail = zip(self.kept[1:], self.reached[1:])
        return [first] + [(kept + w * first) / (reached + w) for kept, reached in tail]

    def forget(self) -> None:
        """A match was found but not fed: old outcomes weigh less, the estimate drifts back to the prior.

        Why: a source is only observed when fed, so without this one failed chain (its first offset
        then estimated at 0.4, its chains worth less than their cost where extra columns are dear)
        would keep a row from ever trying it again, although the text moves on (an answer starts
        copying a passage of the input after a sentence of its own). A row re-tries after about a
        dozen declined matches; each failure costs one wide step."""
        for j in range(len(self.reached)):
            self.reached[j] *= self.DECAY
            self.kept[j] *= self.DECAY
            self.predicted[j] *= self.DECAY


@dataclass
class RowStats:
    """The planner's view of one row: its masks' acceptance, and prompt lookup's and a draft model's
    (None where the row does not use that source)."""

    masks: AcceptanceStats
    lookup: SourceStats | None = None
    assistant: SourceStats | None = None

    def of(self, source: str):
        """The statistics of a draft source other than the masks (``"lookup"`` or ``"assistant"``)."""
        return self.lookup if source == "lookup" else self.assistant
