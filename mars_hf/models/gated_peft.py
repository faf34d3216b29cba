"""PEFT's side of the mask-gated LoRA (MARS_SPEC §7): a LoRA variant whose delta applies at mask positions only.

Built on PEFT's extension points, nothing of PEFT's is patched: :class:`MaskGatedLoraConfig` is a ``LoraConfig``
with ``gate_token_id`` (saved in ``adapter_config.json``: the adapter itself says it is gated) that registers
:class:`MaskGatedLoraLinear` for ``nn.Linear`` targets (``LoraConfig._register_custom_module``); that layer
resolves :class:`MaskGatedLoraVariant` (``resolve_lora_variant``), whose ``forward`` PEFT's ``lora.Linear`` runs
and whose merges refuse. The gate itself, which positions of this thread's forward hold the mask token, is
:mod:`mars_hf.decoding.gated_lora`'s: a pre-hook on the input embedding. PEFT gives a layer no handle on its
model, so :func:`gate_peft_model` installs it, once per model::

    config = MaskGatedLoraConfig.from_pretrained(path)   # also reads an older checkpoint's mars_config.json
    model = PeftModel.from_pretrained(base, path, config=config)
    gate_peft_model(model)

:func:`load_gated_peft_model` does the three, after writing the trained mask row into the base model.
The saved ``adapter_config.json`` names a peft_type PEFT does not know
(:data:`~mars_hf.decoding.gated_lora.MARS_PEFT_TYPE`), so PEFT's loaders without ``config=`` refuse the folder
with an error naming mars_hf rather than loading the LoRA ungated.
The name follows the paper that gates LoRA to its mask tokens (arXiv 2507.11851, "gated LoRA").
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import torch
from peft import LoraConfig, PeftModel
from peft.tuners.lora import Linear as LoraLinear
from peft.tuners.lora import LoraLayer
from peft.tuners.lora.layer import LoraVariant

from mars_hf.decoding.gated_lora import (
    GATE_TOKEN_KEY,
    GATING_KEY,
    MASK_GATING,
    MERGE_REFUSED,
    MergeRefusedError,
    apply_mask_rows,
    check_adapter_fits,
    check_factor_shapes,
    gated_lora_forward,
    install_mask_gate,
    read_gating_record,
    read_mask_rows_file,
    record_gating,
    write_saved_adapter_config,
)

logger = logging.getLogger(__name__)

# Keyword arguments of from_pretrained that choose which files to read (passed to every file lookup).
_HUB_KWARGS = ("revision", "cache_dir", "token", "local_files_only", "force_download", "proxies")


class MaskGatedLoraVariant(LoraVariant):
    """A LoRA whose delta applies only where the input token is the gate token; it cannot be merged.

    ``gate``: the model's :class:`~mars_hf.decoding.gated_lora.MaskGate`, set by :func:`gate_peft_model`.
    """

    def __init__(self):
        self.gate = None

    def supports_lora_conversion(self) -> bool:
        return False  # a plain LoRA would apply the delta at every position

    @staticmethod
    def init(module, adapter_name: str, **kwargs) -> None:
        pass

    @staticmethod
    def merge_safe(module, active_adapter: str, orig_weight: torch.Tensor) -> torch.Tensor:
        raise MergeRefusedError(MERGE_REFUSED)

    @staticmethod
    def merge_unsafe(module, active_adapter: str, orig_weight: torch.Tensor) -> None:
        raise MergeRefusedError(MERGE_REFUSED)

    @staticmethod
    def unmerge(module, active_adapter: str, orig_weight: torch.Tensor) -> torch.Tensor:
        raise MergeRefusedError(MERGE_REFUSED)

    @staticmethod
    def forward(module, active_adapter: str, x: torch.Tensor, result: torch.Tensor, **kwargs) -> torch.Tensor:
        gate = module.lora_variant[active_adapter].gate
        if gate is None:
            raise RuntimeError(
                "This mask-gated LoRA layer has no gate: PEFT cannot reach the model's input embedding from a layer, "
                "so call mars_hf.models.gated_peft.gate_peft_model(model) once after get_peft_model / "
                "PeftModel.from_pretrained (load_gated_peft_model does it)."
            )
        return gated_lora_forward(
            gate,
            x,
            result,
            module.lora_A[active_adapter],
            module.lora_B[active_adapter],
            module.lora_dropout[active_adapter],
            module.scaling[active_adapter],
        )


class MaskGatedLoraLinear(LoraLinear):
    """PEFT's ``lora.Linear`` that resolves :class:`MaskGatedLoraVariant` for a config with ``gate_token_id``."""

    def resolve_lora_variant(self, *, config, **kwargs):
        variant = super().resolve_lora_variant(config=config, **kwargs)
        if getattr(config, GATE_TOKEN_KEY, None) is None:
            return variant
        if variant is not None:
            raise ValueError(
                f"A mask-gated LoRA cannot also be a {type(variant).__name__}: only plain LoRA is gated to mask "
                "positions (drop use_dora and the other variant options)."
            )
        return MaskGatedLoraVariant()


@dataclass
class MaskGatedLoraConfig(LoraConfig):
    """``LoraConfig`` of a LoRA gated to the positions whose input token is ``gate_token_id`` (the mask token).

    Only plain LoRA on linear layers: DoRA and the other variants, LoRA on embeddings and ``modules_to_save``
    would change real tokens, so they are refused (the mask row trains through ``trainable_token_indices``).
    """

    gate_token_id: int | None = field(
        default=None,
        metadata={
            "help": "Token id whose input positions get the LoRA delta (the MARS mask token); 0 elsewhere."
        },
    )

    def __post_init__(self):
        super().__post_init__()
        if self.gate_token_id is None:
            raise ValueError(
                "MaskGatedLoraConfig needs gate_token_id: the mask token id the adapter is gated to."
            )
        if self.modules_to_save:
            raise ValueError(
                f"modules_to_save={self.modules_to_save!r}: a fully trained module changes real tokens too, so it "
                "cannot be gated to mask positions (the mask row trains through `trainable_token_indices`)."
            )
        self._register_custom_module({torch.nn.Linear: MaskGatedLoraLinear})

    def save_pretrained(self, save_directory, **kwargs) -> None:
        """PEFT's ``adapter_config.json``, with the peft_type :data:`~mars_hf.decoding.gated_lora.MARS_PEFT_TYPE`:
        plain PEFT (``PeftModel.from_pretrained``, ``AutoPeftModelForCausalLM``, transformers' ``load_adapter``)
        then refuses the folder with an error that names mars_hf, instead of applying the LoRA at every position.
        ``PeftModel.save_pretrained`` (and so ``MARSTrainer`` and ``mars_hf.hub.save_pretrained``) calls this."""
        super().save_pretrained(save_directory, **kwargs)
        write_saved_adapter_config(save_directory)

    @classmethod
    def from_peft_type(cls, **kwargs):
        """Always this class (PEFT's own picks ``LoraConfig`` by ``peft_type`` and drops ``gate_token_id``); the
        saved peft_type (``MARS_PEFT_TYPE`` or an older ``LORA``) is LoRA here."""
        kwargs.pop("peft_type", None)
        known = {entry.name for entry in dataclasses.fields(cls) if entry.init}
        ignored = sorted(set(kwargs) - known)
        if ignored:
            logger.warning(
                "MaskGatedLoraConfig ignores %s (not fields of this PEFT version's LoraConfig).", ignored
            )
        return cls(**{key: value for key, value in kwargs.items() if key in known})

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, subfolder=None, **kwargs):
        """The config of a saved mask-gated adapter. ``gate_token_id`` comes from ``adapter_config.json``, or, for
        an adapter saved before it carried it, from ``mars_config.json``; an adapter recorded as ungated, or with
        no record, is refused with the fix (:func:`~mars_hf.decoding.gated_lora.read_gating_record`)."""
        path = str(pretrained_model_name_or_path) + (f"/{subfolder}" if subfolder else "")
        hub_kwargs = {key: kwargs[key] for key in _HUB_KWARGS if key in kwargs}
        record = read_gating_record(path, hub_kwargs)
        if record.get(GATING_KEY) != MASK_GATING:
            raise ValueError(
                f"{path} records an adapter trained ungated (a LoRA on every position): load it with "
                "peft.LoraConfig / PeftModel.from_pretrained, not as a mask-gated adapter."
            )
        kwargs.setdefault(GATE_TOKEN_KEY, int(record["mask_token_id"]))
        return super().from_pretrained(pretrained_model_name_or_path, subfolder=subfolder, **kwargs)

    @classmethod
    def from_lora_config(cls, config: LoraConfig, gate_token_id: int) -> MaskGatedLoraConfig:
        """``config``'s settings, gated to ``gate_token_id``."""
        values = {
            entry.name: getattr(config, entry.name) for entry in dataclasses.fields(config) if entry.init
        }
        values[GATE_TOKEN_KEY] = int(gate_token_id)
        gated = cls(**values)
        for base_type, layer_type in (config._custom_modules or {}).items():
            if base_type is not torch.nn.Linear:
                gated._register_custom_module({base_type: layer_type})
        return gated


def _gate_token_id(peft_model, mask_token_id: int | None) -> int:
    """``mask_token_id``, else the configs' ``gate_token_id``; all must agree."""
    found = {getattr(config, GATE_TOKEN_KEY, None) for config in peft_model.peft_config.values()} - {None}
    if mask_token_id is not None:
        found.add(int(mask_token_id))
    if len(found) != 1:
        raise ValueError(
            "Cannot tell which token gates the adapter: "
            + (f"the configs and the argument say {sorted(found)}." if found else "pass mask_token_id=.")
        )
    return found.pop()


def gate_peft_model(peft_model, mask_token_id: int | None = None, reset_per_forward: bool = False) -> int:
    """Gate every LoRA layer of ``peft_model`` to mask positions (idempotent); returns how many layers are gated.

    A model built or loaded with :class:`MaskGatedLoraConfig` already runs the variant: this installs the gate
    (the pre-hook that records each forward's mask positions, per thread) and hands it to the layers. A plain
    LoRA (a ``LoraConfig``, as ``MARSTrainer`` gets one) is converted: its layers run the variant from now on,
    and each adapter's config becomes a :class:`MaskGatedLoraConfig`, so the saved ``adapter_config.json`` says
    ``gate_token_id``. Every layer's factors are checked against its base layer and rank. Only plain LoRA on
    linear layers can be gated (no DoRA or other variants, no LoRA on embeddings, no ``modules_to_save``: those
    would change real tokens' outputs). ``reset_per_forward``: see ``install_mask_gate`` (inference only).
    """
    token = _gate_token_id(peft_model, mask_token_id)
    base = peft_model.get_base_model()
    gate = install_mask_gate(base, token, reset_per_forward=reset_per_forward)
    count = 0
    for name, module in peft_model.named_modules():
        if type(module).__name__ == "ModulesToSaveWrapper":
            raise ValueError(
                f"{name} is a modules_to_save copy: a fully trained module changes real tokens too, so it cannot "
                "be gated to mask positions. Drop it from `modules_to_save` (the mask row trains through "
                "`trainable_token_indices`)."
            )
        if not isinstance(module, LoraLayer):
            continue
        variants = [module.lora_variant.get(adapter) for adapter in module.lora_A]
        if not isinstance(module, LoraLinear) or any(
            v is not None and not isinstance(v, MaskGatedLoraVariant) for v in variants
        ):
            kind = next((type(v).__name__ for v in variants if v is not None), type(module).__name__)
            raise ValueError(
                f"{name} is a {kind} LoRA layer: only plain LoRA on linear layers can be gated to mask positions. "
                "Use `LoraConfig(use_dora=False)` and linear `target_modules` (e.g. 'all-linear')."
            )
        if module.merged:
            raise MergeRefusedError("The LoRA layers are already merged; gate the adapter before merging.")
        for adapter in module.lora_A:
            weight_a, weight_b = module.lora_A[adapter].weight, module.lora_B[adapter].weight
            check_factor_shapes(
                name,
                weight_a.shape,
                weight_b.shape,
                module.in_features,
                module.out_features,
                module.r[adapter],
                name,
            )
            variant = module.lora_variant.setdefault(adapter, MaskGatedLoraVariant())
            variant.gate = gate
        count += 1
    if not count:
        raise ValueError("The model has no LoRA layer to gate; pass a LoraConfig as `peft_config`.")
    configs = peft_model.peft_config
    for adapter, config in list(configs.items()):
        if not isinstance(config, MaskGatedLoraConfig):
            configs[adapter] = MaskGatedLoraConfig.from_lora_config(config, token)
    record_gating(base)
    return count


def load_gated_peft_model(base_model, checkpoint, *, is_trainable: bool = False, **kwargs) -> PeftModel:
    """A saved mask-gated adapter on ``base_model`` through PEFT: the trained mask row written into the base
    (its embeddings grown if the checkpoint's vocabulary is larger), ``PeftModel.from_pretrained`` with
    :class:`MaskGatedLoraConfig`, and the gate. The adapter is checked against the base first, so a wrong base
    is named as such. ``kwargs``: file lookup (``revision``, ``cache_dir``, ``token``...) and PEFT's options."""
    hub_kwargs = {key: kwargs[key] for key in _HUB_KWARGS if key in kwargs}
    config = MaskGatedLoraConfig.from_pretrained(checkpoint, **hub_kwargs)
    check_adapter_fits(base_model, checkpoint, hub_kwargs)
    rows = read_mask_rows_file(checkpoint, hub_kwargs)
    if rows is not None:
        apply_mask_rows(base_model, rows)
    model = PeftModel.from_pretrained(
        base_model, checkpoint, config=config, is_trainable=is_trainable, **kwargs
    )
    gate_peft_model(model, reset_per_forward=not is_trainable)
    return model
