"""`MARSBatchDecoder`: rows advanced one MARS step at a time; rows join and leave between steps.

One verify step, from ``generate`` to the kept tokens, runs through five modules:

1. ``generation``: ``generate`` resolves the call's ``MARSDecodingSettings`` once and hands them whole to a
   decoder, adds one row per prompt and calls ``step`` until every row has ended;
2. ``decoder`` (here): owns every row's state; ``step`` asks the planner for the step's feed, runs the
   forward, asks the acceptance rules what each row keeps and applies it;
3. ``planner``: what each row feeds (``StepPlanner.plan``): which drafts (offered by ``drafts``), how many
   masks in which layout, the step's width; it learns from what rows kept;
4. ``drafts``: immutable ``Drafts`` and their sources (the masks', prompt lookup's, a draft model's);
5. ``acceptance``: pure rules (``decide``): from the forward's logits and the fed drafts, each row's
   ``Decision`` (tokens kept, drafts kept, whether its mask group proposes the next drafts).

Helpers they call hold no decisions: ``layouts`` (a plan as columns, and packing a step's tensors),
``cost_model`` (the measured cost curve), ``memory`` (the caller's ``PlannerMemory``: measured curves and what
the planner learnt, kept between calls), ``stats`` (what the planner has observed), ``sampling`` (keyed
noise), ``rules`` (the rules' primitives), ``processing`` (the logits processors at provisional prefixes),
``cache`` (the KV store and commit schemes), ``calibration`` (confidence maps), ``settings``.

A server drives the decoder directly (``add_row`` / ``step`` / ``drop_row``). Live rows occupy KV slots
``0 … n-1``: a row that leaves is replaced by the last one (one row copy), so memory is bounded by
``max_rows`` and reused.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from .acceptance import ScoreProcessing, StepLogits, decide, one_token_per_step
from .cache import MARSBlockCache, MARSStaticCache, make_scheme
from .calibration import calibration_for
from .cpu_kernels import packed_linears
from .drafts import MASKS, NO_DRAFTS, Drafts, MaskDrafts
from .gated_lora import mask_gate, masks_absent
from .layouts import pack
from .planner import StepPlan, StepPlanner
from .sampling import RowNoise, draw_seed
from .settings import MARSDecodingSettings, check_choice, check_draft_count

__all__ = ["MARSBatchDecoder", "RowSettings", "RowUpdate"]

logger = logging.getLogger(__name__)

# The cache is sized for the prompt, the new tokens and one step's columns; a step wider than this
# (a huge W with the quadratic layout) grows it geometrically instead of allocating W² up front.
_STEP_CAPACITY = 256


@dataclass
class RowSettings:
    """How one row decodes.

    Args:
        threshold: τ for threshold acceptance (``>= 1`` with probability/margin: one token per step).
            With ``acceptance="verify"``: a proposal floor, masks below it are not proposed (default 0).
        acceptance: ``"probability"``, ``"entropy"``, ``"margin"`` or ``"verify"``.
        max_new_tokens: tokens to generate at most.
        eos_token_ids: tokens that end the row (kept in the output).
        do_sample / temperature / top_k / top_p: sampling, as in ``GenerationConfig``; ignored when
            ``logits_processor`` is given.
        logits_processor: processors for this row alone (position-free ones only; a server's rows).
        seed / row_key: a sampled row's randomness: the token at position ``t`` of the row (prompt
            included) is the keyed draw of ``(seed, row_key, t)`` (``sampling.py``), so the same seed gives
            the same tokens whatever the plan, the timing, the kernels or the rest of the batch. ``seed=None``
            draws a seed from torch's global generator when the row is added (``torch.manual_seed`` fixes it).
            ``generate`` gives every row of a call one seed and its batch index as ``row_key``; a server
            request's ``seed`` with ``row_key`` 0.
        prompt_lookup_num_tokens / max_matching_ngram_size: verify only: also propose drafts by prompt
            lookup (transformers' meaning, ``drafts.lookup_drafts``); each step the row feeds the
            lookup's or the masks' drafts, whichever chain it expects to keep more of.
    """

    threshold: float | None = None
    acceptance: str = "probability"
    max_new_tokens: int = 256
    eos_token_ids: tuple[int, ...] = ()
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    logits_processor: LogitsProcessorList | None = None
    seed: int | None = None
    row_key: int = 0
    prompt_lookup_num_tokens: int | None = None
    max_matching_ngram_size: int = 2

    def __post_init__(self):
        """A row built directly (a server's, a caller driving the decoder) is held to ``generate``'s limits."""
        if self.prompt_lookup_num_tokens is not None:
            check_draft_count("prompt_lookup_num_tokens", self.prompt_lookup_num_tokens)


@dataclass
class RowUpdate:
    """What a row gained in one step: tokens now final (verified or accepted), and whether it ended."""

    row_id: int
    tokens: list[int]
    finished: bool
    finish_reason: str | None  # "stop" (EOS / stop criterion), "length", or None while running
    drafts_proposed: int = 0
    drafts_accepted: int = 0
    draft_source: str = MASKS  # where the checked drafts came from ("masks" or "lookup")


class RowState:
    """One row's decoding state, changed by the decoder alone (the planner and the rules read it)."""

    def __init__(self, row_id, prompt, settings, window, processing, batch_index, lead, buffer_lead, floor):
        self.row_id = row_id
        self.tokens = list(prompt)  # real tokens: the prompt, then everything accepted
        self.prompt_length = len(prompt)
        self.settings = settings
        self.verify = settings.acceptance == "verify"
        self.metric = settings.acceptance
        tau = settings.threshold
        self.window = 0 if one_token_per_step(settings.acceptance, tau) else window
        self.tau = float(tau) if tau is not None else 0.0
        self.floor = floor  # verify: masks below this confidence are not proposed as drafts
        self.eos = frozenset(settings.eos_token_ids)
        self.do_sample = settings.do_sample
        self.noise = None  # keyed sampling noise (``sampling.RowNoise``); None: greedy
        if settings.do_sample:
            seed = settings.seed if settings.seed is not None else draw_seed()
            self.noise = RowNoise(seed, settings.row_key)
        self.processing = processing
        self.batch_index = batch_index  # row of ``processing.sequences`` (the stock ``input_ids`` layout)
        self.lead = lead  # left-padding columns of the prompt fed to the model (and kept in the cache)
        self.buffer_lead = buffer_lead  # left-padding columns before the prompt in ``processing.sequences``
        self.prefilled = False
        self.committed = 0  # real tokens whose keys/values are in the cache
        self.drafts: Drafts = NO_DRAFTS  # the masks' proposals from the last step
        self.finished = False

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_length

    @property
    def cache_offset(self) -> int:
        return (self.lead if self.prefilled else 0) + self.committed

    @property
    def column(self) -> int:
        """Buffer column of the next token (``processing.sequences`` layout)."""
        return self.buffer_lead + len(self.tokens)


class MARSBatchDecoder:
    """Advance a set of rows one MARS step at a time.

    Args:
        model: a causal LM.
        settings: the ``MARSDecodingSettings`` to decode with, whole (window, mask token, cache scheme, layout,
            planner, cost table, CPU kernels, a draft model's tokens); its per-row τ are the rows' own
            (``RowSettings``), so a server passes ``thresholds=()``.
        max_rows: KV slots (rows decoded at once).
        max_length: longest row (prompt + generated) the cache is sized for (it grows if exceeded).
        pad_token_id: what idle and padding columns feed.
        kv_cache: a ``MARSBlockCache`` to use (e.g. the caller's), else one is created. A ``MARSStaticCache``
            puts the decoder on transformers' fast path: every decode step is padded to ``step_width`` columns (or
            runs one column, where the planner chooses: ``static_widths``) and attends over the whole cache, so one
            or two compiled graphs (``compiled_forward``) serve every step.
        compiled_forward: the model's compiled call (``model.get_compiled_call(compile_config)``), used for
            decode steps on a static cache (prefills run eager, as transformers does); None: eager.
        stopping_criteria: ``generate``'s non-EOS stopping criteria, checked token by token inside a step
            on the rows' token buffer (``ScoreProcessing.sequences``, indexed by each row's ``batch_index``).
        assistant_model: a draft model (docs/method.md §5), or None.

    The linears run packed (``settings.cpu_kernels``, opt-in) only inside ``step`` and ``measure_costs`` (or a
    caller's enclosing ``cpu_kernels.packed_linears`` block, as ``generate`` opens for its whole call), so the
    model is untouched between. ``forward_widths`` (columns per row of each forward, padding included) and
    ``plan_counts`` (how often a row fed nothing extra, drafts only, a linear or a quadratic group, a fixed
    layout, or a plain ``unit`` step that re-times one column) say what the planner chose; ``cost_tables``
    the curves it used, per batch bucket.
    """

    def __init__(
        self,
        model,
        settings: MARSDecodingSettings,
        *,
        max_rows: int,
        max_length: int,
        pad_token_id: int,
        kv_cache: MARSBlockCache | None = None,
        stopping_criteria=None,
        assistant_model=None,
        compiled_forward=None,
    ):
        if not isinstance(settings, MARSDecodingSettings):
            raise TypeError(
                f"`settings` must be a MARSDecodingSettings (mars_hf.decoding.settings), not {type(settings).__name__}."
            )
        self.model = model
        self.settings = settings
        self.device = model.device
        self.cpu_kernels = settings.cpu_kernels
        self.window = window = settings.window
        self.pad_token_id = pad_token_id
        self.scheme = make_scheme(settings.decoder_cache, settings.cache_block)
        self.planner = StepPlanner(
            model, settings, pad_token_id=pad_token_id, assistant_model=assistant_model
        )
        self.kv = None
        if self.scheme.uses_cache:
            capacity = max_length + min(window * (window + 2), _STEP_CAPACITY) + 8
            self.kv = kv_cache if kv_cache is not None else MARSBlockCache(model.config, capacity, max_rows)
        self.static = isinstance(self.kv, MARSStaticCache)
        if compiled_forward is not None and not self.static:
            raise ValueError("A compiled forward needs a MARSStaticCache (`cache_implementation='static'`).")
        self.compiled_forward = compiled_forward
        self.gate = mask_gate(model) if compiled_forward is not None else None
        self.step_width = widest_step(settings, assistant_model is not None) if self.static else None
        # A static cache's decode steps run at these widths only (one compiled graph each): the full step, and
        # where the planner chooses (``generation._static_feed``) a plain one-column step too.
        self.static_widths = ()
        if self.static:
            self.static_widths = (1, self.step_width) if settings.layout == "auto" else (self.step_width,)
            self.planner.max_width = self.step_width
        self.max_rows = max_rows
        self.stopping_criteria = stopping_criteria or None
        self.rows: list[RowState] = []  # live rows, in KV slot order
        self.joining: list[RowState] = []  # added, prefilled by the next step
        self.num_forwards = 0
        self.forward_widths: list[int] = []
        self.score_records: list | None = None  # set to a list to keep (row, start, scores, logits)
        self._next_id = 0
        self._dtype = next(model.parameters()).dtype
        self.calibration = calibration_for(
            model, window
        )  # None: raw confidences (no config.mars calibration)
        # A CPU forward ends when its call returns, so its wall time is its cost: the measured curve learns
        # from it. (On an accelerator, timing would need a synchronisation per step; its curve is flat.)
        # Only a caller's measured curve (``settings.cost_memory``) learns: without one, nothing is timed.
        self._times_forwards = (
            self.device.type == "cpu" and self.kv is not None and self.planner.memory is not None
        )

    @property
    def plan_counts(self) -> dict[str, int]:
        return self.planner.plan_counts

    @property
    def cost_tables(self) -> dict:
        """The cost curves the planner used, per batch bucket."""
        return self.planner.cost_tables

    @property
    def cost_given(self):
        """The cost curve given instead of measuring (``cost_table=``); settable between steps."""
        return self.planner.cost_given

    @cost_given.setter
    def cost_given(self, table) -> None:
        # the curves already in use (a server measures them all at start-up) give way to the given one
        self.planner.cost_given = table
        self.planner.cost_tables.clear()
        self.planner.unknown_buckets.clear()

    def measure_costs(self) -> None:
        """Measure the cost curves of every batch bucket up to ``max_rows`` now into the settings'
        ``cost_memory`` (a server at start-up), instead of at the first step that needs each (about 2 s at most
        per bucket, once per memory)."""
        with packed_linears(self.model, self.cpu_kernels):
            self.planner.measure_costs(self.max_rows)

    # ----------------------------------------------------------------------------- rows in and out
    @property
    def num_rows(self) -> int:
        return len(self.rows) + len(self.joining)

    @property
    def free_slots(self) -> int:
        return self.max_rows - self.num_rows

    def add_row(
        self,
        prompt_ids,
        settings: RowSettings,
        *,
        processing: ScoreProcessing | None = None,
        batch_index: int = 0,
        lead: int = 0,
        row_id: int | None = None,
    ) -> int:
        """Queue a row; the next ``step`` prefills it. Returns its id.

        ``processing`` / ``batch_index`` / ``lead``: ``generate``'s shared processors, the row's index in
        their token buffer and its left padding there (the padding is fed with the prompt, as stock
        ``generate`` does, so that one-token decoding is numerically stock decoding).
        """
        if self.free_slots <= 0:
            raise RuntimeError(f"all {self.max_rows} rows are in use; drop a row or wait for one to finish")
        prompt = token_list(prompt_ids)
        if not prompt:
            raise ValueError("a row needs at least one prompt token")
        check_choice("mars_acceptance", settings.acceptance)
        verify = settings.acceptance == "verify"
        if not verify and settings.threshold is None:
            raise ValueError("threshold acceptance needs a τ (`mars_threshold`); or use acceptance='verify'")
        if processing is None:
            processing = ScoreProcessing(settings.logits_processor or sampling_processors(settings))
        row_id = self._next_id if row_id is None else row_id
        self._next_id = max(self._next_id, row_id + 1)
        floor = float(settings.threshold) if (verify and settings.threshold is not None) else 0.0
        fed_lead = lead if self.scheme.uses_cache else 0  # without a cache, padding is simply not fed
        row = RowState(row_id, prompt, settings, self.window, processing, batch_index, fed_lead, lead, floor)
        if settings.max_new_tokens <= 0:
            row.finished = True
        self.planner.add_row(row)
        self.joining.append(row)
        return row_id

    @torch.no_grad()
    def drop_row(self, row_id: int) -> None:
        """Forget a row (finished or cancelled); its KV slot is reused."""
        for i, row in enumerate(self.joining):
            if row.row_id == row_id:
                del self.joining[i]
                self.planner.forget(row_id)
                return
        for slot, row in enumerate(self.rows):
            if row.row_id == row_id:
                last = len(self.rows) - 1
                if slot != last and self.kv is not None:
                    self.kv.move_row(last, slot, self.rows[last].cache_offset)
                self.rows[slot] = self.rows[last]
                self.rows.pop()
                self.planner.forget(row_id)
                return
        raise KeyError(f"no row {row_id}")

    def set_threshold(self, row_id: int, tau: float) -> None:
        """Change a threshold row's τ between steps (a load controller's knob)."""
        for row in self.rows + self.joining:
            if row.row_id == row_id:
                if row.verify:
                    row.floor = float(tau)
                else:
                    row.tau = float(tau)
                    row.window = 0 if one_token_per_step(row.metric, tau) else self.window
                return
        raise KeyError(f"no row {row_id}")

    # ------------------------------------------------------------------------------------- a step
    @torch.no_grad()  # decoding never needs a graph (a server calls this outside `generate`)
    def step(self) -> list[RowUpdate]:
        """One MARS step for every live row (rows that joined since the last step are prefilled)."""
        with packed_linears(self.model, self.cpu_kernels):
            return self._step()

    def _step(self) -> list[RowUpdate]:
        updates: list[RowUpdate] = []
        if self.joining:
            joining, self.joining = self.joining, []
            first = len(self.rows)
            self.rows.extend(joining)
            updates += self._advance(first, len(self.rows))
            decode_end = first
        else:
            decode_end = len(self.rows)
        if decode_end:
            updates += self._advance(0, decode_end)
        return updates

    def _advance(self, first: int, end: int) -> list[RowUpdate]:
        """One step for rows ``first … end-1`` (KV slots): plan the feed, run the forward, decide, keep."""
        rows = self.rows[first:end]
        live = [r for r in rows if not r.finished]
        if not live:
            return [RowUpdate(r.row_id, [], True, "length") for r in rows]
        self.scheme.begin_step([len(r.tokens) - r.committed for r in live if r.prefilled])
        deciding = [
            not row.finished
            and (not row.prefilled or self.scheme.participates(len(row.tokens) - row.committed))
            for row in rows
        ]
        plan = self.planner.plan(rows, deciding)
        started = time.perf_counter() if self._times_forwards else None  # the fast path reads no clock
        logits, where = self._forward(rows, plan, deciding, first)
        if started is not None and all(r.prefilled for r in rows):  # a decode step, not a prefill
            self.planner.observe_forward(len(rows), self.forward_widths[-1], time.perf_counter() - started)
        step = StepLogits(
            logits,
            where,
            stopping_criteria=self.stopping_criteria,
            score_records=self.score_records,
            calibration=self.calibration,
        )
        decisions = decide(step, rows, plan.plans, plan.fed, deciding)
        proposed = self._mask_drafts(step, rows, plan, decisions)
        self.planner.learn(rows, plan, decisions, proposed)
        return [self._keep(row, decisions.get(i), plan.fed[i], proposed.get(i)) for i, row in enumerate(rows)]

    def _mask_drafts(self, step, rows, plan: StepPlan, decisions) -> dict[int, Drafts]:
        """The next drafts of each verify row whose kept prefix had a mask group after it (``MaskDrafts``),
        for rows sharing processors and sampling at once."""
        groups: dict = {}
        for i, decision in decisions.items():
            if decision.proposes_after is not None:
                groups.setdefault((id(rows[i].processing), rows[i].do_sample), []).append(i)
        proposed = {}
        for members in groups.values():
            source = MaskDrafts(step, plan.plans, rows[members[0]].processing)
            rooms = [
                rows[i].settings.max_new_tokens - rows[i].generated - len(decisions[i].tokens) - 1
                for i in members
            ]
            found = source.propose(
                [rows[i] for i in members], rooms, [(i, decisions[i].proposes_after) for i in members]
            )
            proposed.update(zip(members, found))
        return proposed

    def _keep(self, row: RowState, decision, fed: Drafts, proposed: Drafts | None) -> RowUpdate:
        """Append a row's kept tokens, commit what its cache scheme keeps, take its next drafts, and say
        whether it ended."""
        if decision is None:  # the row took no decision (finished, or waiting for a block commit)
            return RowUpdate(row.row_id, [], row.finished, "length" if row.finished else None)
        row.committed += self.scheme.keep(row.prefilled, decision.verified_fed)
        row.prefilled = True
        row.tokens += decision.tokens
        if row.noise is not None:
            row.noise.forget_before(len(row.tokens))
        reason = decision.reason
        if reason is None and row.generated >= row.settings.max_new_tokens:
            reason = "length"
        row.finished = reason is not None
        row.drafts = NO_DRAFTS if row.finished or proposed is None else proposed
        return RowUpdate(
            row.row_id, decision.tokens, row.finished, reason, len(fed), decision.drafts_kept, fed.source
        )

    # ------------------------------------------------------------------------------- the forward
    def _forward(self, rows, plan: StepPlan, deciding, first):
        """Run the model on the packed plans (``plan.width`` columns per row, padding included); return the
        needed logits and where each column went."""
        offsets = [r.cache_offset for r in rows]
        decoding = all(r.prefilled for r in rows)
        # A static cache's decode steps have one of ``static_widths`` shapes, the whole cache as keys.
        needed = max(len(p.tokens) for p in plan.plans)
        shape = next((w for w in self.static_widths if w >= needed), None) if decoding else None
        fixed_shape = shape is not None
        step = pack(
            plan.plans,
            offsets,
            [r.lead for r in rows],
            min_width=shape if fixed_shape else plan.width,
            dtype=self._dtype,
            device=self.device,
            pad_token_id=self.pad_token_id,
            max_position=self.planner.position_limit,
            key_length=self.kv.capacity if self.static else None,
        )
        keep = _logit_columns(plan.plans, deciding, step.width)
        if fixed_shape:  # every column's logits: the number of columns read varies, the graph must not
            where, logits_to_keep = {c: c for c in keep}, 0
        else:
            where = {c: i for i, c in enumerate(keep)}
            if keep == list(range(step.width - len(keep), step.width)):
                logits_to_keep = len(keep)
            else:
                logits_to_keep = torch.tensor(keep, device=self.device)
        if self.kv is not None:
            self.kv.begin_forward(offsets, step.width, self.device, first_row=first)
        self.num_forwards += 1
        self.forward_widths.append(step.width)
        compiled = fixed_shape and self.compiled_forward is not None
        forward = self.compiled_forward if compiled else self.model
        graphs, started = (compiled_graphs(), time.perf_counter()) if compiled else (None, None)
        # a plain compiled step feeds no mask (one graph without the gated adapters; a wide step keeps them)
        plain = compiled and step.width == 1 and self._feeds_no_mask(plan)
        with masks_absent(self.gate, plain) if compiled else contextlib.nullcontext():
            outputs = forward(
                input_ids=step.input_ids,
                attention_mask=step.attention_mask,
                position_ids=step.position_ids,
                cache=self.kv,
                use_cache=self.kv is not None,
                logits_to_keep=logits_to_keep,
                return_dict=True,
            )
        if compiled and compiled_graphs() != graphs:
            logger.info(
                "Compiled the decode step for %d rows x %d columns in %.0f s (once per process and shape; "
                "Inductor's cache, TORCHINDUCTOR_CACHE_DIR, shortens it in a later process).",
                len(rows),
                step.width,
                time.perf_counter() - started,
            )
        return outputs.logits, where

    def _feeds_no_mask(self, plan: StepPlan) -> bool:
        """No column of the step holds the mask token (a real token may be the mask's id; padding may too)."""
        mask = self.settings.mask_token_id
        return self.pad_token_id != mask and all(mask not in p.tokens for p in plan.plans)


def compiled_graphs() -> int:
    """Graphs torch.compile has made in this process (its own counter): a new one means a step compiled."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def widest_step(settings: MARSDecodingSettings, assistant: bool = False) -> int:
    """Columns per row of the widest decode step the fixed feed can take (what a static cache pads every
    decode step to): the real tokens not yet cached (verify: the model's own token; τ: up to W + 1 accepted, or
    a block of C), the drafts (verify: the masks' W, prompt lookup's or a draft model's), and the mask groups
    (one after the drafts; quadratic, or τ with a draft model: one after every draft prefix)."""
    if settings.one_token_per_step and not assistant:
        return 1  # τ >= 1: stock decoding's one column
    window = settings.window
    verify = settings.acceptance == "verify"
    fresh = 1 if verify else window + 1
    if settings.cache == "block":
        fresh = max(fresh, settings.cache_block + window + 1)
    drafts = max(window, settings.prompt_lookup_num_tokens or 0) if verify else 0
    if assistant:
        drafts = max(drafts, settings.assistant_tokens)
    groups = drafts + 1 if settings.layout == "quadratic" or (assistant and not verify) else 1
    return fresh + drafts + groups * window


def check_token_ids(ids: torch.Tensor, name: str = "input_ids") -> None:
    """Token ids must be integers: a float id would be truncated silently (7.9 -> 7), where stock ``generate``
    raises in the embedding. A call's ``input_ids`` must be ``[batch, length]``: 1-D ids failed in transformers'
    preparation with ``IndexError: tuple index out of range`` (stock ``generate`` too)."""
    if name == "input_ids" and ids.dim() != 2:
        raise ValueError(
            f"input_ids must be [batch, length], got shape {list(ids.shape)}; for one prompt add the batch "
            "dimension (`input_ids[None]`), or tokenize with `return_tensors='pt'`."
        )
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TypeError(
            f"`{name}` must hold integer token ids (torch.long), not {ids.dtype}; convert it with `.long()`."
        )


def token_list(ids) -> list[int]:
    """A prompt's token ids (a tensor or a sequence of ints) as a list of ints; anything else is refused."""
    if torch.is_tensor(ids):
        check_token_ids(ids, "prompt_ids")
        return [int(t) for t in ids.tolist()]
    tokens = []
    for t in ids:
        if isinstance(t, bool) or not hasattr(t, "__index__"):
            raise TypeError(f"prompt token ids must be integers, got {t!r} ({type(t).__name__}).")
        tokens.append(t.__index__())
    return tokens


def _logit_columns(plans, deciding, width: int) -> list[int]:
    """The step columns whose logits a decision reads (checks and mask groups of deciding rows)."""
    needed: set[int] = set()
    for plan, decides in zip(plans, deciding):
        if decides:
            needed.update(plan.check_columns)
            for columns in plan.group_columns.values():
                needed.update(columns)
    keep = sorted(needed)
    if keep and width > max(len(p.tokens) for p in plans):
        # padded to a cheaper measured width: the LM head then runs on every column from the first
        # needed one, as the cost probe measured it (fewer rows can take a slower kernel path)
        keep = list(range(keep[0], width))
    return keep


def sampling_processors(settings: RowSettings) -> LogitsProcessorList:
    """The position-free warpers of a row's sampling settings (what a server request asks for)."""
    processors = LogitsProcessorList()
    if settings.do_sample:
        if settings.temperature not in (None, 1.0):
            processors.append(TemperatureLogitsWarper(settings.temperature))
        if settings.top_k:
            processors.append(TopKLogitsWarper(settings.top_k))
        if settings.top_p is not None and settings.top_p < 1.0:
            processors.append(TopPLogitsWarper(settings.top_p))
    return processors
