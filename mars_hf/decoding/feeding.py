"""What each row feeds in a MARS step, and the step's width (docs/method.md §4-§6).

``StepFeed.plan`` gives every row its ``layouts.RowPlan``: which drafts it checks (chosen by
``draft_choice.DraftChooser``: the masks', prompt lookup's, a draft model's, or the masks' continued
by a draft model, whichever chain is worth more), how many masks in which layout (fixed, or chosen by
``planner.choose`` from the measured ``cost_model`` curve), and pads the step to the cheapest measured
width. ``StepFeed.learn`` then updates each row's acceptance statistics from what it kept.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .cost_model import batch_bucket, observe, unit_due
from .cost_model import cost_table as curve_for
from .draft_choice import DraftChooser
from .draft_sources import CHAINED, MASKS
from .layouts import RowPlan, idle_plan, plan_row, position_limit
from .planner import AUTO, FIXED, THRESHOLD, DraftingFloor, RowChoice, RowSpec, choose, probe_spacing
from .settings import check_cost_table, check_layout


@dataclass
class StepPlan:
    """One step's feed: each row's plan, the planner's specs and choices, the width and its relative cost."""

    plans: list[RowPlan]
    specs: list[RowSpec]
    choices: list[RowChoice]
    width: int
    cost: float


class StepFeed:
    """Chooses what rows feed (see the module docstring); keeps the cost curves and the plan counts.

    Args: as ``MARSBatchDecoder``'s (``layout``, ``planner``, ``cost_table``, ``cost_probe``,
    ``assistant_model``, ``assistant_tokens``).
    """

    def __init__(
        self,
        model,
        *,
        window: int,
        mask_token_id: int,
        pad_token_id: int,
        layout: str | None = None,
        planner: bool = False,
        cost_table: dict | None = None,
        cost_probe: bool = True,
        assistant_model=None,
        assistant_tokens: int = 5,
    ):
        self.model = model
        self.device = model.device
        self.window = window
        self.mask_token_id = mask_token_id
        self.pad_token_id = pad_token_id
        check_layout(layout)
        self.layout = layout or "auto"
        self.threshold_planner = bool(planner)
        check_cost_table(cost_table)  # a malformed table fails here, naming the keyword
        self.cost_given, self.cost_probe = cost_table, bool(cost_probe)
        self.cost_tables: dict = {}  # batch bucket -> CostTable, filled at first need
        self.unknown_buckets: set[int] = set()  # buckets no curve was known for when a fixed plan asked
        self.position_limit = position_limit(model.config)
        # verify rows may also get prompt lookup's or a draft model's drafts (docs/method.md §5)
        self.drafts = DraftChooser(
            cost_table=self.cost_table,
            positions_left=lambda row: self._room(row)[1],
            device=self.device,
            assistant_model=assistant_model,
            assistant_tokens=assistant_tokens,
            pad_token_id=pad_token_id,
        )
        self.plan_counts: dict[str, int] = {}
        self.floor = DraftingFloor()  # plain steps whenever this batch's drafting stops paying (planner.py)

    def plan(self, rows, deciding) -> StepPlan:
        """Each row's plan, the planner's specs and choices, the step's width and its relative cost.

        Rows the planner serves (verify with ``layout="auto"``, τ rows with ``planner=True``) get their
        feed from ``planner.choose``, which needs the cost curve (measured at first need); the others keep
        a fixed plan and only set a floor on the width. When no row could feed a mask or draft nothing is
        measured and nothing padded: one-token decoding stays stock decoding, column for column. A step
        that carries masks runs at the cheapest width of a known curve at least as wide as it needs (the
        padding replaces a fixed minimum); fixed plans alone never start a probe for it (about two
        seconds, more than a short call of the paper's fixed window could ever win back by padding).
        """
        self.drafts.from_assistant(rows, deciding)
        plans, specs = self._fixed_plans_and_specs(rows, deciding)
        plans_steps = any(s.kind != FIXED and (s.max_masks > 0 or s.draft_probs) for s in specs)
        if not plans_steps:
            choices = [RowChoice() for _ in rows]
            width = 1
            pads = any(p is not None and p.group_columns for p in plans)
            table = self.cost_table(len(rows), measure=False) if pads else None
        else:
            table = self.cost_table(len(rows))
            if all(spec.base <= 1 for spec in specs) and unit_due(self.model, table, len(rows)):
                return self._unit_step(rows, deciding, plans, specs)
            # lookup drafts may outnumber the window: the grid then allows that many
            longest = max((len(s.draft_probs) for s in specs if s.kind == AUTO), default=0)
            width, choices = choose(specs, table.effective, max(self.window, longest), drafting=self.floor.open)
        self._apply_choices(rows, deciding, plans, specs, choices)
        width = max(width, max(len(p.tokens) for p in plans))
        if table is not None and any(p.group_columns for p in plans):
            width = table.padded_width(width)
        cost = table.cost(width) if table is not None else 1.0
        return StepPlan(plans, specs, choices, width, cost)

    def _unit_step(self, rows, deciding, plans, specs) -> StepPlan:
        """A plain step for the planner's rows, to re-time one column where the planner has long run only
        wider steps (``cost_model.unit_due``); only where every row then feeds one column. Its rows learn
        nothing from it (fixed specs): a step they did not choose says nothing of their drafts or gain."""
        for i, (row, spec) in enumerate(zip(rows, specs)):
            if spec.kind != FIXED:
                plans[i] = self._chosen_plan(row, RowChoice())
                specs[i] = RowSpec(FIXED, 1)
            if deciding[i]:
                self.plan_counts["unit"] = self.plan_counts.get("unit", 0) + 1
        return StepPlan(plans, specs, [RowChoice() for _ in rows], 1, 1.0)

    def _fixed_plans_and_specs(self, rows, deciding):
        """Fixed rows' plans (None for the planner's rows) and every row's spec; prompt lookup's drafts
        replace the masks' first where they are worth more."""
        plans, specs = [], []
        known = self.cost_tables.get(batch_bucket(len(rows)))  # none before the first step with masks
        spacing = probe_spacing(known.effective) if known is not None else 1.0
        for row, decides in zip(rows, deciding):
            if decides and row.lookup_stats is not None:
                self.drafts.pick_lookup(row, len(rows))
            kind = self._kind(row) if decides else FIXED
            if kind == FIXED:
                plan = self._fixed_plan(row) if decides else idle_plan(self.pad_token_id)
                plans.append(plan)
                specs.append(RowSpec(FIXED, len(plan.tokens)))
            else:
                plans.append(None)
                specs.append(self._row_spec(row, kind, spacing))
        return plans, specs

    def _apply_choices(self, rows, deciding, plans, specs, choices) -> None:
        """The planner's rows get the plans it chose; every deciding row's kind is counted."""
        for i, (row, spec) in enumerate(zip(rows, specs)):
            if spec.kind != FIXED:
                plans[i] = self._chosen_plan(row, choices[i])
                kind = choices[i].kind
            else:
                kind = "fixed" if deciding[i] else None
            if kind is not None:
                self.plan_counts[kind] = self.plan_counts.get(kind, 0) + 1

    def _kind(self, row) -> str:
        """Verify rows, sampled ones too, may take any feed: what they keep never depends on it (a sampled
        row's draws are keyed to its seed and positions, ``sampling.py``)."""
        if row.verify:
            return AUTO if self.layout == "auto" else FIXED
        return THRESHOLD if (self.threshold_planner and row.window and not row.drafts) else FIXED

    def _room(self, row) -> tuple[int, int]:
        """``(masks at most, drafts + masks at most)``: the window, the tokens left (a mask past them
        predicts a token that can never be kept), and the model's positions left (masks and drafts sit
        past the real tokens; an absolute-position model must never see a position past its table)."""
        remaining = row.settings.max_new_tokens - row.generated
        extra = self.position_limit - len(row.tokens) if self.position_limit else remaining + self.window
        return max(0, min(row.window, remaining - 1, extra)), max(0, extra)

    def _fixed_plan(self, row):
        """The paper's feed: every draft and full groups of W masks, capped by ``_room``. A τ row's
        drafts are a draft model's (§5): a group of masks after every draft prefix."""
        max_masks, extra = self._room(row)
        self.drafts.keep(row, min(len(row.drafts), extra))
        masks = min(max_masks, extra - len(row.drafts))
        if row.verify:
            layout = self.layout if self.layout != "auto" else "linear"
        else:
            layout = "quadratic" if row.drafts else "linear"
        return self._row_plan(row, masks, layout)

    def _row_spec(self, row, kind, spacing: float) -> RowSpec:
        max_masks, extra = self._room(row)
        stats = row.stats
        if stats.probing and not row.drafts:
            stats.probing = False  # the probe proposed nothing (a floor, a stop): nothing to check
        return RowSpec(
            kind,
            base=len(row.tokens) - row.committed + (0 if row.prefilled else row.lead),
            draft_probs=self.drafts.draft_probs(row) if kind == AUTO else [],
            future=stats.future(),
            gain=max(1.0, stats.gain),
            max_masks=max_masks,
            max_extra=extra,
            force_masks=stats.probe_due(spacing),
            force_drafts=stats.probing and bool(row.drafts),
        )

    def _chosen_plan(self, row, choice: RowChoice):
        self.drafts.keep(row, choice.drafts)
        return self._row_plan(row, choice.masks, "quadratic" if choice.quadratic else "linear")

    def _row_plan(self, row, masks: int, layout: str):
        return plan_row(
            row.tokens[row.committed :],
            row.drafts,  # a τ row's are a draft model's (§5), else it has none
            masks,
            self.mask_token_id,
            layout,
            lead=0 if row.prefilled else row.lead,
            pad_token_id=self.pad_token_id,
        )

    def learn(self, rows, specs, choices, outcome, fed_confidence, cost: float, checked, sources) -> None:
        """Update the planner's view of each row it served: acceptance per offset, gain, re-probes
        (prompt lookup's acceptance apart from the masks', whatever the layout)."""
        for i, (row, spec, choice) in enumerate(zip(rows, specs, choices)):
            if i in outcome and sources[i] != MASKS:
                row.source_stats(sources[i]).observe(
                    *self.drafts.source_outcome(sources[i], checked[i], outcome[i][2], fed_confidence[i])
                )
            if spec.kind == FIXED or i not in outcome:
                continue
            tokens, _, kept_drafts, _ = outcome[i]
            stats = row.stats
            if spec.kind == AUTO:
                if sources[i] == MASKS:  # the other sources' acceptance was counted above
                    stats.observe(choice.drafts, kept_drafts, fed_confidence[i])
                elif sources[i] == CHAINED:  # its mask drafts, as the masks' own
                    head = len(fed_confidence[i])
                    stats.observe(min(choice.drafts, head), min(kept_drafts, head), fed_confidence[i])
                if choice.masks and row.draft_confidence and not row.do_sample:
                    # what this step's masks proposed values fresh drafts, checked or not (greedy only:
                    # sampled drafts are valued by their observed acceptance, ``DraftChooser.draft_probs``)
                    stats.propose(row.draft_confidence)
            else:  # τ rows: how many mask predictions passed τ
                stats.observe(choice.masks, max(len(tokens) - 1, 0))
            if spec.force_drafts:
                stats.probing = False
            elif spec.force_masks and choice.masks:
                stats.start_probe()
            forced = spec.force_masks or spec.force_drafts
            stats.observe_step(len(tokens), cost, fed_masks=choice.masks > 0, forced=forced)
        served = [row.stats for i, (row, spec) in enumerate(zip(rows, specs)) if spec.kind == AUTO and i in outcome]
        self.floor.observe(served)

    def measure_costs(self, max_rows: int) -> None:
        """Measure the cost curves of every batch bucket up to ``max_rows`` now (a server at start-up),
        instead of at the first step that needs each (about 2 s at most per bucket, once per process)."""
        for rows in sorted({batch_bucket(n) for n in range(1, max_rows + 1)}):
            self.cost_table(rows)

    def observe_forward(self, rows: int, width: int, seconds: float) -> None:
        """A decode step of ``rows`` rows ran ``width`` columns in ``seconds``: the batch's measured curve
        learns from it (``cost_model.observe``), once one is in use."""
        bucket = batch_bucket(rows)
        table = self.cost_tables.get(bucket)
        if table is not None:
            self.cost_tables[bucket] = observe(self.model, table, width, seconds, rows)

    def cost_table(self, rows: int, measure: bool = True):
        """The cost curve of a batch of ``rows`` rows (its bucket's), measured or read at first need
        (``measure=False``: only one already known to the process or on disk, else None).

        A bucket smaller than one already in use is reached as rows finish: it is not measured then (a
        probe of about two seconds in the middle of a call, once per bucket, where a batch of four decodes
        64 tokens in four seconds on a 2-core CPU). It takes the process's curve if one is known, else
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
                probe=self.cost_probe,
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
