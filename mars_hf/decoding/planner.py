"""The step planner: what each row feeds in a step, chosen for expected tokens per unit of measured cost.

``StepPlanner`` (bottom of this module) is what the decoder calls: ``plan`` gives every row its feed (the drafts
``drafts.DraftChooser`` offers, masks, layout) and the step's width; ``learn`` updates what it has observed
(``stats.py``). ``choose`` (below) is the objective it maximises.

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
planner) take part with their fixed width. The work per step is ``O(rows · W²)`` plain float
operations and one sort (no tensors: for a small model a handful of tensor ops would cost as much as
its forward).

Under all of this sits the batch's floor, plain one-column steps (:class:`DraftingFloor`): the tokens
and measured costs its drafting steps actually gave, pooled over the rows; where they do not beat
plain steps the planner feeds plain steps only, exploring again at spaced, bounded intervals.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import NamedTuple

from .cost_model import CostTable, batch_bucket, curve_key, observe, unit_due
from .cost_model import cost_table as curve_for
from .drafts import CHAINED, MASKS, NO_DRAFTS, AssistantDrafts, DraftChooser, Drafts
from .layouts import RowPlan, idle_plan, plan_row, position_limit
from .stats import AcceptanceStats, DraftingFloor, RowStats, SourceStats, probe_spacing

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


class RowChoice(NamedTuple):
    """The planner's choice for a row: ``drafts`` fed, ``masks`` per group, quadratic or linear. (A named
    tuple: every step builds one per plan a row may take, and a frozen dataclass costs several times more.)"""

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


def choose(
    specs: list[RowSpec], cost, window: int, drafting: bool = True, max_width: int | None = None
) -> tuple[int, list[RowChoice]]:
    """The step's width and each row's choice (``cost(n)``: relative cost of ``n`` columns per row).
    ``drafting=False`` (the batch's :class:`DraftingFloor` is closed): verify rows take plain steps only,
    re-probes included. ``max_width``: no plan wider (a static cache's compiled step; a plain step always fits).

    A sweep over every row's plans in order of width: at each width every row holds its best plan that
    fits (a row without one yet rules the width out), and the total value minus ``Σλ · cost(width)``
    is compared. Ties go to the narrower width, and within a row to the wider plan (a column the
    batch pays for anyway is better filled: it tells the row more about its drafts).
    """
    events = []
    for r, spec in enumerate(specs):
        events += [
            (width, r, value, choice)
            for width, value, choice in _row_plans(spec, cost, window, drafting)
            if max_width is None or width <= max_width
        ]
    events.sort(key=lambda event: event[0])
    best: list[float | None] = [None] * len(specs)
    chosen: list[RowChoice | None] = [None] * len(specs)
    missing, total = len(specs), 0.0
    gains = sum(spec.gain for spec in specs)
    top, top_width, top_choices = _NEG, 0, None
    i = 0
    while i < len(events):
        width = events[i][0]
        while i < len(events) and events[i][0] == width:
            _, r, value, choice = events[i]
            if best[r] is None:
                missing -= 1
                best[r], chosen[r], total = value, choice, total + value
            elif value >= best[r]:
                best[r], chosen[r], total = value, choice, total + value - best[r]
            i += 1
        if not missing:
            objective = total - gains * cost(width)
            if objective > top:
                top, top_width, top_choices = objective, width, list(chosen)
    return top_width, top_choices


def _row_plans(spec: RowSpec, cost, window: int, drafting: bool = True):
    """``(width, value, choice)`` of every plan the row may take (``O(W²)``, W small)."""
    if spec.kind == FIXED:
        return [(spec.base, 0.0, RowChoice())]
    if spec.kind == AUTO and not drafting:
        return [(spec.base, 1.0, RowChoice())]
    extra = max(spec.max_extra, 0)
    masks = min(spec.max_masks, window, extra)
    new = _cumulative(spec.future, masks)  # E[kept among m fresh drafts], or passes for τ rows
    if spec.kind == THRESHOLD:
        plans = [(spec.base + m, 1 + new[m], RowChoice(0, m)) for m in range(masks + 1)]
    else:
        plans = _verify_plans(spec, cost, window, extra, masks, new)
    if spec.force_masks and any(choice.masks for _, _, choice in plans):
        plans = [plan for plan in plans if plan[2].masks]
    return plans


def _verify_plans(spec: RowSpec, cost, window: int, extra: int, masks: int, new: list[float]):
    one = cost(1)
    worth, running = [], _NEG
    for m in range(masks + 1):  # H(m): the best prefix of m fresh drafts, net of checking it
        running = max(running, new[m] - spec.gain * (cost(1 + m) - one))
        worth.append(running)
    drafts = min(len(spec.draft_probs), window, extra)
    plans = []
    now, kept_all = 1.0, 1.0
    for k in range(drafts + 1):
        if k:
            kept_all *= spec.draft_probs[k - 1]
            now += kept_all
        if spec.force_drafts and k != drafts:
            continue
        base = spec.base + k
        for m in range(min(masks, extra - k) + 1):
            plans.append((base + m, now + kept_all * worth[m], RowChoice(k, m, False)))
            if k and m:
                plans.append((base + (k + 1) * m, now + worth[m], RowChoice(k, m, True)))
    return plans


def _cumulative(rates: list[float], count: int) -> list[float]:
    """``out[m] = Σ_{j≤m} Π_{i≤j} rates[i]``: expected leading successes among ``m`` checks."""
    out, reach, total = [0.0], 1.0, 0.0
    for m in range(count):
        reach *= rates[m] if m < len(rates) else 0.0
        total += reach
        out.append(total)
    return out


# --------------------------------------------------------------------------------------------------
# Planning a step
# --------------------------------------------------------------------------------------------------


@dataclass
class StepPlan:
    """One step's feed: each row's plan and the drafts it feeds, the planner's specs and choices, the step's
    width, its relative cost and the drafting floor it was planned under."""

    plans: list[RowPlan]
    fed: list[Drafts]
    specs: list[RowSpec]
    choices: list[RowChoice]
    width: int
    cost: float
    floor: DraftingFloor


def drafting_floor(memory, table, fallback: DraftingFloor, sources: frozenset = frozenset()) -> DraftingFloor:
    """The floor of a batch decoded on ``table``: one per measured curve of the caller's ``PlannerMemory`` (the
    batch size, dtype, threads and kernels it was measured for) and the draft sources the batch's rows use
    besides the masks (``sources``: prompt lookup's drafts may pay where the masks' do not), shared by every call
    and decoder given that memory, so a call starts from what earlier calls found (where drafting did not pay, a
    short call would otherwise spend its first dozen steps finding that out again). A given or flat curve
    (``mars_cost_table=``, a reproducible plan) keeps the caller's own ``fallback``."""
    key = curve_key(memory, table) if table is not None else None
    if key is None:
        return fallback
    key = (key, sources)
    if key not in memory.floors:
        memory.floors[key] = DraftingFloor()
    return memory.floors[key]


def _other_sources(stats) -> frozenset:
    """The draft sources besides the masks that any of these rows (their ``RowStats``) may feed."""
    return frozenset(
        name
        for name, used in (
            ("lookup", any(s.lookup is not None for s in stats)),
            ("assistant", any(s.assistant is not None for s in stats)),
        )
        if used
    )


class StepPlanner:
    """What every row feeds in a step (the module docstring): the drafts (``drafts.DraftChooser`` offers the
    worthiest chain), how many masks in which layout (fixed, or ``choose`` on the measured ``cost_model``
    curve), the step padded to the cheapest measured width. Learns from what rows keep; owns each row's
    statistics (``stats.RowStats``), the batch's ``DraftingFloor``, the cost curves and the plan counts.

    Args:
        model: the decoded model.
        settings: the call's ``settings.MARSDecodingSettings`` (window, mask token, layout, planner, cost table,
            cost probe, draft model's tokens).
        pad_token_id: padding of idle rows and of a draft model's batched contexts.
        assistant_model: a draft model (docs/method.md §5), or None.
    """

    def __init__(self, model, settings, *, pad_token_id: int, assistant_model=None):
        self.model = model
        self.window = settings.window
        self.mask_token_id = settings.mask_token_id
        self.pad_token_id = pad_token_id
        self.threshold_planner = settings.planner
        self.cost_given = settings.cost_table
        # the measured curves and what they taught, kept by the caller between calls (None: nothing is timed)
        self.memory = settings.cost_memory.bind(model) if settings.cost_memory is not None else None
        self.cost_tables: dict = {}  # batch bucket -> CostTable, filled at first need
        self.unknown_buckets: set[int] = set()  # buckets no curve was known for when a fixed plan asked
        self.position_limit = position_limit(model.config)
        self.max_width = None  # a static cache's widest compiled step (set by its decoder): no plan is wider
        assistant = None
        if assistant_model is not None:
            assistant = AssistantDrafts.for_target(
                model, assistant_model, settings.assistant_tokens, pad_token_id
            )
        # verify rows may also get prompt lookup's or a draft model's drafts (docs/method.md §5)
        self.drafts = DraftChooser(
            cost_table=self.cost_table, positions_left=lambda row: self._room(row)[1], assistant=assistant
        )
        self.stats: dict[int, RowStats] = {}  # row id -> what the planner has seen of the row
        self.plan_counts: dict[str, int] = {}
        self.floor = DraftingFloor()  # given curves' floor; a measured one's is the memory's (drafting_floor)
        # under a measured curve, rows start from what earlier rows of the model observed; a given or flat curve
        # (a reproducible plan) starts every row from the prior
        self.shares = settings.cost_table is None and self.memory is not None
        # The default feed, where no curve is measured or given, times nothing and is the same on every machine of a
        # kind: on a CPU (compute-bound: every column costs) the planner on an assumed curve, so masks are fed where
        # the call's own acceptance says they clearly pay; on an accelerator (small batches are memory-bound:
        # columns nearly free) the fixed linear feed. The static cache chooses its feed before this (``_static_feed``).
        assumes = self.memory is None and self.cost_given is None and model.device.type == "cpu"
        if assumes and settings.layout in (None, "auto"):
            self.cost_given = CostTable.assumed_cpu()
        chooses = self.memory is not None or self.cost_given is not None
        self.layout = settings.layout or ("auto" if chooses else "linear")

    # ------------------------------------------------------------------------------------- rows
    def add_row(self, row) -> None:
        """Start statistics for a new row (its lookup's if it uses prompt lookup, its draft model's if any)."""
        lookup = row.settings.prompt_lookup_num_tokens if row.verify else None
        assistant = self.drafts.assistant
        masks = AcceptanceStats(min(self.window, max(row.settings.max_new_tokens, 1)))
        earlier = self.memory.mask_prior if (self.shares and row.verify) else None
        if earlier is not None:
            masks.inherit(earlier)
        self.stats[row.row_id] = RowStats(
            masks,
            SourceStats(int(lookup)) if lookup else None,
            SourceStats(assistant.num_tokens) if assistant is not None else None,
        )

    def forget(self, row_id: int) -> None:
        self.stats.pop(row_id, None)

    # ------------------------------------------------------------------------------------- a step
    def plan(self, rows, deciding) -> StepPlan:
        """Each row's plan and fed drafts, the planner's specs and choices, the step's width and its relative cost.

        Rows the planner serves (verify with ``layout="auto"``, τ rows with ``planner=True``) get their feed
        from ``choose``, which needs the cost curve (measured at first need); the others keep a fixed plan and
        only set a floor on the width. When no row could feed a mask or draft nothing is measured and nothing
        padded: one-token decoding stays stock decoding, column for column. A step that carries masks runs at
        the cheapest width of a known curve at least as wide as it needs (the padding replaces a fixed
        minimum); fixed plans alone never start a probe for it (about two seconds, more than a short call of
        the paper's fixed window could ever win back by padding).
        """
        stats = [self.stats[row.row_id] for row in rows]
        offered = self.drafts.with_assistant(rows, [row.drafts for row in rows], stats, deciding)
        plans, fed, specs = self._fixed_plans_and_specs(rows, deciding, offered, stats)
        plans_steps = any(s.kind != FIXED and (s.max_masks > 0 or s.draft_probs) for s in specs)
        if not plans_steps:
            pads = any(p is not None and p.group_columns for p in plans)
            table = self.cost_table(len(rows), measure=False) if pads else None
        else:
            table = self.cost_table(len(rows))
        # the floor of the batch's curve; a step that plans nothing still counts for it
        curve = table if table is not None else self.cost_tables.get(batch_bucket(len(rows)))
        floor = drafting_floor(self.memory, curve, self.floor, _other_sources(stats))
        if not plans_steps:
            width, choices = 1, [RowChoice() for _ in rows]
        else:
            if all(spec.base <= 1 for spec in specs) and unit_due(self.memory, table, len(rows)):
                return self._unit_step(rows, deciding, plans, fed, specs, floor)
            # lookup drafts may outnumber the window: the grid then allows that many
            longest = max((len(s.draft_probs) for s in specs if s.kind == AUTO), default=0)
            # a prefill step runs eager at any width; decode steps fit the static cache's compiled step
            limit = self.max_width if all(row.prefilled for row in rows) else None
            width, choices = choose(
                specs, table.effective, max(self.window, longest), drafting=floor.open, max_width=limit
            )
        for i, (row, spec) in enumerate(zip(rows, specs)):  # the planner's rows get the plans it chose
            if spec.kind != FIXED:
                plans[i], fed[i] = self._chosen_plan(row, offered[i], choices[i])
            self._count(choices[i].kind if spec.kind != FIXED else "fixed", deciding[i])
        width = max(width, max(len(p.tokens) for p in plans))
        if table is not None and any(p.group_columns for p in plans):
            width = table.padded_width(width)
        cost = table.cost(width) if table is not None else 1.0
        return StepPlan(plans, fed, specs, choices, width, cost, floor)

    def _unit_step(self, rows, deciding, plans, fed, specs, floor) -> StepPlan:
        """A plain step for the planner's rows, to re-time one column where the planner has long run only
        wider steps (``cost_model.unit_due``); only where every row then feeds one column. Its rows learn
        nothing from it (fixed specs): a step they did not choose says nothing of their drafts or gain."""
        for i, (row, spec) in enumerate(zip(rows, specs)):
            if spec.kind != FIXED:
                plans[i], fed[i] = self._chosen_plan(row, NO_DRAFTS, RowChoice())
                specs[i] = RowSpec(FIXED, 1)
            self._count("unit", deciding[i])
        return StepPlan(plans, fed, specs, [RowChoice() for _ in rows], 1, 1.0, floor)

    def _count(self, kind: str, decides: bool) -> None:
        if decides:
            self.plan_counts[kind] = self.plan_counts.get(kind, 0) + 1

    def _fixed_plans_and_specs(self, rows, deciding, offered, stats):
        """Fixed rows' plans and fed drafts (None for the planner's rows) and every row's spec; prompt lookup's
        drafts replace the offer first where they are worth more (``offered`` is updated in place)."""
        plans, fed, specs = [], [], []
        known = self.cost_tables.get(batch_bucket(len(rows)))  # none before the first step with masks
        spacing = probe_spacing(known.effective) if known is not None else 1.0
        for i, (row, decides) in enumerate(zip(rows, deciding)):
            if decides and stats[i].lookup is not None:
                offered[i] = self.drafts.with_lookup(row, offered[i], stats[i], len(rows))
            kind = self._kind(row, offered[i]) if decides else FIXED
            if kind == FIXED:
                plan, feed = (
                    self._fixed_plan(row, offered[i])
                    if decides
                    else (idle_plan(self.pad_token_id), NO_DRAFTS)
                )
                plans.append(plan)
                fed.append(feed)
                specs.append(RowSpec(FIXED, len(plan.tokens)))
            else:
                plans.append(None)
                fed.append(None)
                specs.append(self._row_spec(row, offered[i], stats[i], kind, spacing))
        return plans, fed, specs

    def _kind(self, row, offered: Drafts) -> str:
        """Verify rows, sampled ones too, may take any feed: what they keep never depends on it (a sampled
        row's draws are keyed to its seed and positions, ``sampling.py``)."""
        if row.verify:
            return AUTO if self.layout == "auto" else FIXED
        return THRESHOLD if (self.threshold_planner and row.window and not offered) else FIXED

    def _room(self, row) -> tuple[int, int]:
        """``(masks at most, drafts + masks at most)``: the window, the tokens left (a mask past them
        predicts a token that can never be kept), and the model's positions left (masks and drafts sit
        past the real tokens; an absolute-position model must never see a position past its table)."""
        remaining = row.settings.max_new_tokens - row.generated
        extra = self.position_limit - len(row.tokens) if self.position_limit else remaining + self.window
        return max(0, min(row.window, remaining - 1, extra)), max(0, extra)

    def _fixed_plan(self, row, offered: Drafts) -> tuple[RowPlan, Drafts]:
        """The paper's feed: every draft and full groups of W masks, capped by ``_room``. A τ row's
        drafts are a draft model's (§5): a group of masks after every draft prefix."""
        max_masks, extra = self._room(row)
        feed = offered.first(extra)
        masks = min(max_masks, extra - len(feed))
        if row.verify:
            layout = self.layout if self.layout != "auto" else "linear"
        else:
            layout = "quadratic" if feed else "linear"
        return self._row_plan(row, feed, masks, layout), feed

    def _row_spec(self, row, offered: Drafts, stats: RowStats, kind, spacing: float) -> RowSpec:
        max_masks, extra = self._room(row)
        masks = stats.masks
        if masks.probing and not offered:
            masks.probing = False  # the probe proposed nothing (a floor, a stop): nothing to check
        return RowSpec(
            kind,
            base=len(row.tokens) - row.committed + (0 if row.prefilled else row.lead),
            draft_probs=self.drafts.draft_probs(offered, stats, row.do_sample) if kind == AUTO else [],
            future=masks.future(),
            gain=max(1.0, masks.gain),
            max_masks=max_masks,
            max_extra=extra,
            force_masks=masks.probe_due(spacing),
            force_drafts=masks.probing and bool(offered),
        )

    def _chosen_plan(self, row, offered: Drafts, choice: RowChoice) -> tuple[RowPlan, Drafts]:
        feed = offered.first(choice.drafts)
        return self._row_plan(row, feed, choice.masks, "quadratic" if choice.quadratic else "linear"), feed

    def _row_plan(self, row, feed: Drafts, masks: int, layout: str) -> RowPlan:
        return plan_row(
            row.tokens[row.committed :],
            list(feed.tokens),  # a τ row's are a draft model's (§5)
            masks,
            self.mask_token_id,
            layout,
            lead=0 if row.prefilled else row.lead,
            pad_token_id=self.pad_token_id,
        )

    # ------------------------------------------------------------------------------------- learning
    def learn(self, rows, plan: StepPlan, decisions: dict, proposed: dict) -> None:
        """Update the planner's view of each row it served: acceptance per offset, gain, re-probes (prompt
        lookup's and a draft model's acceptance apart from the masks', whatever the layout). ``decisions``:
        ``acceptance.Decision`` per deciding row; ``proposed``: the mask drafts each row now holds."""
        served = []
        for i, (row, spec, choice) in enumerate(zip(rows, plan.specs, plan.choices)):
            if i not in decisions:
                continue
            stats, fed, decision = self.stats[row.row_id], plan.fed[i], decisions[i]
            if fed.source != MASKS:
                stats.of(fed.source).observe(*self.drafts.source_outcome(fed, decision.drafts_kept))
            if spec.kind == FIXED:
                continue
            masks = stats.masks
            if spec.kind == AUTO:
                served.append(masks)
                if self.shares:
                    self.memory.mask_prior = masks
                confidence = list(fed.confidence)
                if fed.source == MASKS:  # the other sources' acceptance was counted above
                    masks.observe(choice.drafts, decision.drafts_kept, confidence)
                elif fed.source == CHAINED:  # its mask drafts, as the masks' own
                    head = len(confidence)
                    masks.observe(min(choice.drafts, head), min(decision.drafts_kept, head), confidence)
                fresh = proposed.get(i)
                if choice.masks and fresh and not row.do_sample:
                    # what this step's masks proposed values fresh drafts, checked or not (greedy only:
                    # sampled drafts are valued by their observed acceptance, ``DraftChooser.draft_probs``)
                    masks.propose(list(fresh.confidence))
            else:  # τ rows: how many mask predictions passed τ
                masks.observe(choice.masks, max(len(decision.tokens) - 1, 0))
            if spec.force_drafts:
                masks.probing = False
            elif spec.force_masks and choice.masks:
                masks.start_probe()
            forced = spec.force_masks or spec.force_drafts
            masks.observe_step(len(decision.tokens), plan.cost, fed_masks=choice.masks > 0, forced=forced)
        plan.floor.observe(served)

    # ------------------------------------------------------------------------------------- cost curves
    def measure_costs(self, max_rows: int) -> None:
        """Measure the cost curves of every batch bucket up to ``max_rows`` now (a server at start-up),
        instead of at the first step that needs each (about 2 s at most per bucket, once per memory)."""
        for rows in sorted({batch_bucket(n) for n in range(1, max_rows + 1)}):
            self.cost_table(rows)

    def observe_forward(self, rows: int, width: int, seconds: float) -> None:
        """A decode step of ``rows`` rows ran ``width`` columns in ``seconds``: the batch's measured curve
        learns from it (``cost_model.observe``), once one is in use."""
        bucket = batch_bucket(rows)
        table = self.cost_tables.get(bucket)
        if table is not None:
            self.cost_tables[bucket] = observe(self.memory, table, width, seconds, rows)

    def cost_table(self, rows: int, measure: bool = True):
        """The cost curve of a batch of ``rows`` rows (its bucket's), measured or read at first need
        (``measure=False``: only one already known to the memory or on disk, else None).

        A bucket smaller than one already in use is reached as rows finish: it is not measured then (a
        probe of about two seconds in the middle of a call, once per bucket, where a batch of four decodes
        64 tokens in four seconds on a 2-core CPU). It takes the memory's curve if one is known, else
        borrows the smallest larger bucket's (a batch's curve is steeper than a smaller batch's, so the
        tail of the call feeds no more than pays); a later call that *starts* at that size measures it.
        """
        bucket = batch_bucket(rows)
        table = self.cost_tables.get(bucket)
        if table is None and (measure or bucket not in self.unknown_buckets):
            larger = [b for b in self.cost_tables if b > bucket]
            table = curve_for(
                self.model,
                batch_size=rows,
                window=self.window,
                mask_token_id=self.mask_token_id,
                given=self.cost_given,
                memory=self.memory,
                known_only=bool(larger) or not measure,
            )
            if table is None and larger:
                lender = self.cost_tables[min(larger)]
                table = replace(lender, source="borrowed", batch=bucket)
            if table is None:
                self.unknown_buckets.add(bucket)  # asked again only by a step that measures
            else:
                self.cost_tables[bucket] = table
        return table
