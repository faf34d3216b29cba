"""The exactness section: τ = 1 and verify against stock greedy on the *unforced* model in the decoding dtype.

A row that differs is classified at its first differing token by the gap between stock's logit for its
own token and for the other run's token: a near tie (within ``tie_tolerance``, 4 bf16 spacings at that
logit's magnitude) is a floating-point flip; anything larger would be a bug. The baseline "stock, each
row alone" says how often such flips happen without MARS (the same math in other kernel shapes).
"""

from __future__ import annotations

import math
import statistics

import torch

from mars_hf.tools.bench import count_generated_tokens, greedy_generation_config
from mars_hf.tools.gpu_check.decoding import CheckConfiguration, verify_configurations
from mars_hf.tools.gpu_check.generation import SynchronizedGenerate
from mars_hf.tools.gpu_check.random_models import make_prompts

ALONE_LABEL = "stock, each row alone"


def exactness_item(check, shape: str) -> None:
    """One item per exactness batch size, each estimated and run if it fits."""
    args = check.args
    configurations = [CheckConfiguration("cursor", 1.0, args.window), *verify_configurations(args)]
    for batch in args.exactness_batch_sizes:
        estimate = check.estimates.exactness(shape, batch, configurations)
        check.run_item(
            f"{shape}: exactness batch={batch}", estimate, exactness, check, shape, batch, configurations
        )


class _Decoded:
    """Greedy decoding of one prompt batch, each row cut after its EOS (as lists of token ids)."""

    def __init__(self, model, inputs):
        self.inputs = inputs
        self.prompt_length = inputs["input_ids"].shape[1]
        self.eos = [int(model.generation_config.eos_token_id)]
        self.generator = SynchronizedGenerate(model)

    def new_tokens(self, sequences, start: int | None = None) -> list[list[int]]:
        new = sequences[:, self.prompt_length if start is None else start :]
        lengths = count_generated_tokens(new, self.eos).tolist()
        return [row[:n] for row, n in zip(new.tolist(), lengths)]


def exactness(check, shape: str, batch: int, configurations) -> None:
    """Every configuration, then (batch > 1) stock row by row, against stock greedy of the whole batch."""
    args = check.args
    model, forcer = check.models[shape]["model"], check.models[shape]["forcer"]
    forcer.enabled = False
    try:
        inputs = make_prompts(model, batch, args.prompt_length, args.seed + 1, check.device)
        decoded = _Decoded(model, inputs)
        stock_config = greedy_generation_config(model, args.exactness_new_tokens, output_logits=True)
        stock = decoded.generator.generate(**inputs, generation_config=stock_config)
        stock_tokens = decoded.new_tokens(stock.sequences)
        stock_logits = torch.stack(stock.logits, dim=1).float()  # [batch, new, vocab]
        config = greedy_generation_config(model, args.exactness_new_tokens)
        record = dict(model=shape, batch=batch, dtype=args.dtype, new_tokens=args.exactness_new_tokens)
        for configuration in configurations:
            check.budget.check()
            tokens = _decode_configuration(
                check, decoded, config, configuration, f"{shape}: exactness batch={batch}"
            )
            if tokens is None:
                continue
            comparison = compare_with_stock(stock_tokens, tokens, stock_logits)
            check.result["exactness"].append(
                dict(
                    record,
                    label=configuration.label,
                    acceptance=configuration.acceptance,
                    layout=configuration.layout,
                    tau=configuration.tau,
                    **comparison,
                )
            )
        if batch > 1:  # the baseline: stock itself, each row decoded alone (other kernels, same math)
            comparison = compare_with_stock(stock_tokens, _rows_alone(check, decoded, config), stock_logits)
            check.result["exactness"].append(
                dict(record, label=ALONE_LABEL, acceptance=None, layout=None, tau=None, **comparison)
            )
    finally:
        forcer.enabled = True


def _decode_configuration(check, decoded: _Decoded, config, configuration, item: str):
    """The configuration's tokens per row; None (and the reason recorded) when the decoder rejects a verify
    configuration, so that the others are still compared."""
    try:
        output = decoded.generator.generate(
            **decoded.inputs, generation_config=config, **configuration.generate_kwargs()
        )
    except (ValueError, TypeError, NotImplementedError) as error:
        if configuration.acceptance != "verify":
            raise
        check.skip(f"{item} {configuration.label}", f"failed: {type(error).__name__}: {error}")
        return None
    return decoded.new_tokens(output.sequences)


def _rows_alone(check, decoded: _Decoded, config) -> list[list[int]]:
    """Stock greedy of each row by itself, without its padding."""
    tokens = []
    for row in range(decoded.inputs["input_ids"].shape[0]):
        check.budget.check()
        keep = decoded.inputs["attention_mask"][row].bool()
        ids = decoded.inputs["input_ids"][row, keep][None]
        output = decoded.generator.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config
        )
        tokens += decoded.new_tokens(output.sequences, ids.shape[1])
    return tokens


def compare_with_stock(stock_tokens, tokens, stock_logits, spacings: int = 4) -> dict:
    """Compare each row's tokens with stock greedy's (both cut after EOS).

    A differing row is judged at its first differing token ``t`` by stock's logit gap between its own
    token and the other run's there: within ``spacings`` bf16 spacings (2^(e - 7), e the exponent of
    stock's logit) it is a near-tie flip, which floating-point differences between kernels explain;
    a larger gap, or a run that merely stopped earlier or later, counts as another difference.
    """
    identical, flips, other, prefix = 0, [], [], []
    for row, (a, b) in enumerate(zip(stock_tokens, tokens)):
        length = min(len(a), len(b))
        first = next((t for t in range(length) if a[t] != b[t]), None)
        if first is None and len(a) == len(b):
            identical += 1
            prefix.append(1.0)
            continue
        first = length if first is None else first
        prefix.append(first / max(len(a), 1))
        if first >= length:
            other.append({"row": row, "position": first, "gap": None, "tie_tolerance": None})
            continue
        logits = stock_logits[row, first]
        gap = float(logits[a[first]] - logits[b[first]])
        magnitude = max(abs(float(logits[a[first]])), 1e-3)
        tolerance = spacings * 2.0 ** (math.floor(math.log2(magnitude)) - 7)
        entry = {"row": row, "position": first, "gap": gap, "tie_tolerance": tolerance}
        (flips if abs(gap) <= tolerance else other).append(entry)
    rows = len(stock_tokens)
    return {
        "rows": rows,
        "rows_identical": identical,
        "agreement": identical / max(rows, 1),
        "mean_agreeing_prefix": statistics.mean(prefix) if prefix else None,
        "near_tie_flips": len(flips),
        "other_differences": len(other),
        "differences": flips + other,
    }
