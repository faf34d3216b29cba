"""How the check calls `generate`: greedy configs of an exact length, and clocks that see the GPU's work."""

from __future__ import annotations

import copy

import torch


def greedy_generation_config(model, max_new_tokens: int, output_logits: bool = False):
    """The model's generation config made greedy, of exactly ``max_new_tokens``, with a dict output."""
    config = copy.deepcopy(model.generation_config)
    config.do_sample = False
    for name in ("temperature", "top_p", "top_k", "min_p", "typical_p"):
        if hasattr(config, name):
            setattr(config, name, None)
    config.max_new_tokens = max_new_tokens
    config.max_length = None
    config.return_dict_in_generate = True
    config.output_logits = output_logits
    return config


class SynchronizedGenerate:
    """``generate`` with ``torch.cuda.synchronize`` on both sides, so that `bench.run_once`'s wall clock
    covers all of the generation's GPU work (not only its launches)."""

    def __init__(self, model):
        self.model = model
        self.cuda = next(model.parameters()).is_cuda
        self.drafts = None  # (proposed, accepted) of the last generation, when it reports them (verify)

    def generate(self, *args, **kwargs):
        if self.cuda:
            torch.cuda.synchronize()
        output = self.model.generate(*args, **kwargs)
        if self.cuda:
            torch.cuda.synchronize()
        proposed = getattr(output, "drafts_proposed", None)
        accepted = getattr(output, "drafts_accepted", None)
        self.drafts = (
            None if proposed is None or accepted is None else (int(proposed.sum()), int(accepted.sum()))
        )
        return output
