"""Fitting the confidence calibration that decoding applies (``mars_hf.decoding.calibration``).

What is estimated: for mask offset ``k`` (the ``k``-th mask of a step) and raw confidence ``c`` (its
top probability), the probability that its token is the one the model itself chooses there, given
that the tokens before it are the model's own. Threshold acceptance keeps mask ``k`` only after
masks ``1 … k-1``, so this conditional probability is the one that decides whether an accepted token
still agrees with the model's own output.

Samples come from one teacher-forced two-stream forward per example (as in
``evaluation.teacher_forced_acceptance``): at each block start ``s`` inside an answer, mask ``k``
predicts the token at ``s + k`` from the prefix ``x[:s]``; the label is the clean stream's argmax at
that position (the model's own greedy choice given the true prefix). Only starts where the text
itself follows the model's own greedy path up to that token are used, so any text works and
self-distilled answers (the model's own greedy outputs) give nearly every position.

The map is isotonic regression (pool-adjacent-violators, weighted) on the confidences grouped into
quantile bins, kept as one knot per pooled block. A temperature before it would change nothing: an
isotonic fit is invariant to any monotone transform of its input.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path

import torch

from mars_hf.decoding.calibration import CALIBRATION_KEY, ConfidenceCalibration

logger = logging.getLogger(__name__)

DEFAULT_BINS = 64
RELIABILITY_BINS = 10
HELD_OUT_EVERY = 5  # every 5th example measures the reliability of a fit on the other four


# --------------------------------------------------------------------------------------------------
# Isotonic regression
# --------------------------------------------------------------------------------------------------
def pool_adjacent_violators(values: Sequence[float], weights: Sequence[float] | None = None) -> list[float]:
    """The non-decreasing sequence closest to ``values`` in weighted squared error (one value per input)."""
    weights = [1.0] * len(values) if weights is None else [float(w) for w in weights]
    blocks: list[list[float]] = []  # [weighted mean, weight, count]
    for value, weight in zip(values, weights):
        blocks.append([float(value), weight, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            mean2, weight2, count2 = blocks.pop()
            mean1, weight1, count1 = blocks[-1]
            total = weight1 + weight2
            blocks[-1] = [(mean1 * weight1 + mean2 * weight2) / total, total, count1 + count2]
    fitted: list[float] = []
    for mean, _, count in blocks:
        fitted += [mean] * count
    return fitted


def isotonic_knots(confidences: Sequence[float], correct: Sequence[float], bins: int = DEFAULT_BINS) -> dict:
    """``{"x": [...], "y": [...]}``: a monotone map from confidence to the rate of ``correct``.

    Samples are sorted by confidence and cut into at most ``bins`` groups of (nearly) equal size;
    groups with the same mean confidence are merged; the group rates are made monotone by
    pool-adjacent-violators (weighted by group size); each pooled block gives one knot at its
    weighted mean confidence.
    """
    if len(confidences) != len(correct):
        raise ValueError("confidences and correct must have the same length")
    if not confidences:
        raise ValueError("no samples to fit")
    order = sorted(range(len(confidences)), key=lambda i: confidences[i])
    n = len(order)
    groups = []  # [mean x, mean y, weight]
    count = min(bins, n)
    for g in range(count):
        members = order[g * n // count : (g + 1) * n // count]
        if not members:
            continue
        x = sum(confidences[i] for i in members) / len(members)
        y = sum(correct[i] for i in members) / len(members)
        if groups and groups[-1][0] >= x:  # equal confidences: one group
            gx, gy, gw = groups[-1]
            w = gw + len(members)
            groups[-1] = [(gx * gw + x * len(members)) / w, (gy * gw + y * len(members)) / w, w]
        else:
            groups.append([x, y, float(len(members))])
    fitted = pool_adjacent_violators([g[1] for g in groups], [g[2] for g in groups])
    xs, ys = [], []
    start = 0
    while start < len(groups):  # one knot per pooled block (equal fitted values)
        end = start
        while end + 1 < len(groups) and fitted[end + 1] == fitted[start]:
            end += 1
        weight = sum(g[2] for g in groups[start : end + 1])
        xs.append(sum(g[0] * g[2] for g in groups[start : end + 1]) / weight)
        ys.append(fitted[start])
        start = end + 1
    knots = {"x": [], "y": []}
    for x, y in zip(xs, ys):  # rounded for a readable config; knots that round together become one
        x, y = round(x, 9), round(y, 6)
        if knots["x"] and x <= knots["x"][-1]:
            knots["y"][-1] = max(knots["y"][-1], y)
            continue
        knots["x"].append(x)
        knots["y"].append(y)
    return knots


def expected_calibration_error(
    confidences: Sequence[float], correct: Sequence[float], bins: int = RELIABILITY_BINS
) -> float | None:
    """Σ over equal-width confidence bins of (share of samples) × |mean confidence - rate correct|."""
    if not confidences:
        return None
    totals = [[0.0, 0.0, 0] for _ in range(bins)]
    for c, y in zip(confidences, correct):
        b = min(int(c * bins), bins - 1)
        totals[b][0] += c
        totals[b][1] += y
        totals[b][2] += 1
    n = len(confidences)
    return sum(abs(s_c - s_y) / n for s_c, s_y, k in totals if k)


# --------------------------------------------------------------------------------------------------
# Samples from teacher-forced forwards
# --------------------------------------------------------------------------------------------------
@torch.no_grad()
def collect_samples(
    model,
    sequences: Sequence[Sequence[int]],
    labels: Sequence[Sequence[int]],
    *,
    block_size: int | None = None,
    mask_token_id: int | None = None,
    conditional: bool = True,
) -> list[list[tuple[float, int, int]]]:
    """Per example, ``(offset, confidence, correct)`` triples of every usable mask prediction.

    ``labels`` are -100 on the prompt (as in training data). ``conditional``: a mask counts only when
    the masks before it in its step predicted the model's own tokens (see the module docstring).
    """
    from mars_hf.evaluation.runs import mars_block, teacher_forced_forward

    block_size, mask_token_id = mars_block(model, block_size, mask_token_id)
    was_training = model.training
    model.eval()
    per_example = []
    try:
        for ids, labs in zip(sequences, labels):
            tokens, labs_t, logits, length = teacher_forced_forward(
                model, ids, labs, block_size=block_size, mask_token_id=mask_token_id
            )
            if mask_token_id < logits.shape[-1]:  # decoding suppresses the mask token as an output
                logits[:, mask_token_id] = float("-inf")
            confidence, prediction = logits.softmax(-1).max(-1)
            per_example.append(
                _samples_of(
                    tokens.tolist(),
                    (labs_t != -100).tolist(),
                    prediction.tolist(),
                    confidence.tolist(),
                    length,
                    block_size,
                    conditional,
                )
            )
    finally:
        model.train(was_training)
    return per_example


def usable_mask_predictions(tokens, supervised, prediction, length, block_size, conditional=True):
    """``(offset, p, correct)`` of every usable mask prediction of one teacher-forced forward (lists).

    Noisy position ``p`` (logit row ``length + p``) predicts the token at ``p + 1`` as mask ``offset``; it is
    usable where the text up to it is the model's own greedy path, and ``correct`` when it is the clean
    stream's argmax there (the model's own token). ``conditional``: a step's masks stop at its first wrong one.
    """
    clean, noisy = prediction[:length], prediction[length:]
    own = [False] + [tokens[p] == clean[p - 1] for p in range(1, length)]  # text on the model's own path
    for start in range(block_size, length, block_size):
        if not supervised[start]:
            continue
        for j in range(block_size):
            p = start + j
            if p >= length or not supervised[p] or not own[p]:
                break
            correct = int(noisy[p] == clean[p])
            yield j + 1, p, correct
            if conditional and not correct:
                break


def _samples_of(tokens, supervised, prediction, confidence, length, block_size, conditional):
    """The usable ``(offset, confidence, correct)`` of one example (lists from one forward)."""
    return [
        (offset, confidence[length + p], correct)
        for offset, p, correct in usable_mask_predictions(
            tokens, supervised, prediction, length, block_size, conditional
        )
    ]


# --------------------------------------------------------------------------------------------------
# The fit
# --------------------------------------------------------------------------------------------------
def _by_offset(per_example, window):
    confidences = [[] for _ in range(window)]
    correct = [[] for _ in range(window)]
    for samples in per_example:
        for offset, c, y in samples:
            confidences[offset - 1].append(c)
            correct[offset - 1].append(y)
    return confidences, correct


def fit_calibration(
    per_example: list[list[tuple[float, int, int]]],
    window: int,
    *,
    bins: int = DEFAULT_BINS,
    conditional: bool = True,
    held_out_every: int = HELD_OUT_EVERY,
) -> dict:
    """The ``config.mars["calibration"]`` record from :func:`collect_samples`' output.

    Reliability: a fit on all examples but every ``held_out_every``-th is applied to those it did not
    see, and the expected calibration error (10 equal-width bins) there is reported before and after,
    per offset and pooled. The stored maps are then fitted on every example.
    """
    confidences, correct = _by_offset(per_example, window)
    if not confidences[0]:
        raise ValueError(
            "No usable samples: the data has no answer tokens on the model's own greedy path. Use the model's "
            "own greedy answers (`mars-hf distill`) that it never trained on."
        )
    empty = [k + 1 for k in range(window) if not confidences[k]]
    if empty:
        logger.warning(
            "No samples for mask offsets %s (the masks before them were never all right): they get "
            "confidence 0, so τ never accepts them. More or better data, or a better model, fixes this.",
            empty,
        )
    record = {
        "method": "isotonic",
        "condition": "earlier masks of the step right" if conditional else "none",
        "label": "the model's own greedy token (teacher-forced clean stream)",
        "offsets": [_knots_or_zero(confidences[k], correct[k], bins) for k in range(window)],
        "num_examples": len(per_example),
        "num_samples": [len(c) for c in confidences],
        "accuracy": [round(sum(y) / len(y), 6) if y else None for y in correct],
    }
    fit_part = [s for i, s in enumerate(per_example) if i % held_out_every]
    test_part = [s for i, s in enumerate(per_example) if not i % held_out_every]
    fit_c, fit_y = _by_offset(fit_part, window)
    test_c, test_y = _by_offset(test_part, window)
    if fit_c[0] and test_c[0]:
        trial = ConfidenceCalibration(
            {
                "method": "isotonic",
                "offsets": [_knots_or_zero(fit_c[k], fit_y[k], bins) for k in range(window)],
            }
        )
        mapped = [[trial.apply(k + 1, c) for c in test_c[k]] for k in range(window)]
        pooled_c = [c for cs in test_c for c in cs]
        pooled_m = [c for cs in mapped for c in cs]
        pooled_y = [y for ys in test_y for y in ys]

        def ece(c, y):
            value = expected_calibration_error(c, y)
            return None if value is None else round(value, 6)

        record["reliability"] = {
            "metric": f"expected calibration error ({RELIABILITY_BINS} bins) on held-out examples",
            "held_out_examples": len(test_part),
            "before": [ece(test_c[k], test_y[k]) for k in range(window)],
            "after": [ece(mapped[k], test_y[k]) for k in range(window)],
            "pooled_before": ece(pooled_c, pooled_y),
            "pooled_after": ece(pooled_m, pooled_y),
        }
    else:
        record["reliability"] = {"held_out_examples": len(test_part), "note": "too few examples to measure"}
    return record


def _knots_or_zero(confidences, correct, bins):
    """The isotonic knots, or a constant 0 for an offset without samples."""
    return isotonic_knots(confidences, correct, bins) if confidences else {"x": [0.5], "y": [0.0]}


def calibrate(model, sequences, labels, *, conditional: bool = True, bins: int = DEFAULT_BINS) -> dict:
    """Collect samples and fit: the record to store under ``config.mars["calibration"]``."""
    from mars_hf.models.mask_token import get_mars_config

    window = int(get_mars_config(model)["block_size"])
    per_example = collect_samples(model, sequences, labels, conditional=conditional)
    record = fit_calibration(per_example, window, bins=bins, conditional=conditional)
    reliability = record.get("reliability", {})
    logger.info(
        "Calibration fitted on %d examples (%s samples per offset; top-1 rates %s); held-out ECE %s -> %s.",
        record["num_examples"],
        record["num_samples"],
        record["accuracy"],
        reliability.get("pooled_before"),
        reliability.get("pooled_after"),
    )
    return record


def attach_calibration(
    model, tokenizer, rows: Sequence[dict], *, text_field: str | None = None
) -> dict | None:
    """Fit on held-out training-format ``rows`` and store the record in ``model``'s ``config.mars``.

    Used right after training (``mars-hf train``, the quickstart), so every checkpoint they save carries
    a τ that means the same thing. Returns the record, or ``None`` (with a warning) when the rows cannot be
    read or hold no usable sample: the checkpoint then decodes with raw confidences, as before calibration
    existed. ``text_field``: plain-text rows (that column) are read too, every token supervised.
    """
    try:
        sequences, labels = examples_from_records(tokenizer, list(rows), text_field=text_field)
        record = calibrate(model, sequences, labels)
    except ValueError as error:
        logger.warning(
            "No confidence calibration fitted: %s The checkpoint decodes with raw confidences; fit one later "
            "with `mars-hf calibrate CHECKPOINT --data ANSWERS.jsonl`.",
            error,
        )
        return None
    target = model.get_base_model() if hasattr(model, "get_base_model") else model
    target.config.mars = {**target.config.mars, CALIBRATION_KEY: record}
    return record


# --------------------------------------------------------------------------------------------------
# Data and checkpoints
# --------------------------------------------------------------------------------------------------
def examples_from_records(
    tokenizer, records: Sequence[dict], *, text_field: str | None = None
) -> tuple[list[list[int]], list[list[int]]]:
    """``(sequences, labels)`` from training-format rows: ``input_ids`` (+ ``labels``), ``messages``
    (the last turn is the answer), ``prompt`` / ``completion`` (strings or message lists), or, with
    ``text_field``, plain text (every token supervised). A column a row lacks may be present as None
    (rows of a `datasets.Dataset` carry every column)."""
    sequences, labels = [], []
    for n, record in enumerate(records):
        if record.get("input_ids") is not None:
            ids = list(record["input_ids"])
            labs = list(record.get("labels") or ids)
        elif text_field is not None and isinstance(record.get(text_field), str) and _no_chat(record):
            ids = list(tokenizer(record[text_field])["input_ids"])
            labs = list(ids)
        else:
            if record.get("messages") is not None:
                messages = list(record["messages"])
                prompt_messages, answer = messages[:-1], messages[-1:]
            elif record.get("prompt") is not None and record.get("completion") is not None:
                prompt, completion = record["prompt"], record["completion"]
                if isinstance(prompt, str):
                    prompt = [{"role": "user", "content": prompt}]
                if isinstance(completion, str):
                    completion = [{"role": "assistant", "content": completion}]
                prompt_messages, answer = list(prompt), list(completion)
            else:
                text = f", '{text_field}'" if text_field is not None else ""
                raise ValueError(
                    f"Example {n} has none of 'input_ids', 'messages', 'prompt'/'completion'{text} "
                    f"(keys: {sorted(k for k, v in record.items() if v is not None)}); use the output of "
                    "`mars-hf distill`."
                )
            prompt_ids = _template(tokenizer, prompt_messages, add_generation_prompt=True)
            ids = _template(tokenizer, prompt_messages + answer, add_generation_prompt=False)
            if ids[: len(prompt_ids)] != prompt_ids:
                raise ValueError(f"Example {n}: the chat template does not render the prompt as a prefix.")
            labs = [-100] * len(prompt_ids) + ids[len(prompt_ids) :]
        sequences.append(ids)
        labels.append(labs)
    return sequences, labels


def _no_chat(record: dict) -> bool:
    """A row whose chat columns are empty: its text column is what TRL trains on."""
    return record.get("messages") is None and record.get("prompt") is None


def _template(tokenizer, messages, *, add_generation_prompt):
    out = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=True
    )
    return list(out["input_ids"])


def read_jsonl(path: str | Path, limit: int | None = None) -> list[dict]:
    records = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                records.append(json.loads(line))
            if limit is not None and len(records) >= limit:
                break
    return records


def write_calibration(checkpoint: str | Path, record: dict) -> Path:
    """Store ``record`` in a saved checkpoint: ``config.json``'s ``mars`` entry, or ``mars_config.json``
    of an adapter folder; a ``custom_generate/`` folder there is refreshed so that it applies it."""
    from mars_hf.decoding.gated_lora import MARS_ADAPTER_CONFIG_FILE

    folder = Path(checkpoint)
    config_file = folder / "config.json"
    adapter_file = folder / MARS_ADAPTER_CONFIG_FILE
    if config_file.is_file():
        config = json.loads(config_file.read_text())
        if not isinstance(config.get("mars"), dict):
            raise ValueError(f"{config_file} has no `mars` entry: {folder} is not a MARS checkpoint.")
        config["mars"][CALIBRATION_KEY] = record
        config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        target = config_file
    elif adapter_file.is_file():
        mars = json.loads(adapter_file.read_text())
        mars[CALIBRATION_KEY] = record
        adapter_file.write_text(json.dumps(mars, indent=2, sort_keys=True) + "\n")
        target = adapter_file
    else:
        raise FileNotFoundError(
            f"{folder} has neither config.json nor {MARS_ADAPTER_CONFIG_FILE}; pass a saved MARS checkpoint folder."
        )
    if (folder / "custom_generate").is_dir():
        from mars_hf.hub.custom_generate import write_custom_generate

        write_custom_generate(folder / "custom_generate")
    return target


MAX_HOLDOUT = 256  # enough for 64-bin isotonic maps; more would only take data from training


def held_out_split(num_rows: int, holdout: float, limit: int = MAX_HOLDOUT) -> int:
    """Rows to hold out for calibration: ``holdout`` < 1 is a fraction, >= 1 a count (0: none); at most
    ``limit`` and never every row."""
    if holdout is None or holdout <= 0:
        return 0
    count = int(holdout) if holdout >= 1 else int(math.floor(holdout * num_rows))
    return max(0, min(count, limit, num_rows - 1))
