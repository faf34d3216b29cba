"""LoRA adapters gated to mask positions (MARS_SPEC §7): ``h = W x + g · B A x``, ``g = [input is MASK]``.

Real tokens never see the adapter: at every position whose *input* token is not the mask token the
adapted layer returns the base layer's output unchanged (the delta is not computed there at all), so
logits and keys/values at real positions are the base model's, bit for bit, and one-token decoding,
τ = 1 and verified decoding are the base model's output. The masks get the adapter's capacity.

Two ways in, one gate:

* training / mars_hf: :func:`gate_peft_model` gates the LoRA layers of a PEFT model in place;
* torch + transformers only (a checkpoint's ``custom_generate/``): :func:`attach_shipped_adapter`
  reads the checkpoint's ``adapter_model.safetensors``, ``adapter_config.json``, trained mask row and
  ``mars_config.json`` and applies the gated LoRA to a plain transformers model, without PEFT.

Which positions are masks is recorded by a forward pre-hook on the input embedding (it sees the
``input_ids`` of every forward). A gated adapter cannot be merged into the weights (the delta depends
on the input token); every merge entry point raises.

This file ships verbatim in checkpoints (``custom_generate/gated_lora.py``): it imports only torch,
transformers, safetensors and the standard library.
"""

from __future__ import annotations

import json
import logging
import math
import os

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

GATING_KEY = "adapter_gating"
MASK_GATING = "mask"
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
MARS_ADAPTER_CONFIG_FILE = "mars_config.json"
MARS_MASK_ROWS_FILE = "mars_mask_token.safetensors"

MERGE_REFUSED = (
    "This LoRA adapter is gated to mask positions (config.mars adapter_gating='mask', MARS_SPEC §7): its delta "
    "applies only where the input token is the mask token, so it is not a weight change and cannot be merged "
    "into the base weights (a merged model would change every real token's output). Keep it as an adapter: "
    "load it with mars_hf.AutoMARSModelForCausalLM / mars_hf.hub.load, or on a plain transformers model with "
    "generate(custom_generate=<checkpoint>, trust_remote_code=True)."
)


class MergeRefusedError(ValueError):
    """Raised by every merge entry point of a gated adapter."""


def _refuse_merge(*args, **kwargs):
    raise MergeRefusedError(MERGE_REFUSED)


class MaskGate:
    """Which flattened positions of the current forward hold the mask token (``None``: none do)."""

    def __init__(self, mask_token_id: int):
        self.mask_token_id = int(mask_token_id)
        self.index: torch.Tensor | None = None
        self.rows: int | None = None

    def record(self, module, args, kwargs):
        """Forward pre-hook of the input embedding: its first input is ``input_ids``."""
        input_ids = args[0] if args else kwargs.get("input", kwargs.get("input_ids"))
        flat = input_ids.reshape(-1)
        self.rows = flat.numel()
        index = (flat == self.mask_token_id).nonzero().flatten()
        self.index = index if index.numel() else None

    def positions_for(self, x: torch.Tensor) -> torch.Tensor | None:
        rows = x.numel() // x.shape[-1]
        if self.rows is None or rows != self.rows:
            raise RuntimeError(
                f"A mask-gated adapter layer got {rows} positions but the last input_ids had {self.rows}: the "
                "gate reads input_ids through the input embedding, so call the model with `input_ids` (not "
                "`inputs_embeds`)."
            )
        return self.index


def gated_add(gate: MaskGate, x: torch.Tensor, result: torch.Tensor, delta_fn) -> torch.Tensor:
    """``result`` plus ``delta_fn(x)`` at mask positions only; other rows are ``result``'s own values."""
    index = gate.positions_for(x)
    if index is None:
        return result
    flat_x = x.reshape(-1, x.shape[-1]).index_select(0, index)
    delta = delta_fn(flat_x).to(result.dtype)
    flat = result.reshape(-1, result.shape[-1])
    return flat.index_add(0, index, delta).view_as(result)


def install_mask_gate(model, mask_token_id: int) -> MaskGate:
    """Attach (once) the pre-hook that records mask positions; returns the model's gate."""
    gate = getattr(model, "_mars_mask_gate", None)
    if gate is not None:
        if gate.mask_token_id != int(mask_token_id):
            raise ValueError(
                f"The model already has a mask gate for token id {gate.mask_token_id}, not {mask_token_id}."
            )
        return gate
    gate = MaskGate(mask_token_id)
    embedding = model.get_input_embeddings()
    embedding.register_forward_pre_hook(gate.record, with_kwargs=True)
    object.__setattr__(model, "_mars_mask_gate", gate)  # not a submodule, not in the state dict
    return gate


# --------------------------------------------------------------------------------------------------
# PEFT models (training, mars_hf loading): gate the LoRA layers in place
# --------------------------------------------------------------------------------------------------
def _is_lora_layer(module) -> bool:
    return hasattr(module, "lora_A") and hasattr(module, "lora_B") and hasattr(module, "base_layer")


def _gated_peft_forward(layer, gate: MaskGate):
    """A replacement ``forward`` for a PEFT ``lora.Linear``: the vanilla LoRA delta, at mask positions only."""

    def forward(x, *args, **kwargs):
        kwargs.pop("adapter_names", None)
        result = layer.base_layer(x, *args, **kwargs)
        if layer.disable_adapters:
            return result
        adapters = [name for name in layer.active_adapters if name in layer.lora_A.keys()]
        if not adapters:
            return result

        def delta(rows):
            total = None
            for name in adapters:
                lora_A = layer.lora_A[name]
                term = layer.lora_B[name](lora_A(layer.lora_dropout[name](rows.to(lora_A.weight.dtype))))
                term = term * layer.scaling[name]
                total = term if total is None else total + term
            return total

        return gated_add(gate, x, result, delta)

    return forward


def gate_peft_model(peft_model, mask_token_id: int) -> int:
    """Gate every LoRA layer of ``peft_model`` to mask positions (idempotent); returns how many are gated.

    Only plain LoRA on linear layers can be gated (no DoRA or other variants, no LoRA on embeddings,
    no ``modules_to_save``: those would change real tokens' outputs). Merging is refused afterwards.
    """
    base = peft_model.get_base_model() if hasattr(peft_model, "get_base_model") else peft_model
    gate = install_mask_gate(base, mask_token_id)
    count = 0
    for name, module in peft_model.named_modules():
        if type(module).__name__ == "ModulesToSaveWrapper":
            raise ValueError(
                f"{name} is a modules_to_save copy: a fully trained module changes real tokens too, so it cannot "
                "be gated to mask positions. Drop it from `modules_to_save` (the mask row trains through "
                "`trainable_token_indices`)."
            )
        if not _is_lora_layer(module):
            continue
        if type(module).__name__ != "Linear" or getattr(module, "lora_variant", None):
            raise ValueError(
                f"{name} is a {type(module).__name__} LoRA layer{' with a variant (DoRA...)' if getattr(module, 'lora_variant', None) else ''}: "
                "only plain LoRA on linear layers can be gated to mask positions. Use `LoraConfig(use_dora=False)` "
                "and linear `target_modules` (e.g. 'all-linear')."
            )
        if getattr(module, "_mars_gated", False):
            count += 1
            continue
        if module.merged:
            raise MergeRefusedError("The LoRA layers are already merged; gate the adapter before merging.")
        module.forward = _gated_peft_forward(module, gate)
        module.merge = _refuse_merge
        module._mars_gated = True
        count += 1
    if not count:
        raise ValueError("The model has no LoRA layer to gate; pass a LoraConfig as `peft_config`.")
    for obj in (peft_model, getattr(peft_model, "base_model", None)):
        if obj is not None and obj is not base:
            for method in ("merge_and_unload", "merge_adapter"):
                object.__setattr__(obj, method, _refuse_merge)
    _record_gating(base)
    return count


def _record_gating(model) -> None:
    mars = dict(getattr(model.config, "mars", None) or {})
    mars[GATING_KEY] = MASK_GATING
    model.config.mars = mars


def is_gated(model) -> bool:
    """True if ``model`` (or its base) applies an adapter gated to mask positions."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(base, "_mars_mask_gate", None) is not None


# --------------------------------------------------------------------------------------------------
# Torch + transformers only: apply a shipped (gated) LoRA adapter to a plain model
# --------------------------------------------------------------------------------------------------
def _resolve(checkpoint, filename: str, hub_kwargs: dict) -> str | None:
    """A file of a local folder or a (cached) Hub repo; None when it has no such file."""
    if os.path.isdir(str(checkpoint)):
        path = os.path.join(str(checkpoint), filename)
        return path if os.path.isfile(path) else None
    from transformers.utils import cached_file

    return cached_file(
        str(checkpoint),
        filename,
        _raise_exceptions_for_missing_entries=False,
        _raise_exceptions_for_connection_errors=False,
        **hub_kwargs,
    )


def _read_json(path: str) -> dict:
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def _check_adapter_config(config: dict, checkpoint) -> float:
    """Refuse LoRA features this loader does not implement; return the scaling ``alpha / r``."""
    unsupported = []
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        unsupported.append(f"peft_type={config.get('peft_type')!r}")
    for key in ("use_dora", "fan_in_fan_out", "lora_bias"):
        if config.get(key):
            unsupported.append(f"{key}=True")
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save", "layers_to_transform"):
        if config.get(key):
            unsupported.append(f"{key}={config[key]!r}")
    if unsupported:
        raise ValueError(
            f"The adapter of {checkpoint} uses {', '.join(unsupported)}, which the torch-only loader of "
            "custom_generate/gated_lora.py does not implement; load it with mars_hf (which uses PEFT) instead."
        )
    r, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def _adapter_pairs(weights: dict, checkpoint) -> dict[str, dict[str, torch.Tensor]]:
    """``{module path inside the causal LM: {"A": tensor, "B": tensor}}`` from PEFT's saved names."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in weights.items():
        for part, tag in ((".lora_A.weight", "A"), (".lora_B.weight", "B")):
            if key.endswith(part):
                path = key[: -len(part)]
                path = path[len("base_model.model.") :] if path.startswith("base_model.model.") else path
                pairs.setdefault(path, {})[tag] = tensor
                break
        else:
            if "lora_" in key:
                raise ValueError(f"{checkpoint}: unsupported adapter tensor {key!r} (only lora_A/lora_B).")
    broken = [path for path, pair in pairs.items() if set(pair) != {"A", "B"}]
    if broken or not pairs:
        raise ValueError(
            f"{checkpoint}: the adapter has no complete lora_A/lora_B pairs ({broken or 'none'})."
        )
    return pairs


@torch.no_grad()
def _write_mask_rows(model, rows: dict) -> None:
    """Grow the embeddings to the checkpoint's row count (new rows = mean row) and write its trained rows."""
    embeddings = model.get_input_embeddings()
    needed = int(rows["num_embeddings"].item()) if "num_embeddings" in rows else embeddings.weight.shape[0]
    old_rows = embeddings.weight.shape[0]
    if needed > old_rows:
        model.resize_token_embeddings(needed, mean_resizing=False)
        matrices = [model.get_input_embeddings().weight]
        output = model.get_output_embeddings()
        if output is not None and output.weight.data_ptr() != matrices[0].data_ptr():
            matrices.append(output.weight)
        for weight in matrices:
            weight[old_rows:] = weight[:old_rows].mean(dim=0, keepdim=True)
    weight = model.get_input_embeddings().weight
    ids = rows["ids"].long().to(weight.device)
    weight[ids] = rows["input_embeddings"].to(device=weight.device, dtype=weight.dtype)
    output = model.get_output_embeddings()
    if "output_embeddings" in rows and output is not None and output.weight.data_ptr() != weight.data_ptr():
        output.weight[ids] = rows["output_embeddings"].to(
            device=output.weight.device, dtype=output.weight.dtype
        )


def _lora_hook(gate: MaskGate | None, scaling: float):
    def hook(module, args, output):
        x = args[0]

        def delta(rows):
            return (
                F.linear(F.linear(rows.to(module.mars_lora_A.dtype), module.mars_lora_A), module.mars_lora_B)
                * scaling
            )

        if gate is None:  # an ungated adapter: the delta everywhere
            return output + delta(x.reshape(-1, x.shape[-1])).view(*output.shape).to(output.dtype)
        return gated_add(gate, x, output, delta)

    return hook


def attach_shipped_adapter(model, checkpoint, **hub_kwargs) -> bool:
    """Apply the LoRA adapter saved in ``checkpoint`` (folder or Hub id) to a plain transformers model.

    Reads ``adapter_config.json``, ``adapter_model.safetensors``, ``mars_config.json`` and the trained
    mask row (``mars_mask_token.safetensors``): resizes the embeddings if the checkpoint's vocabulary is
    larger, writes the mask row, records ``config.mars``, suppresses the mask token as an output and
    adds the adapter as forward hooks (gated to mask positions when ``adapter_gating == "mask"``), so
    the model's weights and state dict stay the base model's. Idempotent: returns False when the model
    already carries this checkpoint's adapter or the checkpoint is not an adapter (a full checkpoint
    needs nothing), True when it attached it. No PEFT needed.
    """
    key = str(checkpoint)
    attached = getattr(model, "_mars_shipped_adapter", None)
    if attached is not None:
        if attached != key:
            raise ValueError(f"The model already carries the adapter of {attached}; load a fresh base model.")
        return False
    config_path = _resolve(checkpoint, ADAPTER_CONFIG_FILE, hub_kwargs)
    if config_path is None:
        return False
    weights_path = _resolve(checkpoint, ADAPTER_WEIGHTS_FILE, hub_kwargs)
    if weights_path is None:
        raise OSError(f"{checkpoint} has {ADAPTER_CONFIG_FILE} but no {ADAPTER_WEIGHTS_FILE}.")
    from safetensors.torch import load_file

    scaling = _check_adapter_config(_read_json(config_path), checkpoint)
    pairs = _adapter_pairs(load_file(weights_path), checkpoint)
    mars_path = _resolve(checkpoint, MARS_ADAPTER_CONFIG_FILE, hub_kwargs)
    mars = _read_json(mars_path) if mars_path else {}
    rows_path = _resolve(checkpoint, MARS_MASK_ROWS_FILE, hub_kwargs)
    if rows_path is not None:
        _write_mask_rows(model, load_file(rows_path))
    if mars:
        model.config.mars = {**(getattr(model.config, "mars", None) or {}), **mars}
        mask_id = int(mars["mask_token_id"])
        suppressed = list(model.generation_config.suppress_tokens or [])
        if mask_id not in suppressed:
            model.generation_config.suppress_tokens = [*suppressed, mask_id]
    gated = mars.get(GATING_KEY) == MASK_GATING
    if gated and "mask_token_id" not in mars:
        raise ValueError(
            f"{checkpoint}: a mask-gated adapter needs mask_token_id in {MARS_ADAPTER_CONFIG_FILE}."
        )
    gate = install_mask_gate(model, int(mars["mask_token_id"])) if gated else None
    modules = dict(model.named_modules())
    missing = [path for path in pairs if not isinstance(modules.get(path), torch.nn.Linear)]
    if missing:
        raise ValueError(
            f"{checkpoint}: the adapter targets modules this model has no linear layer for: {missing[:4]}; "
            "load the base model the adapter was trained on."
        )
    for path, pair in pairs.items():
        module = modules[path]
        weight = module.weight
        module.register_buffer(
            "mars_lora_A", pair["A"].to(device=weight.device, dtype=weight.dtype), persistent=False
        )
        module.register_buffer(
            "mars_lora_B", pair["B"].to(device=weight.device, dtype=weight.dtype), persistent=False
        )
        module.register_forward_hook(_lora_hook(gate, scaling))
    object.__setattr__(model, "_mars_shipped_adapter", key)
    logger.info(
        "Attached the %sLoRA adapter of %s to %d linear layers.",
        "mask-gated " if gated else "",
        checkpoint,
        len(pairs),
    )
    return True


def find_custom_generate_checkpoint() -> str | None:
    """The ``custom_generate`` argument of the ``generate`` call that is running us (folder or Hub id).

    transformers copies ``custom_generate/*.py`` into its module cache before running it, so the
    checkpoint is not this file's parent folder; the caller's frame still holds the argument.
    """
    import sys

    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "generate":
            value = frame.f_locals.get("custom_generate")
            if isinstance(value, (str, os.PathLike)):
                return str(value)
        frame = frame.f_back
    return None
