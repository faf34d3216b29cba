"""The step planner and the cost model, and MARS near a model's position limit.

- ``planner.choose`` against a brute-force enumeration of every combination of row plans, with
  expected tokens computed outcome by outcome (not with the planner's cumulative products);
- each branch of the planner forced with handcrafted cost tables (flat: widest; steep: one-token
  steps; in between: linear groups) on tiny float64 models of several architectures, batched, left
  padded, pad id == EOS id: the output is stock greedy's every time;
- the cost table: interpolation, padding to a cheaper width, validation, the flat assumption, the
  probe (bounded, cached per process, never run by one-token decoding, outputs unchanged);
- an absolute-position model (GPT-2) decoded up to its last position: no index past it, verify and
  τ = 1 equal stock; a huge W is capped by ``max_new_tokens``.
"""

from __future__ import annotations

import itertools
import json
import random
import time
from types import SimpleNamespace

import pytest
import torch
from transformers import StoppingCriteriaList

from mars_hf.decoding import cost_model
from mars_hf.decoding.cost_model import CostTable
from mars_hf.decoding.generation import enable_mars
from mars_hf.decoding.memory import PlannerMemory
from mars_hf.decoding.planner import (
    AUTO,
    FIXED,
    THRESHOLD,
    RowChoice,
    RowSpec,
    StepPlanner,
    choose,
    plan_width,
)
from mars_hf.decoding.settings import MARSDecodingSettings
from mars_hf.decoding.stats import PROBE_SHARE, AcceptanceStats, DraftingFloor, probe_spacing
from tests.test_generation import StopOnToken, _batch, peaked_model
from tests.tiny import ARCHITECTURES, tiny_model, tiny_tokenizer

FLAT = {1: 1.0}
STEEP = {1: 1.0, 2: 40.0, 64: 2000.0}  # any extra column costs more than any draft could bring
MIDDLE = {1: 1.0, 9: 1.4, 10: 4.0, 64: 40.0}  # up to 1 + 2W = 9 columns cheap (W = 4), more is not


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


# ---------------------------------------------------------------------------------------------------
# the decision function against brute force
# ---------------------------------------------------------------------------------------------------


def _exactly(probs, count):
    """P(exactly j of ``count`` sequential checks pass), j = 0 … count (stop at the first failure)."""
    out = []
    for j in range(count + 1):
        p = 1.0
        for i in range(j):
            p *= probs[i]
        if j < count:
            p *= 1 - probs[j]
        out.append(p)
    return out


def _expected(probs, count):
    return sum(j * p for j, p in enumerate(_exactly(probs, count)))


def _worth(spec, masks, cost):
    """H(m): the best prefix of m fresh drafts, net of what checking it will cost."""
    return max(_expected(spec.future, mm) - spec.gain * (cost(1 + mm) - cost(1)) for mm in range(masks + 1))


def _value(spec, choice, cost):
    if spec.kind == FIXED:
        return 0.0
    if spec.kind == THRESHOLD:
        return 1 + _expected(spec.future, choice.masks)
    outcomes = _exactly(spec.draft_probs, choice.drafts)
    now = sum((j + 1) * p for j, p in enumerate(outcomes))
    if not choice.masks:
        return now
    survive = 1.0 if choice.quadratic else outcomes[choice.drafts]
    return now + survive * _worth(spec, choice.masks, cost)


def _options(spec, window):
    if spec.kind == FIXED:
        return [RowChoice()]
    drafts = len(spec.draft_probs) if spec.kind == AUTO else 0
    options = []
    for k in range(drafts + 1):
        for m in range(window + 1):
            if m > spec.max_masks or k + m > spec.max_extra:
                continue
            if spec.force_drafts and drafts and k != min(drafts, spec.max_extra):
                continue
            options.append(RowChoice(k, m, False))
            if spec.kind == AUTO and k >= 1 and m >= 1:
                options.append(RowChoice(k, m, True))
    if spec.force_masks and any(o.masks for o in options):
        options = [o for o in options if o.masks]
    return options


def _objective(specs, choices, width, cost):
    return sum(_value(s, c, cost) for s, c in zip(specs, choices)) - sum(s.gain for s in specs) * cost(width)


def _random_spec(rng, window):
    kind = rng.choice([AUTO, AUTO, THRESHOLD, FIXED])
    if kind == FIXED:
        return RowSpec(FIXED, rng.randint(1, 9))
    drafts = rng.randint(0, window) if kind == AUTO else 0
    return RowSpec(
        kind,
        base=rng.randint(1, 3),
        draft_probs=[rng.choice([0.0, 0.1, 0.5, 0.9, 1.0, rng.random()]) for _ in range(drafts)],
        future=[rng.random() for _ in range(window)],
        gain=rng.choice([1.0, 1.0, 1.5, 3.0]),
        max_masks=rng.randint(0, window),
        max_extra=rng.randint(0, 2 * window),
        force_masks=rng.random() < 0.15,
        force_drafts=rng.random() < 0.15,
    )


def _random_table(rng):
    kind = rng.choice(["flat", "steep", "linear", "bumpy"])
    if kind == "flat":
        return CostTable.from_mapping(FLAT)
    if kind == "steep":
        return CostTable.from_mapping(STEEP)
    if kind == "linear":
        slope = rng.choice([0.02, 0.1, 0.3])
        return CostTable.from_mapping({n: 1 + slope * (n - 1) for n in range(1, 30)})
    # non-monotone, like CPU kernels that are slower at 3 columns than at 4
    return CostTable.from_mapping({n: 1 + 0.1 * n + rng.choice([0.0, 0.0, 0.5]) for n in range(1, 30)})


def test_choose_finds_the_best_combination_of_row_plans():
    """Every combination of every row's plans, valued outcome by outcome: the planner's choice reaches
    the maximum (ties may pick another combination of equal value) and its width fits every plan."""
    rng = random.Random(0)
    checked = 0
    for trial in range(160):
        window = rng.choice([1, 2, 3])
        specs = [_random_spec(rng, window) for _ in range(rng.randint(1, 3))]
        table = _random_table(rng)
        cost = table.effective
        width, choices = choose(specs, cost, window)
        for spec, choice in zip(specs, choices):
            if spec.kind != FIXED:
                assert choice in _options(spec, window), (trial, spec, choice)
            assert plan_width(spec, choice) <= width
        got = _objective(specs, choices, width, cost)
        best = max(
            _objective(specs, combo, max(plan_width(s, c) for s, c in zip(specs, combo)), cost)
            for combo in itertools.product(*(_options(s, window) for s in specs))
        )
        assert got == pytest.approx(best, abs=1e-9), (trial, specs, table)
        checked += 1
    assert checked == 160


def test_branches_of_the_decision():
    """Worthless drafts: one-token steps; sure drafts on a flat curve: the widest quadratic feed; a
    curve that makes a few columns cheap and more expensive: a linear group; a batch shares the width
    and a row fills it."""
    window = 4
    bad = RowSpec(AUTO, 1, [0.0] * 4, [0.0] * 4, 1.0, max_masks=4, max_extra=100)
    good = RowSpec(AUTO, 1, [0.95] * 4, [0.95] * 4, 3.0, max_masks=4, max_extra=100)
    flat, steep, middle = (CostTable.from_mapping(t).effective for t in (FLAT, STEEP, MIDDLE))
    assert choose([bad], middle, window) == (1, [RowChoice()])
    assert choose([good], steep, window) == (1, [RowChoice()])
    width, (choice,) = choose([good], flat, window)
    assert choice == RowChoice(4, 4, True) and width == 1 + 4 + 5 * 4
    width, (choice,) = choose([good], middle, window)
    assert choice == RowChoice(4, 4, False) and width == 9
    # a batch: the good row sets the width, the bad row fills it for free
    width, (first, second) = choose([good, bad], middle, window)
    assert width == 9 and first == RowChoice(4, 4, False) and plan_width(bad, second) <= 9
    # the position limit: nothing past max_extra
    near = RowSpec(AUTO, 1, [0.95] * 4, [0.95] * 4, 3.0, max_masks=4, max_extra=2)
    width, (choice,) = choose([near], flat, window)
    assert choice.drafts + choice.masks <= 2
    # a re-probe feeds masks although they do not pay
    probing = RowSpec(AUTO, 1, [], [0.0] * 4, 1.0, max_masks=4, max_extra=100, force_masks=True)
    assert choose([probing], steep, window)[1][0].masks >= 1


def test_acceptance_stats_learn_and_reprobe():
    stats = AcceptanceStats(4)
    assert stats.future() == [0.5] * 4 and stats.calibrated([0.8]) == [0.8]
    for _ in range(30):
        stats.observe(4, 0, [0.9, 0.9, 0.9, 0.9])  # confident drafts, never kept
    assert stats.future()[0] < 0.05 and stats.calibrated([0.9])[0] < 0.05
    for _ in range(30):
        stats.observe(4, 4, [0.5] * 4)  # unsure drafts, always kept
    assert min(stats.future()) > 0.9 and min(stats.calibrated([0.5] * 4)) > 0.85  # 0.5 means ~1 here
    # drafts proposed with low probabilities make fresh drafts look worthless, checked or not
    unsure = AcceptanceStats(4)
    for _ in range(30):
        unsure.propose([0.02, 0.01])
    assert max(unsure.future()[:2]) < 0.1 and unsure.future()[2:] == [0.5, 0.5]
    for _ in range(AcceptanceStats.FIRST_PROBE_EVERY):
        assert not stats.probe_due()
        stats.observe_step(1, 1.0, fed_masks=False)
    assert stats.probe_due()
    stats.observe_step(1, 1.0, fed_masks=True)
    assert not stats.probe_due()


def test_probes_spread_out_until_the_planner_feeds_masks_itself():
    """Every probe doubles the interval to the next, kept drafts or not (good drafts on a curve where
    masks do not pay are nothing to feed); masks the planner chose reset it once its drafting steps have
    paid, forced ones and masks that only filled a batch's columns (1 token for their width) do not."""
    first = AcceptanceStats.FIRST_PROBE_EVERY
    stats = AcceptanceStats(4)
    stats.start_probe()  # the probe's mask step
    stats.observe_step(1, 1.3, fed_masks=True, forced=True)
    stats.observe(1, 1, [0.9])  # its draft was kept ...
    stats.observe_step(2, 1.3, fed_masks=True, forced=True)  # ... on the probe's draft step
    assert stats.probe_every == 2 * first and not stats.probe_due()
    for _ in range(2 * first - 1):
        stats.observe_step(1, 1.0, fed_masks=False)  # the planner still feeds no masks
    assert not stats.probe_due()
    stats.observe_step(1, 1.0, fed_masks=False)
    assert stats.probe_due()
    for _ in range(10):
        stats.start_probe()
    assert stats.probe_every == AcceptanceStats.MAX_PROBE_EVERY
    for _ in range(2 * DraftingFloor.EVIDENCE):
        stats.observe_step(1, 1.4, fed_masks=True)  # masks filling a width a companion paid for
    assert stats.probe_every == AcceptanceStats.MAX_PROBE_EVERY and not stats.drafting_pays()
    for _ in range(2 * DraftingFloor.EVIDENCE):
        stats.observe_step(2, 1.2, fed_masks=True)  # masks of the planner's own choosing, which pay
    assert stats.drafting_pays() and stats.probe_every == first


def test_good_drafts_on_a_curve_where_masks_never_pay_are_probed_ever_more_rarely(tok, monkeypatch):
    """A model whose drafts are often right, on a curve where a second column costs 2.5x one (no draft
    can pay for it): the re-probes find kept drafts, yet they come at 8, 16, 32, ... plain steps, not
    every 8; the output is stock's."""
    from mars_hf.decoding import stats

    monkeypatch.setattr(stats, "PROBE_SHARE", 1e6)  # no stretching: probes every FIRST_PROBE_EVERY
    model = peaked_model("llama")
    encoded = _batch(tok)
    stock = model.generate(**encoded, max_new_tokens=96, do_sample=False)
    out = _verify(model, encoded, {1: 1.0, 2: 2.5, 64: 160.0}, max_new_tokens=96)
    assert torch.equal(out.sequences, stock)
    assert int(out.drafts_accepted.sum()) > 0  # the probes did find kept drafts
    widths = out.forward_widths[1:].tolist()
    probes = sum(1 for w, before in zip(widths, [1] + widths) if w > 1 and before == 1)
    assert 1 <= probes <= 4, widths  # 8 + 16 + 32 + 64 > 95 plain steps


def test_reprobes_spread_out_where_extra_columns_are_dear():
    """Probes that find nothing cost at most PROBE_SHARE of the time: free on a flat curve, every few
    dozen steps where two columns cost 1.7x one."""
    assert probe_spacing(CostTable.from_mapping(FLAT).effective) == 1.0
    dear = CostTable.from_mapping({1: 1.0, 2: 1.7, 64: 60.0})
    spacing = probe_spacing(dear.effective)
    assert spacing == pytest.approx(2 * 0.7 / (PROBE_SHARE * AcceptanceStats.FIRST_PROBE_EVERY))
    stats = AcceptanceStats(4)
    for _ in range(AcceptanceStats.FIRST_PROBE_EVERY):
        stats.observe_step(1, 1.0, fed_masks=False)
    assert stats.probe_due() and not stats.probe_due(spacing)
    for _ in range(int(AcceptanceStats.FIRST_PROBE_EVERY * spacing)):
        stats.observe_step(1, 1.0, fed_masks=False)
    assert stats.probe_due(spacing)


def test_worthless_drafts_on_a_dear_curve_decode_one_token_steps(tok):
    """An untrained mask row on a curve where a second column costs 1.7x: one-token steps (stock cost)
    from the first step to the last, no re-probe within 40 tokens; the output is stock's."""
    model = enable_mars(tiny_model("llama", seed=3))
    encoded = _batch(tok)
    stock = model.generate(**encoded, max_new_tokens=40, do_sample=False)
    out = _verify(model, encoded, {1: 1.0, 2: 1.7, 64: 60.0}, max_new_tokens=40)
    assert torch.equal(out.sequences, stock)
    assert out.forward_widths[1:].tolist() == [1] * (out.num_forwards - 1)


# ---------------------------------------------------------------------------------------------------
# the floor: plain steps of the same batch (a feed on a mocked clock)
# ---------------------------------------------------------------------------------------------------

# a batch-4 CPU curve in float32: two columns cost 1.4x one
BATCH_4_CURVE = {1: 1.0, 2: 1.4, 3: 1.55, 4: 1.7, 5: 1.85, 6: 2.0, 9: 2.4}


def _feed(rows, keep, *, steps, window=2, confidence=0.99, told=None, floor=None, seed=0):
    """``steps`` steps of ``rows`` verify rows, planned as ``StepPlanner`` plans them, on the mocked clock of
    ``BATCH_4_CURVE`` (a step costs its width's relative cost; nothing is timed): every mask fed proposes a
    draft of own probability ``confidence``, kept with probability ``keep`` (given the ones before it; a
    function of the step number where the text changes).
    ``told``: the chance of being kept the planner is told instead of its estimates (estimates wrong in a
    way no single step shows). ``floor``: a ``DraftingFloor`` (None: today's planner, no floor).

    Returns the tokens per unit cost relative to plain steps (1.0: one-token decoding) and the widths."""
    rng = random.Random(seed)
    table = CostTable.from_mapping(BATCH_4_CURVE)
    spacing = probe_spacing(table.effective)
    stats = [AcceptanceStats(window) for _ in range(rows)]
    held = [[] for _ in range(rows)]  # each row's drafts (their own probabilities)
    tokens = cost = 0.0
    widths = []
    for step in range(steps):
        kept_rate = keep(step) if callable(keep) else keep
        specs = []
        for row, drafts in zip(stats, held):
            if row.probing and not drafts:
                row.probing = False
            draft_probs = [told] * len(drafts) if told is not None else row.calibrated(drafts)
            future = [told] * window if told is not None else row.future()
            specs.append(
                RowSpec(AUTO, 1, draft_probs, future, max(1.0, row.gain), window, 100,
                        row.probe_due(spacing), row.probing and bool(drafts))
            )  # fmt: skip
        if floor is None:
            width, choices = choose(specs, table.effective, window)
        else:
            width, choices = choose(specs, table.effective, window, drafting=floor.open)
        width = table.padded_width(max(width, 1))
        widths.append(width)
        cost += rows * table.cost(width)
        for r, (row, spec, choice) in enumerate(zip(stats, specs, choices)):
            kept = 0
            while kept < choice.drafts and rng.random() < kept_rate:
                kept += 1
            tokens += kept + 1
            row.observe(choice.drafts, kept, held[r][: choice.drafts])
            fresh = choice.masks and (choice.quadratic or kept == choice.drafts)
            held[r] = [confidence] * choice.masks if fresh else []
            if held[r]:
                row.propose(held[r])
            if spec.force_drafts:
                row.probing = False
            elif spec.force_masks and choice.masks:
                row.start_probe()
            forced = spec.force_masks or spec.force_drafts
            row.observe_step(kept + 1, table.cost(width), fed_masks=choice.masks > 0, forced=forced)
        if floor is not None:
            floor.observe(stats)
    return tokens / cost, widths


def test_re_probes_at_batch_4_spread_out_as_at_batch_1():
    """Confident masks whose drafts are mostly wrong, at batch 4 on a curve where two columns cost 1.4x one:
    the planner feeds plain steps but for re-probes, and no more of those than at batch 1. (Masks that only
    filled a width a companion's re-probe paid for used to reset every row's interval: twice the wide steps,
    2 % of the time lost.)"""
    alone = sum(w > 1 for w in _feed(1, 0.3, steps=256)[1])
    batch = sum(w > 1 for w in _feed(4, 0.3, steps=256)[1])
    assert batch <= alone + 2, (alone, batch)


def test_the_floor_goes_plain_where_drafting_does_not_pay_whatever_the_estimates_say():
    """The planner told every draft is kept 9 times in 10 (it is kept 2 times in 10: < 1.4 tokens per
    forward of two columns at batch 4): without the floor it drafts at every step, far below one-token
    decoding; with it, it drafts for one bounded exploration, then plain steps but for later explorations,
    each as short and each further from the last."""
    ratio, widths = _feed(4, 0.2, steps=512, told=0.9)
    assert ratio < 0.8 and sum(w > 1 for w in widths) > 500  # what the floor is for
    floor = DraftingFloor()
    ratio, widths = _feed(4, 0.2, steps=512, told=0.9, floor=floor)
    wide = [i for i, w in enumerate(widths) if w > 1]
    explorations = [[wide[0]]]
    for i in wide[1:]:
        if i == explorations[-1][-1] + 1:
            explorations[-1].append(i)
        else:
            explorations.append([i])
    assert explorations[0][0] == 0 and len(explorations) <= 4, explorations
    assert all(len(run) <= DraftingFloor.FIRST_LOOK + 2 for run in explorations), explorations
    gaps = [b[0] - a[-1] for a, b in zip(explorations, explorations[1:])]
    assert gaps[0] >= DraftingFloor.FIRST_WAIT and gaps == sorted(gaps) and gaps[-1] > gaps[0], gaps
    assert ratio > 0.95


def test_the_floor_keeps_drafts_that_pay_and_sheds_them_when_they_stop():
    """Drafts kept 9 times in 10 on the same curve: the floor is established and changes nothing. Then the
    text changes (1 in 10 kept) while the planner's estimates stay where they were: the floor closes and the
    batch goes back to plain steps."""
    floor = DraftingFloor()
    ratio, widths = _feed(4, 0.9, steps=256, confidence=0.9, floor=floor)
    assert floor.open and floor.established and ratio > 1.2 and sum(w > 1 for w in widths) > 0.8 * 256
    assert (ratio, widths) == _feed(4, 0.9, steps=256, confidence=0.9)  # the same plans without the floor
    floor = DraftingFloor()
    change = lambda step: 0.9 if step < 128 else 0.1  # noqa: E731
    _, widths = _feed(4, change, steps=384, told=0.9, floor=floor)
    assert sum(w > 1 for w in widths[:128]) > 120 and sum(w > 1 for w in widths[128:]) < 40
    assert widths[150:190] == [1] * 40  # closed within a few steps of the change, until an exploration


def test_with_honest_estimates_and_bad_drafts_the_floor_costs_nothing():
    """Drafts kept 3 times in 10 (< 1.4 tokens per forward at 2 columns): plain steps after the re-probes
    either way, at batch 4 as at batch 1; a floor never opens a batch its planner would not widen."""
    for rows in (1, 4):
        bare, _ = _feed(rows, 0.3, steps=256)
        floored, widths = _feed(rows, 0.3, steps=256, floor=DraftingFloor())
        assert floored >= bare - 0.005 and floored > 0.98 and sum(w > 1 for w in widths) <= 12


class _Row:
    def __init__(self, tokens, cost, drafted=True):
        self.last_sample = (tokens, cost, drafted)


def test_the_floor_rule():
    """The rule as documented: closes far below plain after FIRST_LOOK drafting steps, below 1 + MARGIN after
    EVIDENCE, once established only below plain; explores again at a multiple of its wait, which doubles."""
    far, near, good = DraftingFloor(), DraftingFloor(), DraftingFloor()
    for step in range(1, DraftingFloor.EVIDENCE + 1):
        for floor, tokens in ((far, 0.85), (near, 1.02), (good, 1.2)):
            if floor.open:
                floor.observe([_Row(tokens, 1.0), _Row(1, 1.0, drafted=False)][:1])
        assert far.open == (step < DraftingFloor.FIRST_LOOK)
        assert near.open == (step < DraftingFloor.EVIDENCE)
    assert good.open and good.established and not near.established
    wait = DraftingFloor.FIRST_WAIT
    assert far.closed_until % wait == 0 and far.closed_until >= DraftingFloor.FIRST_LOOK + wait
    assert far.wait == 2 * DraftingFloor.FIRST_WAIT  # the next failed exploration waits longer
    while not far.open:
        far.observe([_Row(1, 1.0, drafted=False)])
    assert far.steps % wait == 0 and far.drafting_steps == 0 and far.tokens == 0.0  # explores afresh
    # established: a ratio between plain and the margin does not close it, one below plain does
    for _ in range(40):
        good.observe([_Row(1.02, 1.0)])
    assert good.open
    while good.open:
        good.observe([_Row(0.9, 1.0)])
    assert good.drafting_steps < DraftingFloor.EVIDENCE + 40 + 8 and good.wait == DraftingFloor.FIRST_WAIT
    # steps where no row drafted are not evidence; a drafting step counts every row of it
    quiet = DraftingFloor()
    for _ in range(100):
        quiet.observe([_Row(1, 1.0, drafted=False), _Row(1, 1.0, drafted=False)])
    assert quiet.open and quiet.drafting_steps == 0
    for _ in range(DraftingFloor.EVIDENCE):
        quiet.observe([_Row(2, 1.4), _Row(1, 1.4, drafted=False)])  # 1.5 tokens per row for 1.4
    assert quiet.open and quiet.established


def test_a_closed_floor_makes_verify_rows_plain():
    """``choose(..., drafting=False)``: verify rows feed nothing extra, re-probes included; fixed rows keep
    their width and τ rows their choice."""
    window, flat = 4, CostTable.from_mapping(FLAT).effective
    good = RowSpec(AUTO, 1, [0.95] * 4, [0.95] * 4, 3.0, max_masks=4, max_extra=100, force_masks=True)
    tau = RowSpec(THRESHOLD, 1, [], [0.95] * 4, 1.0, max_masks=4, max_extra=100)
    fixed = RowSpec(FIXED, 6)
    width, choices = choose([good, tau, fixed], flat, window, drafting=False)
    assert choices[0] == RowChoice() and choices[1].masks == 4 and width == 6
    assert choose([good], flat, window, drafting=False) == (1, [RowChoice()])
    assert choose([good], flat, window)[1][0].masks == 4


# ---------------------------------------------------------------------------------------------------
# each branch on tiny models: the output is stock greedy's
# ---------------------------------------------------------------------------------------------------


def _verify(model, encoded, table, memory=None, **kwargs):
    """Verify on a given curve (``table``), or on the curve measured into ``memory`` (``mars_cost_probe``)."""
    kwargs.setdefault("do_sample", False)
    if memory is not None:
        kwargs["mars_cost_probe"] = memory
    return model.generate(
        **encoded, mars_acceptance="verify", mars_cost_table=table, return_dict_in_generate=True, **kwargs
    )


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_branch_equals_stock_greedy_on_random_models(arch, tok):
    model = enable_mars(tiny_model(arch, seed=3))
    encoded = _batch(tok)
    assert tok.pad_token_id == tok.eos_token_id and (encoded.attention_mask == 0).any()
    stock = model.generate(**encoded, max_new_tokens=14, do_sample=False)
    for table in (FLAT, STEEP, MIDDLE):
        for scheme in ("cursor", "block", "none"):
            out = _verify(model, encoded, table, max_new_tokens=14, mars_cache=scheme, mars_cache_block=3)
            assert torch.equal(out.sequences, stock), (table, scheme)
            assert out.cost_curve == CostTable.from_mapping(table).as_dict()
            assert len(out.forward_widths) == out.num_forwards


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_forced_branches_on_a_model_whose_drafts_are_often_right(arch, tok):
    model = peaked_model(arch)
    encoded = _batch(tok)
    prompt_width = encoded.input_ids.shape[1]
    stock = model.generate(**encoded, max_new_tokens=24, do_sample=False)
    runs = {name: _verify(model, encoded, t, max_new_tokens=24) for name, t in
            (("flat", FLAT), ("steep", STEEP), ("middle", MIDDLE))}  # fmt: skip
    for name, out in runs.items():
        assert torch.equal(out.sequences, stock), name
    # flat: as wide as the window allows, quadratic groups, several tokens per forward
    flat = runs["flat"]
    assert flat.plan_counts.get("quadratic", 0) > 0 and int(flat.drafts_accepted.sum()) >= 10
    assert max(flat.forward_widths[1:].tolist()) == 1 + 4 + 5 * 4
    # steep: one-token steps (stock cost) except the prompt's forward and the rare re-probes
    steep = runs["steep"]
    decode = steep.forward_widths[1:].tolist()
    wide = [w for w in decode if w > 1]
    assert len(wide) <= 2 * (len(decode) // AcceptanceStats.FIRST_PROBE_EVERY + 1), decode
    assert steep.forward_widths[0] == prompt_width  # not even the prompt's forward carries masks
    assert steep.num_forwards >= 24
    # in between: linear groups within 1 + 2W columns, fewer forwards than one-token decoding
    middle = runs["middle"]
    assert middle.plan_counts.get("linear", 0) > 0 and max(middle.forward_widths[1:].tolist()) <= 9
    assert middle.num_forwards < steep.num_forwards
    # partial groups: 4 columns cheap, a fifth dear: at most 3 masks (or drafts + masks) per step
    narrow = _verify(model, encoded, {1: 1.0, 4: 1.05, 5: 30.0, 64: 100.0}, max_new_tokens=24)
    assert torch.equal(narrow.sequences, stock)
    assert max(narrow.forward_widths[1:].tolist()) <= 4 and int(narrow.drafts_accepted.sum()) > 0


def test_threshold_rows_opt_into_the_planner(tok):
    """τ keeps its fixed window unless `mars_planner=True`; then a steep curve means one-token steps
    (but for re-probes), a flat one the full window (the fixed window's output, exactly)."""
    model = peaked_model("qwen2")
    encoded = _batch(tok)
    common = dict(max_new_tokens=16, do_sample=False, mars_threshold=0.3, return_dict_in_generate=True)
    fixed = model.generate(**encoded, mars_cost_table=STEEP, **common)
    assert fixed.plan_counts.get("fixed", 0) > 0 and fixed.accepted_counts.max() > 1
    steep = model.generate(**encoded, mars_cost_table=STEEP, mars_planner=True, **common)
    # no window of masks is bought: one mask at a re-probe, or where a row's accepted tokens widen
    # the step anyway (a column the batch pays for is filled for free)
    decode = steep.forward_widths[1:].tolist()
    assert max(decode) <= 2 and decode.count(1) >= 4, decode
    assert steep.plan_counts["plain"] > steep.plan_counts.get("linear", 0)
    assert steep.num_forwards > fixed.num_forwards
    flat = model.generate(**encoded, mars_cost_table=FLAT, mars_planner=True, **common)
    assert torch.equal(flat.sequences, fixed.sequences)
    assert torch.equal(flat.accepted_counts, fixed.accepted_counts)


# ---------------------------------------------------------------------------------------------------
# the cost table and its probe
# ---------------------------------------------------------------------------------------------------


def test_cost_table_interpolates_extrapolates_and_pads():
    table = CostTable.from_mapping({1: 2.0, 3: 4.0, 4: 3.0, 6: 5.0})  # relative to n = 1
    assert table.cost(1) == 1.0 and table.cost(2) == pytest.approx(1.5) and table.cost(4) == 1.5
    assert table.cost(5) == pytest.approx(2.0) and table.cost(8) == pytest.approx(3.5)  # last slope
    assert table.padded_width(3) == 4 and table.padded_width(2) == 2 and table.padded_width(5) == 5
    assert table.effective(3) == 1.5
    assert CostTable.from_mapping({2: 1.5}).cost(1) == 1.0  # 1 absent: taken as 1.0
    for bad in ({}, {0: 1.0}, {2: -1.0}, {1.5: 1.0}, [1.0]):
        with pytest.raises(ValueError, match="mars_cost_table"):
            CostTable.from_mapping(bad)


def test_generate_refuses_a_malformed_cost_table(tok):
    model = peaked_model("llama")
    with pytest.raises(ValueError, match="mars_cost_table"):
        _verify(model, _batch(tok), {1: float("nan")}, max_new_tokens=4)


def test_without_a_memory_a_cpu_plans_on_the_assumed_curve(tok):
    """No ``mars_cost_probe``, no ``mars_cost_table``: on a CPU verify plans on the assumed curve (each extra column
    ``ASSUMED_CPU_COLUMN_COST`` of one), exactly as if that curve were given, and nothing is timed; the linear layout
    stays the fixed feed. All of them are stock greedy's output."""
    model = peaked_model("llama")
    encoded = _batch(tok)
    common = dict(mars_acceptance="verify", max_new_tokens=48, do_sample=False, return_dict_in_generate=True)
    stock = model.generate(**encoded, max_new_tokens=48, do_sample=False)
    assumed = CostTable.assumed_cpu()
    assert assumed.cost(2) == pytest.approx(1 + cost_model.ASSUMED_CPU_COLUMN_COST)
    default = model.generate(**encoded, **common)
    auto = model.generate(**encoded, mars_layout="auto", **common)
    given = _verify(model, encoded, assumed.as_dict(), max_new_tokens=48)
    linear = model.generate(**encoded, mars_layout="linear", **common)
    assert default.cost_curve == assumed.as_dict() and set(linear.plan_counts) == {"fixed"}
    for out in (auto, given):
        assert torch.equal(out.forward_widths, default.forward_widths)
    # these masks are kept often enough to be fed even there (after the first re-probes), on fewer columns
    assert default.num_forwards < 48 and default.plan_counts["linear"] > 0
    assert int(default.forward_widths[1:].sum()) < int(linear.forward_widths[1:].sum())
    for out in (default, auto, given, linear):
        assert torch.equal(out.sequences, stock)


def test_the_probe_is_bounded_cached_and_changes_nothing(tok, monkeypatch):
    """A fresh model: the first verify call measures (its forwards are not the user's: the output
    equals stock and `num_forwards` counts only decoding); the second reuses the table; one-token
    decoding never measures. (The correction by observed forwards is off here: it would make the second
    call's plan, and so which batch sizes it needs a curve for, depend on this machine's timings; it has
    its own tests below.)"""
    from mars_hf.decoding import planner

    monkeypatch.setattr(planner, "observe", lambda model, table, width, seconds, rows=None: table)
    model = enable_mars(tiny_model("llama", seed=5))
    encoded = _batch(tok)
    calls, memory = [], PlannerMemory()
    handle = model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        calls.clear()
        model.generate(**encoded, max_new_tokens=8, do_sample=False, mars_threshold=1.0, mars_cost_probe=memory)
        assert len(calls) == 8  # τ = 1: no probe
        stock = model.generate(**encoded, max_new_tokens=10, do_sample=False)
        calls.clear()
        default = _verify(model, encoded, None, max_new_tokens=10)  # no memory: nothing measured (assumed curve)
        assert len(calls) == default.num_forwards and default.cost_curve == CostTable.assumed_cpu().as_dict()
        calls.clear()
        start = time.perf_counter()
        first = _verify(model, encoded, None, memory, max_new_tokens=10)
        elapsed = time.perf_counter() - start
        probed = len(calls) - first.num_forwards
        assert probed > 3 and first.cost_curve is not None and first.cost_curve[1] == 1.0
        assert elapsed < 120  # a hang guard, not a timing
        calls.clear()
        second = _verify(model, encoded, None, memory, max_new_tokens=10)
        assert len(calls) == second.num_forwards  # the table was kept in the caller's memory
        assert second.cost_curve == first.cost_curve
        assert torch.equal(first.sequences, stock) and torch.equal(second.sequences, stock)
    finally:
        handle.remove()


def test_the_probe_respects_its_budget():
    model = tiny_model("llama", seed=5)
    mask = model.config.mars["mask_token_id"]
    sizes = cost_model.probe_sizes(cost_model.candidate_widths(4))
    table = cost_model.measure(model, batch=2, sizes=sizes, mask_token_id=mask, budget_s=0.0)
    assert table.sizes[0] == 1 and table.costs[0] == 1.0 and len(table.sizes) >= 2
    assert table.source == "measured" and all(c > 0 for c in table.costs)
    # out of time: 1, 2 (where a straight line would err most) and the widest are still timed
    assert table.sizes == (1, 2, max(sizes))


def test_the_probe_stops_before_a_round_would_pass_its_budget(monkeypatch):
    """Every forward takes 0.05 s on a fake clock: rounds of five sizes take 0.25 s, so a 1 s budget holds
    the set-up (0.2 s) and three rounds; a fourth would end at 1.2 s and is not started."""
    model = tiny_model("llama", seed=5)
    clock = [0.0]

    class Clock:
        @staticmethod
        def perf_counter():
            return clock[0]

    monkeypatch.setattr(cost_model, "time", Clock)
    handle = model.register_forward_pre_hook(lambda *args: clock.__setitem__(0, clock[0] + 0.05))
    try:
        table = cost_model.measure(
            model, batch=1, sizes=[1, 2, 3, 4, 5], mask_token_id=model.config.mars["mask_token_id"], budget_s=1.0
        )
    finally:
        handle.remove()
    assert table.sizes == (1, 2, 3, 4, 5) and clock[0] == pytest.approx(0.95)


def test_the_probe_takes_each_widths_fastest_round(monkeypatch):
    """A forward is slowed by whatever else runs, never sped up: on a fake clock where a column costs 0.1 s
    plus 1 s for the first, two of three rounds of width 2 are slowed by 0.5 s (a busy spell); the curve
    reads the undisturbed cost, 1.1 / 1.0, where a median would read 1.6."""
    model = tiny_model("llama", seed=5)
    clock, calls = [0.0], {}

    class Clock:
        @staticmethod
        def perf_counter():
            return clock[0]

    def forward(module, args, kwargs):
        width = kwargs["input_ids"].shape[1]
        calls[width] = calls.get(width, 0) + 1
        slowed = width == 2 and calls[width] <= 2  # rounds 1 and 2 of 3 (the warm-up times widths 1 and 3)
        clock[0] += 1.0 + 0.1 * (width - 1) + (0.5 if slowed else 0.0)

    monkeypatch.setattr(cost_model, "time", Clock)
    handle = model.register_forward_pre_hook(forward, with_kwargs=True)
    try:
        table = cost_model.measure(
            model, batch=1, sizes=[1, 2, 3], mask_token_id=model.config.mars["mask_token_id"], budget_s=1e9, rounds=3
        )
    finally:
        handle.remove()
    assert table.as_dict() == pytest.approx({1: 1.0, 2: 1.1, 3: 1.2})


def test_decoding_forwards_correct_the_probes_curve():
    """A width's cost becomes the median of its last observed forwards over the recent one-column ones,
    once seen three times (a busy spell does not move it), for the rest of the process; a given curve
    is the user's and is never corrected."""
    probe = CostTable((1, 2, 9), (1.0, 1.75, 2.8), "measured", 4, unit_seconds=0.1)
    memory = PlannerMemory()
    memory.cost_tables["key"] = probe  # where cost_table() keeps the probe's reading
    table = probe
    for seconds in (0.1, 0.1, 0.12, 0.5):  # one-column forward, one more, then two 2-column ones
        table = cost_model.observe(memory, table, 1 if seconds == 0.1 else 2, seconds)
    assert table is probe  # two observations of 2 columns: not trusted yet
    table = cost_model.observe(memory, table, 2, 0.12)
    assert table.source == "observed" and table.batch == 4 and table.unit_seconds == 0.1
    assert table.cost(2) == pytest.approx(1.2) and table.cost(9) == 2.8  # 9 columns: not seen
    assert memory.cost_tables["key"] is table
    given = CostTable.from_mapping({1: 1.0, 2: 1.75})
    for _ in range(5):
        assert cost_model.observe(memory, given, 2, 0.01) is given


def test_a_wide_forward_is_compared_with_one_column_forwards_of_as_many_rows():
    """A batch bucket holds several row counts (a batch of 4 runs 3 rows once one finishes): a 3-row forward
    of 2 columns is compared with 3-row one-column forwards, not with the dearer 4-row ones."""
    probe = CostTable((1, 2), (1.0, 1.75), "measured", 4, unit_seconds=0.1)
    memory = PlannerMemory()
    memory.cost_tables["key"] = probe
    table = probe
    for _ in range(3):
        table = cost_model.observe(memory, table, 1, 0.075, rows=3)
        table = cost_model.observe(memory, table, 1, 0.1, rows=4)
    for _ in range(3):
        table = cost_model.observe(memory, table, 2, 0.09, rows=3)  # 1.2× a 3-row column (0.9× a 4-row one)
    assert table.source == "observed" and table.cost(2) == pytest.approx(1.2)
    memory = PlannerMemory()
    memory.cost_tables["key"] = probe
    table = probe
    for _ in range(3):  # no one-column forward of 2 rows seen yet: nothing to compare with
        table = cost_model.observe(memory, table, 2, 0.09, rows=2)
    assert table is probe


def test_one_slow_one_column_forward_does_not_make_wide_forwards_look_cheap():
    """A planner that believes wide steps cheap runs few one-column forwards, so one slowed by something else
    (a busy spell, a cache growing) must not become the unit: a 2-column forward is compared with the fastest
    recent one-column forward, and 0.15 s against 0.1 s is 1.5×, not 0.75× (which the curve would clamp to 1)."""
    probe = CostTable((1, 2), (1.0, 1.75), "measured", 4, unit_seconds=0.1)
    memory = PlannerMemory()
    memory.cost_tables["key"] = probe
    table = cost_model.observe(memory, probe, 1, 0.1)
    table = cost_model.observe(memory, table, 1, 0.3)  # one slow one-column forward beside a fast one
    for _ in range(3):
        table = cost_model.observe(memory, table, 2, 0.15)
    assert table.source == "observed" and table.cost(2) == pytest.approx(1.5)


def test_wide_forwards_wait_for_decodings_own_unit_which_a_plain_step_times():
    """The probe's one-column time (0.2 s here, a slow spell; on a scratch cache with no mask or step around
    it, in any case not a decoding forward) is never what a decoding forward is divided by: 2-column forwards
    of 0.15 s would read 0.75× (clamped to 1×), and a planner that believed it would never run the
    one-column forward that corrects it. They wait, and after UNIT_FIRST of them a plain step is due; its
    time becomes the unit and those forwards read 1.5× at once. The next one is due UNIT_REFRESH later."""
    probe = CostTable((1, 2), (1.0, 1.75), "measured", 4, unit_seconds=0.2)
    memory = PlannerMemory()
    memory.cost_tables["key"] = probe
    table = probe
    for _ in range(cost_model.UNIT_FIRST):
        assert not cost_model.unit_due(memory, table, 4)
        table = cost_model.observe(memory, table, 2, 0.15)
    assert table is probe  # nothing to compare them with yet
    assert cost_model.unit_due(memory, table, 4) and not cost_model.unit_due(memory, table, 3)
    table = cost_model.observe(memory, table, 1, 0.1)  # the plain step
    assert table.cost(2) == pytest.approx(1.5) and memory.cost_tables["key"] is table
    for _ in range(cost_model.UNIT_REFRESH - 1):
        table = cost_model.observe(memory, table, 2, 0.15)
    assert not cost_model.unit_due(memory, table, 4)
    table = cost_model.observe(memory, table, 2, 0.15)
    assert cost_model.unit_due(memory, table, 4)
    given = CostTable.from_mapping({1: 1.0, 2: 1.75})
    for _ in range(cost_model.UNIT_REFRESH + 1):
        cost_model.observe(memory, given, 2, 0.15)
    assert not cost_model.unit_due(memory, given, 4)  # the user's curve: never second-guessed


def _verify_after_a_flat_reading(model, encoded, monkeypatch, unit_seconds: float, max_new_tokens: int):
    """Verify after a probe that read a flat curve (one column in ``unit_seconds``), where the decoder's clock
    says every forward took as many seconds as it had columns; asserts stock greedy's output, returns it."""
    from mars_hf.decoding import decoder as decoder_module

    stock = model.generate(**encoded, max_new_tokens=max_new_tokens, do_sample=False)
    flat = lambda model, *, batch, **_: CostTable((1,), (1.0,), "measured", batch, unit_seconds)  # noqa: E731
    monkeypatch.setattr(cost_model, "measure", flat)
    widths = []

    class Clock:
        @staticmethod
        def perf_counter():
            return float(sum(widths))

    monkeypatch.setattr(decoder_module, "time", Clock)
    handle = model.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    try:
        out = _verify(model, encoded, None, PlannerMemory(), max_new_tokens=max_new_tokens)
    finally:
        handle.remove()
    assert torch.equal(out.sequences, stock)
    return out


def test_the_decoder_times_its_own_unit_with_a_plain_step(tok, monkeypatch):
    """The probe read a flat curve (its one column took 10 s, a slow spell) where every real forward takes as
    many seconds as it has columns: the planner feeds wide steps and runs no one-column forward. After
    UNIT_FIRST of them it runs one plain step (counted as ``unit``), whose time corrects the curve; the
    output stays stock greedy's."""
    model = peaked_model("llama")
    out = _verify_after_a_flat_reading(model, tok(["the cat sat"], return_tensors="pt"), monkeypatch, 10.0, 40)
    decode = out.forward_widths[1:].tolist()
    first = cost_model.UNIT_FIRST
    assert min(decode[:first]) > 1 and decode[first] == 1 and out.plan_counts["unit"] == 1
    widest = max(decode[:first])
    assert out.cost_curve[widest] == pytest.approx(widest)


def test_a_trusted_width_rebuilds_the_curve_only_when_its_median_moves():
    """Once trusted, a width's new forwards rebuild the curve only when they move its median by more than
    OBSERVED_TOLERANCE; the curve in use then holds the new median."""
    probe = CostTable((1, 2), (1.0, 1.75), "measured", 1, unit_seconds=0.1)
    memory = PlannerMemory()
    memory.cost_tables["key"] = probe
    table = cost_model.observe(memory, probe, 1, 0.1)
    for seconds in (0.12, 0.12, 0.12):
        table = cost_model.observe(memory, table, 2, seconds)
    assert table is not probe and table.cost(2) == pytest.approx(1.2)
    trusted = table
    for seconds in (0.121, 0.1205):  # the median stays within 2 % of 1.2: the same curve
        table = cost_model.observe(memory, table, 2, seconds)
    assert table is trusted
    for seconds in (0.15, 0.15, 0.15):  # the median moves to 1.5: a new curve that says so
        table = cost_model.observe(memory, table, 2, seconds)
    assert table is not trusted and table.cost(2) == pytest.approx(1.5)


def test_the_decoder_learns_the_curve_from_its_own_forwards(tok, monkeypatch):
    """The probe reads a flat curve (wide steps look free) but every real forward costs its width in
    seconds: once a wide width has been run three times the curve says so, and worthless masks go back
    to one-token steps. The output stays stock greedy's."""
    model = enable_mars(tiny_model("llama", seed=3))
    out = _verify_after_a_flat_reading(model, _batch(tok), monkeypatch, 1.0, 30)
    decode = out.forward_widths[1:].tolist()
    widest = max(decode)
    assert widest > 1 and decode.count(widest) >= 3  # the flat reading sent wide steps
    assert out.cost_curve[widest] == pytest.approx(widest)
    learned_at = [i for i, w in enumerate(decode) if w == widest][2]
    assert decode[learned_at + 1 :].count(1) > len(decode[learned_at + 1 :]) // 2


def test_rows_that_finish_mid_call_borrow_the_batch_curve_instead_of_probing(tok, monkeypatch):
    """Rows stop at different steps and leave the decoder, so the call passes through 2 rows, then 1: those
    buckets are not measured in the middle of the call (a probe of about two seconds each on a CPU), they
    borrow the call's own curve. A call that starts at 2 rows measures bucket 2, and a later call that
    shrinks to 2 rows takes that curve. The output is stock greedy's throughout."""
    model = peaked_model("llama")
    memory, measured = PlannerMemory(), []  # the caller's memory, kept across its calls

    def reading(model, *, batch, **_):
        measured.append(batch)
        return CostTable.from_mapping(MIDDLE, "measured", batch)

    monkeypatch.setattr(cost_model, "measure", reading)
    rows_fed = []
    handle = model.register_forward_pre_hook(
        lambda module, args, kwargs: rows_fed.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    stop = StoppingCriteriaList([StopOnToken(tok.convert_tokens_to_ids("three"))])
    encoded, pair = _batch(tok), _batch(tok, ["the cat sat", "one two"])
    try:
        stock = model.generate(**encoded, max_new_tokens=16, do_sample=False, stopping_criteria=stop)
        rows_fed.clear()
        out = _verify(model, encoded, None, memory, max_new_tokens=16, stopping_criteria=stop)
        assert {4, 2, 1} <= set(rows_fed)  # the batch shrank to 2 rows, then 1, while decoding
        assert measured == [4] and torch.equal(out.sequences, stock)
        _verify(model, pair, None, memory, max_new_tokens=16, stopping_criteria=stop)  # starts at 2 rows: measured
        assert measured == [4, 2]
        again = _verify(model, encoded, None, memory, max_new_tokens=16, stopping_criteria=stop)
        assert measured == [4, 2] and torch.equal(again.sequences, stock)
        feed = _bare_feed(model, memory)  # (the hook above is part of the curves' key: still attached)
        feed.cost_table(4)
        assert feed.cost_table(2).source in cost_model.REFINABLE  # the memory knows bucket 2: not borrowed
        borrowed = feed.cost_table(1)
        assert borrowed.source == "borrowed" and borrowed.as_dict() == feed.cost_table(4).as_dict()
        assert measured == [4, 2]
    finally:
        handle.remove()


def test_fixed_window_steps_never_start_a_probe_but_pad_to_a_known_curve(tok, monkeypatch):
    """τ with the paper's fixed window uses the cost curve only to pad a step to a cheaper width: that never
    pays for a probe (about two seconds on a CPU, in a call that may last a few), so a fresh process pads
    nothing; once the planner has measured the curve into the caller's memory (here one where 6 columns cost
    less than 3 to 5), τ steps given that memory are padded to it. Tokens and per-step counts are the same
    either way."""
    model = peaked_model("llama")
    memory, measured = PlannerMemory(), []
    dip = {1: 1.0, 2: 1.6, 3: 1.7, 5: 1.9, 6: 1.3, 8: 2.0}

    def reading(model, *, batch, **_):
        measured.append(batch)
        return CostTable.from_mapping(dip, "measured", batch)

    monkeypatch.setattr(cost_model, "measure", reading)
    monkeypatch.setattr(cost_model, "observe", lambda model, table, width, seconds, rows=None: table)
    encoded = tok(["the cat sat"], return_tensors="pt")
    tau = dict(max_new_tokens=16, do_sample=False, mars_threshold=0.5, mars_block_size=2)
    tau["return_dict_in_generate"] = True
    unpadded = model.generate(**encoded, **tau, mars_cost_probe=memory)
    flat = model.generate(**encoded, mars_cost_table={1: 1.0}, **tau)  # a flat curve never pads
    assert measured == [] and unpadded.forward_widths.tolist() == flat.forward_widths.tolist()
    _verify(model, encoded, None, memory, max_new_tokens=16, mars_block_size=2)  # the planner needs the curve
    assert measured == [1]
    padded = model.generate(**encoded, **tau, mars_cost_probe=memory)
    assert measured == [1]
    assert model.generate(**encoded, **tau).forward_widths.tolist() == flat.forward_widths.tolist()  # no memory
    pairs = list(zip(padded.forward_widths.tolist(), unpadded.forward_widths.tolist()))
    table = CostTable.from_mapping(dip)
    assert all(p in (w, table.padded_width(w)) for p, w in pairs) and any(p != w for p, w in pairs)
    assert torch.equal(padded.sequences, unpadded.sequences)
    assert torch.equal(padded.accepted_counts, unpadded.accepted_counts)


def _bare_feed(model, memory):
    """A bare ``StepPlanner`` on ``model`` measuring into ``memory`` (the planner's curves, nothing fed)."""
    return StepPlanner(model, MARSDecodingSettings.for_model(model, cost_memory=memory), pad_token_id=0)


def test_candidate_widths_cover_every_feed():
    widths = cost_model.candidate_widths(4)
    assert widths[:9] == list(range(1, 10)) and 25 in widths and max(widths) <= cost_model.MAX_PROBED_WIDTH
    assert (
        cost_model.batch_bucket(1) == 1
        and cost_model.batch_bucket(3) == 4
        and cost_model.batch_bucket(4) == 4
    )


def test_the_disk_cache_is_keyed_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv(cost_model.CACHE_ENV, str(tmp_path))
    model = tiny_model("qwen2", seed=9)
    mask = model.config.mars["mask_token_id"]
    table = cost_model.cost_table(model, batch_size=1, window=2, mask_token_id=mask, memory=PlannerMemory())
    files = list(tmp_path.iterdir())
    assert len(files) == 1 and table.source == "measured"
    again = tiny_model("qwen2", seed=9)  # another object, same everything: read from disk
    assert cost_model.cost_table(again, batch_size=1, window=2, mask_token_id=mask, memory=PlannerMemory()).source == "disk"
    cost_model.cost_table(again, batch_size=3, window=2, mask_token_id=mask, memory=PlannerMemory())  # another batch bucket
    assert len(list(tmp_path.iterdir())) == 2
    # the same home folder on another CPU (same model name and core count, other features): its own curve
    monkeypatch.setattr(cost_model, "cpu_flags", lambda: "fpu sse2 avx512f avx512_bf16 amx_tile")
    other = tiny_model("qwen2", seed=9)
    assert cost_model.cost_table(other, batch_size=1, window=2, mask_token_id=mask, memory=PlannerMemory()).source == "measured"
    assert len(list(tmp_path.iterdir())) == 3


def test_a_damaged_disk_curve_is_measured_again_and_rewritten(tmp_path, monkeypatch, caplog):
    """A truncated or nonsensical file (a crash mid-write on an older version, a hand edit) is never
    read as a curve: it is measured again and replaced whole (written aside, then renamed)."""
    monkeypatch.setenv(cost_model.CACHE_ENV, str(tmp_path))
    mask = tiny_model("qwen2", seed=9).config.mars["mask_token_id"]
    cost_model.cost_table(tiny_model("qwen2", seed=9), batch_size=1, window=2, mask_token_id=mask, memory=PlannerMemory())
    (path,) = tmp_path.iterdir()
    whole = path.read_text()
    for damaged in (whole[: len(whole) // 2], '{"sizes": [1, 2], "costs": [1.0, -3.0]}', "[]"):
        path.write_text(damaged)
        with caplog.at_level("WARNING", logger="mars_hf.decoding.cost_model"):
            table = cost_model.cost_table(tiny_model("qwen2", seed=9), batch_size=1, window=2, mask_token_id=mask, memory=PlannerMemory())
        assert table.source == "measured" and "Ignoring the MARS cost table" in caplog.text
        assert json.loads(path.read_text())["sizes"] == list(table.sizes)
        assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no partial file left behind
        caplog.clear()


# ---------------------------------------------------------------------------------------------------
# the position limit and W caps
# ---------------------------------------------------------------------------------------------------


def _gpt2(tok, positions=24):
    from transformers import AutoModelForCausalLM, GPT2Config

    from mars_hf.models.mask_token import add_mask_token, set_mars_config

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=64, n_positions=positions, n_embd=32, n_layer=2, n_head=4, eos_token_id=2,
        pad_token_id=2, bos_token_id=2,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float64, attn_implementation="eager").eval()
    mask = add_mask_token(model, tok)
    set_mars_config(model, block_size=4, mask_token_id=mask, memory=PlannerMemory())
    return enable_mars(model)


def test_an_absolute_position_model_decodes_to_its_last_position(tok):
    positions = 24
    model = _gpt2(tok, positions)
    encoded = tok(["the cat sat on the mat"], return_tensors="pt")
    max_new = positions - encoded.input_ids.shape[1]
    stock = model.generate(**encoded, max_new_tokens=max_new, do_sample=False)
    assert stock.shape[1] == positions
    for kwargs in (
        {"mars_acceptance": "verify", "mars_cost_table": FLAT},
        {"mars_acceptance": "verify", "mars_layout": "quadratic"},
        {"mars_acceptance": "verify", "mars_layout": "linear"},
        {"mars_threshold": 1.0},
    ):
        out = model.generate(**encoded, max_new_tokens=max_new, do_sample=False, **kwargs)
        assert torch.equal(out, stock), kwargs
    for tau in (0.0, 0.5):  # lossy, but never past the table
        out = model.generate(**encoded, max_new_tokens=max_new, do_sample=False, mars_threshold=tau)
        assert out.shape[1] <= positions


def test_an_absolute_position_batch_left_padded(tok):
    positions = 24
    model = _gpt2(tok, positions)
    encoded = _batch(tok)
    max_new = positions - encoded.input_ids.shape[1]
    stock = model.generate(**encoded, max_new_tokens=max_new, do_sample=False)
    out = model.generate(
        **encoded, max_new_tokens=max_new, do_sample=False, mars_acceptance="verify", mars_cost_table=FLAT
    )
    assert torch.equal(out, stock)


def test_a_huge_window_is_capped_by_max_new_tokens(tok):
    model = peaked_model("llama")
    encoded = _batch(tok)
    stock = model.generate(**encoded, max_new_tokens=8, do_sample=False)
    start = time.perf_counter()
    out = model.generate(
        **encoded, max_new_tokens=8, do_sample=False, mars_acceptance="verify", mars_block_size=5000,
        mars_layout="quadratic",
    )  # fmt: skip
    assert torch.equal(out, stock)
    capped = model.generate(
        **encoded, max_new_tokens=8, do_sample=False, mars_threshold=0.3, mars_block_size=7
    )
    huge = model.generate(
        **encoded, max_new_tokens=8, do_sample=False, mars_threshold=0.3, mars_block_size=10**6
    )
    assert torch.equal(capped, huge)
    assert time.perf_counter() - start < 120  # a hang guard, not a timing


def test_the_decoders_floor_sees_every_step_and_a_closed_floor_decodes_plain(tok, monkeypatch):
    """The floor is wired into decoding: it observes each step's served rows, and while it is closed a verify
    batch runs one-column steps only (still stock greedy's tokens); open, the same model drafts."""
    from mars_hf.decoding.stats import DraftingFloor

    model = peaked_model("llama")
    encoded = _batch(tok)
    stock = model.generate(**encoded, max_new_tokens=24, do_sample=False)
    seen = []
    observe = DraftingFloor.observe
    monkeypatch.setattr(DraftingFloor, "observe", lambda self, stats: (seen.append(len(stats)), observe(self, stats)))
    drafting = _verify(model, encoded, FLAT, max_new_tokens=24)
    assert torch.equal(drafting.sequences, stock) and max(drafting.forward_widths[1:].tolist()) > 1
    assert len(seen) == drafting.num_forwards and max(seen) == len(encoded.input_ids)
    monkeypatch.setattr(DraftingFloor, "observe", lambda self, stats: None)
    monkeypatch.setattr(DraftingFloor, "open", property(lambda self: False))  # closed for the whole call
    plain = _verify(model, encoded, FLAT, max_new_tokens=24)
    assert torch.equal(plain.sequences, stock) and max(plain.forward_widths[1:].tolist()) == 1


MILD = {1: 1.0, 2: 1.05, 9: 1.3, 10: 4.0, 64: 40.0}  # a second column is cheap: the prior's masks look worth it


def _measured_into_a_new_memory(monkeypatch, curve: dict) -> PlannerMemory:
    """A new ``PlannerMemory`` whose probe reads ``curve`` (no curve, floor or row statistics kept yet; observed
    forwards never refine it)."""
    from mars_hf.decoding import planner

    monkeypatch.setattr(cost_model, "measure", lambda model, *, batch, **_: CostTable.from_mapping(curve, "measured", batch))
    monkeypatch.setattr(planner, "observe", lambda memory, table, width, seconds, rows=None: table)
    return PlannerMemory()


def test_the_floor_of_a_measured_curve_is_shared_by_later_calls(tok, monkeypatch):
    """One floor per measured curve in the caller's memory, kept across calls: a second call continues the first
    one's floor (its step count goes on), and a floor that an earlier call closed keeps a later call on plain
    steps from its first step, where the same model's good masks otherwise draft. A given curve (a reproducible
    plan) keeps each call's own floor: nothing is shared. The output is stock greedy's throughout."""
    model = peaked_model("llama")
    memory, curve = _measured_into_a_new_memory(monkeypatch, MILD), MILD
    encoded = tok(["the cat sat on the"], return_tensors="pt")
    stock = model.generate(**encoded, max_new_tokens=24, do_sample=False)

    def wide_steps(table=None):
        out = _verify(model, encoded, table, memory if table is None else None, max_new_tokens=24)
        assert torch.equal(out.sequences, stock)
        return sum(w > 1 for w in out.forward_widths[1:].tolist()), len(out.forward_widths)

    assert wide_steps()[0] > 0  # these masks draft on this curve
    (floor,) = memory.floors.values()
    before = floor.steps
    _, forwards = wide_steps()
    assert floor.steps == before + forwards and list(memory.floors.values()) == [floor]
    floor.closed_until = floor.steps + 10_000  # as if earlier calls had found that drafting does not pay here
    assert wide_steps()[0] == 0
    repeating = tok(["one two three four one two three four one two"], return_tensors="pt")
    with_lookup = _verify(model, repeating, None, memory, max_new_tokens=24, prompt_lookup_num_tokens=4)
    assert torch.equal(with_lookup.sequences, model.generate(**repeating, max_new_tokens=24, do_sample=False))
    assert with_lookup.drafts_by_source["lookup"]["proposed"] > 0  # prompt lookup's rows: a floor of their own
    floors = memory.floors
    assert len(floors) == 2 and floors[next(k for k in floors if not k[1])] is floor
    assert wide_steps(curve)[0] > 0 and len(memory.floors) == 2  # given: its own floor


def test_a_new_verify_row_starts_from_what_the_models_last_row_observed(tok, monkeypatch):
    """Under a measured curve a new verify row starts from the masks' statistics of the model's last served
    row (acceptance per offset, gain, re-probe schedule), not from the prior: masks that did not pay on the
    first call are not tried again in the first steps of the next (they are re-probed on the shared schedule).
    Under a given curve every row starts from the prior. The output is stock greedy's throughout."""
    from mars_hf.decoding.decoder import RowSettings

    model = enable_mars(tiny_model("llama", seed=3), block_size=4)  # random masks: their drafts are never kept
    memory, curve = _measured_into_a_new_memory(monkeypatch, MILD), MILD
    encoded = tok(["the cat sat on the"], return_tensors="pt")
    stock = model.generate(**encoded, max_new_tokens=24, do_sample=False)

    def early_wide_steps(table=None):
        out = _verify(model, encoded, table, memory if table is None else None, max_new_tokens=24)
        assert torch.equal(out.sequences, stock)
        return sum(w > 1 for w in out.forward_widths[1:6].tolist())

    assert early_wide_steps(curve) > 0 and memory.mask_prior is None  # given: nothing kept
    assert early_wide_steps() > 0  # the first measured call tries the masks from the prior
    last = memory.mask_prior
    assert sum(last.reached) > 0 and last.kept[0] < 0.5 * last.reached[0]
    assert early_wide_steps() == 0  # the next starts from what the first found
    row = SimpleNamespace(row_id=7, verify=True, settings=RowSettings(acceptance="verify", max_new_tokens=24))
    fresh = StepPlanner(model, MARSDecodingSettings.for_model(model, cost_memory=memory), pad_token_id=0)
    fresh.add_row(row)
    inherited, last = fresh.stats[7].masks, memory.mask_prior
    assert inherited is not last and inherited.kept == last.kept and inherited.probe_every == last.probe_every
    given = StepPlanner(model, MARSDecodingSettings.for_model(model, cost_table=curve), pad_token_id=0)
    given.add_row(row)
    assert given.stats[7].masks.kept == [0.0] * 4 and given.stats[7].masks.gain == 1.0


def test_a_planner_memory_serves_one_model_and_copies_empty(tok):
    """A ``PlannerMemory`` keeps what one model's planner measured; a second model is refused by name, and a copy or
    an unpickled memory starts empty (what it held was measured for one process's model on one machine)."""
    import copy
    import pickle

    model, other = tiny_model("llama", seed=5), tiny_model("llama", seed=6)
    mask = model.config.mars["mask_token_id"]
    memory = PlannerMemory()
    table = cost_model.cost_table(model, batch_size=1, window=2, mask_token_id=mask, memory=memory)
    assert table.source == "measured" and list(memory.cost_tables.values()) == [table]
    with pytest.raises(ValueError, match="one PlannerMemory per model"):
        cost_model.cost_table(other, batch_size=1, window=2, mask_token_id=mask, memory=memory)
    for copied in (pickle.loads(pickle.dumps(memory)), copy.deepcopy(memory)):
        assert copied.cost_tables == {} and copied.floors == {} and copied.mask_prior is None
    memory.clear()
    assert memory.cost_tables == {} and "0 cost curves" in repr(memory)
    with pytest.raises(TypeError, match="PlannerMemory"):
        _verify(enable_mars(model), _batch(tok), None, "yes", max_new_tokens=2)
