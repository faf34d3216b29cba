"""What each row feeds in a MARS step, and the step's width (docs/method.md §4-§6).

``StepFeed.plan`` gives every row its ``layouts.RowPlan``: which drafts it checks (the masks', prompt
lookup's, a draft model's, or the masks' continued by a draft model: whichever chain is worth more),
how many masks in which layout (fixed, or chosen by ``planner.choose`` from the measured
``cost_model`` curve), and pads the step to the cheapest measured width. ``StepFeed.learn`` then
updates each row's acceptance statistics from what it kept.

This file depends on torch and transformers only (it ships in a checkpoint's ``custom_generate/``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .cost_model import batch_bucket, observe
from .cost_model import cost_table as curve_for
from .draft_sources import ASSISTANT, CHAINED, LOOKUP, MASKS, lookup_drafts
from .layouts import RowPlan, idle_plan, plan_row, position_limit
from .planner import AUTO, FIXED, THRESHOLD, RowChoice, RowSpec, choose, probe_spacing
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
        self.position_limit = position_limit(model.config)
        self.assistant = assistant_model  # verify rows also get a draft model's drafts (docs/method.md §5)
        self.assistant_tokens = int(assistant_tokens)
        self.plan_counts: dict[str, int] = {}

    def plan(self, rows, deciding) -> StepPlan:
        """Each row's plan, the planner's specs and choices, the step's width and its relative cost.

        Rows the planner serves (verify with ``layout="auto"``, τ rows with ``planner=True``) get their
        feed from ``planner.choose``; the others keep a fixed plan and only set a floor on the width.
        When no row could feed a mask or draft nothing is measured and nothing padded: one-token
        decoding stays stock decoding, column for column. A step that carries masks runs at the
        cheapest measured width at least as wide as it needs (the padding replaces a fixed minimum).
        """
        if self.assistant is not None:
            assisted = [r for r, d in zip(rows, deciding) if d and r.assistant_stats is not None]
            self._assistant_drafts(assisted, len(rows))
        plans, specs = self._fixed_plans_and_specs(rows, deciding)
        wants_table = any(s.kind != FIXED and (s.max_masks > 0 or s.draft_probs) for s in specs) or any(
            p is not None and p.group_columns for p in plans
        )
        if not wants_table:
            choices = [RowChoice() for _ in rows]
            width, table = 1, None
        else:
            table = self.cost_table(len(rows))
            # lookup drafts may outnumber the window: the grid then allows that many
            longest = max((len(s.draft_probs) for s in specs if s.kind == AUTO), default=0)
            width, choices = choose(specs, table.effective, max(self.window, longest))
        self._apply_choices(rows, deciding, plans, specs, choices)
        width = max(width, max(len(p.tokens) for p in plans))
        if table is not None and any(p.group_columns for p in plans):
            width = table.padded_width(width)
        cost = table.cost(width) if table is not None else 1.0
        return StepPlan(plans, specs, choices, width, cost)

    def _fixed_plans_and_specs(self, rows, deciding):
        """Fixed rows' plans (None for the planner's rows) and every row's spec; prompt lookup's drafts
        replace the masks' first where they are worth more."""
        plans, specs = [], []
        known = self.cost_tables.get(batch_bucket(len(rows)))  # none before the first step with masks
        spacing = probe_spacing(known.effective) if known is not None else 1.0
        for row, decides in zip(rows, deciding):
            if decides and row.lookup_stats is not None:
                self._pick_drafts(row, len(rows))
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
        """A row with its own seed keeps a fixed feed: the planner fills a row up to the batch's width,
        so its draws would depend on its companions (their distribution would not)."""
        if row.verify:
            return AUTO if (self.layout == "auto" and row.generator is None) else FIXED
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
        self._keep_drafts(row, min(len(row.drafts), extra))
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
            draft_probs=self._draft_probs(row) if kind == AUTO else [],
            future=stats.future(),
            gain=max(1.0, stats.gain),
            max_masks=max_masks,
            max_extra=extra,
            force_masks=stats.probe_due(spacing),
            force_drafts=stats.probing and bool(row.drafts),
        )

    @staticmethod
    def _draft_probs(row) -> list[float]:
        """Chance that each draft in hand is kept given the ones before it. Prompt lookup's: its
        observed acceptance per offset. Sampled mask drafts: the masks' observed acceptance, not the
        drafts' own probabilities (feeding a sampled draft because of its value would bias the output)."""
        if row.draft_source == CHAINED:  # mask drafts (calibrated), then the draft model's (observed)
            follow = row.assistant_stats.future()[: len(row.drafts) - len(row.draft_confidence)]
            return row.stats.calibrated(row.draft_confidence) + follow
        if row.draft_source != MASKS:
            return row.source_stats(row.draft_source).future()[: len(row.drafts)]
        if row.do_sample:
            return row.stats.future()[: len(row.drafts)]
        return row.stats.calibrated(row.draft_confidence[: len(row.drafts)])

    def _pick_drafts(self, row, batch: int) -> None:
        """Prompt lookup's drafts replace the masks' when their chain is worth more: expected drafts
        kept (from the row's observed acceptance per source) less what checking them costs, at the
        best length (``_draft_value``); a re-probe of the masks keeps theirs. The choice never reads a
        sampled draft's value, so sampling stays exact."""
        if not row.prefilled or (row.stats.probing and row.drafts):
            # the prompt's last n-gram is its end (a chat template's assistant header), whose earlier
            # occurrences continue into another turn: a first lookup there fails and would cost the
            # source its prior
            return
        room = self._draft_room(row)
        if room <= 0:
            return
        found = lookup_drafts(
            row.tokens, row.settings.prompt_lookup_num_tokens, row.settings.max_matching_ngram_size, row.eos
        )[:room]
        if not found:
            return
        table = self.cost_table(batch)
        mine = self._draft_value(row, row.lookup_stats.future()[: len(found)], table)
        if mine > self._held_value(row, table):
            row.drafts, row.draft_confidence, row.proposal, row.draft_source = found, [], None, LOOKUP
        else:
            row.lookup_stats.forget()

    @torch.no_grad()
    def _assistant_drafts(self, rows, batch: int) -> None:
        """docs/method.md §5: a draft model continues each row (one batched stock ``generate`` call,
        left-padded). Per row, before anything is drawn, the proposals are valued as the planner values
        drafts (``_draft_value``: expected drafts kept, less λ × the extra cost of their columns):

        - the masks' drafts alone (what the row holds from the last step);
        - the draft model's ``assistant_tokens`` tokens after the row's tokens (*plain*);
        - greedy rows only: the first ``j`` mask drafts, then the draft model's tokens after the row's
          tokens *and* those ``j`` drafts (*chained*, for the best ``j``): the mask drafts' calibrated
          probabilities value the first part, the draft model's observed acceptance the rest, reached
          only if every mask draft before it is kept.

        The draft model runs only for rows where its proposal is worth more than the masks' drafts
        alone. Greedy rows compare again once the tokens are known (an EOS shortens a chain);
        sampled rows take what was chosen (only plain drafts, with their distributions as q): the
        choice never reads a sampled draft, so speculative sampling stays exact. The planner then
        feeds a prefix of the chosen drafts with mask groups after them (quadratic: fresh mask
        drafts after whatever prefix is kept)."""
        eligible = [r for r in rows if not (r.stats.probing and r.drafts)]  # a re-probe keeps the masks'
        if not eligible:
            return
        # τ rows take the paper's k drafts without valuing them: no cost curve needed for them alone
        table = self.cost_table(batch) if any(r.verify for r in eligible) else None
        for do_sample in (False, True):
            picked = []
            for row in eligible:
                if row.do_sample == do_sample:
                    option = self._assistant_option(row, table)
                    if option is not None:
                        picked.append((row, option))
            if not picked:
                continue
            contexts = [row.tokens + row.drafts[:head] for row, (head, _) in picked]
            out, longest = self._assistant_generate(contexts, do_sample)
            new = out.sequences[:, longest:].tolist()
            for b, (row, (head, count)) in enumerate(picked):
                scores = out.scores if do_sample else None
                self._offer_assistant_drafts(row, head, new[b][:count], scores, b, table)

    def _assistant_option(self, row, table) -> tuple[int, int] | None:
        """``(head, count)``: the draft model's ``count`` tokens after the row's first ``head`` mask drafts
        (``head = 0``: plain), whichever chain is worth most, or None when the masks' drafts alone (or no
        drafts) are worth as much. Reads the row's statistics only, never a draft's value."""
        room = self._draft_room(row)
        if room <= 0:
            return None
        if not row.verify:  # τ (docs/method.md §5): the paper's fixed k drafts, whatever the machine
            return 0, min(self.assistant_tokens, room)
        follow = row.assistant_stats.future()
        masks = self._draft_probs(row) if row.drafts else []
        best, option = self._held_value(row, table, masks), None
        heads = 0 if row.do_sample else self._chainable(row, room)
        for head in range(heads + 1):
            count = min(self.assistant_tokens, room - head)
            if count <= 0:
                break
            value = self._draft_value(row, masks[:head] + follow[:count], table)
            if value > best:
                best, option = value, (head, count)
        return option

    def _draft_room(self, row) -> int:
        """Drafts a row may check this step: the tokens left but one (the step's own token), and its
        positions left."""
        return min(row.settings.max_new_tokens - row.generated - 1, self._room(row)[1])

    @staticmethod
    def _chainable(row, room: int) -> int:
        """Mask drafts the draft model may continue after: those before the first EOS (nothing follows a
        kept EOS), leaving room for at least one of its tokens."""
        usable = len(row.drafts)
        for j, token in enumerate(row.drafts):
            if token in row.eos:
                usable = j
                break
        return max(0, min(usable, room - 1))

    def _assistant_generate(self, contexts, do_sample: bool):
        """The draft model's stock ``generate`` after each context (a token list), left-padded; and the
        padded length."""
        longest = max(len(c) for c in contexts)
        pad = self.pad_token_id
        ids = torch.tensor([[pad] * (longest - len(c)) + c for c in contexts], device=self.device)
        mask = torch.tensor([[0] * (longest - len(c)) + [1] * len(c) for c in contexts], device=self.device)
        sampling = {"top_k": 0, "top_p": 1.0, "temperature": 1.0} if do_sample else {}
        out = self.assistant.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=self.assistant_tokens,
            min_new_tokens=0,
            do_sample=do_sample,
            pad_token_id=pad,
            eos_token_id=None,  # every row proposes its tokens; verify stops at an EOS it keeps
            return_dict_in_generate=True,
            output_scores=do_sample,
            **sampling,
        )
        return out, longest

    def _offer_assistant_drafts(self, row, head: int, drafts, scores, b: int, table) -> None:
        """Row ``b`` of the draft model's output (cut after an EOS), after the row's first ``head`` mask
        drafts, becomes the row's drafts (a greedy row checks first that the chain, shortened by an EOS,
        is still worth more than the masks' drafts alone)."""
        for j, token in enumerate(drafts):
            if token in row.eos:
                drafts = drafts[: j + 1]
                break
        if not drafts:
            return
        if row.verify and not row.do_sample:
            masks = self._draft_probs(row) if row.drafts else []
            follow = row.assistant_stats.future()[: len(drafts)]
            value = self._draft_value(row, masks[:head] + follow, table)
            if value <= self._held_value(row, table, masks):
                return
        proposal = None
        if scores is not None:
            proposal = torch.stack([torch.softmax(scores[j][b].float(), -1) for j in range(len(drafts))]).to(
                self.device
            )
        if head:  # the mask drafts keep their confidences: they say where the draft model's part starts
            row.drafts, row.draft_confidence = row.drafts[:head] + drafts, row.draft_confidence[:head]
            row.proposal, row.draft_source = None, CHAINED
        else:
            row.drafts, row.draft_confidence, row.proposal = drafts, [], proposal
            row.draft_source = ASSISTANT

    @staticmethod
    def _source_outcome(source: str, checked: int, kept: int, fed_confidence) -> tuple[int, int]:
        """``(checked, kept)`` of a draft source's own part of the chain a row checked: all of it, but for
        a chained proposal only the draft model's tokens after the mask drafts (``fed_confidence``, one
        confidence per mask draft), reached only when every mask draft was kept."""
        if source != CHAINED:
            return checked, kept
        head = len(fed_confidence)
        if kept < head:
            return 0, 0
        return checked - head, kept - head

    def _held_value(self, row, table, probs=None) -> float:
        """What the drafts a row holds (the masks' from the last step) are worth fed alone (0: none);
        ``probs``: their ``_draft_probs`` when the caller has them already."""
        if not row.drafts:
            return 0.0
        return self._draft_value(row, self._draft_probs(row) if probs is None else probs, table)

    @staticmethod
    def _draft_value(row, probs, table) -> float:
        """``max_k [E[kept among the first k drafts] − λ·(cost(base + k) − cost(base))]`` (k = 0: 0):
        what feeding a chain of drafts alone is worth this step (the planner's objective, no masks)."""
        base = len(row.tokens) - row.committed + (0 if row.prefilled else row.lead)
        gain, start = max(1.0, row.stats.gain), table.effective(base)
        best, chain, reach = 0.0, 0.0, 1.0
        for k, p in enumerate(probs, 1):
            reach *= p
            chain += reach
            best = max(best, chain - gain * (table.effective(base + k) - start))
        return best

    def _chosen_plan(self, row, choice: RowChoice):
        self._keep_drafts(row, choice.drafts)
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

    @staticmethod
    def _keep_drafts(row, count: int) -> None:
        """Feed only the first ``count`` drafts (the rest are proposals nobody checks: dropping them
        never changes what verify keeps, only how much it can keep)."""
        if count < len(row.drafts):
            if row.draft_source == CHAINED and count <= len(row.draft_confidence):
                row.draft_source = MASKS  # only mask drafts of a chained proposal are fed
            row.drafts = row.drafts[:count]
            row.draft_confidence = row.draft_confidence[:count]
            row.proposal = row.proposal[:count] if row.proposal is not None else None

    def learn(self, rows, specs, choices, outcome, fed_confidence, cost: float, checked, sources) -> None:
        """Update the planner's view of each row it served: acceptance per offset, gain, re-probes
        (prompt lookup's acceptance apart from the masks', whatever the layout)."""
        for i, (row, spec, choice) in enumerate(zip(rows, specs, choices)):
            if i in outcome and sources[i] != MASKS:
                row.source_stats(sources[i]).observe(
                    *self._source_outcome(sources[i], checked[i], outcome[i][2], fed_confidence[i])
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
                    # a sampled draft's own probability must not steer whether it is fed)
                    stats.propose(row.draft_confidence)
            else:  # τ rows: how many mask predictions passed τ
                stats.observe(choice.masks, max(len(tokens) - 1, 0))
            if spec.force_drafts:
                stats.probing = False
            elif spec.force_masks and choice.masks:
                stats.probing = True
            stats.observe_step(len(tokens), cost, fed_masks=choice.masks > 0)

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
            self.cost_tables[bucket] = observe(self.model, table, width, seconds)

    def cost_table(self, rows: int):
        """The cost curve of a batch of ``rows`` rows (its bucket's), measured or read at first need."""
        bucket = batch_bucket(rows)
        table = self.cost_tables.get(bucket)
        if table is None:
            table = curve_for(
                self.model,
                batch_size=rows,
                window=self.window,
                mask_token_id=self.mask_token_id,
                given=self.cost_given,
                probe=self.cost_probe,
            )
            self.cost_tables[bucket] = table
        return table
