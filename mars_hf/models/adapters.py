"""PEFT adapters of MARS models: telling one apart, and saving its trained mask-token rows.

An adapter checkpoint keeps the base model's embeddings; what training changed in them (the mask row,
and any rows the base lacks) is saved on its own, in the mask-row file whose format
:mod:`mars_hf.decoding.gated_lora` defines and reads (a checkpoint's ``custom_generate/`` reads it too).
"""

from __future__ import annotations

from pathlib import Path

import torch

from mars_hf.decoding.gated_lora import write_mask_rows_file


def is_peft_model(model) -> bool:
    """True for a ``peft.PeftModel`` (the adapter still separate from its base)."""
    from peft import PeftModel

    return isinstance(model, PeftModel)


def unwrap_peft(model):
    """The transformers model inside a ``PeftModel``; any other model unchanged."""
    return model.get_base_model() if is_peft_model(model) else model


@torch.no_grad()
def save_mask_rows(model, mask_token_id: int, path: str | Path) -> None:
    """The *effective* mask-token rows (LoRA / trainable-token deltas applied), plus any rows the base lacks."""
    input_embeddings = model.get_input_embeddings()
    num_rows = input_embeddings.weight.shape[0]
    base_rows = _base_vocab_size(model)
    ids = sorted({mask_token_id} | set(range(base_rows, num_rows) if base_rows is not None else []))
    index = torch.tensor(ids, device=input_embeddings.weight.device)
    output_weight = _effective_weight(model.get_output_embeddings())
    untied = output_weight is not None and output_weight.data_ptr() != _effective_weight(input_embeddings).data_ptr()
    # The gating is repeated in the file, so a gated adapter that lost mars_config.json is refused, not run ungated.
    gating = (getattr(unwrap_peft(model).config, "mars", None) or {}).get("adapter_gating")
    write_mask_rows_file(
        path,
        ids,
        num_rows,
        input_embeddings(index),
        output_weight[index] if untied else None,
        gating=gating,
    )


def _effective_weight(module):
    """The weight a (possibly PEFT-wrapped) embedding or head really uses."""
    if module is None:
        return None
    if hasattr(module, "get_merged_weights") and hasattr(module, "active_adapters"):
        return module.get_merged_weights(module.active_adapters)
    return getattr(module, "weight", None)


def _base_vocab_size(model) -> int | None:
    """Rows of the adapter's base checkpoint, when its config can be read without a network."""
    base = getattr(next(iter(model.peft_config.values())), "base_model_name_or_path", None)
    if not base:
        return None
    try:
        from transformers import AutoConfig

        return int(AutoConfig.from_pretrained(base, local_files_only=True).vocab_size)
    except Exception:  # noqa: BLE001 - any failure just means "only save the mask row"
        return None
