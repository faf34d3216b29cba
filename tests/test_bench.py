"""The benchmark reports what really happened: its counts are re-derived here independently.

No timing thresholds (speed is the benchmark's job, not a unit test's); only that every number the
table claims is consistent with the outputs and with an independent count of model calls.
"""

import dataclasses
import json
import math
import random
import statistics

import pytest
import torch

from mars_hf.decoding import cost_model
from mars_hf.decoding.cost_model import CostTable
from mars_hf.tools.bench import (
    BenchArguments,
    BenchConfiguration,
    build_configurations,
    count_generated_tokens,
    format_table,
    prepare_inputs,
    run_benchmark,
)
from mars_hf.tools.bench.divergences import is_lossless
from mars_hf.tools.synthetic import synthetic_examples, synthetic_pair, synthetic_prompts, synthetic_tokenizer
from tests.tiny import tiny_model, tiny_tokenizer

PROMPTS = ["the cat sat on the mat", "one two three", "hello world print x", "a red dog is not blue"]


def test_build_configurations_grid():
    configurations = build_configurations([1.0, 0.9], [4, 16], cache_blocks=["W", 16, 32])
    assert configurations[0] == BenchConfiguration("stock")
    # tau = 1 is one-token mode: only the default scheme runs there.
    assert [c for c in configurations if c.tau == 1.0] == [
        BenchConfiguration("cursor", 1.0, 4),
        BenchConfiguration("cursor", 1.0, 16),
    ]
    blocks = {(c.window, c.cache_block) for c in configurations if c.scheme == "block"}
    assert blocks == {(4, 4), (4, 16), (4, 32), (16, 16), (16, 32)}  # C = W = 16 is not repeated
    assert {c.scheme for c in configurations if c.tau == 0.9} == {"none", "cursor", "block"}
    with pytest.raises(ValueError, match="Unknown scheme"):
        build_configurations([0.9], [4], schemes=["stock", "fast"])
    # The decoder's own one-token rule: margin at τ = 1 keeps one token per step too, entropy does not.
    for acceptance, schemes in (("margin", {"cursor"}), ("entropy", {"none", "cursor", "block"})):
        grid = build_configurations([1.0], [4], acceptance=acceptance)
        assert {c.scheme for c in grid if c.scheme != "stock"} == schemes, acceptance


def test_every_mars_row_runs_once_per_kernel_mode():
    grid = build_configurations(
        [0.9], [4], schemes=["stock", "cursor"], verify_layouts=["auto"], cpu_kernels=["auto", "stock"]
    )
    assert [(c.scheme, c.layout, c.cpu_kernels) for c in grid] == [
        ("stock", None, "auto"),
        ("cursor", None, "auto"),
        ("cursor", None, "stock"),
        ("cursor", "auto", "auto"),
        ("cursor", "auto", "stock"),
    ]
    assert (
        grid[3].generate_kwargs("probability")["mars_cpu_kernels"] == "auto"
    )  # named: generate defaults to stock
    assert grid[4].generate_kwargs("probability")["mars_cpu_kernels"] == "stock"
    assert grid[4].label.endswith("kernels=stock") and "kernels" not in grid[3].label


def test_tau_rows_plan_their_window_unless_fixed():
    """τ < 1 rows pass `mars_planner=True` (`planned`, the commands' default) or the paper's window (`fixed`,
    named in the label); τ = 1, verify and stock rows never carry it."""
    for window, planner in (("planned", True), ("fixed", None)):
        grid = build_configurations(
            [1.0, 0.9],
            [4],
            schemes=["stock", "none", "cursor", "block"],
            verify_layouts=["auto"],
            tau_window=window,
        )
        for c in grid:
            kwargs = c.generate_kwargs("probability")
            # without a cache (none) a step recomputes everything: the planner's curve does not price it
            feeds = c.scheme in ("cursor", "block") and c.layout is None and c.tau < 1.0
            assert kwargs.get("mars_planner") == (planner if feeds else None), (window, c.label)
            assert c.label.endswith("window=fixed") == (feeds and window == "fixed"), c.label
    with pytest.raises(ValueError, match="tau_window"):
        build_configurations([0.9], [4], tau_window="sometimes")
    # eager rows plan on the measured curve, but a planned τ row on the assumed one (its text never follows timing)
    from mars_hf.decoding.memory import PlannerMemory
    from mars_hf.tools.bench.measure import _generate_kwargs

    memory = PlannerMemory()
    for c in build_configurations([0.9], [4], schemes=["stock", "cursor"], verify_layouts=["auto"]):
        probed = "mars_cost_probe" in _generate_kwargs(c, "probability", None, None, memory)
        assert probed == (c.scheme != "stock" and not c.feeds_tau), c.label


def test_count_generated_tokens_stops_at_first_eos():
    new = torch.tensor([[5, 6, 2, 2, 2], [5, 6, 7, 8, 9], [2, 2, 2, 2, 2]])
    assert count_generated_tokens(new, [2]).tolist() == [3, 5, 1]
    assert count_generated_tokens(new, []).tolist() == [5, 5, 5]


def test_prepare_batches_cover_every_prompt(tokenizer):
    from mars_hf.tools.bench import prepare_batches

    batches = prepare_batches(tokenizer, PROMPTS, 3)
    assert [b["input_ids"].shape[0] for b in batches] == [3, 3]
    texts = [
        tokenizer.decode(b["input_ids"][i][b["attention_mask"][i].bool()]) for b in batches for i in range(3)
    ]
    assert all(PROMPTS[i % len(PROMPTS)] in text for i, text in enumerate(texts))
    assert (
        len(prepare_batches(tokenizer, PROMPTS, 8)) == 1 and len(prepare_batches(tokenizer, PROMPTS, 1)) == 4
    )


def test_prepare_inputs_left_pads_chat_prompts(tokenizer):
    inputs = prepare_inputs(tokenizer, PROMPTS, 6)
    assert inputs["input_ids"].shape[0] == 6
    assert inputs["attention_mask"][:, -1].all()  # left padding: every row ends with a real token
    text = tokenizer.decode(inputs["input_ids"][4][inputs["attention_mask"][4].bool()])
    assert (
        text
        == tokenizer.apply_chat_template(
            [{"role": "user", "content": PROMPTS[0]}], tokenize=False, add_generation_prompt=True
        ).strip()
    )


@pytest.fixture(scope="module")
def tiny_result():
    from mars_hf.decoding.generation import enable_mars

    tokenizer = tiny_tokenizer()
    model = tiny_model("llama", dtype=torch.float32, tokenizer=tokenizer)
    model = enable_mars(model)
    args = BenchArguments(
        batch_sizes=[1, 3],
        taus=[1.0, 0.0],
        windows=[2],
        cache_blocks=["W", 4],
        max_new_tokens=7,
        repeats=2,
        warmup=0,
        cost_repeats=1,
        tau_window="fixed",  # the paper's window: the τ = 0 rows below feed W masks at every step
    )
    # The planner's rows plan on a fixed curve, not this host's measured one: a curve under
    # which they mix drafts-only steps and groups of several widths, the same on any machine
    # ("given": decoding's own forwards never correct it, as they would a measured one).
    curve = {1: 1.0, 2: 1.02, 3: 1.05, 4: 1.3, 6: 3.0}

    def fixed(model, *, batch, sizes, mask_token_id, **_):
        return CostTable.from_mapping(curve, "given", batch)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cost_model, "measure", fixed)
        result = run_benchmark(model, tokenizer, PROMPTS, args, model_name="tiny-llama", progress=False)
    return model, tokenizer, args, result


def test_bench_rows_and_fields(tiny_result):
    _, _, args, result = tiny_result
    configurations = build_configurations(
        args.taus, args.windows, cache_blocks=args.cache_blocks, verify_layouts=args.verify_layouts
    )
    assert len(result["rows"]) == len(configurations) * len(args.batch_sizes)
    verify_rows = [row for row in result["rows"] if row["acceptance"] == "verify"]
    assert {row["layout"] for row in verify_rows} == {"auto", "linear", "quadratic"}
    # verified decoding is lossless, and the bench measures it (it compares every row with stock)
    assert all(row["same_as_stock"] == 1.0 and row["tau"] is None for row in verify_rows)
    fields = {
        "model",
        "batch",
        "tau",
        "window",
        "scheme",
        "cache_block",
        "tokens_per_forward",
        "tokens_per_s",
        "speedup",
        "efficiency",
        "predicted_speedup",
        "step_cost",
        "num_forwards",
        "generated_tokens",
    }
    for row in result["rows"]:
        assert fields <= set(row)
        assert row["model"] == "tiny-llama"
    assert {row["scheme"] for row in result["rows"]} == {"stock", "none", "cursor", "block"}
    assert set(result["costs"]) == {"1", "3"}
    for costs in result["costs"].values():
        assert costs["cached_step_cost"]["1"] == pytest.approx(1.0)
    json.loads(json.dumps(result))  # the JSON really is JSON
    table = format_table(result)
    assert "tok/fwd" in table and "speedup" in table and "pred." in table
    # every row that should equal stock greedy was compared with it, token by token (and does equal it)
    references = [row for row in result["rows"] if (row["scheme"], row["cpu_kernels"]) == ("stock", "auto")]
    lossless = [row for row in result["rows"] if is_lossless(row) and row not in references]
    assert {row["tau"] for row in lossless} >= {1.0, None}
    assert lossless and all(
        row["divergences"]["rows_identical"] == row["divergences"]["rows"] for row in lossless
    )
    assert all("divergences" not in row for row in result["rows"] if row["tau"] == 0.0)
    assert f"divergences from stock greedy: none (all {len(lossless)} lossless rows" in table
    assert result["environment"]["cpu_flags"] in table  # the CPU's speed-relevant flags beside the numbers
    # the planner's rows: the forwards' widths add up to the model calls, the curve starts at 1.0
    for row in verify_rows:
        assert sum(row["width_histogram"].values()) == row["num_forwards"]
        assert sum(row["plan_counts"].values()) >= row["num_forwards"]  # one choice per row and step
        if row["layout"] == "auto":
            curve = {int(n): c for n, c in row["cost_curve"].items()}
            assert curve == {1: 1.0, 2: 1.02, 3: 1.05, 4: 1.3, 6: 3.0}  # what the decoder was given
            assert set(row["plan_counts"]) <= {"plain", "drafts", "linear", "quadratic"}
        else:
            assert set(row["plan_counts"]) == {"fixed"}
    planner_lines = table[table.index("forwards by columns per row") :].splitlines()
    assert sum("widths" in line for line in planner_lines) == len(
        [r for r in result["rows"] if r["scheme"] != "stock"]
    )
    assert sum("cost curve" in line for line in planner_lines) == len(args.batch_sizes)
    main = table[: table.index("forwards by columns per row")]
    assert len([line for line in main.splitlines() if line.strip().startswith(("1 ", "3 "))]) == len(
        result["rows"]
    )


def test_bench_numbers_are_what_they_claim(tiny_result):
    _, _, _, result = tiny_result
    for batch in (1, 3):
        rows = [row for row in result["rows"] if row["batch"] == batch]
        stock = rows[0]
        assert stock["scheme"] == "stock"
        # Every prompt is decoded once per configuration, in batches of `batch`.
        assert len(stock["generated_per_row"]) == batch * stock["num_batches"] >= len(PROMPTS)
        assert len(stock["forwards_per_batch"]) == stock["num_batches"]
        # Stock generate: one forward per new column of each batch, the prompt's forward included.
        for index, forwards in enumerate(stock["forwards_per_batch"]):
            assert forwards == max(stock["generated_per_row"][index * batch : (index + 1) * batch])
        for row in rows:
            # Every model call was counted by an independent forward hook.
            assert row["counted_forwards"] == row["num_forwards"], row
            assert row["num_forwards"] == sum(row["forwards_per_batch"])
            assert row["tokens_per_forward"] == pytest.approx(
                row["generated_tokens"] / (batch * row["num_forwards"])
            )
            assert row["generated_tokens"] == sum(row["generated_per_row"])
            assert row["tokens_per_s"] == pytest.approx(row["generated_tokens"] / row["seconds"])
            assert row["seconds"] == pytest.approx(statistics.median(row["seconds_all"]))
            assert row["speedup"] == pytest.approx(row["tokens_per_s"] / stock["tokens_per_s"])
            best = row["generated_tokens"] / min(row["seconds_all"])
            assert row["speedup_best"] == pytest.approx(
                best / (stock["generated_tokens"] / min(stock["seconds_all"]))
            )
            relative = row["tokens_per_forward"] / stock["tokens_per_forward"]
            assert row["efficiency"] == pytest.approx(row["speedup"] / relative)
            assert row["predicted_speedup"] == pytest.approx(relative / row["step_cost"])
            assert math.isfinite(row["predicted_speedup"]) and row["step_cost"] > 0
            assert row["deterministic"]
            if row["scheme"] != "stock":
                # MARS's own per-step accounting adds up to the tokens it returned.
                assert row["accepted_per_row"] == row["generated_per_row"]
            if row["tau"] == 1.0:
                assert row["same_as_stock"] == 1.0
                assert row["num_forwards"] == stock["num_forwards"]
                assert row["step_tokens"] == 1.0  # one-token mode appends no masks
            if row["tau"] == 0.0:
                # tau = 0 accepts every prediction: up to W + 1 tokens per forward.
                assert row["tokens_per_forward"] > stock["tokens_per_forward"]
                assert row["scheme"] in ("none", "cursor", "block")
                # Each forward after the prompt's feeds the accepted tokens plus W masks (the hook saw it).
                assert row["step_tokens"] >= row["window"] + 1
        schemes_at_zero = [r for r in rows if r["tau"] == 0.0]
        # Every cache scheme decodes the same tokens as the uncached reference path.
        assert len({tuple(r["generated_per_row"]) for r in schemes_at_zero}) == 1


def test_bench_generated_counts_match_a_direct_generate_call(tiny_result):
    model, tokenizer, _, result = tiny_result
    row = next(r for r in result["rows"] if r["batch"] == 3 and r["scheme"] == "cursor" and r["tau"] == 0.0)
    inputs = prepare_inputs(tokenizer, PROMPTS, 3)
    output = model.generate(
        **inputs,
        do_sample=False,
        max_new_tokens=7,
        pad_token_id=tokenizer.pad_token_id,
        mars_threshold=0.0,
        mars_block_size=2,
        return_dict_in_generate=True,
    )
    new = output.sequences[:, inputs["input_ids"].shape[1] :]
    assert count_generated_tokens(new, [tokenizer.eos_token_id]).tolist() == row["generated_per_row"][:3]
    assert int(output.num_forwards) == row["forwards_per_batch"][0]


def test_bench_cli_on_a_saved_tiny_model(tmp_path, capsys):
    from mars_hf.cli import main

    tokenizer = tiny_tokenizer()
    model = tiny_model("qwen2", dtype=torch.float32, tokenizer=tokenizer)
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    output_file = tmp_path / "bench.txt"
    code = main(
        [
            "bench",
            "--model",
            str(tmp_path / "model"),
            "--prompts",
            str(prompts),
            "--batch-sizes",
            "2",
            "--taus",
            "1.0,0.5",
            "--windows",
            "2",
            "--schemes",
            "stock,cursor,block",
            "--cache-blocks",
            "W",
            "--max-new-tokens",
            "5",
            "--repeats",
            "1",
            "--warmup",
            "0",
            "--cost-repeats",
            "1",
            "--no-progress",
            "--cpu-kernels",
            "auto,packed",
            "--output",
            str(output_file),
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "note: τ < 1 rows with a cache feed the masks the step planner expects to pay" in out  # says which
    json_line = next(line for line in out.splitlines() if line.startswith("JSON: "))
    result = json.loads(json_line[len("JSON: ") :])
    mars_rows = [(s, t, la) for s, t, la in [("cursor", 1.0, None), ("cursor", 0.5, None), ("block", 0.5, None),
                 ("cursor", None, "auto"), ("cursor", None, "linear"), ("cursor", None, "quadratic")]]  # fmt: skip
    # the packed mode's rows need their MARS-off: stock `generate` on the packed kernels follows the stock row
    packed_stock = [("stock", None, None, "packed")]
    assert [(r["scheme"], r["tau"], r["layout"], r["cpu_kernels"]) for r in result["rows"]] == [
        ("stock", None, None, "auto"),
        *packed_stock,
        *[(*row, mode) for row in mars_rows for mode in ("auto", "packed")],
    ]
    assert all(r["same_as_stock"] == 1.0 for r in result["rows"] if r["tau"] in (None, 1.0))
    assert "cursor+packed" in out and result["environment"]["cpu_kernels_auto"] in ("packed", "stock")
    # every MARS row has its MARS-off denominator on the kernels it ran on
    from mars_hf.tools.bench.denominators import off_label

    for row in result["rows"]:
        if row["scheme"] != "stock":
            reference = next(
                r for r in result["rows"] if r["mars_off"] and off_label(r) == row["off_reference"]
            )
            assert reference["kernels"] == row["kernels"] and reference is not row
            assert row["vs_off"] == pytest.approx(row["tokens_per_s"] / reference["tokens_per_s"])
    # a full checkpoint does not record its base: no untrained-mask rows, and the table says why
    assert "note: no untrained-mask rows" in out and "--untrained-base" in out
    assert "the decoder's cost curve" in out and "plans: " in out
    assert result["num_prompts"] == len(PROMPTS)
    assert "stock" in output_file.read_text() and '"rows"' in output_file.read_text()


def test_synthetic_language_is_a_function_of_the_prompt():
    tokenizer = synthetic_tokenizer()
    assert tokenizer.pad_token_id == tokenizer.eos_token_id and tokenizer.mask_token == "<|mask|>"
    rng = random.Random(0)
    answers = {}
    for _ in range(500):
        prompt, answer = synthetic_pair(rng)
        assert answers.setdefault(prompt, answer) == answer  # deterministic given the prompt
        words = prompt.split()
        start, end = int(words[-3]), int(words[-1])
        step = -1 if "down" in words else 1
        assert (start > end) == (step == -1)
        assert answer == " ".join(str(n) for n in range(start, end + step, step))
        ids = tokenizer(answer, add_special_tokens=False).input_ids
        assert tokenizer.unk_token_id not in ids and tokenizer.decode(ids) == answer
    example = synthetic_examples(1)[0]
    assert example["prompt"][0]["role"] == "user" and example["completion"][0]["role"] == "assistant"
    assert len(synthetic_prompts(8)) == 8 and synthetic_prompts(8) == synthetic_prompts(8)


@pytest.mark.slow
def test_synthetic_model_accepts_several_tokens_per_forward(tmp_path):
    """MARSTrainer on the synthetic language (about a minute) gives a model MARS accelerates, and
    what it accepts is still the right answer."""
    from mars_hf.decoding.generation import enable_mars
    from mars_hf.tools.synthetic import train_synthetic_model

    model, tokenizer = train_synthetic_model(tmp_path / "synthetic")
    assert model.config.mars["block_size"] == 4
    model = enable_mars(model)
    prompts = ["count from 10 to 50", "count down from 90 to 60", "please count from 3 to 20"]
    inputs = prepare_inputs(tokenizer, prompts, len(prompts))
    kwargs = dict(do_sample=False, max_new_tokens=48, pad_token_id=tokenizer.pad_token_id)
    stock = model.generate(**inputs, **kwargs)
    mars = model.generate(**inputs, **kwargs, mars_threshold=0.9, return_dict_in_generate=True)
    # Tokens per forward of each row while it was decoding.
    counts = mars.accepted_counts
    assert (counts.sum(0) / (counts > 0).sum(0)).min() > 2.0
    expected = [
        " ".join(map(str, range(10, 51))),
        " ".join(map(str, range(90, 59, -1))),
        " ".join(map(str, range(3, 21))),
    ]
    for output in (mars.sequences, stock):
        texts = tokenizer.batch_decode(output[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        texts = [text.strip() for text in texts]
        # Counting up stops where asked; counting down sometimes runs on past its end (a model this
        # small, trained this briefly), so only its start is checked.
        assert texts[0] == expected[0] and texts[2] == expected[2]
        assert texts[1].startswith(expected[1])


def test_load_prompts_from_text_and_jsonl(tmp_path):
    from mars_hf.tools.bench import load_prompts

    text = tmp_path / "prompts.txt"
    text.write_text("first prompt\n\nsecond prompt\n")
    assert load_prompts(text) == ["first prompt", "second prompt"]
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text(
        json.dumps({"prompt": "plain"})
        + "\n"
        + json.dumps({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "chat"}]})
        + "\n"
    )
    assert load_prompts(jsonl) == ["plain", "chat"]
    (tmp_path / "empty.txt").write_text("\n")
    with pytest.raises(ValueError, match="No prompts"):
        load_prompts(tmp_path / "empty.txt")


def test_where_auto_packs_stock_generate_also_runs_on_the_packed_kernels(monkeypatch):
    """The reference row that says how much of a MARS row's speed-up the kernels alone give."""
    from mars_hf.decoding import cpu_kernels
    from mars_hf.decoding.generation import enable_mars
    from mars_hf.tools.bench import runner

    tokenizer = tiny_tokenizer()
    model = enable_mars(tiny_model("llama", dtype=torch.float32, tokenizer=tokenizer))
    monkeypatch.setattr(runner, "use_packed", lambda model, mode="auto": True)
    packed_during_stock = []
    generate = model.generate

    def spying(*args, **kwargs):
        if not any(key.startswith("mars_") for key in kwargs):
            packed_during_stock.append(cpu_kernels.active(model))
        return generate(*args, **kwargs)

    monkeypatch.setattr(model, "generate", spying)
    args = BenchArguments(
        batch_sizes=[1], taus=[1.0], windows=[2], schemes=["stock", "cursor"], max_new_tokens=4, repeats=1,
        warmup=0, cost_repeats=1,
    )  # fmt: skip
    result = run_benchmark(model, tokenizer, PROMPTS[:2], args, model_name="tiny-llama", progress=False)
    rows = [(r["scheme"], r["cpu_kernels"]) for r in result["rows"]]
    assert rows[:2] == [("stock", "auto"), ("stock", "packed")] and rows[1] not in rows[2:]
    assert result["rows"][1]["same_as_stock"] == 1.0
    # each stock run: the plain one unpacked, the reference one packed, alternating with the repeats
    assert sorted(set(packed_during_stock)) == [False, True] and not cpu_kernels.active(model)
    assert BenchConfiguration("stock", cpu_kernels="packed").label == "stock kernels=packed"


def test_each_rows_step_cost_is_read_on_the_kernels_it_ran(monkeypatch):
    """A MARS row's multi-row forwards run on packed kernels where its mode picks them; stock `generate` on
    stock ones (unless it is the stock+packed row). The cost column divides each row's forward, timed on its
    own kernels, by stock's 1-token forward: here a packed forward costs half a stock one at every width."""
    from types import SimpleNamespace

    from mars_hf.decoding import cpu_kernels
    from mars_hf.tools.bench import step_costs

    model = tiny_model("llama", dtype=torch.float32)
    monkeypatch.setattr(cpu_kernels, "use_packed", lambda model, mode="auto": mode != "stock")
    monkeypatch.setattr(step_costs, "use_packed", cpu_kernels.use_packed)

    def timings(model, inputs, *, step_sizes, full_lengths, **_):
        scale = 0.5 if cpu_kernels.active(model) else 1.0
        return {k: scale * (1.0 + 0.1 * (k - 1)) for k in step_sizes}, {n: scale * 3.0 for n in full_lengths}

    monkeypatch.setattr(step_costs, "measure_step_costs", timings)

    def row(scheme, kernels, step, tokens_per_forward=1.0):
        return {
            "scheme": scheme,
            "cpu_kernels": kernels,
            "step_tokens": step,
            "tokens_per_forward": tokens_per_forward,
            "generated_tokens": 8,
            "generated_per_row": [8],
            "prompt_tokens": 4,
        }

    rows = [row("stock", "auto", 1), row("stock", "packed", 1), row("cursor", "auto", 6, 2.0)]
    rows.append(row("cursor", "stock", 6, 2.0))
    costs = step_costs.add_cost_model(model, {}, rows, SimpleNamespace(cost_repeats=1))
    assert [r["step_kernels"] for r in rows] == ["stock", "packed", "packed", "stock"]
    assert [r["step_cost"] for r in rows] == pytest.approx([1.0, 0.5, 0.75, 1.5])
    assert rows[2]["predicted_speedup"] == pytest.approx(2.0 / 0.75)
    assert costs["cached_step_cost"]["6"] == pytest.approx(1.5)
    assert costs["cached_step_cost_packed"]["6"] == pytest.approx(0.75)
    assert not cpu_kernels.active(model)  # each measurement's kernels were restored


def test_the_step_cost_of_several_columns_is_timed_on_masks_as_a_mars_step_feeds_them():
    """A MARS step of k columns feeds one real token then masks, and on a gated checkpoint it is the masks that
    switch the adapter on: the bench's cost of a k-column forward must time that input, not k random tokens
    (which timed the base model alone and read a gated step as cheap as a plain one)."""
    from types import SimpleNamespace

    from mars_hf.tools.bench import step_costs

    model = tiny_model("llama", dtype=torch.float32)
    mask = model.config.mars["mask_token_id"]
    fed = []
    hook = model.get_input_embeddings().register_forward_pre_hook(
        lambda module, args: fed.append(args[0].clone())
    )
    inputs = {"input_ids": torch.tensor([[5, 6, 7]]), "attention_mask": torch.ones(1, 3, dtype=torch.long)}

    def row(scheme, step, tokens_per_forward):
        return {
            "scheme": scheme,
            "cpu_kernels": "stock",
            "step_tokens": step,
            "tokens_per_forward": tokens_per_forward,
            "generated_tokens": 8,
            "generated_per_row": [8],
            "prompt_tokens": 3,
        }

    try:
        step_costs.add_cost_model(
            model, inputs, [row("stock", 1, 1.0), row("cursor", 3, 2.0)], SimpleNamespace(cost_repeats=2)
        )
    finally:
        hook.remove()
    steps = [ids for ids in fed if ids.shape[1] in (1, 3)]  # the timed cached forwards (the prefix is longer)
    wide = [ids for ids in steps if ids.shape[1] == 3]
    assert len(wide) == 3 and all(ids[0, 0] != mask and ids[0, 1:].tolist() == [mask, mask] for ids in wide)
    assert all(ids[0, 0] != mask for ids in steps if ids.shape[1] == 1)


# ---------------------------------------------------------------------------------------------------
# Honest denominators: MARS-off on the same kernels, the untrained-mask row, categories
# ---------------------------------------------------------------------------------------------------


def _trained_and_untrained(tokenizer):
    """A tiny "trained" MARS model (its mask row a random row, as training leaves one) and the same base
    model made into its untrained-mask twin."""
    from mars_hf.decoding.generation import enable_mars
    from mars_hf.tools.bench import with_untrained_mask

    model = enable_mars(tiny_model("llama", dtype=torch.float32, tokenizer=tokenizer, block_size=2))
    base = tiny_model("llama", dtype=torch.float32, block_size=None)
    return model, with_untrained_mask(base, model)


def test_the_untrained_mask_model_is_the_base_with_a_mean_mask_row(tokenizer):
    from mars_hf.models.mask_token import set_mars_config
    from mars_hf.tools.bench import with_untrained_mask

    model, untrained = _trained_and_untrained(tokenizer)
    mask = model.config.mars["mask_token_id"]
    assert untrained.config.mars["mask_token_id"] == mask and untrained.config.mars["block_size"] == 2
    for name, weight in untrained.named_parameters():
        trained_weight = dict(model.named_parameters())[name]
        if (
            weight.shape[0] == TINY_ROWS
            and weight.ndim == 2
            and name.endswith(("embed_tokens.weight", "lm_head.weight"))
        ):
            others = torch.cat([weight[:mask], weight[mask + 1 :]])
            assert torch.allclose(weight[mask], others.mean(0)), name
            assert not torch.equal(weight[mask], trained_weight[mask]), name  # the trained row is not kept
            assert torch.equal(others, torch.cat([trained_weight[:mask], trained_weight[mask + 1 :]])), name
        else:
            assert torch.equal(weight, trained_weight), name  # no adapter, nothing else changed
    # a mask id past the base's rows: the base grows a row, started at the mean of its rows
    stand_in = tiny_model("llama", dtype=torch.float32, block_size=None)
    set_mars_config(stand_in, block_size=3, mask_token_id=TINY_ROWS)
    grown = with_untrained_mask(tiny_model("llama", dtype=torch.float32, block_size=None), stand_in)
    rows = grown.get_input_embeddings().weight
    assert rows.shape[0] == TINY_ROWS + 1 and torch.allclose(rows[TINY_ROWS], rows[:TINY_ROWS].mean(0))
    assert grown.config.mars["block_size"] == 3


TINY_ROWS = 64


def test_the_untrained_mask_row_runs_on_its_own_model_and_the_ratios_come_from_the_same_run(
    tokenizer, monkeypatch
):
    model, untrained = _trained_and_untrained(tokenizer)
    calls = {"trained": [], "untrained": []}
    for name, decoder in (("trained", model), ("untrained", untrained)):
        generate = decoder.generate

        def spying(*args, _generate=generate, _name=name, **kwargs):
            calls[_name].append(kwargs)
            return _generate(*args, **kwargs)

        monkeypatch.setattr(decoder, "generate", spying)
    args = BenchArguments(
        batch_sizes=[1], taus=[1.0], windows=[2], schemes=["stock", "cursor"], verify_layouts=["auto"],
        max_new_tokens=4, repeats=1, warmup=0, cost_repeats=1, untrained_masks=True,
    )  # fmt: skip
    result = run_benchmark(
        model, tokenizer, PROMPTS[:2], args, model_name="tiny", progress=False, untrained_model=untrained
    )
    rows = [r for r in result["rows"] if (r["scheme"], r["cpu_kernels"]) != ("stock", "packed")]
    assert [(r["scheme"], r["tau"], r["layout"], r["masks"]) for r in rows] == [
        ("stock", None, None, "trained"),
        ("cursor", 1.0, None, "trained"),
        ("cursor", None, "auto", "trained"),
        ("cursor", None, "auto", "untrained"),
    ]
    verify, untrained_row = rows[2], rows[3]
    # the untrained row decoded on the untrained model (two prompts, one repeat), on the trained row's kernels
    assert len(calls["untrained"]) == 2
    assert all(c["mars_acceptance"] == "verify" for c in calls["untrained"])
    assert {c["mars_cpu_kernels"] for c in calls["untrained"]} == {verify["kernels"]}
    assert untrained_row["kernels"] == verify["kernels"]
    assert untrained_row["counted_forwards"] == untrained_row["num_forwards"]  # its own forward counter
    # both verify rows give stock greedy's answers (float32), and are judged so
    assert verify["answers"] == untrained_row["answers"] == "identical"
    # the masks' own value and MARS-off: tokens/s of this run's rows
    assert verify["masks_value"] == pytest.approx(verify["tokens_per_s"] / untrained_row["tokens_per_s"])
    assert untrained_row["masks_value"] is None
    for row in result["rows"]:
        if row["scheme"] == "stock":
            assert row["mars_off"] and "vs_off" not in row
            continue
        off = [r for r in result["rows"] if r["mars_off"] and r is not row and r["kernels"] == row["kernels"]]
        best = max(off, key=lambda r: r["tokens_per_s"])
        assert row["vs_off"] == pytest.approx(row["tokens_per_s"] / best["tokens_per_s"])
    assert rows[1]["mars_off"] and not verify["mars_off"] and not untrained_row["mars_off"]
    table = format_table(result)
    assert "masks' own value" in table and f"{verify['masks_value']:.2f}x" in table
    assert "untrained" in table and "vs off" in table and "kernels" in table
    with pytest.raises(ValueError, match="untrained_model="):
        run_benchmark(model, tokenizer, PROMPTS[:2], args, progress=False)


def test_denominators_pick_the_fastest_mars_off_row_on_the_same_kernels():
    from mars_hf.tools.bench import add_denominators

    def row(
        scheme, tps, kernels, tau=None, layout=None, lookup=None, masks="trained", mode="auto", off=False
    ):
        return {
            "scheme": scheme, "tau": tau, "window": None if scheme == "stock" else 2, "layout": layout,
            "prompt_lookup_num_tokens": lookup, "cache_block": None, "cpu_kernels": mode, "masks": masks,
            "acceptance": "verify" if layout else ("stock" if scheme == "stock" else None), "kernels": kernels,
            "mars_off": off, "tokens_per_s": tps,
        }  # fmt: skip

    stock = row("stock", 100.0, "stock", off=True)
    stock_packed = row("stock", 150.0, "packed", mode="packed", off=True)
    tau1 = row("cursor", 160.0, "packed", tau=1.0, off=True)
    verify = row("cursor", 200.0, "packed", layout="auto")
    untrained = row("cursor", 180.0, "packed", layout="auto", masks="untrained")
    lookup = row("cursor", 300.0, "packed", layout="auto", lookup=10)
    stock_lookup = row("stock", 400.0, "stock", lookup=10)  # prompt lookup is not MARS-off
    verify_stock = row("cursor", 120.0, "stock", layout="auto", mode="stock")
    rows = [stock, stock_packed, tau1, verify, untrained, lookup, stock_lookup, verify_stock]
    add_denominators(rows)
    assert (verify["vs_off"], verify["off_reference"]) == (pytest.approx(200 / 160), "tau=1 W=2")
    assert verify["masks_value"] == pytest.approx(200 / 180)
    assert (lookup["vs_off"], lookup["masks_value"]) == (pytest.approx(300 / 160), None)  # no untrained twin
    assert (untrained["vs_off"], untrained["masks_value"]) == (pytest.approx(180 / 160), None)
    assert (tau1["vs_off"], tau1["off_reference"]) == (pytest.approx(160 / 150), "stock+packed")  # not itself
    assert (verify_stock["vs_off"], verify_stock["off_reference"]) == (pytest.approx(120 / 100), "stock")
    assert "vs_off" not in stock and "vs_off" not in stock_lookup


def test_categories_are_grouped_and_add_up_to_the_overall_rows(tokenizer):
    from mars_hf.decoding.generation import enable_mars
    from mars_hf.tools.bench.categories import categorised_batches

    model = enable_mars(tiny_model("llama", dtype=torch.float32, tokenizer=tokenizer, block_size=2))
    prompts, categories = PROMPTS[:3], ["x", "y", "x"]
    batches, batch_categories = categorised_batches(tokenizer, prompts, categories, 2)
    assert batch_categories == ["x", "y"]  # a batch never mixes categories; the y batch cycles its one prompt
    assert torch.equal(batches[1]["input_ids"][0], batches[1]["input_ids"][1])
    args = BenchArguments(
        batch_sizes=[1, 2], taus=[1.0], windows=[2], schemes=["stock", "cursor"], verify_layouts=["auto"],
        lookup_tokens=[3], max_new_tokens=4, repeats=1, warmup=0, cost_repeats=1,
    )  # fmt: skip
    result = run_benchmark(model, tokenizer, prompts, args, progress=False, categories=categories)
    for batch in (1, 2):
        overall = [r for r in result["rows"] if r["batch"] == batch]
        by_category = result["categories"][str(batch)]
        assert [r["category"] for r in by_category] == ["x"] * len(overall) + ["y"] * len(overall)
        for index, row in enumerate(overall):
            parts = [by_category[index], by_category[len(overall) + index]]
            assert all(p["scheme"] == row["scheme"] and p["layout"] == row["layout"] for p in parts)
            assert sum(p["generated_tokens"] for p in parts) == row["generated_tokens"]
            assert sum(p["num_forwards"] for p in parts) == row["num_forwards"]
            assert sum(p["seconds"] for p in parts) == pytest.approx(row["seconds"])  # one repeat: same runs
            assert [p["rows"] for p in parts] == ([2, 1] if batch == 1 else [2, 2])
            for part in parts:
                stock = next(p for p in by_category if p["category"] == part["category"])
                assert part["tokens_per_forward"] == pytest.approx(
                    part["generated_tokens"] / (batch * part["num_forwards"])
                )
                assert part["speedup"] == pytest.approx(part["tokens_per_s"] / stock["tokens_per_s"])
                if row["acceptance"] == "verify" or row["tau"] == 1.0:
                    assert part["rows_identical"] == part["rows"] and part["near_tie_flips"] == 0
                if row["scheme"] != "stock":
                    assert part["vs_off"] is not None and part["off_reference"]
    table = format_table(result)
    assert "per category, batch 1" in table and "per category, batch 2" in table and "identical" in table


def test_bench_cli_dataset_rows_by_category(tmp_path, capsys):
    from mars_hf.cli import main

    tokenizer = tiny_tokenizer()
    model = tiny_model("qwen2", dtype=torch.float32, tokenizer=tokenizer, block_size=2)
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    tiny_model("qwen2", dtype=torch.float32, block_size=None).save_pretrained(tmp_path / "base")
    data = tmp_path / "set.jsonl"
    records = [
        {"prompt": PROMPTS[0], "category": "animals"},
        {"messages": [{"role": "user", "content": PROMPTS[1]}], "category": "numbers"},
        {"prompt": PROMPTS[3], "category": "animals"},
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    common = [
        "bench",
        "--model",
        str(tmp_path / "model"),
        "--max-new-tokens",
        "4",
        "--repeats",
        "1",
        "--warmup",
        "0",
    ]
    common += ["--cost-repeats", "1", "--no-progress", "--untrained-base", str(tmp_path / "base")]
    assert main([*common, "--dataset", str(data)]) == 0
    out = capsys.readouterr().out
    result = json.loads(next(line for line in out.splitlines() if line.startswith("JSON: "))[len("JSON: ") :])
    rows = [(r["batch"], r["scheme"], r["tau"], r["layout"], r["prompt_lookup_num_tokens"], r["masks"])
            for r in result["rows"] if (r["scheme"], r["cpu_kernels"]) != ("stock", "packed")]  # fmt: skip
    assert rows == [  # --dataset's defaults: batch 1; stock, τ = 1, verify, verify + prompt lookup, untrained
        (1, "stock", None, None, None, "trained"),
        (1, "cursor", 1.0, None, None, "trained"),
        (1, "cursor", None, "auto", None, "trained"),
        (1, "stock", None, None, 10, "trained"),
        (1, "cursor", None, "auto", 10, "trained"),
        (1, "cursor", None, "auto", None, "untrained"),
    ]
    assert {r["window"] for r in result["rows"] if r["scheme"] != "stock"} == {2}  # the model's own window
    categories = result["categories"]["1"]
    assert [c["category"] for c in categories] == ["animals"] * len(result["rows"]) + ["numbers"] * len(
        result["rows"]
    )
    assert "per category, batch 1" in out and "masks' own value" in out and "v-auto+pl" in out
    # the packaged benchmarks, a few prompts per category, several sets at once (categories named set/category)
    assert main([*common, "--dataset", f"mt-bench,{data}", "--per-category", "1", "--schemes", "stock"]) == 0
    out = capsys.readouterr().out
    result = json.loads(next(line for line in out.splitlines() if line.startswith("JSON: "))[len("JSON: ") :])
    names = list(dict.fromkeys(c["category"] for c in result["categories"]["1"]))
    assert len(names) == 10 and names[0] == "mt-bench/writing" and names[-1] == f"{data}/numbers"
    assert result["num_prompts"] == 10


def test_the_compiled_grid_runs_mars_on_the_fast_path_beside_stock_eager_and_stock_compiled():
    grid = build_configurations([1.0, 0.9], [2], schemes=["stock", "cursor"], verify_layouts=["auto"],
                                lookup_tokens=[10], untrained_masks=True, compiled=True)  # fmt: skip
    labels = [c.label for c in grid]
    assert labels[:2] == ["stock", "stock compiled"]
    assert (
        "stock prompt-lookup=10" in labels
    )  # transformers' own prompt lookup stays eager (assisted decoding)
    mars = [c for c in grid if c.scheme != "stock"]
    assert mars and all(c.compiled for c in mars)
    assert any(c.untrained and c.compiled for c in mars)
    stock_compiled = grid[1].generate_kwargs("probability")
    assert stock_compiled["cache_implementation"] == "static"
    assert stock_compiled["compile_config"]._compile_all_devices  # stock generate compiles on a CPU only so
    verify = next(c for c in mars if c.verify and not c.lookup and not c.untrained).generate_kwargs(
        "probability"
    )
    assert verify["cache_implementation"] == "static" and not verify["compile_config"]._compile_all_devices
    assert verify["compile_config"].options == {"freezing": True}  # a CPU's MARS rows: prepacked weights
    assert stock_compiled["compile_config"].options in (None, {})  # transformers' loop would not freeze


def test_a_compiled_row_is_divided_by_mars_off_on_the_compiled_path():
    from mars_hf.tools.bench import add_denominators
    from mars_hf.tools.bench.step_costs import row_kernels

    def row(scheme, tps, compiled, tau=None, layout=None, off=False):
        row = {
            "scheme": scheme, "tau": tau, "window": None if scheme == "stock" else 2, "layout": layout,
            "prompt_lookup_num_tokens": None, "cache_block": None, "cpu_kernels": "auto", "masks": "trained",
            "acceptance": "verify" if layout else ("stock" if scheme == "stock" else None), "compiled": compiled,
            "mars_off": off, "tokens_per_s": tps,
        }  # fmt: skip
        row["kernels"] = row_kernels(None, row) if compiled else "stock"
        return row

    stock = row("stock", 100.0, False, off=True)
    stock_compiled = row("stock", 250.0, True, off=True)
    tau1 = row("cursor", 240.0, True, tau=1.0, off=True)
    verify = row("cursor", 500.0, True, layout="auto")
    add_denominators([stock, stock_compiled, tau1, verify])
    assert (verify["vs_off"], verify["off_reference"]) == (pytest.approx(500 / 250), "stock compiled")
    assert (tau1["vs_off"], tau1["off_reference"]) == (pytest.approx(240 / 250), "stock compiled")


def test_a_compiled_benchmark_compiles_in_its_warmup_run_only(monkeypatch):
    """The quickstart's pattern: a pace run of the first (short) prompt with one untimed warm-up, then every
    prompt timed without one. Given one static cache size for both (``max_cache_len``: the longest prompt's;
    the short prompt's own cache would be 256 entries, the long one's 512), the warm-up compiles every graph
    and the timed run compiles none. The graphs are dynamo's (backend ``eager``: Inductor's guards and shapes,
    without its minutes)."""
    from torch._dynamo.utils import counters
    from transformers import CompileConfig

    from mars_hf.decoding.generation import enable_mars
    from mars_hf.tools.bench import configurations, prepare_batches
    from mars_hf.tools.bench.configurations import STEP_ROOM, one_cache_length

    def eager_config(device="cpu", stock=False, freezing=True):
        config = CompileConfig(fullgraph=True, backend="eager")
        config._compile_all_devices = stock
        return config

    monkeypatch.setattr(configurations, "fast_compile_config", eager_config)
    tokenizer = tiny_tokenizer()
    model = enable_mars(tiny_model("llama", dtype=torch.float32, tokenizer=tokenizer).eval())
    prompts = [PROMPTS[0], " ".join(PROMPTS * 14)]
    size = one_cache_length(prepare_batches(tokenizer, prompts, 1), 6)
    assert size == 512 > len(tokenizer(prompts[1])["input_ids"]) + 6 + STEP_ROOM
    args = BenchArguments(
        batch_sizes=[1], taus=[1.0], windows=[2], schemes=["stock", "cursor"], verify_layouts=["linear"],
        max_new_tokens=6, repeats=1, warmup=0, cost_repeats=0, cpu_kernels=["stock"], compiled=True,
        max_cache_len=size,
    )  # fmt: skip
    torch._dynamo.reset()
    counters.clear()
    pace = dataclasses.replace(args, max_new_tokens=2, warmup=1)
    run_benchmark(model, tokenizer, prompts[:1], pace, model_name="tiny-llama", progress=False)
    compiled = counters["stats"]["unique_graphs"]
    assert compiled > 0
    run_benchmark(model, tokenizer, prompts, args, model_name="tiny-llama", progress=False)
    assert counters["stats"]["unique_graphs"] == compiled  # nothing compiled while timing
