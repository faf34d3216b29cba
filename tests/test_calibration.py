"""Calibrated τ: the isotonic fit, the samples it is fitted on, and decoding with the fitted maps.

Fast code against slow obvious computations; float64 tiny models where tokens are compared.
"""

import json
import random

import numpy as np
import pytest
import torch

from mars_hf.decoding.calibration import (
    ConfidenceCalibration,
    calibration_disabled,
    calibration_for,
    interpolate,
)
from mars_hf.decoding.generation import enable_mars
from mars_hf.training.calibration_fit import (
    collect_samples,
    examples_from_records,
    expected_calibration_error,
    fit_calibration,
    held_out_split,
    isotonic_knots,
    pool_adjacent_violators,
    write_calibration,
)
from tests.tiny import tiny_model, tiny_tokenizer

WINDOW = 4


# ------------------------------------------------------------------------------------------ the fit
def _isotonic_brute_force(values, weights):
    """The min-max formula: f_i = max_{j<=i} min_{k>=i} weighted mean(values[j..k])."""
    n = len(values)

    def mean(j, k):
        w = sum(weights[j : k + 1])
        return sum(v * x for v, x in zip(values[j : k + 1], weights[j : k + 1])) / w

    return [max(min(mean(j, k) for k in range(i, n)) for j in range(i + 1)) for i in range(n)]


@pytest.mark.parametrize("seed", range(6))
def test_pool_adjacent_violators_equals_the_min_max_formula(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 14)
    values = [rng.choice([0.0, 1.0, rng.random()]) for _ in range(n)]
    weights = [rng.choice([1.0, 2.0, 0.5 + rng.random()]) for _ in range(n)]
    fitted = pool_adjacent_violators(values, weights)
    assert fitted == pytest.approx(_isotonic_brute_force(values, weights), abs=1e-12)
    assert all(a <= b + 1e-15 for a, b in zip(fitted, fitted[1:]))


def test_isotonic_knots_are_the_pooled_blocks_of_the_sorted_samples():
    rng = random.Random(1)
    confidences = [rng.random() for _ in range(30)]
    correct = [int(rng.random() < c) for c in confidences]
    knots = isotonic_knots(confidences, correct, bins=1000)  # more bins than samples: one per sample
    order = sorted(range(30), key=lambda i: confidences[i])
    xs = [confidences[i] for i in order]
    fitted = _isotonic_brute_force([correct[i] for i in order], [1.0] * 30)
    expected_x, expected_y = [], []
    i = 0
    while i < 30:  # one knot per run of equal fitted values, at the run's mean confidence
        j = i
        while j + 1 < 30 and abs(fitted[j + 1] - fitted[i]) < 1e-12:
            j += 1
        expected_x.append(sum(xs[i : j + 1]) / (j + 1 - i))
        expected_y.append(fitted[i])
        i = j + 1
    assert knots["x"] == pytest.approx(expected_x, abs=1e-6)
    assert knots["y"] == pytest.approx(expected_y, abs=1e-6)
    assert len(isotonic_knots(confidences * 100, correct * 100, bins=16)["x"]) <= 16
    # confidences that differ below the stored precision still give strictly increasing knots
    near_one = [1 - 1e-12 * i for i in range(200)]
    knots = isotonic_knots(near_one, [i % 2 for i in range(200)], bins=64)
    ConfidenceCalibration({"method": "isotonic", "offsets": [knots]})


def test_interpolation_is_numpys():
    xs, ys = [0.1, 0.3, 0.35, 0.9], [0.0, 0.2, 0.6, 0.95]
    for value in np.linspace(-0.5, 1.5, 201):
        assert interpolate(xs, ys, float(value)) == pytest.approx(float(np.interp(value, xs, ys)), abs=1e-12)


def test_reliability_improves_after_fitting_on_overconfident_synthetic_data():
    rng = random.Random(0)
    per_example = []
    for _ in range(400):
        samples = []
        for offset in range(1, WINDOW + 1):
            confidence = rng.random()
            truth = confidence ** (1 + offset)  # overconfident, more so further ahead
            samples.append((offset, confidence, int(rng.random() < truth)))
        per_example.append(samples)
    record = fit_calibration(per_example, WINDOW, conditional=False)
    reliability = record["reliability"]
    assert reliability["held_out_examples"] == 80
    assert reliability["pooled_after"] < 0.5 * reliability["pooled_before"]
    assert all(after < before for before, after in zip(reliability["before"], reliability["after"]))
    assert record["num_examples"] == 400 and record["num_samples"] == [400] * WINDOW
    calibration = ConfidenceCalibration(record)
    for offset in range(1, WINDOW + 1):  # close to the truth it was sampled from
        assert calibration.apply(offset, 0.8) == pytest.approx(0.8 ** (1 + offset), abs=0.12)
    # the ECE itself, against its definition on a hand example
    assert expected_calibration_error([0.05, 0.05, 0.95], [0, 1, 1], bins=10) == pytest.approx(
        (2 / 3) * abs(0.05 - 0.5) + (1 / 3) * abs(0.95 - 1)
    )


def test_held_out_split():
    assert held_out_split(100, 0) == 0
    assert held_out_split(100, 0.05) == 5
    assert held_out_split(100, 12) == 12
    assert held_out_split(3, 10) == 2  # never every row


# ------------------------------------------------------------------------------ the fitted samples
@torch.no_grad()
def _plain_step(model, prefix, mask_token_id):
    """Decoding-time forward: the prefix then W masks, plain causal attention; per mask its
    (max probability, argmax) with the mask token suppressed, as collect_samples reads them."""
    logits = model(input_ids=torch.tensor([list(prefix) + [mask_token_id] * WINDOW])).logits[0].float()
    logits[:, mask_token_id] = float("-inf")
    probs = logits.softmax(-1)
    last = len(prefix) - 1
    return [(float(probs[last + k].max()), int(probs[last + k].argmax())) for k in range(WINDOW + 1)]


def _own_greedy(model, prompt, length, mask_token_id):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(length):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
            logits[mask_token_id] = float("-inf")
            ids.append(int(logits.argmax()))
    return ids


@pytest.mark.parametrize("conditional", [True, False])
def test_collected_samples_are_what_a_decoding_step_sees(conditional):
    tokenizer = tiny_tokenizer()
    model = tiny_model("qwen2", seed=3, tokenizer=tokenizer, vocab_size=len(tokenizer))
    model.config._attn_implementation = "sdpa"
    mask = model.config.mars["mask_token_id"]
    prompt = tokenizer("the cat sat on the mat", add_special_tokens=False).input_ids
    own = _own_greedy(model, prompt, 21, mask)
    other = list(own)
    other[len(prompt) + 9] = (other[len(prompt) + 9] + 1) % mask  # leaves the model's path at one token
    sequences = [own, other]
    labels = [[-100] * len(prompt) + seq[len(prompt) :] for seq in sequences]
    collected = collect_samples(model, sequences, labels, conditional=conditional)
    for seq, lab, samples in zip(sequences, labels, collected):
        expected = []
        for start in range(WINDOW, len(seq), WINDOW):
            if lab[start] == -100:
                continue
            step = _plain_step(model, seq[:start], mask)
            for k in range(1, WINDOW + 1):
                p = start + k - 1
                if p >= len(seq):
                    break
                if not all(_plain_step(model, seq[:q], mask)[0][1] == seq[q] for q in range(start, p + 1)):
                    break
                own_token = _plain_step(model, seq[: p + 1], mask)[0][1]
                confidence, token = step[k]
                expected.append((k, confidence, int(token == own_token)))
                if conditional and token != own_token:
                    break
        assert [(k, y) for k, _, y in samples] == [(k, y) for k, _, y in expected]
        assert [c for _, c, _ in samples] == pytest.approx([c for _, c, _ in expected], abs=1e-6)
    assert len(collected[1]) < len(collected[0])  # the off-path token removes samples


def test_examples_from_chat_records():
    tokenizer = tiny_tokenizer()
    record = {
        "messages": [
            {"role": "user", "content": "the cat"},
            {"role": "assistant", "content": "sat on the mat"},
        ]
    }
    (ids,), (labels,) = examples_from_records(tokenizer, [record])
    prompt = tokenizer.apply_chat_template(
        record["messages"][:1], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    assert ids[: len(prompt)] == prompt and labels[: len(prompt)] == [-100] * len(prompt)
    assert labels[len(prompt) :] == ids[len(prompt) :] and len(ids) > len(prompt)
    with pytest.raises(ValueError, match="mars-hf distill"):
        examples_from_records(tokenizer, [{"text": "x"}])


# ------------------------------------------------------------------------------------- decoding
def _peaked(model):
    """A random tiny model is nearly uniform (p ≈ 1/64); a scaled head gives confidences 0.6-0.95."""
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(25)
    return model


def _calibrated(model, maps):
    _peaked(model)
    model.config.mars = {
        **model.config.mars,
        "calibration": {"method": "isotonic", "offsets": [{"x": x, "y": y} for x, y in maps]},
    }
    return model


@torch.no_grad()
def _reference_calibrated(model, prompt, tau, maps, max_new_tokens, eos):
    """Slow threshold decoding: mask k is kept while interpolate(map_k, p(chosen)) >= τ."""
    mask = model.config.mars["mask_token_id"]
    generated, per_step = [], []
    while len(generated) < max_new_tokens:
        sequence = list(prompt) + generated
        logits = model(input_ids=torch.tensor([sequence + [mask] * WINDOW])).logits[0].float()
        last, accepted = len(sequence) - 1, 0
        for j in range(WINDOW + 1):
            probs = logits[last + j].softmax(-1)
            token = int(probs.argmax())
            if j > 0 and interpolate(*maps[j - 1], float(probs[token])) < tau:
                break
            generated.append(token)
            accepted += 1
            if token == eos or len(generated) == max_new_tokens:
                return generated, per_step + [accepted]
        per_step.append(accepted)
    return generated, per_step


@torch.no_grad()
def _mask_confidence_quantiles(model, prompts, steps=6):
    """Quantiles of the raw mask confidences along one-token decoding (maps are placed among them)."""
    mask = model.config.mars["mask_token_id"]
    values = []
    for prompt in prompts:
        ids = list(prompt)
        for _ in range(steps):
            probs = model(input_ids=torch.tensor([ids + [mask] * WINDOW])).logits[0, len(ids) - 1 :].float()
            probs = probs.softmax(-1)
            values += probs[1:].max(-1).values.tolist()
            ids.append(int(probs[0].argmax()))
    return {q: float(np.quantile(values, q / 100)) for q in (0, 10, 25, 50, 75, 100)}


def _maps(name, q):
    if name == "stretched":  # τ = 0.9 passes about the upper half
        return [([q[10], q[50], q[100] + 0.01], [0.0, 0.9, 1.0])] * WINDOW
    if name == "per_offset":
        return [
            ([q[10], q[75]], [0.0, 1.0]),
            ([q[10], q[50]], [0.5, 1.0]),
            ([q[0] - 0.01, q[50], q[100] + 0.01], [0.0, 0.95, 1.0]),
            ([0.5], [0.0]),
        ]
    return [([0.5], [1.0])] + [([0.5], [0.0])] * (WINDOW - 1)  # first_mask_only


MAPS = ("first_mask_only", "per_offset", "stretched")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("name", MAPS)
@pytest.mark.parametrize("cache", ["cursor", "none"])
def test_threshold_acceptance_follows_the_mapped_confidences(arch, name, cache):
    tokenizer = tiny_tokenizer()
    eos = tokenizer.eos_token_id
    prompts = [
        tokenizer(t, add_special_tokens=False).input_ids for t in ("the cat sat", "one two three four")
    ]
    quantiles = _mask_confidence_quantiles(_peaked(tiny_model(arch, seed=5, tokenizer=tokenizer)), prompts)
    maps = _maps(name, quantiles)
    model = enable_mars(_calibrated(tiny_model(arch, seed=5, tokenizer=tokenizer), maps))
    seen = set()
    for prompt in prompts:
        out = model.generate(
            torch.tensor([prompt]), mars_threshold=0.9, mars_cache=cache, max_new_tokens=16,
            do_sample=False, eos_token_id=eos, pad_token_id=eos, return_dict_in_generate=True,
        )  # fmt: skip
        tokens, per_step = _reference_calibrated(model, prompt, 0.9, maps, 16, eos)
        assert out.sequences[0, len(prompt) :].tolist()[: len(tokens)] == tokens
        assert [c for c in out.accepted_counts[:, 0].tolist() if c] == per_step
        seen.update(per_step[:-1])
    if name == "first_mask_only":
        assert seen == {2}
    else:
        assert len(seen) > 1  # the maps both accept and reject masks here


def test_identity_calibration_and_no_calibration_decode_the_same():
    tokenizer = tiny_tokenizer()
    plain = enable_mars(_peaked(tiny_model("llama", seed=2, tokenizer=tokenizer)))
    identity = enable_mars(
        _calibrated(tiny_model("llama", seed=2, tokenizer=tokenizer), [([0.0, 1.0], [0.0, 1.0])] * 4)
    )
    assert calibration_for(plain) is None and calibration_for(identity) is not None
    ids = torch.tensor([tokenizer("the dog sat on", add_special_tokens=False).input_ids] * 2)
    # A fixed feed: with the default planner each model would measure its own (host-timed) cost curve.
    for kwargs in (
        {"mars_threshold": 0.8},
        {"mars_threshold": 0.0},
        {"mars_acceptance": "verify", "mars_threshold": 0.75, "mars_layout": "linear"},
    ):
        a = plain.generate(
            ids, max_new_tokens=12, do_sample=False, pad_token_id=2, return_dict_in_generate=True, **kwargs
        )
        b = identity.generate(
            ids, max_new_tokens=12, do_sample=False, pad_token_id=2, return_dict_in_generate=True, **kwargs
        )
        assert torch.equal(a.sequences, b.sequences)
        assert torch.equal(a.accepted_counts, b.accepted_counts) and torch.equal(
            a.drafts_proposed, b.drafts_proposed
        )


def test_calibrated_verify_floor_is_the_raw_floor_it_maps_to_and_calibration_can_be_turned_off():
    tokenizer = tiny_tokenizer()
    ids = torch.tensor([tokenizer("one two three", add_special_tokens=False).input_ids])
    common = dict(max_new_tokens=16, do_sample=False, pad_token_id=2, return_dict_in_generate=True)
    common["mars_layout"] = "linear"  # a fixed feed: the planner would size groups from the confidences
    raw = enable_mars(_peaked(tiny_model("mistral", seed=7, tokenizer=tokenizer)))
    # linear from (0.6, 0) to (0.9, 1): a calibrated floor of 0.5 is a raw floor of 0.75
    calibrated = enable_mars(
        _calibrated(tiny_model("mistral", seed=7, tokenizer=tokenizer), [([0.6, 0.9], [0.0, 1.0])] * WINDOW)
    )
    a = raw.generate(ids, mars_acceptance="verify", mars_threshold=0.75, **common)
    b = calibrated.generate(ids, mars_acceptance="verify", mars_threshold=0.5, **common)
    assert torch.equal(a.sequences, b.sequences)
    assert torch.equal(a.drafts_proposed, b.drafts_proposed)
    assert 0 < int(a.drafts_proposed.sum()) < WINDOW * a.drafts_proposed.shape[0]
    greedy = raw.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=2)
    assert torch.equal(b.sequences[:, : greedy.shape[1]], greedy)  # verify stays lossless
    with calibration_disabled(calibrated):
        c = calibrated.generate(ids, mars_acceptance="verify", mars_threshold=0.75, **common)
    assert torch.equal(a.drafts_proposed, c.drafts_proposed)
    assert calibration_for(calibrated) is not None


def test_offsets_beyond_the_fit_are_never_accepted():
    calibration = ConfidenceCalibration(
        {"method": "isotonic", "offsets": [{"x": [0.0, 1.0], "y": [0.0, 1.0]}]}
    )
    assert calibration.apply(1, 0.7) == 0.7 and calibration.apply(2, 0.99) == 0.0
    with pytest.raises(ValueError, match="mars-hf calibrate"):
        ConfidenceCalibration({"method": "platt", "offsets": []})


# ------------------------------------------------------------------------------ command and files
def test_calibrate_command_writes_the_record_and_loading_applies_it(tmp_path):
    from mars_hf import AutoMARSModelForCausalLM
    from mars_hf.cli import main
    from mars_hf.decoding.decoder import MARSBatchDecoder
    from mars_hf.decoding.settings import MARSDecodingSettings

    tokenizer = tiny_tokenizer()
    model = _peaked(tiny_model("llama", seed=1, tokenizer=tokenizer, vocab_size=len(tokenizer)))
    folder = tmp_path / "ckpt"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    mask = model.config.mars["mask_token_id"]
    rows = []
    for n, text in enumerate(["the cat", "one two", "red blue green", "hello world", "x y z", "yes no"] * 2):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]  # fmt: skip
        full = _own_greedy(model, list(prompt), 12 + n, mask)
        rows.append({"input_ids": full, "labels": [-100] * len(prompt) + full[len(prompt) :]})
    data = tmp_path / "held_out.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["calibrate", str(folder), "--data", str(data), "--num-examples", "10"]) == 0
    record = json.loads((folder / "config.json").read_text())["mars"]["calibration"]
    assert record["method"] == "isotonic" and record["num_examples"] == 10
    assert len(record["offsets"]) == WINDOW and "reliability" in record
    loaded = AutoMARSModelForCausalLM.from_pretrained(str(folder))
    decoder = MARSBatchDecoder(
        loaded, MARSDecodingSettings(window=WINDOW, mask_token_id=mask), max_rows=1, max_length=32, pad_token_id=2
    )
    assert decoder.calibration is not None and decoder.calibration.num_offsets == WINDOW


def test_write_calibration_into_an_adapter_folder_refreshes_custom_generate(tmp_path):
    (tmp_path / "mars_config.json").write_text(json.dumps({"block_size": 4, "mask_token_id": 9}))
    (tmp_path / "custom_generate").mkdir()
    record = {"method": "isotonic", "offsets": [{"x": [0.5], "y": [0.5]}]}
    write_calibration(tmp_path, record)
    assert json.loads((tmp_path / "mars_config.json").read_text())["calibration"] == record
    assert "calibration" in (tmp_path / "custom_generate" / "decoder.py").read_text()
    with pytest.raises(FileNotFoundError, match="MARS checkpoint"):
        write_calibration(tmp_path / "nothing", record)


def test_training_script_fits_a_calibration_on_its_held_out_rows(tmp_path):
    from mars_hf.commands.train import load_example_script

    model_dir = tmp_path / "model"
    tokenizer = tiny_tokenizer(with_mask=False)
    base = _peaked(tiny_model("llama", block_size=None, dtype=torch.float32))
    base.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    rows = []  # the model's own greedy answers (self-distilled), as input_ids / labels
    for n, text in enumerate(
        ["the cat sat", "is the dog red", "one two", "hello world", "x y z", "yes no"] * 2
    ):
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        ids = _own_greedy(base, list(prompt), 10 + n, mask_token_id=base.config.vocab_size - 1)
        rows.append({"input_ids": ids, "labels": [-100] * len(prompt) + ids[len(prompt) :]})
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "out"
    argv = ["--model_name_or_path", str(model_dir), "--dataset_name", str(data), "--output_dir", str(out),
            "--max_steps", "1", "--per_device_train_batch_size", "2", "--report_to", "none", "--bf16", "false",
            "--save_strategy", "no", "--block_size", "2", "--use_cpu", "--learning_rate", "1e-9",
            "--calibration_holdout", "4"]  # fmt: skip
    trainer = load_example_script().cli(argv)
    assert len(trainer.train_dataset) == 8
    record = json.loads((out / "config.json").read_text())["mars"]["calibration"]
    assert record["method"] == "isotonic" and record["num_examples"] == 4 and len(record["offsets"]) == 2
    none = tmp_path / "none"
    load_example_script().cli([*argv[:5], str(none), *argv[6:-1], "0"])
    assert "calibration" not in json.loads((none / "config.json").read_text())["mars"]
    # a gated LoRA adapter (the shipped model's method): the record goes to mars_config.json
    gated = tmp_path / "gated"
    gated_argv = ["--use_peft", "--lora_r", "4", "--lora_target_modules", "all-linear", "--adapter_gating", "mask",
                  "--mask_targets", "soft", "--ar_weight", "0"]  # fmt: skip
    load_example_script().cli([*argv[:5], str(gated), *argv[6:], *gated_argv])
    record = json.loads((gated / "mars_config.json").read_text())["calibration"]
    assert record["num_examples"] == 4 and record["num_samples"][0] > 0


def test_custom_generate_copy_applies_the_stored_calibration(tmp_path):
    """A checkpoint's custom_generate/ (no mars_hf import) decodes τ with the calibration in config.json."""
    from transformers import AutoModelForCausalLM

    from mars_hf import hub

    tokenizer = tiny_tokenizer()
    prompts = [tokenizer("the cat sat", add_special_tokens=False).input_ids]
    quantiles = _mask_confidence_quantiles(_peaked(tiny_model("llama", seed=5, tokenizer=tokenizer)), prompts)
    maps = _maps("per_offset", quantiles)
    model = _calibrated(tiny_model("llama", seed=5, tokenizer=tokenizer), maps)
    hub.save_pretrained(model, tokenizer, tmp_path / "ckpt")
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.float64)
    eos = tokenizer.eos_token_id
    out = plain.generate(
        torch.tensor(prompts), max_new_tokens=16, do_sample=False, eos_token_id=eos, pad_token_id=eos,
        custom_generate=str(tmp_path / "ckpt"), trust_remote_code=True, mars_threshold=0.9,
    )  # fmt: skip
    tokens, per_step = _reference_calibrated(model, prompts[0], 0.9, maps, 16, eos)
    assert out[0, len(prompts[0]) :].tolist()[: len(tokens)] == tokens
    assert len(set(per_step[:-1])) > 1
    uncalibrated, _ = _reference_calibrated(
        model, prompts[0], 0.9, [([0.0, 1.0], [0.0, 1.0])] * WINDOW, 16, eos
    )
    assert uncalibrated != tokens  # the stored maps changed what τ = 0.9 accepts
