"""A slow, obviously-correct MARS decoder (docs/method.md §2), independent of ``mars_hf.decoding.generation``.

One prompt at a time, no cache, no padding: every step runs the model on the whole accepted
sequence followed by W mask tokens. Logits are read in float32, like stock ``generate``, so that
ties and confidences are computed the same way.
"""

from __future__ import annotations

import torch


def confidence(probs: torch.Tensor, token: int, acceptance: str) -> float:
    if acceptance == "probability":
        return float(probs[token])
    if acceptance == "entropy":
        return float(torch.special.entr(probs).sum())
    top = torch.topk(probs, 2).values
    return float(top[0] - top[1])


def passes(value: float, tau: float, acceptance: str) -> bool:
    if acceptance == "entropy":
        return value <= tau
    if tau >= 1.0:  # τ = 1 means exactly one token, even where a float32 softmax rounds to 1.0
        return False
    return value >= tau


@torch.no_grad()
def reference_generate(
    model,
    prompt: list[int],
    *,
    tau: float,
    window: int,
    mask_token_id: int,
    max_new_tokens: int,
    eos_token_ids: list[int] = (),
    acceptance: str = "probability",
    stop_token_ids: list[int] = (),
) -> tuple[list[int], list[int]]:
    """Greedy MARS decoding of one prompt. Returns (generated tokens, tokens accepted per step)."""
    sequence = list(prompt)
    generated: list[int] = []
    per_step: list[int] = []
    while len(generated) < max_new_tokens:
        inputs = torch.tensor([sequence + [mask_token_id] * window])
        logits = model(input_ids=inputs).logits[0].float()
        last = len(sequence) - 1
        accepted = 0
        for j in range(window + 1):
            probs = torch.softmax(logits[last + j], dim=-1)
            token = int(torch.argmax(logits[last + j]))
            if j > 0 and not passes(confidence(probs, token, acceptance), tau, acceptance):
                break
            generated.append(token)
            accepted += 1
            if token in eos_token_ids or token in stop_token_ids or len(generated) == max_new_tokens:
                per_step.append(accepted)
                return generated, per_step
        per_step.append(accepted)
        sequence = list(prompt) + generated
    return generated, per_step


@torch.no_grad()
def reference_assisted_generate(
    model,
    assistant,
    prompt: list[int],
    *,
    tau: float,
    window: int,
    mask_token_id: int,
    max_new_tokens: int,
    num_assistant_tokens: int,
    eos_token_ids: list[int] = (),
) -> tuple[list[int], int]:
    """Greedy MARS with τ and a draft model (docs/method.md §5), one prompt, no cache. Each step: the
    draft model's greedy tokens (``num_assistant_tokens``, never past the tokens left but one, cut after
    an EOS); the target keeps the longest prefix of them equal to its own greedy choices, then makes one
    ordinary τ step after that prefix (its next token, then the masks while they pass τ). Returns
    (generated tokens, target steps)."""
    generated: list[int] = []
    steps = 0
    while len(generated) < max_new_tokens:
        sequence = list(prompt) + generated
        drafts: list[int] = []
        for _ in range(min(num_assistant_tokens, max_new_tokens - len(generated) - 1)):
            drafts.append(int(assistant(input_ids=torch.tensor([sequence + drafts])).logits[0, -1].float().argmax()))
            if drafts[-1] in eos_token_ids:
                break
        own = model(input_ids=torch.tensor([sequence + drafts])).logits[0, len(sequence) - 1 :].float().argmax(-1)
        kept = 0
        while kept < len(drafts) and drafts[kept] == int(own[kept]):
            kept += 1
        steps += 1
        for token in drafts[:kept]:
            generated.append(token)
            if token in eos_token_ids:
                return generated, steps
        sequence = list(prompt) + generated
        logits = model(input_ids=torch.tensor([sequence + [mask_token_id] * window])).logits[0].float()
        for j in range(window + 1):
            probs = torch.softmax(logits[len(sequence) - 1 + j], dim=-1)
            token = int(torch.argmax(probs))
            if j > 0 and not passes(confidence(probs, token, "probability"), tau, "probability"):
                break
            generated.append(token)
            if token in eos_token_ids or len(generated) == max_new_tokens:
                return generated, steps
    return generated, steps
