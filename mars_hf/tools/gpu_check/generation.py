"""How the check calls `generate`: with clocks that see the GPU's work (greedy configs: `bench`)."""

from __future__ import annotations

import torch


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
