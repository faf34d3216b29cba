"""Forced acceptance: a random model whose predictions are a known function of the position.

Why: a random model accepts nothing, and a trained one cannot be downloaded on an offline GPU machine.
Forcing the logits from inside the forward (after the real LM head has run) gives every configuration a
known acceptance rate while every forward still costs what it costs. `mars-hf gpu-check` decodes with it;
its tests check that the pattern and the decoder's counts agree.
"""

from __future__ import annotations

import torch

from mars_hf.tools.gpu_check.random_models import ordinary_token_ids


def _select_kept(values: torch.Tensor, logits_to_keep) -> torch.Tensor:
    """``values[b, t]`` at the positions the LM head saw (transformers' ``logits_to_keep`` rule)."""
    if isinstance(logits_to_keep, int):
        return values if logits_to_keep == 0 else values[:, -logits_to_keep:]
    if logits_to_keep.dim() == 1:
        return values[:, logits_to_keep]
    if logits_to_keep.dtype == torch.bool:
        return values[logits_to_keep]
    return values.gather(1, logits_to_keep)


class ForcedAcceptance:
    """Make a random model's predictions a known function of the position, from inside its forward.

    The logit at position ``p`` predicts the token at ``p + 1``. For a real token it becomes
    ``correct[p + 1]`` with probability ~1 (a peak of ``peak`` over logits of a few units), whatever the
    token: so stock greedy decoding outputs ``correct[t]`` at every generated position ``t``. For a mask
    token at ``p`` the prediction is the same ``correct[p + 1]`` (peaked) when ``agree[p + 1]`` holds,
    which happens for a share ``rate`` of the positions (a fixed pseudo-random pattern), and otherwise a
    wrong token at probability ~0.62 next to a second wrong one: below any τ > 0.63, and rejected by
    verification. Position-based (not token-based) so that every layout (linear, quadratic groups with
    their own position ids) and cache scheme sees the same pattern.

    The hooks capture the input ids (embedding), the position ids (rotary embedding, i.e. those the
    model really used) and ``logits_to_keep`` (the model's forward), and overwrite three logits per
    position after the LM head: the head's matrix product still runs, so forwards cost what they cost.
    """

    TABLE = 1 << 15
    PEAK = 40.0
    DECOY_GAP = 0.5

    def __init__(self, model, rate: float, seed: int = 0):
        self.model = model
        self.mask_token_id = int(model.config.mars["mask_token_id"])
        self.enabled = True
        device = model.get_output_embeddings().weight.device
        ordinary = ordinary_token_ids(model)
        generator = torch.Generator().manual_seed(seed + 1)
        index = torch.randint(len(ordinary), (self.TABLE,), generator=generator)
        shift = torch.randint(1, len(ordinary) // 2, (self.TABLE,), generator=generator)
        self.correct_cpu = ordinary[index]
        self.correct = self.correct_cpu.to(device)
        self.decoy = ordinary[(index + shift) % len(ordinary)].to(device)
        self.decoy2 = ordinary[(index + 2 * shift) % len(ordinary)].to(device)
        self.uniform_cpu = torch.rand(self.TABLE, generator=generator)
        self.set_rate(rate)
        self._ids = self._positions = None
        self._keep = 0
        rotary = next(m for name, m in model.named_modules() if name.endswith("rotary_emb"))
        self._handles = [
            model.register_forward_pre_hook(self._on_model, with_kwargs=True),
            model.get_input_embeddings().register_forward_pre_hook(self._on_embedding),
            rotary.register_forward_pre_hook(self._on_rotary, with_kwargs=True),
            model.get_output_embeddings().register_forward_hook(self._on_logits),
        ]

    def set_rate(self, rate: float) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"A forced agreement rate is a probability, got {rate}.")
        self.rate = float(rate)
        self.agree_cpu = self.uniform_cpu < self.rate
        self.agree = self.agree_cpu.to(self.correct.device)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def _on_model(self, module, args, kwargs):
        self._keep = kwargs.get("logits_to_keep", 0)

    def _on_embedding(self, module, args):
        self._ids = args[0]

    def _on_rotary(self, module, args, kwargs):
        self._positions = kwargs.get("position_ids", args[1] if len(args) > 1 else None)

    @torch.no_grad()
    def _on_logits(self, module, args, output):
        if not self.enabled or self._ids is None or self._positions is None:
            return None
        ids = self._ids
        positions = self._positions.expand_as(ids)
        ids = _select_kept(ids, self._keep).reshape(output.shape[:-1])
        target = (_select_kept(positions, self._keep).reshape(output.shape[:-1]) + 1) % self.TABLE
        hit = (ids != self.mask_token_id) | self.agree[target]
        first = torch.where(hit, self.correct[target], self.decoy[target])
        second = torch.where(hit, self.decoy[target], self.decoy2[target])
        second_value = torch.where(hit, 0.0, self.PEAK - self.DECOY_GAP).to(output.dtype)
        output.scatter_(-1, second[..., None], second_value[..., None])
        output.scatter_(-1, first[..., None], torch.full_like(second_value[..., None], self.PEAK))
        return output

    def expected_tokens_per_step(self, window: int) -> float:
        """1 + r + … + r^W: what one threshold step accepts on average (independent agreements)."""
        return sum(self.rate**k for k in range(window + 1))

    def simulate_steps(self, last_positions: list[int], new_tokens: int, window: int) -> list[int]:
        """Threshold steps each row needs under this pattern (docs/method.md §2 rule, exact): the forwards of
        the cursor and none schemes are the maximum over the rows."""
        steps = []
        agree = self.agree_cpu.tolist()
        for anchor in last_positions:
            done = count = 0
            while done < new_tokens:
                count += 1
                accepted = 1
                while accepted <= window and done + accepted < new_tokens:
                    if not agree[(anchor + 1 + accepted) % self.TABLE]:
                        break
                    accepted += 1
                done += accepted
                anchor += accepted
            steps.append(count)
        return steps
