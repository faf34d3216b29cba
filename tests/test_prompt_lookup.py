"""Prompt-lookup drafts verified in the MARS step (docs/method.md §5-§6).

The n-gram search is transformers' own (compared with its ``PromptLookupCandidateGenerator`` on the
same inputs); verify + lookup must be stock greedy token for token (tiny float64 models of several
architectures, left-padded batches with pad = EOS, prompts whose n-grams repeat so that lookup really
proposes and the model really keeps and rejects its drafts), and sampled verify + lookup must be
distributed as stock sampling (one-hot proposals in the speculative rule).
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

from mars_hf.decoding.acceptance import verify_drafts
from mars_hf.decoding.cost_model import CostTable
from mars_hf.decoding.drafts import DraftChooser, lookup_drafts
from mars_hf.decoding.generation import enable_mars
from mars_hf.decoding.sampling import gumbel_noise
from mars_hf.decoding.stats import AcceptanceStats, RowStats, SourceStats
from tests.test_generation import peaked_model
from tests.tiny import ARCHITECTURES, tiny_model, tiny_tokenizer

# n-grams repeat inside each prompt (and rows differ in length: left padding with pad = EOS)
REPEATING = [
    "the cat sat on a mat and one two three the cat sat on a mat and one",
    "print x if x in y else z print x if",
    "hello world",
    "one two three four five one two three four five six seven one two",
]
# drafts and wide feeds are cheap under this curve: the planner feeds lookup drafts and mask groups
CHEAP = {1: 1.0, 12: 1.1, 40: 1.6, 64: 3.0}


# one prompt whose n-grams repeat, copied into many rows by the sampling tests
SAMPLED_PROMPT = "the cat sat on a mat and one two three the cat sat on"


@pytest.fixture(scope="module")
def tok():
    tokenizer = tiny_tokenizer()
    tokenizer.padding_side = "left"
    return tokenizer


@pytest.fixture
def padded(tok):
    """Every REPEATING prompt in one batch: rows of different lengths, left-padded with pad = EOS."""
    return tok(REPEATING, return_tensors="pt", padding=True)


@pytest.fixture
def single(tok):
    """The first REPEATING prompt alone (no padding)."""
    return tok(REPEATING[:1], return_tensors="pt")


def _sampling_rows(tok, rows: int) -> dict:
    """SAMPLED_PROMPT copied ``rows`` times: one sampled run's rows estimate the output distribution."""
    prompt = tok([SAMPLED_PROMPT], return_tensors="pt")
    return {k: v.repeat(rows, 1) for k, v in prompt.items()}


def _assert_same_counts(a: torch.Tensor, b: torch.Tensor, where) -> None:
    """Two-sample chi-square of count vectors over the cells with > 10 draws, with a wide margin (mean +
    6 sd + 10), so a wrong distribution fails and sampling noise does not."""
    keep = (a + b) > 10
    statistic = float(((a - b)[keep] ** 2 / (a + b)[keep]).sum())
    degrees = max(int(keep.sum()) - 1, 1)
    assert statistic < degrees + 6 * (2 * degrees) ** 0.5 + 10, (where, statistic, degrees)


def _assert_same_token_distribution(stock: torch.Tensor, ours: torch.Tensor, vocab: int) -> None:
    """Each generated position is distributed alike in the two runs (``[rows, positions]`` token ids)."""
    for j in range(stock.shape[1]):
        a = torch.bincount(stock[:, j], minlength=vocab).double()
        b = torch.bincount(ours[:, j], minlength=vocab).double()
        _assert_same_counts(a, b, j)


def _lookup(model, encoded, **kwargs):
    kwargs.setdefault("do_sample", False)
    kwargs.setdefault("prompt_lookup_num_tokens", 6)
    return model.generate(**encoded, mars_acceptance="verify", return_dict_in_generate=True, **kwargs)


# ---------------------------------------------------------------------------------------------------
# the n-gram search is transformers'
# ---------------------------------------------------------------------------------------------------


def test_lookup_drafts_equal_transformers_prompt_lookup():
    rng = random.Random(0)
    checked = found = 0
    for trial in range(600):
        vocab = rng.choice([3, 5, 9])
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        k, n = rng.choice([1, 2, 5, 10]), rng.choice([1, 2, 3, 4])
        eos = [rng.randrange(vocab)] if trial % 3 == 0 else []
        generator = PromptLookupCandidateGenerator(
            eos_token_id=torch.tensor(eos) if eos else None,
            num_output_tokens=k,
            max_matching_ngram_size=n,
            max_length=10_000,
        )
        ids = torch.tensor([tokens])
        candidates, _ = generator.get_candidates(ids)
        expected = candidates[0, len(tokens) :].tolist()
        assert lookup_drafts(tokens, k, n, eos) == expected, (tokens, k, n, eos)
        checked += 1
        found += bool(expected)
    assert found > 300 and checked - found > 50  # both matches and misses were compared


def test_lookup_drafts_cases_and_errors():
    assert lookup_drafts([1, 2, 3, 1, 2], 2, 2) == [3, 1]  # the bigram (1, 2) recurs
    assert lookup_drafts([1, 2, 3, 1, 2], 9, 2, eos_token_ids={1}) == [3]  # cut before EOS
    assert lookup_drafts([5, 6, 7], 3, 2) == []
    assert lookup_drafts([4], 3, 2) == []
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens"):
        lookup_drafts([1, 2], 0, 2)


# ---------------------------------------------------------------------------------------------------
# greedy: verify + lookup == stock greedy
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_verify_with_lookup_equals_stock_greedy(arch, tok, padded):
    model = enable_mars(tiny_model(arch, seed=1))
    assert padded.attention_mask[:, 0].eq(0).any() and tok.pad_token_id == model.config.eos_token_id
    stock = model.generate(**padded, max_new_tokens=20, do_sample=False)
    proposed = accepted = 0
    for layout, cache in [("auto", "cursor"), ("linear", "cursor"), ("quadratic", "block"), ("auto", "none")]:
        out = _lookup(
            model,
            padded,
            max_new_tokens=20,
            mars_layout=layout,
            mars_cache=cache,
            mars_cache_block=3,
            mars_cost_table=CHEAP,
        )
        assert torch.equal(out.sequences, stock), (arch, layout, cache)
        lookup = out.drafts_by_source["lookup"]
        assert (
            lookup["proposed"] == int(out.drafts_proposed.sum()) - out.drafts_by_source["masks"]["proposed"]
        )
        proposed, accepted = proposed + lookup["proposed"], accepted + lookup["accepted"]
    assert accepted > 10 and proposed > accepted, (proposed, accepted)  # kept and rejected, really


def test_lookup_and_masks_share_a_run_and_stops_inside_lookup_drafts(tok, padded):
    """A model with useful masks: both sources' drafts are fed and kept; EOS, a stop criterion and
    max_new_tokens falling inside lookup drafts still give stock output."""
    model = peaked_model("llama")
    out = _lookup(model, padded, max_new_tokens=24, mars_cost_table=CHEAP)
    assert torch.equal(out.sequences, model.generate(**padded, max_new_tokens=24, do_sample=False))
    by_source = out.drafts_by_source
    assert by_source["masks"]["accepted"] > 0 and by_source["lookup"]["accepted"] > 0, by_source
    eos = tok.convert_tokens_to_ids("two")
    for max_new in (1, 2, 5, 11):
        for kwargs in ({}, {"eos_token_id": eos}):
            stock = model.generate(**padded, max_new_tokens=max_new, do_sample=False, **kwargs)
            for layout in ("auto", "linear"):
                run = _lookup(
                    model,
                    padded,
                    max_new_tokens=max_new,
                    mars_layout=layout,
                    mars_cost_table=CHEAP,
                    **kwargs,
                )
                assert torch.equal(run.sequences, stock), (max_new, kwargs, layout)


def test_max_matching_ngram_size_and_lookup_length_are_honoured(single):
    model = enable_mars(tiny_model("qwen2", seed=1))
    stock = model.generate(**single, max_new_tokens=16, do_sample=False)
    for k, n in [(1, 1), (3, 3), (10, 2)]:
        out = model.generate(
            **single,
            max_new_tokens=16,
            do_sample=False,
            mars_acceptance="verify",
            prompt_lookup_num_tokens=k,
            max_matching_ngram_size=n,
            mars_layout="linear",
            return_dict_in_generate=True,
        )
        assert torch.equal(out.sequences, stock)
        if out.drafts_by_source["lookup"]["proposed"]:
            assert int(out.drafts_proposed.max()) <= max(k, model.config.mars["block_size"])


# ---------------------------------------------------------------------------------------------------
# sampling: one-hot proposals
# ---------------------------------------------------------------------------------------------------


def test_one_hot_rule_reproduces_the_target_distribution():
    """A deterministic draft d is kept iff it is the row's keyed draw (sampling.py): with probability p(d);
    the token there is the draw, P(t) = p(t)."""
    p = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05], [0.1, 0.2, 0.3, 0.2, 0.2]], dtype=torch.float64)
    for draft in (0, 3):
        counts = torch.zeros(5, dtype=torch.float64)
        kept_total, trials = 0, 6000
        for k in range(trials):
            noises = [gumbel_noise(draft, 0, 2 * k + j, 5) for j in (0, 1)]
            own = [int((torch.log(p[j]).float() + noises[j]).argmax()) for j in (0, 1)]
            kept = verify_drafts([draft], own)
            token = own[kept]
            counts[draft if kept else token] += 1
            kept_total += kept
            assert kept or token != draft  # a rejected draft is never the replacement
        expected = p[0] * trials
        assert float(((counts - expected) ** 2 / expected).sum()) < 25.0, (draft, counts)
        assert abs(kept_total / trials - float(p[0, draft])) < 0.03


def test_sampled_verify_with_lookup_matches_stock_sampling_statistically(tok):
    model = peaked_model("qwen3")
    copies = _sampling_rows(tok, 400)
    kwargs = dict(max_new_tokens=5, do_sample=True, temperature=1.5, top_k=0)
    torch.manual_seed(1)
    stock = model.generate(**copies, **kwargs)[:, -5:]
    torch.manual_seed(2)
    out = _lookup(model, copies, mars_cost_table=CHEAP, **kwargs)
    ours = out.sequences[:, -5:]
    lookup = out.drafts_by_source["lookup"]
    assert lookup["accepted"] > 100 and lookup["proposed"] - lookup["accepted"] > 30, lookup
    vocab = model.config.vocab_size
    _assert_same_token_distribution(stock, ours, vocab)
    pair = lambda x: x[:, 1] * vocab + x[:, 2]  # noqa: E731
    a = torch.bincount(pair(stock), minlength=vocab * vocab).double()
    b = torch.bincount(pair(ours), minlength=vocab * vocab).double()
    _assert_same_counts(a, b, "positions 1-2 jointly")


# ---------------------------------------------------------------------------------------------------
# keywords and errors
# ---------------------------------------------------------------------------------------------------


def test_lookup_keywords_are_checked(single):
    model = enable_mars(tiny_model("llama"))
    with pytest.raises(ValueError, match="mars_acceptance='verify'"):
        model.generate(**single, max_new_tokens=4, mars_threshold=0.5, prompt_lookup_num_tokens=3)
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="prompt_lookup_num_tokens"):
            _lookup(model, single, max_new_tokens=4, **{"prompt_lookup_num_tokens": bad})
    with pytest.raises(ValueError, match="max_matching_ngram_size"):
        _lookup(model, single, max_new_tokens=4, max_matching_ngram_size=0)
    # without MARS settings it is transformers' own prompt lookup
    stock = model.generate(**single, max_new_tokens=8, do_sample=False)
    assert torch.equal(
        model.generate(**single, max_new_tokens=8, do_sample=False, prompt_lookup_num_tokens=3), stock
    )


def test_lookup_through_custom_generate_is_refused_naming_mars_hf(tmp_path, tok, padded):
    """The slim custom_generate/ has no prompt lookup (docs/hub.md): asking for it is an error that names
    mars_hf, never a silent decode without it."""
    from transformers import AutoModelForCausalLM

    from mars_hf import hub
    from tests.test_hub import confident_model

    model = confident_model("llama")
    folder = tmp_path / "ckpt"
    hub.save_pretrained(model, tok, folder, base_model="tiny")
    plain = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
    with pytest.raises(ValueError, match="mars_hf"):
        plain.generate(
            **padded,
            max_new_tokens=12,
            do_sample=False,
            custom_generate=str(folder),
            trust_remote_code=True,
            mars_acceptance="verify",
            prompt_lookup_num_tokens=4,
        )


# ---------------------------------------------------------------------------------------------------
# mars-hf serve: per-request prompt_lookup_num_tokens, acceptance by source in usage and /metrics
# ---------------------------------------------------------------------------------------------------


def test_serve_per_request_prompt_lookup(tok):
    import httpx2 as httpx

    from mars_hf.serving import BackgroundServer, ControllerConfig, ServerConfig, build_server

    model = peaked_model("llama")  # continues its grammar: lookup drafts are really kept
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    config = ServerConfig(
        model_id="tiny",
        max_rows=3,
        max_length=96,
        controller=ControllerConfig(tau_min=1.0, tau_max=1.0, enabled=False),
    )
    app, scheduler = build_server(model, tok, config)
    scheduler.engine.decoder.cost_given = CHEAP  # a fixed cost curve, not this busy host's
    with BackgroundServer(app) as server:
        url = server.base_url + "/v1/completions"
        kept = 0
        for prompt in (REPEATING[0], "the dog sat on a red and one two three the"):
            ids = torch.tensor([tok(prompt)["input_ids"]])
            greedy = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False
            )
            expected = tok.decode(greedy[0, ids.shape[1] :], skip_special_tokens=True)
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "mars_acceptance": "verify"}
            r = httpx.post(url, json={**body, "prompt_lookup_num_tokens": 5}, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == expected
            lookup = r.json()["usage"]["mars_drafts"].get("lookup", {"proposed": 0, "accepted": 0})
            kept += lookup["accepted"]
            assert lookup["proposed"] >= lookup["accepted"], lookup
            plain = httpx.post(url, json=body, timeout=60).json()
            assert plain["choices"][0]["text"] == expected and "lookup" not in plain["usage"]["mars_drafts"]
        assert kept > 0
        bad = [
            ({"prompt_lookup_num_tokens": 0, "mars_acceptance": "verify"}, "prompt_lookup_num_tokens"),
            ({"prompt_lookup_num_tokens": "5", "mars_acceptance": "verify"}, "prompt_lookup_num_tokens"),
            ({"prompt_lookup_num_tokens": 500, "mars_acceptance": "verify"}, "prompt_lookup_num_tokens"),
            ({"prompt_lookup_num_tokens": 3}, "prompt_lookup_num_tokens"),  # not verify
            ({"max_matching_ngram_size": 2, "mars_acceptance": "verify"}, "max_matching_ngram_size"),
        ]
        for extra, name in bad:
            r = httpx.post(url, json={"model": "tiny", "prompt": "x y", "max_tokens": 4, **extra}, timeout=60)
            assert r.status_code == 400 and name in r.json()["error"]["message"], (extra, r.text)
        metrics = httpx.get(server.base_url + "/metrics").text
        lines = [line for line in metrics.splitlines() if line.startswith("mars_drafts_")]
        assert any(line.startswith('mars_drafts_accepted_total{source="lookup"}') for line in lines), lines
        assert any(line.startswith('mars_drafts_proposed_total{source="lookup"}') for line in lines), lines


# ---------------------------------------------------------------------------------------------------
# mars-hf bench: the grounded prompt set and the prompt-lookup rows
# ---------------------------------------------------------------------------------------------------


def test_grounded_prompts_repeat_their_input():
    from mars_hf.tools.bench import grounded_prompts

    prompts = grounded_prompts()
    assert len(prompts) >= 12 and len(set(prompts)) == len(prompts)
    assert all(len(p.split()) >= 30 for p in prompts)  # each carries the text it asks to rework


def test_bench_cli_prompt_lookup_rows(tmp_path, capsys):
    import json

    from mars_hf.cli import main

    tokenizer = tiny_tokenizer()
    model = tiny_model("qwen2", dtype=torch.float32, tokenizer=tokenizer)
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(REPEATING) + "\n")
    common = ["bench", "--model", str(tmp_path / "model"), "--batch-sizes", "1,2", "--taus", "1.0"]
    common += [
        "--schemes",
        "stock",
        "--verify-layouts",
        "auto",
        "--prompt-lookup",
        "4",
        "--max-new-tokens",
        "6",
    ]
    common += ["--repeats", "1", "--warmup", "0", "--cost-repeats", "1", "--no-progress"]
    assert main(common + ["--prompts", str(prompts)]) == 0
    out = capsys.readouterr().out
    result = json.loads(next(line for line in out.splitlines() if line.startswith("JSON: "))[len("JSON: ") :])
    rows = [(r["batch"], r["scheme"], r["layout"], r["prompt_lookup_num_tokens"]) for r in result["rows"]]
    assert rows == [  # transformers' prompt lookup serves batch 1 only
        (1, "stock", None, None),
        (1, "cursor", "auto", None),
        (1, "stock", None, 4),
        (1, "cursor", "auto", 4),
        (2, "stock", None, None),
        (2, "cursor", "auto", None),
        (2, "cursor", "auto", 4),
    ]
    for row in result["rows"]:
        if row["acceptance"] == "verify":
            assert row["same_as_stock"] == 1.0
        if row["prompt_lookup_num_tokens"] and row["layout"]:
            # whether lookup pays depends on this host's measured cost curve: only the bookkeeping here
            assert set(row["drafts_by_source"]["lookup"]) == {"proposed", "accepted"}
            assert {"masks", "lookup"} <= set(row["tokens_per_forward_by_source"])
    assert "v-auto+pl" in out and "pl4" in out and "drafts by source" in out
    # the grounded set is built in
    assert main(common + ["--prompt-set", "grounded", "--num-prompts", "2", "--batch-sizes", "1"]) == 0
    out = capsys.readouterr().out
    result = json.loads(next(line for line in out.splitlines() if line.startswith("JSON: "))[len("JSON: ") :])
    assert result["num_prompts"] == 2 and len(result["rows"]) == 4


# ---------------------------------------------------------------------------------------------------
# assistant_model: a draft model's drafts verified by a MARS target (docs/method.md §5)
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("target_arch, assistant_arch", [("llama", "qwen3"), ("mistral", "qwen2")])
def test_verify_with_an_assistant_of_another_architecture_equals_stock_greedy(
    target_arch, assistant_arch, padded
):
    model, assistant = peaked_model(target_arch), peaked_model(assistant_arch)
    stock = model.generate(**padded, max_new_tokens=16, do_sample=False)
    kept = 0
    for layout in ("auto", "quadratic"):
        out = model.generate(
            **padded,
            max_new_tokens=16,
            do_sample=False,
            mars_acceptance="verify",
            assistant_model=assistant,
            num_assistant_tokens=4,
            mars_layout=layout,
            mars_cost_table=CHEAP,
            return_dict_in_generate=True,
        )
        assert torch.equal(out.sequences, stock), layout
        kept += out.drafts_by_source["assistant"]["accepted"]
    assert kept > 10
    # a random assistant: its drafts are mostly rejected, the output is still the target's
    stranger = tiny_model(assistant_arch, seed=3, block_size=None)
    out = model.generate(
        **padded,
        max_new_tokens=12,
        do_sample=False,
        mars_acceptance="verify",
        assistant_model=stranger,
        mars_cost_table=CHEAP,
        return_dict_in_generate=True,
    )
    assert torch.equal(out.sequences, stock[:, : out.sequences.shape[1]])


def test_sampled_verify_with_an_assistant_matches_stock_sampling_statistically(tok):
    model, assistant = peaked_model("qwen3"), peaked_model("llama")
    copies = _sampling_rows(tok, 1000)  # enough to see a wrong q
    kwargs = dict(max_new_tokens=4, do_sample=True, temperature=1.5, top_k=0)
    torch.manual_seed(1)
    stock = model.generate(**copies, **kwargs)[:, -4:]
    torch.manual_seed(2)
    out = model.generate(
        **copies,
        mars_acceptance="verify",
        assistant_model=assistant,
        num_assistant_tokens=3,
        mars_cost_table=CHEAP,
        return_dict_in_generate=True,
        **kwargs,
    )
    ours = out.sequences[:, -4:]
    counts = out.drafts_by_source["assistant"]
    assert counts["accepted"] > 100 and counts["proposed"] - counts["accepted"] > 30, counts
    _assert_same_token_distribution(stock, ours, model.config.vocab_size)


def test_a_row_whose_first_lookup_failed_tries_again_after_declined_matches():
    """One failed chain must not end prompt lookup for the row: each match it declines lets the failure
    fade, so after about a dozen it is worth trying again (on a curve where 2 columns cost 2.1x one,
    11 columns 2.4x, measured on one AVX2 CPU)."""
    table = CostTable.from_mapping({1: 1.0, 2: 2.14, 9: 2.36})
    row = SimpleNamespace(tokens=[1] * 20, committed=19, prefilled=True, lead=0)
    lookup = SourceStats(10)
    stats = RowStats(AcceptanceStats(2), lookup)
    assert DraftChooser.draft_value(row, stats, lookup.future(), table) > 0  # a first match is tried
    lookup.observe(10, 0)  # ... and fails at its first token
    assert DraftChooser.draft_value(row, stats, lookup.future(), table) == 0.0  # the next matches are declined
    declined = 0
    while DraftChooser.draft_value(row, stats, lookup.future(), table) == 0.0:
        lookup.forget()
        declined += 1
        assert declined < 30
    assert 5 <= declined <= 20
