"""Start training from a saved MARS adapter (``MARSConfig.init_adapter``), e.g. the shipped ``embedded-mars``.

Why: a GPU lent for a quarter of an hour trains a few minutes; starting the next run where the shipped model
ended lets those minutes add up across runs instead of starting again from a random adapter.

The start is exact: before the first step the new PEFT model computes what the checkpoint computes. The
checkpoint's mask-token rows are written into the base model before PEFT wraps it (so PEFT's trainable copy
of the row starts there), and its LoRA factors into the new adapter's first ``r`` ranks, rescaled from the
checkpoint's LoRA scaling to the new one. Ranks beyond the checkpoint's keep PEFT's random ``A`` and get
``B = 0``: they add nothing until trained. The checkpoint's calibration is not carried over: it describes
the old masks (refit it after training, as the training script does with ``calibration_holdout``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mars_hf.decoding import gated_lora


@dataclass
class WarmStart:
    """What a checkpoint gives the new run: LoRA factors by module path, their scaling, the mask rows."""

    checkpoint: str
    pairs: dict
    scaling: float
    mask_rows: dict | None


def read_warm_start(checkpoint, mask_token_id: int, adapter_gating: str | None) -> WarmStart:
    """Read ``checkpoint`` (a folder, or a name such as ``embedded-mars``) and check it fits this run."""
    from mars_hf.models.embedded_model import resolve_model_path

    folder = resolve_model_path(checkpoint)
    record = gated_lora.read_gating_record(folder)
    recorded_gating = record.get(gated_lora.GATING_KEY)
    if recorded_gating != adapter_gating:
        raise ValueError(
            f"init_adapter={checkpoint!r} was trained with adapter_gating={recorded_gating!r}, this run uses "
            f"{adapter_gating!r}: a gated adapter trained ungated (or the reverse) would change every real "
            f"token. Set adapter_gating={recorded_gating!r}."
        )
    if "mask_token_id" in record and int(record["mask_token_id"]) != int(mask_token_id):
        raise ValueError(
            f"init_adapter={checkpoint!r} has its mask token at id {record['mask_token_id']}, this run's tokenizer "
            f"at {mask_token_id}: train with the tokenizer the checkpoint was trained with (the checkpoint folder "
            "holds it)."
        )
    pairs, scaling = gated_lora.read_adapter_weights(folder)
    return WarmStart(str(checkpoint), pairs, scaling, gated_lora.read_mask_rows_file(folder))


@torch.no_grad()
def write_mask_rows(base_model, start: WarmStart) -> None:
    """The checkpoint's trained mask-token rows into ``base_model`` (before PEFT wraps it)."""
    if start.mask_rows is not None:
        gated_lora.apply_mask_rows(base_model, start.mask_rows)


@torch.no_grad()
def load_lora_factors(peft_model, start: WarmStart, adapter_name: str = "default") -> int:
    """Copy the checkpoint's LoRA factors into ``peft_model``'s adapter; returns the layers written.

    Every checkpoint layer must be adapted in the new model with at least the checkpoint's rank: a layer
    left out, or ranks cut off, would silently start from a different model.
    """
    layers = {}
    for name, module in peft_model.named_modules():
        lora_a = getattr(module, "lora_A", None)
        if isinstance(lora_a, torch.nn.ModuleDict) and adapter_name in lora_a:
            path = name[len("base_model.model.") :] if name.startswith("base_model.model.") else name
            layers[path] = module
    missing = sorted(set(start.pairs) - set(layers))
    if missing:
        raise ValueError(
            f"init_adapter={start.checkpoint!r} adapts {len(missing)} layer(s) this run's LoRA does not, e.g. "
            f"{missing[0]!r}: include them in lora_target_modules (the checkpoint's adapter_config.json lists its "
            "target_modules)."
        )
    for path, pair in start.pairs.items():
        module = layers[path]
        weight_a, weight_b = module.lora_A[adapter_name].weight, module.lora_B[adapter_name].weight
        rank = pair["A"].shape[0]
        if weight_a.shape[0] < rank:
            raise ValueError(
                f"init_adapter={start.checkpoint!r} has rank {rank} at {path!r}; this run's LoRA has rank "
                f"{weight_a.shape[0]}. Use lora_r >= {rank}."
            )
        rescale = start.scaling / float(module.scaling[adapter_name])
        weight_a[:rank] = pair["A"].to(weight_a)
        weight_b.zero_()
        weight_b[:, :rank] = (pair["B"].to(torch.float64) * rescale).to(weight_b)
    return len(start.pairs)
