"""The two-stream MARS training batch and its attention mask (docs/method.md §1.1-1.3, §1.5).

One forward pass runs on ``z = [clean ; noisy]``. The clean half is the sequence as is; the noisy half
replaces every supervised token by ``[MASK]`` and may drop blocks that hold no target (§1.5, exact).
Both halves reuse the clean positions ``0 … L-1``. Query ``i`` may attend key ``j`` when

    clean → clean   p_j <= p_i
    noisy → noisy   b(p_j) == b(p_i) and p_j <= p_i
    noisy → clean   b(p_j) <  b(p_i)
    clean → noisy   never

and ``j`` is a real token. A query that is padding sees only itself, which keeps SDPA finite (a row
with no key at all turns into NaN) without affecting any real token.

Padding is read from the attention mask only: pad and EOS are often the same id.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

# Attention backends that accept an arbitrary per-example mask.
SUPPORTED_ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flex_attention")


def check_attn_implementation(model_or_config) -> str:
    """Return the model's attention backend, or raise if it cannot take the MARS mask."""
    config = getattr(model_or_config, "config", model_or_config)
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in SUPPORTED_ATTN_IMPLEMENTATIONS:
        raise ValueError(
            f"MARS training needs an attention backend that takes a custom 4D mask, but the model uses "
            f"attn_implementation={implementation!r}. Load the model with "
            '`attn_implementation="sdpa"` (or "eager" / "flex_attention"), or switch it with '
            '`model.set_attn_implementation("sdpa")`; varlen kernels such as flash_attention_2 only know '
            "causal/padding masks."
        )
    return implementation


@dataclass
class MARSInputs:
    """A built two-stream batch. Every tensor is ``[batch, L + M]`` (clean length ``L``, noisy ``M``)."""

    input_ids: torch.LongTensor
    position_ids: torch.LongTensor
    # Target predicted by the logit at each position (the next label of the same half), -100 if none.
    shift_labels: torch.LongTensor
    is_noisy: torch.BoolTensor
    # True on real tokens, False on padding (batch padding, or unused slots of the compacted noisy half).
    valid: torch.BoolTensor
    clean_length: int
    block_size: int

    @property
    def num_targets(self) -> torch.Tensor:
        """``N`` of §1.4: supervised labels at position >= 1 (counted once, on the clean half)."""
        return (self.shift_labels[:, : self.clean_length] != -100).sum()

    @property
    def block_ids(self) -> torch.LongTensor:
        return self.position_ids // self.block_size


def _right_align(input_ids, valid, labels):
    """Move every row's real tokens to the front (keeps order). A no-op for right-padded batches."""
    if not (valid[:, 1:] & ~valid[:, :-1]).any():
        return input_ids, valid, labels
    order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)
    return input_ids.gather(1, order), valid.gather(1, order), labels.gather(1, order)


def build_mars_inputs(
    input_ids: torch.LongTensor,
    attention_mask: torch.Tensor | None,
    labels: torch.LongTensor | None,
    *,
    block_size: int,
    mask_token_id: int,
    drop_target_free_blocks: bool = True,
) -> MARSInputs:
    """Build ``z = [clean ; noisy]``, its position ids and per-position targets (§1.1, §1.3, §1.5).

    ``labels`` are aligned with ``input_ids`` as in HF (``-100`` = unsupervised); ``None`` means every
    real token is supervised. Left-padded rows are right-aligned first so blocks count from each row's
    first real token. With ``drop_target_free_blocks`` the noisy half keeps, per row, only the blocks
    with at least one target; rows are then padded to the longest kept set (unused slots are invalid).
    """
    if int(block_size) < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}.")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, length], got shape {tuple(input_ids.shape)}.")
    batch, length = input_ids.shape
    device = input_ids.device
    valid = (
        torch.ones_like(input_ids, dtype=torch.bool)
        if attention_mask is None
        else attention_mask.to(device).bool()
    )
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError("attention_mask must be the 2D padding mask [batch, length] of the collated batch.")
    labels = input_ids.clone() if labels is None else labels.to(device)
    input_ids, valid, labels = _right_align(input_ids, valid, labels)
    labels = labels.masked_fill(~valid, -100)

    # Target of the logit at p is the label at p+1 (same half).
    targets = torch.full_like(labels, -100)
    targets[:, :-1] = labels[:, 1:]
    positions = torch.arange(length, device=device).expand(batch, length)
    noisy_tokens = torch.where(labels != -100, torch.full_like(input_ids, mask_token_id), input_ids)

    if drop_target_free_blocks:
        num_blocks = -(-length // block_size)
        padded = torch.nn.functional.pad(targets != -100, (0, num_blocks * block_size - length))
        keep = padded.view(batch, num_blocks, block_size).any(-1)  # [batch, num_blocks]
        kept_count = keep.sum(1)
        max_kept = int(kept_count.max()) if batch else 0
        # Kept blocks first, in order (stable sort on "not kept").
        block_order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)[:, :max_kept]
        slot_in_use = torch.arange(max_kept, device=device)[None, :] < kept_count[:, None]
        offsets = torch.arange(block_size, device=device)
        noisy_pos = (block_order[:, :, None] * block_size + offsets).reshape(batch, max_kept * block_size)
        slot_in_use = slot_in_use[:, :, None].expand(batch, max_kept, block_size).reshape(batch, -1)
        inside = noisy_pos < length
        noisy_pos = noisy_pos.clamp(max=max(length - 1, 0))
        noisy_valid = slot_in_use & inside & valid.gather(1, noisy_pos)
        # Trailing columns that no row uses are cut.
        used = noisy_valid.any(0).nonzero()
        width = int(used.max()) + 1 if used.numel() else 0
        noisy_pos, noisy_valid = noisy_pos[:, :width], noisy_valid[:, :width]
    else:
        noisy_pos, noisy_valid = positions, valid

    noisy_ids = noisy_tokens.gather(1, noisy_pos)
    noisy_targets = targets.gather(1, noisy_pos).masked_fill(~noisy_valid, -100)
    width = noisy_pos.shape[1]
    return MARSInputs(
        input_ids=torch.cat([input_ids, noisy_ids], dim=1),
        position_ids=torch.cat([positions, noisy_pos], dim=1),
        shift_labels=torch.cat([targets, noisy_targets], dim=1),
        is_noisy=torch.cat(
            [torch.zeros_like(valid), torch.ones(batch, width, dtype=torch.bool, device=device)], dim=1
        ),
        valid=torch.cat([valid, noisy_valid], dim=1),
        clean_length=length,
        block_size=int(block_size),
    )


def _allowed(q_noisy, k_noisy, q_pos, k_pos, q_valid, k_valid, same, block_size):
    """The §1.2 rule on broadcastable per-token tensors (shared by the dense and flex masks)."""
    q_block, k_block = q_pos // block_size, k_pos // block_size
    causal = k_pos <= q_pos
    clean_clean = ~q_noisy & ~k_noisy & causal
    noisy_noisy = q_noisy & k_noisy & (q_block == k_block) & causal
    noisy_clean = q_noisy & ~k_noisy & (k_block < q_block)
    allowed = (clean_clean | noisy_noisy | noisy_clean) & k_valid
    return torch.where(q_valid, allowed, same)


def dense_mars_mask(inputs: MARSInputs) -> torch.BoolTensor:
    """Boolean ``[batch, 1, T, T]`` mask, True = attend (what SDPA takes)."""
    total = inputs.input_ids.shape[1]
    noisy, pos, valid = inputs.is_noisy, inputs.position_ids, inputs.valid
    same = torch.eye(total, dtype=torch.bool, device=pos.device)[None]
    allowed = _allowed(
        noisy[:, :, None],
        noisy[:, None, :],
        pos[:, :, None],
        pos[:, None, :],
        valid[:, :, None],
        valid[:, None, :],
        same,
        inputs.block_size,
    )
    return allowed[:, None]


def flex_mars_mask(inputs: MARSInputs):
    """The same mask as a flex-attention ``BlockMask`` (sparse blocks are skipped by the kernel)."""
    from torch.nn.attention.flex_attention import create_block_mask

    noisy, pos, valid, block_size = inputs.is_noisy, inputs.position_ids, inputs.valid, inputs.block_size

    def mask_mod(b, h, q_idx, kv_idx):
        return _allowed(
            noisy[b, q_idx],
            noisy[b, kv_idx],
            pos[b, q_idx],
            pos[b, kv_idx],
            valid[b, q_idx],
            valid[b, kv_idx],
            q_idx == kv_idx,
            block_size,
        )

    batch, total = inputs.input_ids.shape
    return create_block_mask(mask_mod, B=batch, H=None, Q_LEN=total, KV_LEN=total, device=pos.device)


def mars_attention_mask(inputs: MARSInputs, attn_implementation: str, dtype: torch.dtype = torch.float32):
    """The mask in the form the given attention backend takes it.

    ``sdpa``: boolean 4D; ``eager``: additive 4D in ``dtype`` (eager adds the mask to the scores);
    ``flex_attention``: a ``BlockMask``. Anything else is refused (see ``check_attn_implementation``).
    """
    check_attn_implementation(type("_Config", (), {"_attn_implementation": attn_implementation})())
    if attn_implementation == "flex_attention":
        return flex_mars_mask(inputs)
    allowed = dense_mars_mask(inputs)
    if attn_implementation == "sdpa":
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
        ~allowed, torch.finfo(dtype).min
    )
