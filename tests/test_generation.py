"""MARS decoding (docs/method.md §2) against stock ``generate`` and the slow reference decoder."""

from __future__ import annotations

import functools
import random

import pytest
import torch
from transformers import (
    GenerationMixin,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
    TextIteratorStreamer,
    TextStreamer,
)
from transformers.generation.streamers import BaseStreamer

import mars_hf
from mars_hf.decoding.enable import MARSModel
from mars_hf.decoding.generation import (
    MARSGenerateOutput,
    enable_mars,
    generate,
    mars_generate,
)
from tests.reference_decoder import reference_generate
from tests.tiny import tiny_model, tiny_tokenizer

PEAKED_ARCHS = ["llama", "qwen2", "qwen3"]
SCHEMES = ["cursor", "block", "none"]
PROMPTS = ["the cat sat", "hello world the dog sat on a", "one two", "a red"]


def _grammar_sentence(rng: random.Random, token_id) -> list[int]:
    """A synthetic language: mostly deterministic, with two binary choices per period."""
    words: list[str] = []
    while len(words) < 40:
        words += ["the", rng.choice(["cat", "dog"]), "sat", "on", "a", rng.choice(["mat", "red"])]
        words += ["and", "one", "two", "three"]
    return [token_id(w) for w in words]


@functools.cache
def peaked_model(arch: str, window: int = 4, steps: int = 250):
    """A tiny float64 model trained (AR + mask predictions) on the synthetic language.

    Its output distributions are peaked where the language is predictable and flat at the binary
    choices, so thresholds below 1 really accept several tokens and rows accept different counts.
    """
    tokenizer = tiny_tokenizer()
    model = tiny_model(arch, seed=0, block_size=window)
    mask = model.config.mars["mask_token_id"]
    rng = random.Random(0)
    torch.manual_seed(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(steps):
        batch = torch.tensor([_grammar_sentence(rng, tokenizer.convert_tokens_to_ids) for _ in range(16)])
        cut = rng.randint(3, 28)
        ar_logits = model(input_ids=batch[:, :30]).logits
        loss = torch.nn.functional.cross_entropy(ar_logits[:, :-1].flatten(0, 1), batch[:, 1:30].flatten())
        noisy = torch.cat([batch[:, :cut], torch.full((16, window), mask)], dim=1)
        mask_logits = model(input_ids=noisy).logits[:, cut : cut + window]
        loss = loss + torch.nn.functional.cross_entropy(
            mask_logits.flatten(0, 1), batch[:, cut + 1 : cut + 1 + window].flatten()
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    return enable_mars(model)


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def _batch(tok, prompts=PROMPTS):
    return tok(list(prompts), return_tensors="pt", padding=True)


def _rows(tok, encoded):
    """Each row's real prompt ids (padding read from the attention mask, never from token ids)."""
    return [ids[mask.bool()].tolist() for ids, mask in zip(encoded.input_ids, encoded.attention_mask)]


def _generated(output, prompt_length, pad_id, counts=None):
    """Per-row generated tokens; rows end where their accepted counts say (pad == eos here)."""
    sequences = output.sequences if hasattr(output, "sequences") else output
    rows = []
    for b, row in enumerate(sequences[:, prompt_length:].tolist()):
        n = int(counts[:, b].sum()) if counts is not None else len(row)
        rows.append(row[:n])
    return rows


def _reference_rows(model, tok, encoded, **kwargs):
    mask = model.config.mars["mask_token_id"]
    window = kwargs.pop("window", model.config.mars["block_size"])
    return [
        reference_generate(model, p, window=window, mask_token_id=mask, **kwargs) for p in _rows(tok, encoded)
    ]


class StopOnToken(StoppingCriteria):
    """A user stopping criterion (not an EOS criterion): stop right after ``token_id``."""

    def __init__(self, token_id):
        self.token_id = token_id

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token_id


# ---------------------------------------------------------------------------------------------
# τ = 1 is stock greedy decoding
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("window", [1, 3, 4])
def test_tau_one_equals_stock_greedy_left_padded_batch(arch, tok, window):
    model = enable_mars(tiny_model(arch))
    encoded = _batch(tok)
    stock = model.generate(**encoded, max_new_tokens=12, do_sample=False)
    for scheme in SCHEMES:
        ours = model.generate(
            **encoded,
            max_new_tokens=12,
            do_sample=False,
            mars_threshold=1.0,
            mars_block_size=window,
            mars_cache=scheme,
        )
        assert torch.equal(ours, stock), scheme
    # per-row τ all at 1 takes the same path
    ours = model.generate(**encoded, max_new_tokens=12, do_sample=False, mars_threshold=[1.0] * len(PROMPTS))
    assert torch.equal(ours, stock)


@pytest.mark.parametrize("arch", PEAKED_ARCHS)
def test_tau_one_equals_stock_with_eos_and_stopping_criterion(arch, tok):
    model = peaked_model(arch)
    encoded = _batch(tok)
    eos = tok.convert_tokens_to_ids("three")
    stop = StoppingCriteriaList([StopOnToken(tok.convert_tokens_to_ids("a"))])
    cases = [
        ({"eos_token_id": eos}, [eos]),
        ({"eos_token_id": [eos, tok.convert_tokens_to_ids("red")]}, [eos, tok.convert_tokens_to_ids("red")]),
        ({"stopping_criteria": stop}, [tok.convert_tokens_to_ids("a")]),
    ]
    prompt_length = encoded.input_ids.shape[1]
    for kwargs, stop_ids in cases:
        stock = model.generate(**encoded, max_new_tokens=15, do_sample=False, **kwargs)
        for scheme in SCHEMES:
            ours = model.generate(
                **encoded, max_new_tokens=15, do_sample=False, mars_threshold=1.0, mars_cache=scheme, **kwargs
            )
            assert torch.equal(ours, stock), (kwargs, scheme)
        # some row really stopped before the length limit
        assert torch.isin(stock[:, prompt_length:-1], torch.tensor(stop_ids)).any()


def test_tau_one_means_one_token_even_when_softmax_rounds_to_one(tok):
    model = peaked_model("llama")
    with torch.no_grad():
        model.lm_head.weight.mul_(1000.0)  # float32 softmax now rounds to exactly 1.0
    try:
        encoded = _batch(tok)
        out = model.generate(
            **encoded, max_new_tokens=8, do_sample=False, mars_threshold=1.0, return_dict_in_generate=True
        )
        assert out.accepted_counts.max() == 1
        probs = torch.softmax(model(**encoded).logits[:, -1].float(), -1).max(-1).values
        assert (probs == 1.0).any()
        # the general loop enforces it too (one row at τ = 1 next to one at τ = 0)
        out = model.generate(
            **encoded,
            max_new_tokens=8,
            do_sample=False,
            mars_threshold=[1.0, 0.0, 1.0, 0.0],
            return_dict_in_generate=True,
        )
        assert out.accepted_counts[:, 0].max() == 1 and out.accepted_counts[:, 1].max() > 1
    finally:
        with torch.no_grad():
            model.lm_head.weight.div_(1000.0)


# ---------------------------------------------------------------------------------------------
# τ < 1 equals the slow reference decoder, for every cache scheme
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", PEAKED_ARCHS)
@pytest.mark.parametrize("tau", [0.9, 0.5, 0.0])
def test_matches_reference_decoder(arch, tau, tok):
    model = peaked_model(arch)
    encoded = _batch(tok)
    prompt_length = encoded.input_ids.shape[1]
    reference = _reference_rows(
        model, tok, encoded, tau=tau, max_new_tokens=18, eos_token_ids=[tok.eos_token_id]
    )
    for scheme in SCHEMES:
        out = model.generate(
            **encoded,
            max_new_tokens=18,
            do_sample=False,
            mars_threshold=tau,
            mars_cache=scheme,
            mars_cache_block=3,
            return_dict_in_generate=True,
        )
        assert isinstance(out, MARSGenerateOutput)
        rows = _generated(out, prompt_length, tok.pad_token_id, out.accepted_counts)
        for b, (tokens, per_step) in enumerate(reference):
            assert rows[b] == tokens, (scheme, b)
            steps = [int(n) for n in out.accepted_counts[:, b] if n > 0]
            assert steps == per_step, (scheme, b)
        # acceptance really happened, and rows accepted different counts in the same step
        assert out.accepted_counts.max() > 1
        if tau > 0:
            assert any(len(set(step.tolist())) > 1 for step in out.accepted_counts)
        assert out.num_forwards == out.accepted_counts.shape[0]


@pytest.mark.parametrize(
    "acceptance,tau", [("entropy", 0.5), ("entropy", 0.0), ("margin", 0.6), ("margin", 0.0)]
)
def test_other_acceptance_metrics_match_reference(acceptance, tau, tok):
    model = peaked_model("qwen2")
    encoded = _batch(tok)
    reference = _reference_rows(
        model,
        tok,
        encoded,
        tau=tau,
        max_new_tokens=14,
        acceptance=acceptance,
        eos_token_ids=[tok.eos_token_id],
    )
    for scheme in SCHEMES:
        out = model.generate(
            **encoded,
            max_new_tokens=14,
            do_sample=False,
            mars_threshold=tau,
            mars_acceptance=acceptance,
            mars_cache=scheme,
            return_dict_in_generate=True,
        )
        rows = _generated(out, encoded.input_ids.shape[1], tok.pad_token_id, out.accepted_counts)
        assert rows == [r[0] for r in reference], scheme
    if tau > 0:
        assert out.accepted_counts.max() > 1


@pytest.mark.parametrize("max_new_tokens", [5, 7, 10])
@pytest.mark.parametrize("window", [2, 4])
def test_eos_and_max_new_tokens_inside_a_window(max_new_tokens, window, tok):
    """EOS (one id or several) and max_new_tokens hit in the middle of a multi-token step."""
    model = peaked_model("llama")
    encoded = _batch(tok)
    eos_ids = [tok.convert_tokens_to_ids("two"), tok.convert_tokens_to_ids("mat")]
    reference = _reference_rows(
        model, tok, encoded, tau=0.5, window=window, max_new_tokens=max_new_tokens, eos_token_ids=eos_ids
    )
    for scheme in SCHEMES:
        for cache_block in (1, 4):
            out = model.generate(
                **encoded,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                mars_threshold=0.5,
                mars_block_size=window,
                mars_cache=scheme,
                mars_cache_block=cache_block,
                eos_token_id=eos_ids,
                return_dict_in_generate=True,
            )
            rows = _generated(out, encoded.input_ids.shape[1], tok.pad_token_id, out.accepted_counts)
            assert rows == [r[0] for r in reference], (scheme, cache_block)
            assert out.sequences.shape[1] <= encoded.input_ids.shape[1] + max_new_tokens
            # finished rows are padded like stock generate pads them
            for b, tokens in enumerate(rows):
                assert out.sequences[b, encoded.input_ids.shape[1] + len(tokens) :].eq(tok.pad_token_id).all()
    stopped_early = [r for r in reference if r[0][-1] in eos_ids]
    assert stopped_early, "the test must exercise EOS"


def test_user_stopping_criterion_checked_token_by_token(tok):
    model = peaked_model("qwen3")
    encoded = _batch(tok)
    stop_id = tok.convert_tokens_to_ids("sat")
    reference = _reference_rows(model, tok, encoded, tau=0.0, max_new_tokens=16, stop_token_ids=[stop_id])
    for scheme in SCHEMES:
        out = model.generate(
            **encoded,
            max_new_tokens=16,
            do_sample=False,
            mars_threshold=0.0,
            mars_cache=scheme,
            eos_token_id=None,
            pad_token_id=tok.pad_token_id,
            stopping_criteria=StoppingCriteriaList([StopOnToken(stop_id)]),
            return_dict_in_generate=True,
        )
        rows = _generated(out, encoded.input_ids.shape[1], tok.pad_token_id, out.accepted_counts)
        assert rows == [r[0] for r in reference], scheme
    assert all(r[0][-1] == stop_id for r in reference) and min(len(r[0]) for r in reference) < 16


# ---------------------------------------------------------------------------------------------
# batching
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", PEAKED_ARCHS)
def test_batch_equals_each_prompt_alone(arch, tok):
    model = peaked_model(arch)
    encoded = _batch(tok)
    for scheme in SCHEMES:
        batched = model.generate(
            **encoded,
            max_new_tokens=16,
            do_sample=False,
            mars_threshold=0.7,
            mars_cache=scheme,
            return_dict_in_generate=True,
        )
        rows = _generated(batched, encoded.input_ids.shape[1], tok.pad_token_id, batched.accepted_counts)
        for b, prompt in enumerate(PROMPTS):
            alone = tok([prompt], return_tensors="pt")
            single = model.generate(
                **alone, max_new_tokens=16, do_sample=False, mars_threshold=0.7, mars_cache=scheme
            )
            assert rows[b] == single[0, alone.input_ids.shape[1] :].tolist()[: len(rows[b])], (scheme, b)
            assert single.shape[1] - alone.input_ids.shape[1] == len(rows[b])


def test_per_row_threshold_equals_each_row_alone(tok):
    model = peaked_model("llama")
    encoded = _batch(tok)
    taus = [1.0, 0.5, 0.0, 0.9]
    for scheme in SCHEMES:
        batched = model.generate(
            **encoded,
            max_new_tokens=14,
            do_sample=False,
            mars_threshold=torch.tensor(taus),
            mars_cache=scheme,
            return_dict_in_generate=True,
        )
        rows = _generated(batched, encoded.input_ids.shape[1], tok.pad_token_id, batched.accepted_counts)
        for b, (prompt, tau) in enumerate(zip(PROMPTS, taus)):
            alone = tok([prompt], return_tensors="pt")
            single = model.generate(
                **alone, max_new_tokens=14, do_sample=False, mars_threshold=tau, mars_cache=scheme
            )
            assert rows[b] == single[0, alone.input_ids.shape[1] :].tolist(), (scheme, b)
        assert batched.accepted_counts[:, 0].max() == 1 and batched.accepted_counts[:, 2].max() > 1


# ---------------------------------------------------------------------------------------------
# logits processors and sampling
# ---------------------------------------------------------------------------------------------


class NoImmediateRepeat(LogitsProcessor):
    """Bans the last token of ``input_ids``: only correct per position if the provisional prefix is used."""

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        scores.scatter_(1, input_ids[:, -1:], -float("inf"))
        return scores


def test_logits_processors_see_the_provisional_prefix(tok):
    model = peaked_model("qwen2")
    encoded = _batch(tok)
    processors = LogitsProcessorList([NoImmediateRepeat()])
    outputs = []
    for scheme in SCHEMES:
        out = model.generate(
            **encoded,
            max_new_tokens=16,
            do_sample=False,
            mars_threshold=0.3,
            mars_cache=scheme,
            logits_processor=processors,
            return_dict_in_generate=True,
        )
        outputs.append(out.sequences)
        assert out.accepted_counts.max() > 1
        for b, row in enumerate(
            _generated(out, encoded.input_ids.shape[1], tok.pad_token_id, out.accepted_counts)
        ):
            full = _rows(tok, encoded)[b] + row
            assert all(x != y for x, y in zip(full[-len(row) - 1 :], full[-len(row) :])), row
    assert all(torch.equal(outputs[0], o) for o in outputs)
    # at τ = 1 processors (repetition penalty, min_new_tokens) behave exactly as in stock generate
    kwargs = dict(max_new_tokens=12, do_sample=False, repetition_penalty=1.3, min_new_tokens=6)
    assert torch.equal(
        model.generate(**encoded, mars_threshold=1.0, **kwargs), model.generate(**encoded, **kwargs)
    )
    # with τ < 1 a position-dependent processor gives the same rows batched as alone
    batched = model.generate(**encoded, mars_threshold=0.5, **kwargs)
    for b, prompt in enumerate(PROMPTS):
        alone = tok([prompt], return_tensors="pt")
        single = model.generate(**alone, mars_threshold=0.5, **kwargs)
        n = single.shape[1] - alone.input_ids.shape[1]
        assert (
            batched[b, encoded.input_ids.shape[1] : encoded.input_ids.shape[1] + n].tolist()
            == single[0, -n:].tolist()
        )


def test_sampling_is_reproducible_with_a_seed(tok):
    model = peaked_model("llama")
    encoded = _batch(tok)
    kwargs = dict(max_new_tokens=14, do_sample=True, temperature=1.3, top_k=8, top_p=0.95, mars_threshold=0.6)
    runs = []
    for _ in range(2):
        torch.manual_seed(123)
        runs.append(model.generate(**encoded, return_dict_in_generate=True, **kwargs))
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    assert runs[0].accepted_counts.max() > 1
    for scheme in ("block", "none"):  # the cache scheme does not change what is sampled
        torch.manual_seed(123)
        assert torch.equal(model.generate(**encoded, mars_cache=scheme, **kwargs), runs[0].sequences)


def test_sampling_at_tau_one_matches_stock_sampling(tok):
    """τ = 1 sampling is distributed as stock sampling (its draws are keyed to the seed, row and position,
    mars_hf/decoding/sampling.py, so they are not stock's draws for the same seed)."""
    model = peaked_model("qwen3")
    prompt = tok(["the"], return_tensors="pt")
    kwargs = dict(max_new_tokens=3, do_sample=True, temperature=2.0, top_k=0)

    # statistical test on the first two generated tokens of many independent samples
    copies = {k: v.repeat(600, 1) for k, v in prompt.items()}
    torch.manual_seed(1)
    stock = model.generate(**copies, **kwargs)[:, -3:-1]
    torch.manual_seed(2)
    ours = model.generate(**copies, mars_threshold=1.0, **kwargs)[:, -3:-1]
    with torch.no_grad():
        first = torch.softmax(model(**prompt).logits[0, -1].float() / 2.0, -1)
    vocab = first.shape[0]
    for sample in (stock, ours):
        counts = torch.bincount(sample[:, 0], minlength=vocab).double()
        expected = first.double() * sample.shape[0]
        keep = expected > 5
        chi2 = (((counts - expected)[keep]) ** 2 / expected[keep]).sum()
        # chi-square with < 64 degrees of freedom: 120 is far in the tail (p < 1e-5)
        assert chi2 < 120, chi2
    # the second token depends on the first: compare the two samples with a two-sample chi-square
    second_stock = torch.bincount(stock[:, 1], minlength=vocab).double()
    second_ours = torch.bincount(ours[:, 1], minlength=vocab).double()
    total = second_stock + second_ours
    keep = total > 10
    statistic = ((second_stock - second_ours)[keep] ** 2 / total[keep]).sum()
    degrees = int(keep.sum()) - 1
    assert statistic < degrees + 6 * (2 * degrees) ** 0.5 + 10, (statistic, degrees)


# ---------------------------------------------------------------------------------------------
# streamers, outputs, entry points
# ---------------------------------------------------------------------------------------------


class Recorder(BaseStreamer):
    def __init__(self):
        self.chunks = []
        self.ended = False

    def put(self, value):
        self.chunks.append(value.tolist())

    def end(self):
        self.ended = True


@pytest.mark.parametrize("scheme", SCHEMES)
def test_streamer_receives_exactly_the_final_tokens(scheme, tok):
    model = peaked_model("llama")
    prompt = tok(["hello world the dog sat on a"], return_tensors="pt")
    recorder = Recorder()
    out = model.generate(
        **prompt,
        max_new_tokens=15,
        do_sample=False,
        mars_threshold=0.5,
        mars_cache=scheme,
        streamer=recorder,
        return_dict_in_generate=True,
    )
    assert recorder.chunks[0] == prompt.input_ids.tolist()
    streamed = [t for chunk in recorder.chunks[1:] for t in chunk]
    assert streamed == out.sequences[0, prompt.input_ids.shape[1] :].tolist()
    assert [len(c) for c in recorder.chunks[1:]] == [n for n in out.accepted_counts[:, 0].tolist() if n]
    assert recorder.ended and out.accepted_counts.max() > 1
    # the callable form on a plain model: transformers does not hand `streamer` to a decoding
    # callable, so it travels as `mars_streamer` (the prompt once, then the final tokens, then the end)
    recorder = Recorder()
    GenerationMixin.generate(
        model,
        **prompt,
        max_new_tokens=15,
        do_sample=False,
        custom_generate=mars_generate,
        mars_threshold=0.5,
        mars_cache=scheme,
        mars_streamer=recorder,
    )
    assert recorder.chunks[0] == prompt.input_ids.tolist()
    assert [t for chunk in recorder.chunks[1:] for t in chunk] == streamed
    assert recorder.ended


@pytest.mark.parametrize("mars", [{"mars_threshold": 0.5}, {"mars_acceptance": "verify"}])
def test_a_batch_streams_whole_output_columns_as_stock_does(mars, tok):
    """Stock `generate` puts one ``(batch,)`` column per step, and the columns stack to the output's new tokens.
    Rows keep different numbers of tokens per step here, so a column is sent once every running row has filled
    it: the same columns (verify: the same as stock's, one by one), never a pad in the middle of a row."""
    model = peaked_model("llama")
    encoded = _batch(tok)
    kwargs = dict(max_new_tokens=14, do_sample=False, eos_token_id=tok.convert_tokens_to_ids("three"))
    stock_recorder, recorder = Recorder(), Recorder()
    stock = model.generate(**encoded, streamer=stock_recorder, **kwargs)
    out = model.generate(
        **encoded, streamer=recorder, return_dict_in_generate=True, mars_cost_table={1: 1.0}, **mars, **kwargs
    )
    prompt_length = encoded.input_ids.shape[1]
    assert recorder.chunks[0] == encoded.input_ids.tolist() and recorder.ended
    assert all(len(column) == len(PROMPTS) for column in recorder.chunks[1:])
    assert torch.tensor(recorder.chunks[1:]).T.tolist() == out.sequences[:, prompt_length:].tolist()
    assert len(set(out.accepted_counts[out.accepted_counts > 0].tolist())) > 1  # rows kept unequal counts
    if "mars_acceptance" in mars:
        assert torch.equal(out.sequences, stock) and recorder.chunks == stock_recorder.chunks


def test_text_streamers(tok, capsys):
    model = peaked_model("qwen2")
    prompt = tok(["the cat sat"], return_tensors="pt")
    out = model.generate(
        **prompt,
        max_new_tokens=12,
        do_sample=False,
        mars_threshold=0.5,
        streamer=TextStreamer(tok, skip_prompt=True),
    )
    text = tok.decode(out[0, prompt.input_ids.shape[1] :])
    assert capsys.readouterr().out.strip() == text.strip()
    streamer = TextIteratorStreamer(tok, skip_prompt=True)
    model.generate(**prompt, max_new_tokens=12, do_sample=False, mars_threshold=0.5, streamer=streamer)
    assert "".join(streamer).strip() == text.strip()


def test_return_dict_fields_are_exact(tok):
    model = peaked_model("qwen3")
    encoded = _batch(tok)
    prompt_length = encoded.input_ids.shape[1]
    calls = []
    handle = model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        out = model.generate(
            **encoded,
            max_new_tokens=13,
            do_sample=False,
            mars_threshold=0.8,
            mars_cost_table={1: 1.0},  # no cost probe: every model call is a decoding step
            return_dict_in_generate=True,
            output_scores=True,
            output_logits=True,
        )
    finally:
        handle.remove()
    assert out.num_forwards == len(calls) == out.accepted_counts.shape[0] == len(out.forward_widths)
    assert out.accepted_counts.dtype == torch.long and out.accepted_counts.shape[1] == len(PROMPTS)
    generated = out.sequences.shape[1] - prompt_length
    assert len(out.scores) == len(out.logits) == generated
    for b in range(len(PROMPTS)):
        n = int(out.accepted_counts[:, b].sum())
        tokens = out.sequences[b, prompt_length : prompt_length + n]
        assert torch.equal(torch.stack([s[b] for s in out.scores[:n]]).argmax(-1), tokens)
        finished_at = (out.accepted_counts[:, b] > 0).nonzero().max()
        assert (out.accepted_counts[finished_at + 1 :, b] == 0).all()
    # at τ = 1 the layout and the scores are stock generate's
    stock = model.generate(
        **encoded, max_new_tokens=6, do_sample=False, return_dict_in_generate=True, output_scores=True
    )
    ours = model.generate(
        **encoded,
        max_new_tokens=6,
        do_sample=False,
        return_dict_in_generate=True,
        output_scores=True,
        mars_threshold=1.0,
    )
    assert torch.equal(stock.sequences, ours.sequences) and ours.num_forwards == 6
    assert all(torch.equal(a, b) for a, b in zip(stock.scores, ours.scores))


def test_without_threshold_generate_is_stock(tok, arch):
    plain = tiny_model(arch)
    encoded = _batch(tok)
    expected = plain.generate(**encoded, max_new_tokens=8, do_sample=False)
    model = enable_mars(plain)
    assert isinstance(model, MARSModel) and model.get_base_model() is plain
    assert torch.equal(model.generate(**encoded, max_new_tokens=8, do_sample=False), expected)
    assert torch.equal(
        model.generate(**encoded, max_new_tokens=8, do_sample=False, mars_threshold=None), expected
    )
    with pytest.raises(ValueError, match="mars_threshold"):
        model.generate(**encoded, max_new_tokens=8, mars_block_size=2)


def test_entry_points_agree(tok, tmp_path):
    model = peaked_model("llama")
    encoded = _batch(tok)
    kwargs = dict(max_new_tokens=10, do_sample=False, mars_threshold=0.5)
    expected = model.generate(**encoded, **kwargs)
    plain = tiny_model("llama")
    plain.load_state_dict(model.state_dict())
    plain.config.mars = dict(model.config.mars)
    assert torch.equal(plain.generate(**encoded, custom_generate=mars_generate, **kwargs), expected)
    assert mars_hf.mars_generate is mars_generate
    assert torch.equal(generate(plain, **encoded, **kwargs), expected)
    # the string form: this module shipped verbatim as custom_generate/generate.py (+ its siblings)
    from mars_hf.hub.custom_generate import write_custom_generate

    write_custom_generate(tmp_path / "custom_generate")
    out = plain.generate(**encoded, custom_generate=str(tmp_path), trust_remote_code=True, **kwargs)
    assert torch.equal(out, expected)
    stock = plain.generate(**encoded, max_new_tokens=10, do_sample=False)
    assert torch.equal(
        plain.generate(
            **encoded,
            custom_generate=str(tmp_path),
            trust_remote_code=True,
            max_new_tokens=10,
            do_sample=False,
        ),
        stock,
    )
    # enable_mars keywords override config.mars
    plain = enable_mars(plain, block_size=2)
    out = plain.generate(**encoded, return_dict_in_generate=True, **kwargs)
    assert torch.equal(out.sequences, model.generate(**encoded, mars_block_size=2, **kwargs))
    assert plain.config.mars["block_size"] == 4


# ---------------------------------------------------------------------------------------------
# errors that name the fix
# ---------------------------------------------------------------------------------------------


def test_clear_errors(tok):
    model = enable_mars(tiny_model("llama"))
    encoded = _batch(tok)

    def run(**kwargs):
        return model.generate(**encoded, max_new_tokens=4, **kwargs)

    for tau in (1.5, -0.1):
        for acceptance in ("probability", "margin"):
            with pytest.raises(ValueError, match=r"\[0, 1\]"):
                run(mars_threshold=tau, mars_acceptance=acceptance)
    with pytest.raises(ValueError, match=">= 0"):
        run(mars_threshold=-0.5, mars_acceptance="entropy")
    run(mars_threshold=3.0, mars_acceptance="entropy")  # an entropy bound may exceed 1
    with pytest.raises(ValueError, match=">= 1"):
        run(mars_threshold=0.5, mars_block_size=0)
    with pytest.raises(ValueError, match="rows"):
        run(mars_threshold=[0.5, 0.5])
    with pytest.raises(ValueError, match="mars_acceptance"):
        run(mars_threshold=0.5, mars_acceptance="confidence")
    with pytest.raises(ValueError, match="mars_cache"):
        run(mars_threshold=0.5, mars_cache="paged")
    with pytest.raises(ValueError, match="beam"):
        run(mars_threshold=0.5, num_beams=2)
    from transformers.generation.logits_process import UnbatchedClassifierFreeGuidanceLogitsProcessor

    # classifier-free guidance runs the model itself once per new token: it crashed (float64) or guided wrongly
    for mars in ({"mars_threshold": 1.0}, {"mars_acceptance": "verify"}):
        with pytest.raises(ValueError, match="guidance_scale"):
            run(guidance_scale=1.5, do_sample=False, **mars)
        guidance = UnbatchedClassifierFreeGuidanceLogitsProcessor(1.5, model)
        with pytest.raises(ValueError, match="guidance_scale"):
            run(logits_processor=LogitsProcessorList([guidance]), do_sample=False, **mars)

    no_mask = tiny_model("llama", block_size=None)
    with pytest.raises(ValueError, match="add_mask_token"):
        no_mask.generate(
            **encoded, max_new_tokens=4, custom_generate=mars_generate, mars_threshold=0.5, mars_block_size=4
        )
    with pytest.raises(ValueError, match="mask token|MARS window"):
        no_mask = enable_mars(no_mask)
    with pytest.raises(ValueError, match="mars_threshold"):
        model.generate(**encoded, max_new_tokens=4, custom_generate=mars_generate)

    from transformers import DynamicCache

    class FrozenCache(DynamicCache):
        is_croppable = False

    with pytest.raises(ValueError, match="cannot be cropped"):
        run(mars_threshold=0.5, cache=FrozenCache())


def test_a_threshold_per_prompt_serves_each_of_its_return_sequences(tok):
    """transformers repeats each prompt ``num_return_sequences`` times side by side: one τ per prompt is that
    prompt's for every one of its sequences (the call used to be refused for a count that was not the rows')."""
    model = peaked_model("llama")
    encoded = _batch(tok, PROMPTS[:2])
    kwargs = dict(max_new_tokens=10, do_sample=True, num_return_sequences=2, return_dict_in_generate=True)
    torch.manual_seed(0)
    per_prompt = model.generate(**encoded, mars_threshold=[0.0, 1.0], **kwargs)
    torch.manual_seed(0)
    per_row = model.generate(**encoded, mars_threshold=[0.0, 0.0, 1.0, 1.0], **kwargs)
    assert torch.equal(per_prompt.sequences, per_row.sequences)
    counts = per_prompt.accepted_counts
    assert counts[:, :2].max() > 1 and counts[:, 2:].max() <= 1  # τ = 0 keeps masks; τ = 1 one token per step
    with pytest.raises(ValueError, match="num_return_sequences=2"):
        model.generate(**encoded, mars_threshold=[0.5, 0.5, 0.5], **kwargs)


def test_tau_one_feeds_no_masks_at_all(tok):
    """One-token mode is plain decoding: one new column per forward, never a mask token."""
    model = peaked_model("llama")
    encoded = _batch(tok)
    mask_id = model.config.mars["mask_token_id"]
    fed = []
    handle = model.register_forward_pre_hook(lambda m, a, k: fed.append(k["input_ids"]), with_kwargs=True)
    try:
        for scheme in ("cursor", "block"):
            fed.clear()
            out = model.generate(
                **encoded,
                max_new_tokens=9,
                do_sample=False,
                mars_threshold=1.0,
                mars_cache=scheme,
                return_dict_in_generate=True,
            )
            assert [ids.shape[1] for ids in fed] == [encoded.input_ids.shape[1]] + [1] * (
                out.num_forwards - 1
            )
            assert not any((ids == mask_id).any() for ids in fed)
    finally:
        handle.remove()


def test_suppressed_tokens_are_never_generated_and_tau_one_stays_stock():
    """`suppress_tokens` (used to keep a tied mask row out of the output) takes the batched processor path."""
    from mars_hf import enable_mars
    from tests.tiny import tiny_model, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    model = tiny_model("llama", seed=3)
    prompt = tokenizer(["hello world the cat", "one two"], return_tensors="pt", padding=True)
    stock = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    banned = int(stock[0, prompt["input_ids"].shape[1]])  # the first token stock greedy would pick
    model = enable_mars(model)
    expected = model.generate(**prompt, max_new_tokens=12, do_sample=False, suppress_tokens=[banned])
    for tau in (1.0, 0.0):
        out = model.generate(
            **prompt, max_new_tokens=12, do_sample=False, suppress_tokens=[banned], mars_threshold=tau
        )
        assert not (out[:, prompt["input_ids"].shape[1] :] == banned).any()
        if tau == 1.0:
            assert torch.equal(out, expected)


@pytest.mark.parametrize("scheme", ["cursor", "block"])
@pytest.mark.parametrize("window", [1, 2])
def test_forwards_are_padded_to_a_cheaper_measured_width_without_changing_anything(scheme, window, tok):
    """A step that carries masks runs at the cheapest width of the cost curve at least as wide as it
    needs (a curve where 4 columns cost less than 2 or 3, as CPU kernels can make it): padding columns
    after everything real. Tokens, per-step counts and forward counts equal the unpadded run's (a flat
    curve never pads) and the reference decoder's. Two runs: τ = 0.5 (several tokens per step), and an
    entropy bound of 0, which never accepts a mask, so that every step but the last feeds 1 + W < 4
    columns on any host."""
    from mars_hf.decoding.cost_model import CostTable

    model = peaked_model("llama")
    encoded = tok(["the cat sat"], return_tensors="pt")
    prompt_length = encoded.input_ids.shape[1]
    dip = {1: 1.0, 2: 1.6, 3: 1.7, 4: 1.3, 8: 2.0}
    table = CostTable.from_mapping(dip)
    widths = []
    handle = model.register_forward_pre_hook(
        lambda m, a, k: widths.append(k["input_ids"].shape[1]), with_kwargs=True
    )
    try:
        for acceptance, tau in (("probability", 0.5), ("entropy", 0.0)):
            kwargs = dict(
                max_new_tokens=16,
                do_sample=False,
                mars_threshold=tau,
                mars_acceptance=acceptance,
                mars_block_size=window,
                mars_cache=scheme,
                mars_cache_block=3,
                return_dict_in_generate=True,
            )
            widths.clear()
            padded = model.generate(**encoded, mars_cost_table=dip, **kwargs)
            padded_widths = list(widths)
            widths.clear()
            plain = model.generate(**encoded, mars_cost_table={1: 1.0}, **kwargs)
            plain_widths = list(widths)
            assert padded_widths == padded.forward_widths.tolist() and plain_widths == plain.forward_widths.tolist()
            assert all(p in (w, table.padded_width(w)) for p, w in zip(padded_widths, plain_widths))
            assert torch.equal(padded.sequences, plain.sequences)
            assert torch.equal(padded.accepted_counts, plain.accepted_counts)
            assert padded.num_forwards == plain.num_forwards
            ((tokens, per_step),) = _reference_rows(
                model,
                tok,
                encoded,
                window=window,
                tau=tau,
                acceptance=acceptance,
                max_new_tokens=16,
                eos_token_ids=[tok.eos_token_id],
            )
            assert _generated(padded, prompt_length, tok.pad_token_id, padded.accepted_counts)[0] == tokens
            assert [int(n) for n in padded.accepted_counts[:, 0] if n > 0] == per_step
            if acceptance == "entropy":  # the padding really happened: every step but the last was short
                assert min(plain_widths[1:-1]) < 4 and min(padded_widths[1:-1]) >= 4
                assert plain_widths[-1] == padded_widths[-1]  # the last token needs no mask: never padded
            else:
                assert padded.accepted_counts.max() > 1
    finally:
        handle.remove()
