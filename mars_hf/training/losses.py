"""The sums behind docs/method.md §1.4's loss, ``(Σ noisy term + ar_weight · Σ clean term) / N``, computed two ways.

`two_stream_sums` runs the clean and noisy streams in one forward under the MARS mask (§1.2).
`frozen_clean_sums` gives the same sums when nothing trainable touches the clean stream: clean queries
never attend to noisy keys, so the clean half is a plain causal forward run without autograd, and the noisy
half attends to its cached keys/values. Both return `LossSums`; `MARSTrainer` turns them into one loss.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from mars_hf.training.attention_mask import dense_mars_mask


@dataclass
class LossSums:
    """Per-batch sums over MARS targets (not yet divided by the target count) and correct-prediction counts.

    ``clean_term`` is what ``ar_weight`` multiplies (the clean cross-entropy, or the KL to the base model);
    ``clean_sum`` / ``clean_correct`` are None when the clean LM head was skipped because nothing needed it.
    """

    noisy_sum: torch.Tensor
    noisy_correct: torch.Tensor
    clean_term: torch.Tensor | float
    clean_sum: torch.Tensor | None
    clean_correct: torch.Tensor | None
    kl_sum: torch.Tensor | None
    outputs: Any


def _compute_dtype(logits: torch.Tensor) -> torch.Tensor:
    """Logits in float64 when the model is float64 (exactness tests), else float32."""
    return logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32)


def _target_columns(labels: torch.Tensor, keep_one: bool) -> torch.Tensor:
    """Columns holding a target in some row: only those go through the LM head.

    With ``keep_one`` and no target at all, column 0 is kept so the zero loss still has a graph.
    """
    keep = (labels != -100).any(0).nonzero().flatten()
    if keep_one and keep.numel() == 0:
        keep = torch.zeros(1, dtype=torch.long, device=labels.device)
    return keep


def two_stream_sums(
    model,
    mars,
    attention_mask,
    *,
    clean_loss: str,
    base_clean_logits: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
) -> LossSums:
    """One forward of both streams under the MARS mask; cross-entropy on every target.

    ``base_clean_logits(clean_ids, clean_valid, columns)`` gives the frozen starting model's clean logits
    (for ``clean_loss="kl_to_base"``). It runs before the model's forward: a forward in between would
    change what a mask gate recorded, which gradient checkpointing's recompute reads again in backward.
    """
    keep = _target_columns(mars.shift_labels, keep_one=True)
    length = mars.clean_length
    clean_cols = keep < length
    clean_keep = keep[clean_cols]
    base_logits = None
    if clean_loss == "kl_to_base" and clean_keep.numel():
        base_logits = base_clean_logits(mars.input_ids[:, :length], mars.valid[:, :length], clean_keep)
    outputs = model(
        input_ids=mars.input_ids,
        attention_mask=attention_mask,
        position_ids=mars.position_ids,
        logits_to_keep=keep,
        use_cache=False,
    )
    logits = _compute_dtype(outputs.logits)
    targets = mars.shift_labels[:, keep]
    noisy = mars.is_noisy[:, keep]
    is_target = targets != -100
    ce = F.cross_entropy(
        logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="none"
    ).view_as(targets)
    clean_sum = ce[~noisy].sum()
    clean_term, kl_sum = clean_sum, None
    if clean_loss == "kl_to_base":
        if base_logits is not None:
            base_logp = base_logits.to(logits.dtype).log_softmax(-1)
            model_logp = logits[:, clean_cols].log_softmax(-1)
            kl = (base_logp.exp() * (base_logp - model_logp)).sum(-1)
            kl_sum = kl[is_target[:, clean_cols]].sum()
        else:
            kl_sum = logits.sum() * 0.0
        clean_term = kl_sum
    with torch.no_grad():
        correct = (logits.argmax(-1) == targets) & is_target
    return LossSums(
        noisy_sum=ce[noisy].sum(),
        noisy_correct=(correct & noisy).sum(),
        clean_term=clean_term,
        clean_sum=clean_sum,
        clean_correct=(correct & ~noisy).sum(),
        kl_sum=kl_sum,
        outputs=outputs,
    )


class FrozenPrefixCache(DynamicCache):
    """The clean stream's keys/values; once ``frozen``, ``update`` returns prefix + new states without storing.

    Stateless reads make the noisy pass safe to recompute (gradient checkpointing) and let the clean
    keys/values be shared by every noisy query exactly as in the two-stream forward.
    """

    frozen = False

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if not self.frozen:
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        layer = self.layers[layer_idx]
        return torch.cat([layer.keys, key_states], dim=-2), torch.cat([layer.values, value_states], dim=-2)


def _split_masks(mars, attn_implementation: str, dtype: torch.dtype):
    """The MARS mask's clean-query/clean-key block and its noisy-query rows (boolean for sdpa, else additive)."""
    length = mars.clean_length
    allowed = dense_mars_mask(mars)
    if attn_implementation != "sdpa":
        allowed = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
            ~allowed, torch.finfo(dtype).min
        )
    return allowed[:, :, :length, :length], allowed[:, :, length:, :]


def _noisy_forward(model, unwrapped, mars, noisy_mask, cache: FrozenPrefixCache, noisy_keep):
    """The noisy stream alone, reading the frozen clean keys/values.

    The noisy pass only reads the cache, so gradient checkpointing may keep it (its recompute reads the
    same clean keys/values); transformers drops caches of checkpointed layers otherwise.
    """
    length = mars.clean_length
    cache.frozen = True
    layers = [m for m in unwrapped.modules() if hasattr(m, "_can_checkpoint_with_cache")]
    for layer in layers:
        layer._can_checkpoint_with_cache = True
    try:
        return model(
            input_ids=mars.input_ids[:, length:],
            attention_mask=noisy_mask,
            position_ids=mars.position_ids[:, length:],
            cache=cache,
            use_cache=True,
            logits_to_keep=noisy_keep,
        )
    finally:
        for layer in layers:
            del layer._can_checkpoint_with_cache


def _soft_targets(clean_logits, clean_keep, mars, noisy_keep, dtype) -> torch.Tensor:
    """Per noisy target, the base model's log-distribution at its position (the soft target)."""
    length = mars.clean_length
    base_logp = clean_logits.to(dtype).log_softmax(-1)
    column = torch.full((length,), -1, dtype=torch.long, device=base_logp.device)
    column[clean_keep] = torch.arange(clean_keep.numel(), device=base_logp.device)
    positions = mars.position_ids[:, length:][:, noisy_keep]
    index = column[positions].clamp(min=0)
    return base_logp.gather(1, index[..., None].expand(-1, -1, base_logp.shape[-1]))


def frozen_clean_sums(
    model,
    unwrapped,
    mars,
    attn_implementation: str,
    dtype: torch.dtype,
    *,
    soft: bool,
    ar_weight: float,
    clean_loss: str,
) -> LossSums:
    """The same sums as `two_stream_sums`, the clean stream computed under ``no_grad`` with a cache.

    Nothing trainable touches the clean stream, so its gradient contribution is zero either way. With
    ``soft`` the noisy targets are the clean (base) distribution at each position instead of the token.
    """
    length = mars.clean_length
    clean_mask, noisy_mask = _split_masks(mars, attn_implementation, dtype)
    clean_targets, noisy_targets = mars.shift_labels[:, :length], mars.shift_labels[:, length:]
    need_clean_logits = soft or ar_weight > 0
    clean_keep = _target_columns(clean_targets, keep_one=False)
    noisy_keep = _target_columns(noisy_targets, keep_one=True)
    cache = FrozenPrefixCache(config=unwrapped.config)
    with torch.no_grad():
        clean_out = model(
            input_ids=mars.input_ids[:, :length],
            attention_mask=clean_mask,
            position_ids=mars.position_ids[:, :length],
            cache=cache,
            use_cache=True,
            logits_to_keep=clean_keep if need_clean_logits and clean_keep.numel() else 1,
        )
    outputs = _noisy_forward(model, unwrapped, mars, noisy_mask, cache, noisy_keep)
    logits = _compute_dtype(outputs.logits)
    targets = noisy_targets[:, noisy_keep]
    is_target = targets != -100
    log_probs = logits.log_softmax(-1)
    if soft:
        target_logp = _soft_targets(clean_out.logits, clean_keep, mars, noisy_keep, logits.dtype)
        per_target = -(target_logp.exp() * log_probs).sum(-1)
    else:
        per_target = -log_probs.gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    clean_sum = clean_correct = None
    if need_clean_logits and clean_keep.numel():
        clean_logits = _compute_dtype(clean_out.logits)
        kept_targets = clean_targets[:, clean_keep]
        clean_sum = F.cross_entropy(
            clean_logits.flatten(0, 1), kept_targets.flatten(), ignore_index=-100, reduction="sum"
        )
        clean_correct = ((clean_logits.argmax(-1) == kept_targets) & (kept_targets != -100)).sum()
    clean_term = clean_sum if clean_sum is not None else 0.0
    if clean_loss == "kl_to_base" and clean_sum is not None:
        clean_term = clean_sum * 0.0  # the clean stream *is* the base model: KL(base || model) = 0
    with torch.no_grad():
        noisy_correct = ((logits.argmax(-1) == targets) & is_target).sum()
    return LossSums(
        noisy_sum=per_target[is_target].sum(),
        noisy_correct=noisy_correct,
        clean_term=clean_term,
        clean_sum=clean_sum,
        clean_correct=clean_correct,
        kl_sum=logits.new_zeros(()) if clean_loss == "kl_to_base" else None,
        outputs=outputs,
    )


def mars_loss(sums: LossSums, ar_weight: float, denominator) -> torch.Tensor:
    """``(Σ noisy term + ar_weight · Σ clean term) / N``, N = ``denominator`` (at least 1)."""
    denominator = torch.as_tensor(denominator, device=sums.noisy_sum.device).clamp(min=1)
    return (sums.noisy_sum + ar_weight * sums.clean_term) / denominator
