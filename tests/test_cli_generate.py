"""`mars-hf generate`: the text it prints is what `generate` decodes; `--show-chunks` is faithful."""

import logging
import os
import re

import pytest
import torch

from mars_hf.cli import main
from mars_hf.commands.generate import render_chunks, split_chunks
from tests.tiny import tiny_model, tiny_tokenizer

ANSI = re.compile(r"\033\[[0-9;]*m")


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    """A float64 tiny MARS model (mask token + config.mars) saved like a checkpoint."""
    folder = tmp_path_factory.mktemp("tiny-mars")
    tokenizer = tiny_tokenizer()
    # Vocabulary = the tokenizer's, so every generated id decodes to a word.
    model = tiny_model("llama", tokenizer=tokenizer, vocab_size=len(tokenizer))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _reference(folder, prompts, **generate_kwargs):
    """Decode with transformers directly: what the command should print."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mars_hf.decoding.generation import enable_mars

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    model = enable_mars(model)
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
        )
        for p in prompts
    ]
    tokenizer.padding_side = "left"
    inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    output = model.generate(
        **inputs, pad_token_id=tokenizer.pad_token_id, return_dict_in_generate=True, **generate_kwargs
    )
    new = output.sequences[:, inputs["input_ids"].shape[1] :]
    decoded, rows = [], []
    for row in new.tolist():
        if tokenizer.eos_token_id in row:
            row = row[: row.index(tokenizer.eos_token_id) + 1]
        rows.append(row)
        decoded.append(tokenizer.decode(row, skip_special_tokens=True))
    return decoded, output, rows


def test_split_and_render_chunks():
    tokenizer = tiny_tokenizer()
    tokens = tokenizer("the cat sat on the mat", add_special_tokens=False).input_ids
    chunks = split_chunks(tokens, [1, 0, 3, 2, 0])
    assert chunks == [tokens[:1], tokens[1:4], tokens[4:6]]
    coloured = render_chunks(tokenizer, chunks)
    assert ANSI.sub("", coloured) == "the cat sat on the mat"
    assert coloured.count("\033[0m") == 3
    assert render_chunks(tokenizer, chunks, colour=False) == "the| cat sat on| the mat"


def test_generate_prints_greedy_text(saved_model, capsys):
    prompt = "the cat sat on the mat"
    assert (
        main(
            [
                "generate",
                prompt,
                "--model",
                str(saved_model),
                "--tau",
                "1.0",
                "--max-new-tokens",
                "9",
                "--dtype",
                "float64",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    stock, _, _ = _reference(saved_model, [prompt], do_sample=False, max_new_tokens=9)
    assert out == stock[0] + "\n"


@pytest.mark.parametrize("tau", [1.0, 0.0])
def test_show_chunks_is_faithful(saved_model, capsys, tau):
    prompts = ["hello world", "one two three four"]
    args = [
        "generate",
        *prompts,
        "--model",
        str(saved_model),
        "--tau",
        str(tau),
        "--window",
        "3",
        "--max-new-tokens",
        "10",
        "--dtype",
        "float64",
        "--tau-window",
        "fixed",  # the paper's window, as the reference below decodes
    ]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main(args + ["--show-chunks"]) == 0
    shown = capsys.readouterr().out
    assert main(args + ["--show-chunks", "--no-color"]) == 0
    separated = capsys.readouterr().out

    texts, output, rows = _reference(
        saved_model, prompts, do_sample=False, max_new_tokens=10, mars_threshold=tau, mars_block_size=3
    )
    tokenizer = tiny_tokenizer()
    silent = {i for i in range(len(tokenizer)) if not tokenizer.decode([i], skip_special_tokens=True)}
    assert plain == "".join(f"### {p}\n{t}\n" for p, t in zip(prompts, texts))
    body, _, summary = ANSI.sub("", shown).rpartition("\n[")
    assert body.rstrip("\n") == plain.rstrip("\n")  # colours only, no text changed
    generated = 0
    for row, tokens in enumerate(rows):
        counts = [c for c in output.accepted_counts[:, row].tolist() if c > 0]
        assert sum(counts) == len(tokens)
        generated += len(tokens)
        # The words each forward accepted (special tokens print nothing), one '|'-separated piece each.
        expected, start = [], 0
        for count in counts:
            words = [t for t in tokens[start : start + count] if t not in silent]
            start += count
            if words:
                expected.append(len(words))
        line = shown.split("\n")[2 * row + 1]
        pieces = re.findall(r"\033\[48;5;\d+m(.*?)\033\[0m", line)
        assert "".join(pieces) == texts[row]
        assert [len(p.split()) for p in pieces] == expected
        # Neighbouring chunks get different colours.
        colours = re.findall(r"\033\[(48;5;\d+)m", line)
        assert all(a != b for a, b in zip(colours, colours[1:]))
        assert separated.split("\n")[2 * row + 1].replace("|", "") == texts[row].replace("|", "")
    forwards = int(output.num_forwards)
    assert summary.startswith(
        f"{forwards} forwards, {generated} tokens, {generated / (2 * forwards):.2f} tokens"
    )
    if tau == 0.0:
        assert generated > 2 * forwards  # several tokens per forward really were accepted


def test_show_chunks_with_verified_decoding(saved_model, capsys):
    """--acceptance verify prints exactly the ordinary greedy text, chunked by forward."""
    prompts = ["hello world", "one two three four"]
    base = ["generate", *prompts, "--model", str(saved_model), "--max-new-tokens", "10", "--dtype", "float64"]
    assert main(base + ["--tau", "1.0"]) == 0
    greedy = capsys.readouterr().out
    for layout in ("linear", "quadratic"):
        assert main(base + ["--acceptance", "verify", "--layout", layout]) == 0
        assert capsys.readouterr().out == greedy
        assert main(base + ["--acceptance", "verify", "--layout", layout, "--show-chunks", "--no-color"]) == 0
        body, _, summary = capsys.readouterr().out.rpartition("\n[")
        assert body.replace("|", "").rstrip("\n") == greedy.replace("|", "").rstrip("\n")
        assert "verify," in summary and "drafts kept" in summary


def test_sampling_is_reproducible_with_a_seed(saved_model, capsys):
    args = [
        "generate",
        "hello world",
        "--model",
        str(saved_model),
        "--do-sample",
        "--temperature",
        "1.5",
        "--top-k",
        "20",
        "--tau",
        "0.5",
        "--max-new-tokens",
        "12",
        "--seed",
        "3",
    ]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args) == 0
    assert capsys.readouterr().out == first


def test_model_without_mars_metadata_gets_an_untrained_mask_token(tmp_path, capsys, caplog):
    tokenizer = tiny_tokenizer(with_mask=False)
    model = tiny_model("qwen3", block_size=None)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with caplog.at_level(logging.WARNING):
        assert (
            main(
                [
                    "generate",
                    "hello world",
                    "--model",
                    str(tmp_path),
                    "--max-new-tokens",
                    "6",
                    "--dtype",
                    "float64",
                    "--show-chunks",
                ]
            )
            == 0
        )
    assert "UNTRAINED" in caplog.text and "--tau 1.0" in caplog.text
    out = capsys.readouterr().out
    assert "tau=1]" in out
    forwards, tokens = re.search(r"\[(\d+) forwards, (\d+) tokens", out).groups()
    assert forwards == tokens  # tau = 1: one token per forward


def test_bad_window_is_refused(saved_model, capsys):
    assert main(["generate", "hello", "--model", str(saved_model), "--window", "0"]) == 2
    assert "--window must be >= 1" in capsys.readouterr().err


def test_dtype_auto_keeps_a_small_model_in_float32_and_says_so(saved_model, capsys, caplog, monkeypatch):
    """`--dtype auto` (the default): a model narrower than precision.MIN_AUTO_HIDDEN_SIZE stays float32
    (on any CPU), so the text is the float32 decoding's; the choice is logged."""
    from mars_hf.models import precision

    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: True)  # as on a bf16 CPU
    argv = ["generate", "the cat sat", "--model", str(saved_model), "--tau", "0.0", "--max-new-tokens", "8"]
    with caplog.at_level(logging.INFO, logger="mars_hf.models.precision"):
        assert main(argv) == 0
    auto = capsys.readouterr().out
    assert "float32" in caplog.text and "too small" in caplog.text
    assert main([*argv, "--dtype", "float32"]) == 0
    assert capsys.readouterr().out == auto


def test_generate_keeps_its_cost_curve_under_the_home_folder(saved_model, capsys, tmp_path, monkeypatch):
    """A one-shot `mars-hf generate` reads the curve an earlier process measured instead of probing again;
    an empty MARS_HF_COST_CACHE turns the disk off; the library's own environment is left as it was."""
    from mars_hf.decoding import cost_model

    monkeypatch.delenv(cost_model.CACHE_ENV)
    monkeypatch.setenv("MARS_HF_HOME", str(tmp_path))
    probes = []
    measure = cost_model.measure
    monkeypatch.setattr(cost_model, "measure", lambda *a, **k: probes.append(1) or measure(*a, **k))
    args = [
        "generate",
        "hello world",
        "--model",
        str(saved_model),
        "--max-new-tokens",
        "10",
        "--dtype",
        "float64",
    ]
    args += ["--acceptance", "verify"]
    assert main(args) == 0
    first = capsys.readouterr().out
    curves = list((tmp_path / "cost-curves").iterdir())
    assert len(probes) == 1 and len(curves) == 1
    assert cost_model.CACHE_ENV not in os.environ  # set for the command only
    assert main(args) == 0  # a new process would load the model again: a new model object here too
    assert capsys.readouterr().out == first and len(probes) == 1  # read from disk, not measured
    monkeypatch.setenv(cost_model.CACHE_ENV, "")
    assert main(args) == 0
    assert capsys.readouterr().out == first and len(probes) == 2
    assert list((tmp_path / "cost-curves").iterdir()) == curves


@pytest.mark.slow
def test_compile_prints_what_eager_prints_and_says_which_path(saved_model, capsys, monkeypatch):
    """`--compile`: transformers' fast path (static cache, compiled forward) prints the eager path's text. One answer
    compiles without weight freezing (which would bypass AOTAutograd's on-disk cache in every later process)."""
    from transformers import PreTrainedModel

    argv = ["generate", "the cat sat", "a dog", "--model", str(saved_model), "--acceptance", "verify"]
    argv += ["--max-new-tokens", "9", "--dtype", "float64"]
    assert main(argv) == 0
    eager = capsys.readouterr()
    configs, compiled_call = [], PreTrainedModel.get_compiled_call
    monkeypatch.setattr(
        PreTrainedModel,
        "get_compiled_call",
        lambda self, config: configs.append(config) or compiled_call(self, config),
    )
    assert main(argv + ["--compile"]) == 0
    assert configs and all(config.options in (None, {}) for config in configs)
    compiled = capsys.readouterr()
    assert compiled.out == eager.out
    stock, _, _ = _reference(saved_model, ["the cat sat", "a dog"], do_sample=False, max_new_tokens=9)
    assert compiled.out == "".join(f"### {p}\n{text}\n" for p, text in zip(["the cat sat", "a dog"], stock))
    assert "[path: static cache, compiled forward (--compile); float64]" in compiled.err
    assert "[path: eager; float64;" in eager.err


def test_tau_rows_plan_their_window_by_default_and_say_so(saved_model, capsys, monkeypatch):
    """τ < 1 passes `mars_planner=True` unless --tau-window fixed (the paper's window, generate's default); τ = 1
    and verify are unchanged; stderr names the feed. The keywords are read off the real `generate` call."""
    import mars_hf.commands.generate as command

    calls = []
    load = command.load_model_and_tokenizer

    def recording_load(*args, **kwargs):
        model, tokenizer, trained = load(*args, **kwargs)
        real = model.generate

        def generate(*a, **k):
            calls.append(k)
            return real(*a, **k)

        model.generate = generate
        return model, tokenizer, trained

    monkeypatch.setattr(command, "load_model_and_tokenizer", recording_load)
    base = [
        "generate",
        "hello world",
        "--model",
        str(saved_model),
        "--max-new-tokens",
        "4",
        "--dtype",
        "float64",
    ]
    for extra, planned, said in (
        (["--tau", "0.5"], True, "τ window: planned per step"),
        (["--tau", "0.5", "--tau-window", "fixed"], False, "τ window: fixed"),
        (["--tau", "1.0"], False, "τ window: fixed"),  # one token per step: nothing to plan
        (["--acceptance", "verify"], False, None),
    ):
        assert main(base + extra) == 0
        err = capsys.readouterr().err
        call = calls.pop()
        assert call.get("mars_planner", False) is planned, extra
        # a planned window plans on generate's assumed curve: nothing timed, the same text every run
        assert ("mars_cost_probe" in call) is not planned, extra
        assert (said in err) if said else ("τ window" not in err), (extra, err)
