"""The exactness section: τ = 1 and verify against stock greedy on the *unforced* model in the decoding dtype.

A row that differs is classified at its first differing token by the gap between the logit of stock's token
and of the other run's token there, measured in float32 on a float32 copy of the model's weights
(`mars_hf.tools.divergence.judge_against_stock`): a near tie (within 4 bf16 spacings at that logit's
magnitude) is a floating-point flip; anything larger would be a bug. The baseline "stock, each row alone"
says how often such flips happen without MARS (the same math in other kernel shapes).
"""

from __future__ import annotations

import copy
import functools

import torch
from transformers import AutoModelForCausalLM

from mars_hf.tools.bench import count_generated_tokens, greedy_generation_config
from mars_hf.tools.divergence import judge_against_stock, narrower_than_float32, prompt_rows
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
        config = greedy_generation_config(model, args.exactness_new_tokens)
        stock_tokens = decoded.new_tokens(
            decoded.generator.generate(**inputs, generation_config=config).sequences
        )
        prompts = prompt_rows([inputs])
        reference = functools.cache(lambda: float32_reference(model))  # built only if a row differs
        record = dict(model=shape, batch=batch, dtype=args.dtype, new_tokens=args.exactness_new_tokens)
        for configuration in configurations:
            check.budget.check()
            tokens = _decode_configuration(
                check, decoded, config, configuration, f"{shape}: exactness batch={batch}"
            )
            if tokens is None:
                continue
            comparison = judge_against_stock(reference, prompts, stock_tokens, tokens)
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
            comparison = judge_against_stock(
                reference, prompts, stock_tokens, _rows_alone(check, decoded, config)
            )
            check.result["exactness"].append(
                dict(record, label=ALONE_LABEL, acceptance=None, layout=None, tau=None, **comparison)
            )
    finally:
        forcer.enabled = True


def float32_reference(model):
    """The model itself where it computes in float32 or wider; else a float32 copy of its weights, without the
    forcing hooks: what measures each divergence's logit gap in float32."""
    if not narrower_than_float32(next(model.parameters()).dtype):
        return model
    with torch.device(model.device):
        reference = AutoModelForCausalLM.from_config(copy.deepcopy(model.config), dtype=torch.float32)
    reference.load_state_dict({name: tensor.float() for name, tensor in model.state_dict().items()})
    return reference.eval()


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
