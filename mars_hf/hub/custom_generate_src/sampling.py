"""Reproducible sampling: the token at position ``t`` of row ``r`` is ``argmax(scores_t + G(seed, r, t))``.

A deliberate copy of mars_hf's seed contract (``mars_hf/decoding/sampling.py``: ``position_seed``,
``gumbel_noise``, ``draw_seed``), bit for bit, so that the same seed gives the same tokens here as with
mars_hf installed. Change neither copy alone: tests/test_custom_generate.py compares them.

``scores_t`` are the logits after the call's processors (filtered entries are -inf); ``G`` is standard
Gumbel noise drawn from a CPU generator seeded with ``position_seed(seed, row, t)``: an exact draw from
``softmax(scores_t)`` that never depends on what a step fed, so a sampled draft is verified by an exact
match, as in greedy. ``t`` counts the row's own tokens, prompt included, padding not; the row key is the
row's index in the batch; the base seed comes from torch's global generator (``torch.manual_seed``).
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def position_seed(seed: int, row: int, position: int) -> int:
    """SplitMix64 chained over ``seed``, ``row`` and ``position``, each taken modulo ``2**64``."""
    h = _splitmix64(seed & _MASK64)
    h = _splitmix64(h ^ (row & _MASK64))
    return _splitmix64(h ^ (position & _MASK64))


def gumbel_noise(seed: int, row: int, position: int, vocab: int) -> torch.Tensor:
    """``[vocab]`` float32 Gumbel noise of ``(seed, row, position)`` on the CPU."""
    generator = torch.Generator(device="cpu").manual_seed(position_seed(seed, row, position))
    uniform = torch.rand(vocab, generator=generator, dtype=torch.float32)
    return -torch.log(-torch.log(uniform.clamp_(min=torch.finfo(torch.float32).tiny)))


def draw_seed() -> int:
    """The call's base seed, from torch's global generator."""
    return int(torch.randint(0, (1 << 63) - 1, (), dtype=torch.int64))


class RowNoise:
    """One row's keyed noise; a position drafted in one step is checked in the next, so it is kept until then."""

    def __init__(self, seed: int, row: int):
        self.seed, self.row = int(seed), int(row)
        self._cache: dict[int, torch.Tensor] = {}

    def at(self, position: int, vocab: int, device) -> torch.Tensor:
        noise = self._cache.get(position)
        if noise is None or noise.shape[0] != vocab:
            noise = self._cache[position] = gumbel_noise(self.seed, self.row, position, vocab).to(device)
        return noise

    def forget_before(self, position: int) -> None:
        for key in [key for key in self._cache if key < position]:
            del self._cache[key]


def choose(scores: torch.Tensor, places=None) -> torch.Tensor:
    """One token per row of ``scores``: the argmax, or with ``places`` (``(RowNoise, position)`` per row) the
    keyed draw ``argmax(scores + G)``."""
    if places is None:
        return scores.argmax(dim=-1)
    noise = torch.stack([noise.at(position, scores.shape[-1], scores.device) for noise, position in places])
    return (scores.float() + noise).argmax(dim=-1)
