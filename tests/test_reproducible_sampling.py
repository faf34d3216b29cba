"""Reproducible sampling (docs/verified_decoding.md, "Seeds and reproducibility"; mars_hf/decoding/sampling.py).

The same prompt, seed and settings give the same tokens whatever the plan (forced cost tables, layouts), the
kernels or the batch companions; τ = 1 sampling and verify sampling give the same text for the same seed.
float64 tiny models (float32 where kernels differ), so token equality is meaningful.
"""

from __future__ import annotations

import copy

import pytest
import torch

from mars_hf.decoding.decoder import MARSBatchDecoder, RowSettings
from mars_hf.decoding.sampling import gumbel_noise, position_seed
from mars_hf.decoding.settings import MARSDecodingSettings
from tests.test_generation import PROMPTS, _batch, peaked_model
from tests.tiny import tiny_tokenizer

FLAT = {1: 1.0, 16: 1.0}  # every width costs one column's: the planner feeds as much as it can
STEEP = {1: 1.0, 2: 4.0, 16: 60.0}  # extra columns are dear: the planner feeds (almost) nothing extra
SAMPLING = dict(do_sample=True, temperature=1.4, top_k=20, top_p=0.95)


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model():
    return peaked_model("llama")


def _sample(model, encoded, seed=0, **kwargs):
    kwargs.setdefault("max_new_tokens", 24)
    torch.manual_seed(seed)
    return model.generate(**encoded, return_dict_in_generate=True, **SAMPLING, **kwargs)


def test_verify_sampling_is_the_same_twice_and_under_any_plan(model, tok):
    """fault 4 of issue 52: flat vs steep cost tables (and the fixed layouts) changed the sample."""
    encoded = _batch(tok)
    flat = _sample(model, encoded, mars_acceptance="verify", mars_cost_table=FLAT)
    assert torch.equal(
        _sample(model, encoded, mars_acceptance="verify", mars_cost_table=FLAT).sequences, flat.sequences
    )
    steep = _sample(model, encoded, mars_acceptance="verify", mars_cost_table=STEEP)
    assert flat.num_forwards < steep.num_forwards  # the plans really differ
    assert int(flat.drafts_accepted.sum()) > 10 and int(flat.drafts_proposed.sum()) > int(
        flat.drafts_accepted.sum()
    )
    assert torch.equal(steep.sequences, flat.sequences)
    for layout in ("linear", "quadratic"):
        fixed = _sample(model, encoded, mars_acceptance="verify", mars_layout=layout)
        assert torch.equal(fixed.sequences, flat.sequences), layout
    for scheme in ("block", "none"):
        other = _sample(model, encoded, mars_acceptance="verify", mars_cost_table=FLAT, mars_cache=scheme)
        assert torch.equal(other.sequences, flat.sequences), scheme
    assert not torch.equal(
        _sample(model, encoded, seed=1, mars_acceptance="verify").sequences, flat.sequences
    )


def test_tau_one_sampling_equals_verify_sampling_for_the_same_seed(model, tok):
    """Both keep, at every position, the keyed draw of the model's own processed distribution; so does a
    prefix-dependent processor (repetition penalty, read at each provisional prefix)."""
    encoded = _batch(tok)
    for extra in ({}, {"repetition_penalty": 1.3}):
        tau_one = _sample(model, encoded, seed=5, mars_threshold=1.0, **extra)
        verify = _sample(model, encoded, seed=5, mars_acceptance="verify", mars_cost_table=FLAT, **extra)
        assert int(verify.drafts_accepted.sum()) > 0
        assert torch.equal(tau_one.sequences, verify.sequences), extra


def test_sampled_tau_is_the_same_under_any_cost_table(model, tok):
    """τ < 1 keeps the paper's fixed window by default: its samples never depend on the curve either."""
    encoded = _batch(tok)
    flat = _sample(model, encoded, mars_threshold=0.5, mars_cost_table=FLAT)
    assert int(flat.accepted_counts.max()) > 1
    assert torch.equal(
        _sample(model, encoded, mars_threshold=0.5, mars_cost_table=STEEP).sequences, flat.sequences
    )


def test_batch_companions_never_change_a_rows_sample(model, tok):
    """generate: row b's draws are keyed to the call's seed and b, so the same first prompt draws the same
    text alone and left-padded beside others. The decoder: a row with its own seed (a server request's)
    draws the same text whatever rows share its batch, and wherever its slot is."""
    single = tok(PROMPTS[:1], return_tensors="pt")
    alone = _sample(model, single, seed=3, mars_acceptance="verify").sequences[0, single.input_ids.shape[1] :]
    encoded = _batch(tok, [PROMPTS[0], PROMPTS[1]])
    batch = _sample(model, encoded, seed=3, mars_acceptance="verify").sequences[
        0, encoded.input_ids.shape[1] :
    ]
    assert encoded.attention_mask[0, 0] == 0  # the first prompt is left-padded beside the longer one
    assert batch[: len(alone)].tolist() == alone.tolist()

    window, mask = model.config.mars["block_size"], model.config.mars["mask_token_id"]
    prompts = [tok(p).input_ids for p in PROMPTS]

    def run(companions, acceptance):
        decoder = MARSBatchDecoder(
            model, MARSDecodingSettings(window=window, mask_token_id=mask), max_rows=4, max_length=64, pad_token_id=2
        )
        for prompt in companions:
            decoder.add_row(prompt, RowSettings(threshold=0.5, do_sample=True, max_new_tokens=16))
        settings = dict(threshold=0.5) if acceptance != "verify" else {}
        row = decoder.add_row(
            prompts[0],
            RowSettings(
                acceptance=acceptance, do_sample=True, temperature=1.3, max_new_tokens=16, seed=11, **settings
            ),
        )
        tokens, done = [], False
        while not done:
            for update in decoder.step():
                if update.row_id == row:
                    tokens += update.tokens
                    done = update.finished
        return tokens

    for acceptance in ("verify", "probability"):
        torch.manual_seed(0)
        first = run([], acceptance)
        torch.manual_seed(1)
        assert run(prompts[1:4], acceptance) == first, acceptance


def test_kernel_modes_draw_the_same_sample(model, tok):
    """float32, where packed kernels round multi-column forwards differently from stock: the keyed draw
    stays the same (the noise is float32 on the CPU, drawn apart from any forward)."""
    model32 = copy.deepcopy(model).float()  # peaked_model is shared by every test: never convert it in place
    encoded = _batch(tok)
    runs = [
        _sample(
            model32, encoded, seed=2, mars_acceptance="verify", mars_cost_table=FLAT, mars_cpu_kernels=mode
        )
        for mode in ("stock", "auto")
    ]
    assert torch.equal(runs[0].sequences, runs[1].sequences)


def test_greedy_tau_never_depends_on_the_cost_curve_without_the_planner(model, tok):
    """Greedy τ with the default fixed window: the curve changes only the padding of a step, never the tokens.
    With ``mars_planner=True`` the planner may shrink τ's window (docs/method.md §8, an explicit option):
    then the output is reproducible for a given table, and may differ between tables."""
    encoded = _batch(tok)
    greedy = dict(max_new_tokens=24, do_sample=False, mars_threshold=0.6, return_dict_in_generate=True)
    flat = model.generate(**encoded, mars_cost_table=FLAT, **greedy)
    assert torch.equal(model.generate(**encoded, mars_cost_table=STEEP, **greedy).sequences, flat.sequences)
    planned = model.generate(**encoded, mars_cost_table=STEEP, mars_planner=True, **greedy)
    again = model.generate(**encoded, mars_cost_table=STEEP, mars_planner=True, **greedy)
    assert torch.equal(planned.sequences, again.sequences)


def test_a_served_row_draws_the_same_tokens_after_a_failed_step_is_re_run(model, tok):
    """The server re-runs every row alone from its tokens so far after a failed step; a sampled request
    without a seed gets one when it is added, so the re-run row draws what it would have drawn."""
    from mars_hf.serving.engine import DecoderEngine

    prompt = tok(PROMPTS[1]).input_ids
    settings = RowSettings(acceptance="verify", do_sample=True, temperature=1.3, max_new_tokens=20)

    def run(fail_at_step):
        engine = DecoderEngine(model, max_rows=2, max_length=64)
        torch.manual_seed(4)
        row = engine.add_row(prompt, settings)
        tokens, steps = [], 0
        while True:
            decoder = engine.decoder
            if steps == fail_at_step:
                decoder.step = lambda: 1 / 0  # this step fails: the engine isolates and re-runs the row
            updates = engine.step()
            steps += 1
            finished = False
            for update in updates:
                assert update.row_id == row and not hasattr(update, "error")
                tokens += update.tokens
                finished = update.finished
            if finished:
                return tokens

    uninterrupted = run(fail_at_step=None)
    assert len(uninterrupted) == 20
    assert run(fail_at_step=2) == uninterrupted


# ---------------------------------------------------------------------------------------------------
# the keyed draw itself
# ---------------------------------------------------------------------------------------------------


def test_position_seed_is_the_documented_pure_function():
    """Pinned values: a copy of sampling.py (a checkpoint's custom_generate/) must replicate them bit for bit."""
    assert position_seed(0, 0, 0) == 0x238275BC38FCBE91
    assert position_seed(123, 4, 56) == 0x678BC1E1F3EE03A1
    assert position_seed(-1, 0, 0) == position_seed((1 << 64) - 1, 0, 0)  # seeds are taken modulo 2**64
    assert len({position_seed(7, r, t) for r in range(20) for t in range(200)}) == 4000
    first = gumbel_noise(7, 1, 9, 64)
    assert first.dtype == torch.float32 and torch.equal(first, gumbel_noise(7, 1, 9, 64))
    assert not torch.equal(first, gumbel_noise(7, 1, 10, 64)) and not torch.equal(
        first, gumbel_noise(7, 2, 9, 64)
    )


def test_the_keyed_draw_is_distributed_as_the_softmax():
    """argmax(log p + G(seed, row, t)) over many (row, t) keys: chi-square against p, with -inf filtered
    entries never drawn."""
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05, 0.0], dtype=torch.float64)
    logits = torch.log(p).float()
    counts = torch.zeros(6, dtype=torch.float64)
    trials = 6000
    for k in range(trials):
        counts[int((logits + gumbel_noise(3, k % 60, k // 60, 6)).argmax())] += 1
    assert counts[5] == 0
    expected = p[:5] * trials
    chi2 = float(((counts[:5] - expected) ** 2 / expected).sum())
    assert chi2 < 25.0, (counts, expected)  # 4 degrees of freedom: p < 1e-4
