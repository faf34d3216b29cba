"""The logits processors a model's generation config asks for, built for each served row as `generate` builds them.

A checkpoint keeps tokens out of its outputs through its generation config: MARS checkpoints list their mask
token in ``suppress_tokens`` (an input-only token that a trained model may still rank high). ``generate`` turns
such fields into logits processors itself; a server drives the decoder directly, so it builds the same ones for
every row, whatever its decode path (τ, verify, one token per step). Sampling (temperature, top-k, top-p) comes
from the request instead, as in OpenAI's API; the other generation-config processors are not applied, and
`unapplied_settings` names them so that the server can say so at start-up.
"""

from __future__ import annotations

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    NoBadWordsLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
)

# Fields whose processors `generate` adds and a served request does not get, with their neutral values.
NOT_APPLIED = {
    "repetition_penalty": (None, 1.0),
    "no_repeat_ngram_size": (None, 0),
    "min_length": (None, 0),
    "min_new_tokens": (None, 0),
    "sequence_bias": (None,),
    "forced_bos_token_id": (None,),
    "forced_eos_token_id": (None,),
    "exponential_decay_length_penalty": (None,),
    "remove_invalid_values": (None, False),
}


def model_processors(generation_config, prompt_length: int, device) -> LogitsProcessorList:
    """``bad_words_ids``, ``suppress_tokens`` and ``begin_suppress_tokens`` as processors, in `generate`'s order.

    ``prompt_length``: the row's prompt, where ``begin_suppress_tokens`` apply (the first new token).
    """
    processors = LogitsProcessorList()
    if generation_config is None:
        return processors
    if generation_config.bad_words_ids:
        eos = generation_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else eos
        processors.append(NoBadWordsLogitsProcessor(generation_config.bad_words_ids, eos))
    if generation_config.suppress_tokens:
        processors.append(SuppressTokensLogitsProcessor(generation_config.suppress_tokens, device=device))
    if generation_config.begin_suppress_tokens:
        begin = prompt_length
        if prompt_length <= 1 and generation_config.forced_bos_token_id is not None:
            begin += 1  # as `generate`: a forced BOS comes first
        processors.append(
            SuppressTokensAtBeginLogitsProcessor(
                generation_config.begin_suppress_tokens, begin, device=device
            )
        )
    return processors


def unapplied_settings(generation_config) -> list[str]:
    """``name=value`` of the generation-config processor settings a served request does not get."""
    if generation_config is None:
        return []
    found = []
    for name, neutral in NOT_APPLIED.items():
        value = getattr(generation_config, name, None)
        if value not in neutral:
            found.append(f"{name}={value!r}")
    return found


def token_buffer(tokens: list[int], room: int, device) -> torch.Tensor:
    """``[1, len(tokens) + room]``: a row's tokens in `generate`'s ``input_ids`` layout, for processors that
    read the prefix (bad words, begin-suppress); ``room`` holds the new tokens and a step's provisional ones."""
    buffer = torch.zeros((1, len(tokens) + room), dtype=torch.long, device=device)
    buffer[0, : len(tokens)] = torch.tensor(tokens, dtype=torch.long, device=device)
    return buffer
