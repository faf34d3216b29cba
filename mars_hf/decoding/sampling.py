"""Reproducible sampling: each output position's randomness is keyed to ``(seed, row, position)``.

The token a sampled row chooses at position ``t`` (the index of that token in the row's own sequence, prompt
included, padding not) is the Gumbel-max draw

    argmax(processed_logits_t + G(seed, row, t))

where ``processed_logits_t`` are the logits after the call's processors and warpers (filtered entries are
-inf) and ``G`` is standard Gumbel noise over the vocabulary, drawn from a CPU ``torch.Generator`` seeded
with ``position_seed(seed, row, t)``. That is an exact draw from ``softmax(processed_logits_t)``, and since
the noise of a position never depends on what a step fed, the draw does not depend on the plan, the
timing, the kernels or the batch companions. It also makes verification of a sampled draft an exact
match, as in greedy: a draft is kept iff it equals the draw at its position, so ``τ = 1`` sampling and
verify sampling give the same text for the same seed. (docs/verified_decoding.md, "Seeds and
reproducibility".)

Every checkpoint's ``custom_generate/`` carries this file verbatim (``mars_hf.hub.custom_generate``), so it
imports torch and transformers only.
"""

from __future__ import annotations

import torch
from transformers.generation.logits_process import LogitsProcessor

_MASK64 = (1 << 64) - 1
# Noise positions a row keeps ready (a verify row needs the next W + 1 or so); past this the cache is cleared.
_CACHED_POSITIONS = 256


def _splitmix64(x: int) -> int:
    """One round of SplitMix64 (Steele, Lea & Flood 2014) on a 64-bit integer."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def position_seed(seed: int, row: int, position: int) -> int:
    """The generator seed of ``(seed, row, position)``, in ``[0, 2**64)``: SplitMix64 chained over the three
    integers, each taken modulo ``2**64`` (a pure function: any copy of this file replicates it)::

        h = splitmix64(seed mod 2**64)
        h = splitmix64(h xor (row mod 2**64))
        h = splitmix64(h xor (position mod 2**64))
    """
    h = _splitmix64(seed & _MASK64)
    h = _splitmix64(h ^ (row & _MASK64))
    return _splitmix64(h ^ (position & _MASK64))


def gumbel_noise(seed: int, row: int, position: int, vocab: int) -> torch.Tensor:
    """``[vocab]`` float32 standard Gumbel noise of ``(seed, row, position)``, on the CPU:
    ``-log(-log(u))`` with ``u = torch.rand(vocab)`` from a generator seeded with ``position_seed`` (``u``
    clamped below at the smallest normal float32, so that no entry is infinite)."""
    generator = torch.Generator(device="cpu").manual_seed(position_seed(seed, row, position))
    uniform = torch.rand(vocab, generator=generator, dtype=torch.float32)
    return -torch.log(-torch.log(uniform.clamp_(min=torch.finfo(torch.float32).tiny)))


def draw_seed() -> int:
    """A base seed from torch's global generator (``torch.manual_seed`` before ``generate`` fixes it)."""
    return int(torch.randint(0, (1 << 63) - 1, (), dtype=torch.int64))


class RowNoise:
    """One row's keyed noise (``seed``, ``row``: its base seed and row key). A position's noise is drawn
    when the position is first decided (or drafted) and kept until the row moves past it: a verify row
    drafts a position in one step and checks it in the next."""

    def __init__(self, seed: int, row: int = 0):
        self.seed, self.row = int(seed), int(row)
        self._cache: dict[tuple[int, int], torch.Tensor] = {}

    def at(self, position: int, vocab: int, device) -> torch.Tensor:
        """The ``[vocab]`` noise of ``position`` on ``device``."""
        key = (position, vocab)
        noise = self._cache.get(key)
        if noise is None or noise.device != torch.device(device):
            if len(self._cache) >= _CACHED_POSITIONS:
                self._cache.clear()
            noise = gumbel_noise(self.seed, self.row, position, vocab).to(device)
            self._cache[key] = noise
        return noise

    def forget_before(self, position: int) -> None:
        """Drop the noise of positions before ``position`` (the row's tokens there are final)."""
        for key in [key for key in self._cache if key[0] < position]:
            del self._cache[key]


def noise_for(places, vocab: int, device) -> torch.Tensor:
    """``[len(places), vocab]``: the noise of each ``(RowNoise, position)``."""
    return torch.stack([noise.at(position, vocab, device) for noise, position in places])


def keyed_choice(scores: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
    """One token per row of ``scores``: the argmax, or with ``noise`` the keyed draw ``argmax(scores + noise)``."""
    if noise is None:
        return scores.argmax(dim=-1)
    return (scores.float() + noise).argmax(dim=-1)


class KeyedNoiseProcessor(LogitsProcessor):
    """Adds each row's keyed noise to a draft model's scores, so that its greedy choice is the draw coupled
    to the target's: the draft at ``t`` is ``argmax(q_t + G(t))``, the target keeps it iff it is also
    ``argmax(p_t + G(t))`` — likely where ``q`` is close to ``p``, and never a change to the output.

    ``noises[b]``: batch row ``b``'s ``RowNoise`` (None: left alone), ``starts[b]``: the position of its first
    new token, ``context``: the (padded) context length the draft model's ``generate`` starts from.
    """

    def __init__(self, noises, starts, context: int):
        self.noises, self.starts, self.context = list(noises), list(starts), int(context)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        step = input_ids.shape[1] - self.context
        scores = scores.clone()
        for b, noise in enumerate(self.noises):
            if noise is not None:
                scores[b] += noise.at(self.starts[b] + step, scores.shape[-1], scores.device).to(scores.dtype)
        return scores
