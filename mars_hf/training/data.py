"""Training data for MARS made from the model itself: self-distillation.

Why self-distillation: MARS teaches the ``[MASK]`` positions to predict the tokens the model will emit
2, 3, ... steps ahead. If the training text is the model's *own* greedy output, those targets are
exactly what the model would say, so the masks learn to run ahead of the model rather than towards
some other writer, and the clean (next-token) stream is trained on text it already predicts with top-1
probability: its greedy, one-token-per-step (``τ = 1``) behaviour stays what it was. Training on
someone else's answers would instead pull the model towards them (its τ = 1 output would drift), and
a model that only approximates a new distribution is rarely confident enough to accept extra tokens.

The dataset is returned already tokenized with the exact token ids the model generated (decoding and
re-encoding text does not always round-trip), plus the conversation as text for reading:

* ``input_ids``: chat-templated prompt + generated response, ending with the EOS token only when the
  model really stopped there;
* ``labels``: ``input_ids`` with the prompt set to -100, so only the response is supervised whatever
  the trainer's ``completion_only_loss`` (TRL keeps a provided ``labels`` column as it is);
* ``completion_mask``: 1 on response tokens (TRL's own name for the same information);
* ``messages``: ``[{"role": "user", ...}, {"role": "assistant", ...}]`` (plus a system message
  when one was given), for humans and for trainers that want text;
* ``ends_with_eos``: whether the response ended with EOS. A response cut at ``max_new_tokens`` does
  not end with EOS, so the trainer's collator (docs/method.md §1.5) never pads it with a false end.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from mars_hf.models.eos import eos_token_ids, pad_token_id, trim_at_eos

logger = logging.getLogger(__name__)


def chat_prompt_ids(tokenizer, prompt: str, system_prompt: str | None = None) -> list[int]:
    """Token ids of ``prompt`` as a user turn under the chat template, ready for the assistant's reply."""
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
        {"role": "user", "content": prompt}
    ]
    if tokenizer.chat_template is None:
        raise ValueError(
            "self_distill needs a tokenizer with a chat template (an instruction-tuned model); set "
            "`tokenizer.chat_template` or pass an instruct checkpoint."
        )
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    return list(ids["input_ids"])


def sampling_kwargs(temperature: float | None, top_p: float = 1.0) -> dict:
    """``generate`` keywords: greedy when ``temperature`` is None or 0, else sampling at that temperature."""
    if not temperature:
        return {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"Need temperature >= 0 and 0 < top_p <= 1, got {temperature} and {top_p}.")
    return {"do_sample": True, "temperature": float(temperature), "top_p": float(top_p), "top_k": None}


@torch.no_grad()
def model_responses(
    model,
    tokenizer,
    prompt_ids: Sequence[Sequence[int]],
    *,
    max_new_tokens: int = 128,
    batch_size: int = 16,
    progress: bool = True,
    desc: str = "Greedy generation",
    temperature: float | None = None,
    top_p: float = 1.0,
) -> list[tuple[list[int], bool]]:
    """The model's own answers: greedy ``generate`` on token-id prompts, batched with left padding (sampled when a
    ``temperature`` is given: more varied contexts for the masks, whose soft targets come from the model).

    Returns, per prompt in the input order, ``(response_ids, ended_with_eos)``; the response stops at
    (and includes) the first EOS. Prompts are batched by length to keep padding small.
    """
    from tqdm.auto import tqdm

    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}.")
    eos_ids = eos_token_ids(model, tokenizer)
    pad_id = pad_token_id(tokenizer, eos_ids)
    device = next(model.parameters()).device
    order = sorted(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))
    results: list[tuple[list[int], bool] | None] = [None] * len(prompt_ids)
    was_training = model.training
    model.eval()
    bar = tqdm(total=len(order), desc=desc, unit="prompt", disable=not progress)
    try:
        for start in range(0, len(order), batch_size):
            chunk = order[start : start + batch_size]
            width = max(len(prompt_ids[i]) for i in chunk)
            input_ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
            attention_mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for row, i in enumerate(chunk):  # left padding: the generated tokens line up on the right
                ids = torch.as_tensor(prompt_ids[i], dtype=torch.long)
                input_ids[row, width - len(ids) :] = ids
                attention_mask[row, width - len(ids) :] = 1
            output = model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention_mask.to(device),
                max_new_tokens=max_new_tokens,
                pad_token_id=pad_id,
                eos_token_id=sorted(eos_ids),
                **sampling_kwargs(temperature, top_p),
            )
            for row, i in enumerate(chunk):
                response = trim_at_eos(output[row, width:].tolist(), eos_ids)
                results[i] = (response, bool(response) and response[-1] in eos_ids)
            bar.update(len(chunk))
    finally:
        bar.close()
        model.train(was_training)
    return results  # type: ignore[return-value]


def self_distill(
    model,
    tokenizer,
    prompts: Sequence[str],
    *,
    max_new_tokens: int = 128,
    batch_size: int = 16,
    system_prompt: str | None = None,
    progress: bool = True,
    temperature: float | None = None,
    top_p: float = 1.0,
):
    """Answer every prompt with the model's own greedy (or sampled) output; a ``datasets.Dataset`` for MARSTrainer.

    Training MARS on these answers teaches the masks to predict exactly what the model would say, and
    keeps its ``τ = 1`` (one token per step) behaviour unchanged: the next-token targets are the
    model's own top-1 choices. Generation is greedy, batched (``batch_size`` prompts at a time, left
    padded, grouped by prompt length) with a progress bar.

    Args:
        model: a causal LM (the base model, before MARS training).
        tokenizer: its tokenizer, with a chat template.
        prompts: user messages.
        max_new_tokens: response length limit; a response cut there is recorded with
            ``ends_with_eos=False`` and carries no EOS token.
        batch_size: prompts per ``generate`` call.
        system_prompt: optional system message (else the chat template's default).
        temperature, top_p: sample the answers instead (``temperature`` > 0): text the model could have
            written, for more varied training contexts; with soft mask targets (taken from the model at
            every position) the masks still learn the model's own choices.

    Returns:
        ``datasets.Dataset`` with columns ``messages``, ``input_ids``, ``labels``, ``completion_mask``
        and ``ends_with_eos`` (see the module docstring), one row per prompt, in order.
    """
    from datasets import Dataset

    prompts = list(prompts)
    if not prompts:
        raise ValueError("self_distill needs at least one prompt.")
    prompt_ids = [chat_prompt_ids(tokenizer, prompt, system_prompt) for prompt in prompts]
    responses = model_responses(
        model,
        tokenizer,
        prompt_ids,
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        progress=progress,
        desc="Self-distillation" if not temperature else f"Sampled self-distillation (T={temperature})",
        temperature=temperature,
        top_p=top_p,
    )
    rows = {"messages": [], "input_ids": [], "labels": [], "completion_mask": [], "ends_with_eos": []}
    for prompt, ids, (response, ended) in zip(prompts, prompt_ids, responses):
        text = tokenizer.decode(response, skip_special_tokens=True)
        messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
            {"role": "user", "content": prompt},
            {"role": "assistant", "content": text},
        ]
        rows["messages"].append(messages)
        rows["input_ids"].append(list(ids) + response)
        rows["labels"].append([-100] * len(ids) + response)
        rows["completion_mask"].append([0] * len(ids) + [1] * len(response))
        rows["ends_with_eos"].append(ended)
    cut = len(prompts) - sum(rows["ends_with_eos"])
    logger.info(
        "Self-distilled %d prompts: %d responses ended with EOS, %d were cut at max_new_tokens=%d.",
        len(prompts),
        len(prompts) - cut,
        cut,
        max_new_tokens,
    )
    return Dataset.from_dict(rows)
