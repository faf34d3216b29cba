"""Lower a trained LoRA adapter's rank after training: each layer's update ``s·B·A`` becomes its best
rank-k approximation (truncated SVD; Eckart–Young: the closest rank-k matrix in Frobenius norm).

Why: a mask-gated adapter cannot be merged into the weights, so every decoding step with masks streams
its matrices (``docs/gated_adapters.md``). Their bytes grow with the rank, while a trained update's
singular values fall fast (embedded-mars v4, rank 32: on average 99.2 % of each update's energy lies in
its first 16 directions). Halving the rank halves the bytes; what it costs in acceptance is measured
(``docs/embedded_mars.md``), not assumed.

Only the LoRA pairs change. The old scaling is folded into ``B`` and the new config says ``lora_alpha = r``
(scaling 1, ``use_rslora`` off), so PEFT and mars_hf's own loader read the same update. Every other file
of the checkpoint (mask rows, ``mars_config.json`` with its calibration, tokenizer) is copied unchanged;
refit the calibration (``mars-hf calibrate``) if the reduction moved the confidences.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from mars_hf.decoding.gated_lora import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    check_adapter_config,
    saved_adapter_config,
)

A_SUFFIX, B_SUFFIX = ".lora_A.weight", ".lora_B.weight"


@dataclass
class RankReduction:
    """What a reduction kept: per adapted layer, the share of its update's squared Frobenius norm."""

    old_rank: int
    new_rank: int
    kept_energy: dict[str, float]

    @property
    def mean_kept_energy(self) -> float:
        return sum(self.kept_energy.values()) / len(self.kept_energy)

    @property
    def min_kept_energy(self) -> float:
        return min(self.kept_energy.values())


@torch.no_grad()
def reduce_pair(A: torch.Tensor, B: torch.Tensor, scaling: float, rank: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``(A', B', kept energy)`` with ``B' A'`` the best rank-``rank`` approximation of ``scaling · B A``.

    Computed in float64 through the small ``r x r`` core (QR of ``B`` and ``Aᵀ``), never forming the
    ``out x in`` update; the singular values are split evenly between the two factors."""
    q_b, r_b = torch.linalg.qr(B.double() * scaling)
    q_a, r_a = torch.linalg.qr(A.double().t())
    u, s, vh = torch.linalg.svd(r_b @ r_a.t())
    root = s[:rank].sqrt()
    new_b = (q_b @ u[:, :rank]) * root
    new_a = root[:, None] * (vh[:rank] @ q_a.t())
    energy = float((s[:rank] ** 2).sum() / (s**2).sum()) if s.any() else 1.0
    return new_a.to(A.dtype).contiguous(), new_b.to(B.dtype).contiguous(), energy


def reduce_adapter_rank(checkpoint: str | Path, output_dir: str | Path, rank: int) -> RankReduction:
    """Write ``checkpoint`` (a saved LoRA adapter folder) with every LoRA pair reduced to ``rank``."""
    from safetensors.torch import load_file, save_file

    source, target = Path(checkpoint), Path(output_dir)
    config = json.loads((source / ADAPTER_CONFIG_FILE).read_text(encoding="utf-8"))
    scaling = check_adapter_config(config, source)
    old_rank = int(config["r"])
    if not 0 < rank < old_rank:
        raise ValueError(f"--rank must be between 1 and the adapter's rank minus one ({old_rank - 1}), got {rank}.")
    if target.resolve() == source.resolve():
        raise ValueError("Write the reduced adapter to a new folder (--out), not over the original.")
    weights = load_file(source / ADAPTER_WEIGHTS_FILE)
    reduced, kept = {}, {}
    for name, tensor in weights.items():
        if name.endswith(A_SUFFIX):
            layer = name[: -len(A_SUFFIX)]
            reduced[name], reduced[layer + B_SUFFIX], kept[layer] = reduce_pair(
                tensor, weights[layer + B_SUFFIX], scaling, rank
            )
        elif not name.endswith(B_SUFFIX):
            reduced[name] = tensor  # mask-row deltas and the like: not LoRA pairs
    if not kept:
        raise ValueError(f"{source}/{ADAPTER_WEIGHTS_FILE} holds no LoRA pairs to reduce.")
    target.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.is_dir():
            shutil.copytree(item, target / item.name, dirs_exist_ok=True)  # e.g. custom_generate/
        elif item.name not in (ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE):
            shutil.copyfile(item, target / item.name)
    save_file(reduced, target / ADAPTER_WEIGHTS_FILE, metadata={"format": "pt"})
    config.update(r=rank, lora_alpha=rank, use_rslora=False)
    config = saved_adapter_config(config)  # a gated adapter keeps (or gets) the peft_type plain PEFT refuses
    (target / ADAPTER_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return RankReduction(old_rank, rank, kept)
