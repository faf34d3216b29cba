"""A checkpoint's LoRA adapter on a plain transformers model, in torch, without PEFT (MARS_SPEC §7).

A MARS adapter checkpoint holds ``adapter_config.json`` and ``adapter_model.safetensors`` (PEFT's format),
``mars_config.json`` (``block_size``, ``mask_token_id``, ``adapter_gating``, maybe a calibration) and
``mars_mask_token.safetensors`` (the trained mask-token rows). Gated (``adapter_gating == "mask"``), each adapted
linear layer adds ``(x Aᵀ)(s B)ᵀ`` only at positions whose *input token* is the mask token: real positions keep
the base layer's output bits, so real tokens, their keys/values and one-token decoding are the base model's.
A forward pre-hook on the input embedding records where the masks are; a forward hook on each adapted layer
adds the delta there. The model's weights and state dict stay the base model's; the adapter cannot be merged.
"""

from __future__ import annotations

import json
import logging
import math
import os

import torch

logger = logging.getLogger(__name__)

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
# How a gated adapter's adapter_config.json starts its peft_type (mars_hf.decoding.gated_lora.MARS_PEFT_TYPE):
# plain PEFT refuses it; this loader reads it as LoRA gated to mask positions.
MARS_PEFT_TYPE_PREFIX = "MARS_MASK_GATED_LORA"
MARS_CONFIG_FILE = "mars_config.json"
MASK_ROWS_FILE = "mars_mask_token.safetensors"
GATING_METADATA_KEY = (
    "mars_adapter_gating"  # the mask-row file repeats the gating, so a lost record is noticed
)


def attach_checkpoint(model, checkpoint=None) -> None:
    """Apply the adapter of ``checkpoint`` (``mars_checkpoint=``), else of the folder or Hub repo transformers
    loaded ``model`` from (its ``name_or_path``; nothing there for a full checkpoint, whose weights already hold
    everything). Looked up once per model."""
    if checkpoint is None:
        source = getattr(model, "name_or_path", None)
        if source and getattr(model, "_mars_checked_source", None) != source:
            attach_shipped_adapter(model, source)
            model._mars_checked_source = source
        return
    if (
        not attach_shipped_adapter(model, checkpoint)
        and getattr(model, "_mars_shipped_adapter", None) is None
    ):
        raise ValueError(
            f"mars_checkpoint={str(checkpoint)!r} has no {ADAPTER_CONFIG_FILE}: it names the adapter checkpoint to apply "
            "to a base model. A full MARS checkpoint needs no mars_checkpoint (load it with from_pretrained)."
        )


def attach_shipped_adapter(model, checkpoint, **hub_kwargs) -> bool:
    """Apply the LoRA adapter saved in ``checkpoint`` (folder or Hub id) to ``model``; False when ``checkpoint``
    holds no adapter or ``model`` already carries it. A gated adapter is checked once: real positions' logits must
    equal the base model's, bit for bit, or it is refused."""
    key = str(checkpoint)
    attached = getattr(model, "_mars_shipped_adapter", None)
    if attached is not None:
        if attached != key:
            raise ValueError(f"The model already carries the adapter of {attached}; load a fresh base model.")
        return False
    config_path = _resolve(checkpoint, ADAPTER_CONFIG_FILE, hub_kwargs)
    if config_path is None:
        return False
    if getattr(model, "_hf_peft_config_loaded", False):
        raise ValueError(
            f"transformers loaded the adapter of {checkpoint} with PEFT, which would apply a MARS adapter at every "
            "position; load its base model instead and pass `mars_checkpoint=` to generate."
        )
    adapter_config = _read_json(config_path)
    scaling = _check_adapter_config(adapter_config, checkpoint)
    weights_path = _resolve(checkpoint, ADAPTER_WEIGHTS_FILE, hub_kwargs)
    if weights_path is None:
        raise OSError(f"{checkpoint} has {ADAPTER_CONFIG_FILE} but no {ADAPTER_WEIGHTS_FILE}.")
    from safetensors.torch import load_file

    pairs = _adapter_pairs(load_file(weights_path), checkpoint)
    modules = dict(model.named_modules())
    missing = [path for path in pairs if not isinstance(modules.get(path), torch.nn.Linear)]
    if missing:
        raise ValueError(
            f"{checkpoint}: the adapter targets no linear layer of this model at {missing[:4]}; load its base model."
        )
    mars = _read_gating_record(checkpoint, hub_kwargs, adapter_config)
    rows_path = _resolve(checkpoint, MASK_ROWS_FILE, hub_kwargs)
    if rows_path is not None:
        _apply_mask_rows(model, load_file(rows_path))
    gate = None
    if mars:
        model.config.mars = {**(getattr(model.config, "mars", None) or {}), **mars}
        suppressed = list(model.generation_config.suppress_tokens or [])
        if int(mars["mask_token_id"]) not in suppressed:  # the mask token is never an output
            model.generation_config.suppress_tokens = [*suppressed, int(mars["mask_token_id"])]
    if mars.get("adapter_gating") == "mask":
        before = _probe_logits(model, int(mars["mask_token_id"]))
        gate = MaskGate(int(mars["mask_token_id"]))
        model.get_input_embeddings().register_forward_pre_hook(gate.record, with_kwargs=True)
        model.register_forward_pre_hook(gate.reset)
    for path, pair in pairs.items():
        _install(modules[path], pair, scaling, gate)
    model._mars_shipped_adapter = key
    if gate is not None:
        after = _probe_logits(model, gate.mask_token_id)
        real = slice(0, after.shape[1] - _PROBE_MASKS)
        if not torch.equal(after[:, real], before[:, real]):
            raise RuntimeError(
                f"{checkpoint}: with its mask-gated adapter attached, the logits at real positions differ from the base "
                "model's, so it would change every real token; refusing it. Load it onto a plain transformers model of "
                "the architecture it was trained on (no other hooks or adapters on its linear layers)."
            )
    logger.info(
        "Attached the %sLoRA adapter of %s to %d linear layers.",
        "mask-gated " if gate else "",
        checkpoint,
        len(pairs),
    )
    return True


class MaskGate:
    """Where the current forward's input tokens are the mask token (set by a pre-hook on the input embedding)."""

    def __init__(self, mask_token_id: int):
        self.mask_token_id = mask_token_id
        self.rows: int | None = None  # positions in this forward; None until the embedding has run
        self.index: torch.Tensor | None = None  # flattened mask positions; None when there are none

    def record(self, module, args, kwargs):
        ids = args[0] if args else kwargs.get("input", kwargs.get("input_ids"))
        flat = ids.reshape(-1)
        self.rows = flat.numel()
        index = (flat == self.mask_token_id).nonzero().flatten()
        self.index = index if index.numel() else None

    def reset(self, *args):
        """Model pre-hook: a forward with ``inputs_embeds`` finds no stale gate (and fails loudly)."""
        self.rows = self.index = None


class _LoRAHook:
    """Forward hook of one adapted linear layer: ``y + (x Aᵀ)(s B)ᵀ`` at mask rows (every row when ungated).

    The delta runs in float32 for a 16-bit model on CPU (cheaper there), added to the base output and rounded once.
    """

    def __init__(self, gate: MaskGate | None):
        self.gate = gate

    def __call__(self, module, args, output):
        x = args[0].reshape(-1, args[0].shape[-1])
        y = output.reshape(-1, output.shape[-1])
        index = None
        if self.gate is not None:
            if self.gate.rows != x.shape[0]:
                raise RuntimeError(
                    "A mask-gated adapter reads the mask positions from input_ids: call the model with `input_ids`, "
                    "not `inputs_embeds`."
                )
            if self.gate.index is None:
                return output
            index = self.gate.index
            x, y = x.index_select(0, index), y.index_select(0, index)
        A, BT = module.mars_lora_A, module.mars_lora_BT
        adapted = (y.to(A.dtype) + (x.to(A.dtype) @ A.T) @ BT).to(output.dtype)
        if index is None:
            return adapted.view_as(output)
        return output.reshape(-1, output.shape[-1]).index_copy(0, index, adapted).view_as(output)


def _install(module: torch.nn.Linear, pair: dict, scaling: float, gate) -> None:
    weight = module.weight
    dtype = (
        torch.float32
        if weight.device.type == "cpu" and weight.dtype in (torch.bfloat16, torch.float16)
        else weight.dtype
    )
    module.register_buffer("mars_lora_A", pair["A"].to(weight.device, dtype).contiguous(), persistent=False)
    bt = (pair["B"].to(torch.float64) * scaling).t()  # the scale folded into B once
    module.register_buffer("mars_lora_BT", bt.to(weight.device, dtype).contiguous(), persistent=False)
    module.register_forward_hook(_LoRAHook(gate))


# ------------------------------------------------------------------------------------------ the checkpoint's files
def _resolve(checkpoint, filename: str, hub_kwargs: dict) -> str | None:
    """A file of a local folder or a (cached) Hub repo; None when it has none."""
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
    peft_type = str(config.get("peft_type", "LORA"))
    unsupported = (
        [f"peft_type={peft_type!r}"]
        if peft_type.upper() != "LORA" and not peft_type.startswith(MARS_PEFT_TYPE_PREFIX)
        else []
    )
    unsupported += [f"{key}=True" for key in ("use_dora", "fan_in_fan_out", "lora_bias") if config.get(key)]
    unsupported += [
        f"{key}={config[key]!r}"
        for key in ("rank_pattern", "alpha_pattern", "modules_to_save", "layers_to_transform")
        if config.get(key)
    ]
    if unsupported:
        raise ValueError(
            f"The adapter of {checkpoint} uses {', '.join(unsupported)}, which custom_generate/ does not implement."
        )
    r, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def _adapter_pairs(weights: dict, checkpoint) -> dict:
    """``{module path in the causal LM: {"A": tensor, "B": tensor}}`` from PEFT's tensor names."""
    pairs: dict = {}
    for key, tensor in weights.items():
        for suffix, tag in ((".lora_A.weight", "A"), (".lora_B.weight", "B")):
            if key.endswith(suffix):
                path = key[: -len(suffix)].removeprefix("base_model.model.")
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


def _read_gating_record(checkpoint, hub_kwargs: dict, adapter_config: dict) -> dict:
    """``mars_config.json`` (``{}`` if none), checked against the mask-row file and ``adapter_config.json``
    (``gate_token_id``, the peft_type of a gated adapter): a gated adapter whose record is lost would run ungated
    and change every real token, so disagreeing or missing records are refused."""
    mars_path = _resolve(checkpoint, MARS_CONFIG_FILE, hub_kwargs)
    mars = _read_json(mars_path) if mars_path else {}
    gate_token = adapter_config.get("gate_token_id")
    if gate_token is not None or str(adapter_config.get("peft_type", "")).startswith(MARS_PEFT_TYPE_PREFIX):
        if mars_path is None and gate_token is not None:
            mars = {"adapter_gating": "mask", "mask_token_id": int(gate_token)}
        if mars.get("adapter_gating") != "mask" or "mask_token_id" not in mars:
            raise ValueError(
                f"{checkpoint}: {ADAPTER_CONFIG_FILE} says the adapter is gated to mask positions but "
                f"{MARS_CONFIG_FILE} does not (adapter_gating={mars.get('adapter_gating')!r}); the files come from "
                "different checkpoints."
            )
    rows_path = _resolve(checkpoint, MASK_ROWS_FILE, hub_kwargs)
    claimed = None
    if rows_path is not None:
        from safetensors import safe_open

        with safe_open(rows_path, framework="pt") as handle:
            claimed = (handle.metadata() or {}).get(GATING_METADATA_KEY)
        if mars_path is None:
            raise ValueError(
                f"{checkpoint} has {MASK_ROWS_FILE} (adapter_gating={claimed!r}) but no {MARS_CONFIG_FILE}, the record "
                f"of its block size, mask token and gating; restore {MARS_CONFIG_FILE} from where the checkpoint came from."
            )
    recorded = mars.get("adapter_gating")
    if claimed is not None and claimed != recorded:
        raise ValueError(
            f"{checkpoint}: {MASK_ROWS_FILE} says adapter_gating={claimed!r} but {MARS_CONFIG_FILE} says {recorded!r}; "
            "the files come from different checkpoints."
        )
    if recorded not in (None, "mask"):
        raise ValueError(
            f"{checkpoint}: unknown adapter_gating {recorded!r} in {MARS_CONFIG_FILE} (known: 'mask')."
        )
    if mars and "mask_token_id" not in mars:
        raise ValueError(f"{checkpoint}: {MARS_CONFIG_FILE} has no mask_token_id.")
    return mars


@torch.no_grad()
def _apply_mask_rows(model, rows: dict) -> None:
    """Grow the embeddings to the trained model's rows (new rows start at the mean row, as training starts a new
    token), then write the trained rows: ``ids``, ``input_embeddings`` and, for an untied head, ``output_embeddings``."""
    embedding = model.get_input_embeddings()
    old = embedding.weight.shape[0]
    needed = int(rows["num_embeddings"].item()) if "num_embeddings" in rows else 0
    if needed > old:
        model.resize_token_embeddings(needed, mean_resizing=False)
        embedding = model.get_input_embeddings()
        output = model.get_output_embeddings()
        for matrix in {
            id(m): m for m in (embedding.weight, getattr(output, "weight", None)) if m is not None
        }.values():
            matrix[old:] = matrix[:old].mean(dim=0, keepdim=True)
        if output is not None and getattr(output, "bias", None) is not None:
            output.bias[old:] = output.bias[:old].mean()
    weight = embedding.weight
    ids = rows["ids"].long().to(weight.device)
    weight[ids] = rows["input_embeddings"].to(weight.device, weight.dtype)
    output = model.get_output_embeddings()
    if "output_embeddings" in rows and output is not None and output.weight.data_ptr() != weight.data_ptr():
        output.weight[ids] = rows["output_embeddings"].to(output.weight.device, output.weight.dtype)


_PROBE_MASKS = 2


@torch.no_grad()
def _probe_logits(model, mask_token_id: int) -> torch.Tensor:
    """Logits of a few real tokens followed by masks, as a MARS window feeds them."""
    real = [i for i in range(1, 7) if i != mask_token_id][:5]
    ids = torch.tensor(
        [real + [mask_token_id] * _PROBE_MASKS], device=model.get_input_embeddings().weight.device
    )
    training = model.training
    model.eval()
    try:
        return model(input_ids=ids, use_cache=False).logits
    finally:
        model.train(training)
