"""LoRA adapters gated to mask positions (MARS_SPEC §7): ``h = W x + g · B A x``, ``g = [input is MASK]``.

Real tokens never see the adapter: at every position whose *input* token is not the mask token the
adapted layer returns the base layer's output bits (the added delta row is exactly zero there), so
logits and keys/values at real positions are the base model's, bit for bit, and one-token decoding,
τ = 1 and verified decoding are the base model's output. The masks get the adapter's capacity.

What lives here (torch, transformers, safetensors and the standard library only):

* the gate, :class:`MaskGate`: a forward pre-hook on the input embedding (it sees the ``input_ids`` of
  every forward) records which positions hold the mask token, per forward *and per thread*; the adapted
  layers read the record of the thread that runs them, so concurrent ``generate`` calls on one model
  each see their own forward's masks;
* :func:`gated_lora_forward`, the gated delta that PEFT runs through the LoRA variant of
  ``mars_hf.models.gated_peft`` (``MaskGatedLoraConfig``, ``MaskGatedLoraVariant``: training, and loading
  with ``PeftModel.from_pretrained``);
* the lean loader of a saved adapter on a plain transformers model, :func:`attach_shipped_adapter` (what
  ``mars_hf``'s own loaders use): each adapted ``nn.Linear`` is replaced by an :class:`AdaptedLinear` that
  holds the same parameters and adds the delta only when the forward holds a mask token;
* the checkpoint's gating record (which gating, which mask token) and the checks that an adapter fits
  the model it is attached to.

A gated adapter cannot be merged into the weights (the delta depends on the input token): every merge
entry point raises :class:`MergeRefusedError`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
from contextlib import contextmanager

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

# Chooses the opt-in C kernel of gated_kernel (its KERNEL_ENV); unset, or "torch", the default path never imports it.
KERNEL_ENV = "MARS_HF_GATED_KERNEL"

GATING_KEY = "adapter_gating"
MASK_GATING = "mask"
NO_GATING = "none"  # what a caller passes to say that an adapter without a record was trained ungated
# adapter_config.json field of a mask-gated adapter (MaskGatedLoraConfig): the record inside the adapter itself.
GATE_TOKEN_KEY = "gate_token_id"
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
MARS_ADAPTER_CONFIG_FILE = "mars_config.json"
MARS_MASK_ROWS_FILE = "mars_mask_token.safetensors"
# Metadata key of the mask-row file that repeats the gating, so a lost mars_config.json is noticed.
GATING_METADATA_KEY = "mars_adapter_gating"

MERGE_REFUSED = (
    "This LoRA adapter is gated to mask positions (config.mars adapter_gating='mask', MARS_SPEC §7): its delta "
    "applies only where the input token is the mask token, so it is not a weight change and cannot be merged "
    "into the base weights (a merged model would change every real token's output). Keep it as an adapter: "
    "load it with mars_hf.AutoMARSModelForCausalLM / mars_hf.hub.load, or on a plain transformers model with "
    "generate(custom_generate=<checkpoint>, trust_remote_code=True)."
)


class MergeRefusedError(ValueError):
    """Raised by every merge entry point of a gated adapter."""


# --------------------------------------------------------------------------------------------------
# The gate: which positions of this thread's forward hold the mask token
# --------------------------------------------------------------------------------------------------
class ForwardGate:
    """What one forward's ``input_ids`` say about mask positions (one thread's, one forward's).

    ``rows``: flattened positions; ``gate``: ``None`` when no position holds the mask token, else a
    ``(rows, 1)`` 0/1 tensor in the embedding's dtype. ``kept``: products that sibling layers of this forward
    share (see :class:`_SharedInput`); they die with the record, at the thread's next forward.
    """

    __slots__ = ("rows", "gate", "kept", "_index", "_converted")

    def __init__(self, rows: int, gate: torch.Tensor | None):
        self.rows, self.gate = rows, gate
        self.kept: dict = {}
        self._index: torch.Tensor | None = None
        self._converted: dict = {}

    def gate_for(self, dtype: torch.dtype) -> torch.Tensor:
        """The gate in ``dtype`` (converted once per forward)."""
        gate = self.gate
        if gate.dtype == dtype:
            return gate
        converted = self._converted.get(dtype)
        if converted is None:
            converted = self._converted[dtype] = gate.to(dtype)
        return converted

    def positions(self) -> torch.Tensor | None:
        """Flattened mask positions (``None``: none)."""
        if self.gate is None:
            return None
        if self._index is None:
            self._index = self.gate.reshape(-1).nonzero().flatten()
        return self._index


_UNSET = object()


class MaskGate:
    """Which positions of the current forward hold the mask token, recorded per thread.

    :meth:`record` is a forward pre-hook on the input embedding; adapted layers call :meth:`current` in the
    thread that runs them. The record lives in a ``threading.local``, so two threads running forwards of one
    model (two ``generate`` calls) never read each other's. Autograd may recompute checkpointed layers in a
    thread of its own (CUDA's backward threads): a thread that never ran a forward of this model reads the
    record of the latest forward run with autograd on (one training loop per model).
    """

    def __init__(self, mask_token_id: int):
        self.mask_token_id = int(mask_token_id)
        self._local = threading.local()
        self._grad_record: ForwardGate | None = None
        # (traced forwards) False only while a caller runs a forward it knows feeds no mask token (the decoder's
        # plain compiled steps: ``masks_absent``): the adapted layers then trace as their base layers, as the
        # eager form skips them. A compiler guards on the value, so each value gets its own graph. One value per
        # model, not per thread: the decoder's compiled forwards of one model take ``traced_lock`` in turn.
        self.traced_masks = True
        self.traced_lock = threading.Lock()

    def __getstate__(self) -> dict:
        return {"mask_token_id": self.mask_token_id}  # records are per process and thread

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["mask_token_id"])

    def record(self, module, args, kwargs):
        """Forward pre-hook of the input embedding: its first input is ``input_ids``."""
        input_ids = args[0] if args else kwargs.get("input", kwargs.get("input_ids"))
        flat = input_ids.reshape(-1)
        is_mask = flat == self.mask_token_id
        if torch.compiler.is_compiling():
            # Traced: the gate is a tensor of this forward's graph, read by the adapted layers of the same graph
            # (``traced``), with no host sync and no thread-local record for the compiler to break on.
            self.traced = is_mask.unsqueeze(1)
            return
        gate = None
        # One host sync per forward; without masks every adapted layer is its base layer.
        if bool(is_mask.any()):
            weight = getattr(module, "weight", None)
            gate = is_mask.unsqueeze(1).to(
                weight.dtype if isinstance(weight, torch.Tensor) else torch.float32
            )
        record = ForwardGate(flat.numel(), gate)
        self._local.record = record
        if torch.is_grad_enabled():
            self._grad_record = record

    def reset(self, *args):
        """Forward pre-hook of the model: a forward without ``input_ids`` finds no stale record."""
        if torch.compiler.is_compiling():
            self.traced = None  # a traced forward without input_ids then fails in its first adapted layer
            return
        self._local.record = None

    def traced_gate(self, rows: int, dtype: torch.dtype) -> torch.Tensor:
        """(traced forwards) ``(rows, 1)``: 1 at this forward's mask positions, else 0, in ``dtype``."""
        gate = getattr(self, "traced", None)
        if gate is None or gate.shape[0] != rows:
            _require_rows(None, rows)
        return gate.to(dtype)

    def current(self) -> ForwardGate | None:
        """This thread's record of its current forward (``None``: no ``input_ids`` seen)."""
        record = getattr(self._local, "record", _UNSET)
        if record is _UNSET:
            return self._grad_record if torch.is_grad_enabled() else None
        return record

    def require(self, rows: int | None = None) -> ForwardGate:
        """This thread's record, checked to describe ``rows`` positions when given; raises otherwise."""
        return _require_rows(self.current(), rows)


def _require_rows(record: ForwardGate | None, rows: int | None) -> ForwardGate:
    if record is None or (rows is not None and rows != record.rows):
        raise RuntimeError(
            f"A mask-gated adapter layer got {rows} positions but this thread's last input_ids had "
            f"{None if record is None else record.rows}: the gate reads input_ids through the input embedding, so "
            "call the model with `input_ids` (not `inputs_embeds`)."
        )
    return record


def install_mask_gate(model, mask_token_id: int, reset_per_forward: bool = False) -> MaskGate:
    """Attach (once) the pre-hook that records mask positions; returns the model's gate.

    ``reset_per_forward`` also forgets the thread's record when ``model``'s forward starts, so a forward with
    ``inputs_embeds`` fails loudly even right after an ``input_ids`` forward (or an embedding call) of the
    same size. Training leaves it off: a forward of the same model between a forward and its backward would
    otherwise leave checkpointed layers without a record to recompute with.
    """
    gate = getattr(model, "_mars_mask_gate", None)
    if gate is not None:
        if gate.mask_token_id != int(mask_token_id):
            raise ValueError(
                f"The model already has a mask gate for token id {gate.mask_token_id}, not {mask_token_id}."
            )
        return gate
    gate = MaskGate(mask_token_id)
    model.get_input_embeddings().register_forward_pre_hook(gate.record, with_kwargs=True)
    if reset_per_forward:
        model.register_forward_pre_hook(gate.reset)
    object.__setattr__(model, "_mars_mask_gate", gate)  # not a submodule, not in the state dict
    return gate


def gated_lora_forward(gate: MaskGate, x, result, lora_A, lora_B, dropout, scaling: float) -> torch.Tensor:
    """``result`` plus ``scaling · lora_B(lora_A(dropout(x)))`` at the mask positions of this thread's forward.

    The delta is computed for the mask rows only and added there (``index_add``); every other row keeps
    ``result``'s bits. PEFT's layer calls this through ``MaskGatedLoraVariant.forward``.
    """
    if torch.compiler.is_compiling():  # traced: the delta at every row, times the gate (0 at real positions)
        if not gate.traced_masks:
            return result
        rows = x.reshape(-1, x.shape[-1])
        delta = lora_B(lora_A(dropout(rows))) * scaling
        delta = delta * gate.traced_gate(rows.shape[0], delta.dtype)
        return (result.reshape(-1, result.shape[-1]) + delta.to(result.dtype)).view(result.shape)
    index = gate.require(x.numel() // x.shape[-1]).positions()
    if index is None:
        return result
    rows = x.reshape(-1, x.shape[-1]).index_select(0, index)
    delta = (lora_B(lora_A(dropout(rows))) * scaling).to(result.dtype)
    if torch.is_grad_enabled() or not result.is_contiguous():
        return result.reshape(-1, result.shape[-1]).index_add(0, index, delta).view(result.shape)
    result.view(-1, result.shape[-1]).index_add_(0, index, delta)
    return result


def record_gating(model) -> None:
    """``config.mars.adapter_gating = "mask"`` on ``model`` (what the saved mars_config.json carries)."""
    mars = dict(getattr(model.config, "mars", None) or {})
    mars[GATING_KEY] = MASK_GATING
    model.config.mars = mars


def mask_gate(model) -> MaskGate | None:
    """The mask gate of ``model`` (or of its base), or None where no adapter is gated to mask positions."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(base, "_mars_mask_gate", None)


def is_gated(model) -> bool:
    """True if ``model`` (or its base) applies an adapter gated to mask positions."""
    return mask_gate(model) is not None


@contextmanager
def masks_absent(gate: MaskGate | None, absent: bool):
    """A compiled forward of a gated model: within the block, when ``absent``, traced forwards skip the gated
    adapters (``MaskGate.traced_masks``; for a forward the caller knows feeds no mask token, whose adapted layers
    would add exact zeros at every position at the cost of their low-rank products). The block holds the gate's
    ``traced_lock`` either way, so another thread's compiled forward through this function never runs while the
    flag is off (a compiled forward called without it, e.g. stock ``generate``'s in another thread, is not held)."""
    if gate is None:
        yield
        return
    with gate.traced_lock:
        gate.traced_masks = not absent
        try:
            yield
        finally:
            gate.traced_masks = True


# --------------------------------------------------------------------------------------------------
# The saved form of a mask-gated adapter: a peft_type that plain PEFT refuses, naming mars_hf
# --------------------------------------------------------------------------------------------------
# PEFT picks a config class by ``peft_type`` (``PEFT_TYPE_TO_CONFIG_MAPPING[peft_type]``). Saved as "LORA", a gated
# adapter loads through PeftModel.from_pretrained / AutoPeftModelForCausalLM / transformers' load_adapter as a
# plain LoRA, applied at every position: every real token changes, without an error. PEFT's aLoRA cannot stand in
# (it adapts from the *last* occurrence of its invocation tokens onward, not every mask position of a layout), and
# PEFT cannot register a new peft_type from outside. So a gated adapter is saved under a peft_type PEFT does not
# know, whose text is the error PEFT's KeyError then shows. mars_hf's readers take any value that starts with
# MARS_PEFT_TYPE_PREFIX as LoRA gated to mask positions; "LORA" with gate_token_id (the older form) still loads.
MARS_PEFT_TYPE_PREFIX = "MARS_MASK_GATED_LORA"
MARS_PEFT_TYPE = (
    f"{MARS_PEFT_TYPE_PREFIX} -- a mars_hf LoRA gated to mask positions: plain PEFT would apply it at every position "
    "and change every real token's output, so it refuses this peft_type. Load it with mars_hf (pip install mars-hf): "
    "mars_hf.AutoMARSModelForCausalLM.from_pretrained(path), or through PEFT with "
    "mars_hf.models.gated_peft.load_gated_peft_model(base_model, path)"
)


def is_mars_peft_type(peft_type) -> bool:
    """True for the ``peft_type`` of a mask-gated adapter saved by mars_hf (:data:`MARS_PEFT_TYPE`)."""
    return isinstance(peft_type, str) and peft_type.startswith(MARS_PEFT_TYPE_PREFIX)


def saved_adapter_config(config: dict) -> dict:
    """``adapter_config.json``'s dict as mars_hf saves it: a gated adapter (``gate_token_id`` set, or already of
    :data:`MARS_PEFT_TYPE`) gets :data:`MARS_PEFT_TYPE`, so plain PEFT refuses it; any other adapter is unchanged."""
    if config.get(GATE_TOKEN_KEY) is None and not is_mars_peft_type(config.get("peft_type")):
        return dict(config)
    return {**config, "peft_type": MARS_PEFT_TYPE}


def write_saved_adapter_config(folder) -> None:
    """Rewrite ``folder``'s ``adapter_config.json`` in the saved form (:func:`saved_adapter_config`), keys sorted
    as PEFT writes them."""
    path = os.path.join(str(folder), ADAPTER_CONFIG_FILE)
    config = _read_json(path)
    saved = saved_adapter_config(config)
    if saved != config:
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(json.dumps(saved, indent=2, sort_keys=True) + "\n")


# --------------------------------------------------------------------------------------------------
# Files of a saved adapter
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


def check_adapter_config(config: dict, checkpoint) -> float:
    """Refuse LoRA features this loader does not implement; return the scaling ``alpha / r``."""
    unsupported = []
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA" and not is_mars_peft_type(peft_type):
        unsupported.append(f"peft_type={peft_type!r}")
    for key in ("use_dora", "fan_in_fan_out", "lora_bias"):
        if config.get(key):
            unsupported.append(f"{key}=True")
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save", "layers_to_transform"):
        if config.get(key):
            unsupported.append(f"{key}={config[key]!r}")
    if unsupported:
        raise ValueError(
            f"The adapter of {checkpoint} uses {', '.join(unsupported)}, which mars_hf's loader of gated adapters "
            "does not implement; retrain the adapter without them."
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


def read_adapter_weights(checkpoint, hub_kwargs: dict | None = None) -> tuple[dict, float]:
    """``({module path: {"A": tensor, "B": tensor}}, scaling)`` of the LoRA adapter saved in ``checkpoint``.

    Raises for an adapter this loader does not implement (see :func:`check_adapter_config`) or that lacks
    its config or weights file.
    """
    from safetensors.torch import load_file

    hub_kwargs = hub_kwargs or {}
    config_path = _resolve(checkpoint, ADAPTER_CONFIG_FILE, hub_kwargs)
    weights_path = _resolve(checkpoint, ADAPTER_WEIGHTS_FILE, hub_kwargs)
    if config_path is None or weights_path is None:
        raise OSError(f"{checkpoint} needs both {ADAPTER_CONFIG_FILE} and {ADAPTER_WEIGHTS_FILE}.")
    scaling = check_adapter_config(_read_json(config_path), checkpoint)
    return _adapter_pairs(load_file(weights_path), checkpoint), scaling


# The mask-row file (MARS_MASK_ROWS_FILE) of an adapter checkpoint: the trained rows of the mask token and
# of any row the base model lacks. Tensors: "ids" (int64 row ids), "num_embeddings" (scalar: the trained
# model's row count), "input_embeddings" (len(ids) x hidden) and, for an untied head, "output_embeddings";
# its metadata repeats the adapter gating under GATING_METADATA_KEY.
def write_mask_rows_file(
    path, ids, num_embeddings: int, input_rows: torch.Tensor, output_rows=None, gating: str | None = None
) -> None:
    """Write a mask-row file (the format above); what it holds is the caller's (the effective trained rows)."""
    from safetensors.torch import save_file

    tensors = {
        "ids": torch.as_tensor(ids, dtype=torch.long).cpu(),
        "num_embeddings": torch.tensor(int(num_embeddings)),
        "input_embeddings": input_rows.detach().cpu().contiguous(),
    }
    if output_rows is not None:
        tensors["output_embeddings"] = output_rows.detach().cpu().contiguous()
    metadata = {"format": "pt", **({GATING_METADATA_KEY: str(gating)} if gating else {})}
    save_file(tensors, str(path), metadata=metadata)


def read_mask_rows_file(checkpoint, hub_kwargs: dict | None = None) -> dict | None:
    """The mask-row file of ``checkpoint`` as ``safetensors.torch.load_file`` reads it (None: it has none)."""
    from safetensors.torch import load_file

    path = _resolve(checkpoint, MARS_MASK_ROWS_FILE, hub_kwargs or {})
    return None if path is None else load_file(path)


@torch.no_grad()
def grow_embeddings(model, num_rows: int) -> None:
    """Grow the input (and untied output) embeddings to ``num_rows`` rows; new rows start at the mean row.

    The mean row is how training starts a new mask token, so a row an adapter never trained (e.g. the
    output row when only the input row was trainable) loads as it was trained. No-op when not larger.
    """
    old_rows = model.get_input_embeddings().weight.shape[0]
    if num_rows <= old_rows:
        return
    model.resize_token_embeddings(num_rows, mean_resizing=False)
    matrices = [model.get_input_embeddings().weight]
    output = model.get_output_embeddings()
    if output is not None and output.weight.data_ptr() != matrices[0].data_ptr():
        matrices.append(output.weight)
    for weight in matrices:
        weight[old_rows:] = weight[:old_rows].mean(dim=0, keepdim=True)
    if output is not None and getattr(output, "bias", None) is not None:
        output.bias[old_rows:] = output.bias[:old_rows].mean()


@torch.no_grad()
def apply_mask_rows(model, rows: dict, min_rows: int = 0) -> None:
    """Write the rows of a mask-row file (as ``safetensors.torch.load_file`` reads it) into ``model``.

    The embeddings first grow (:func:`grow_embeddings`) to the file's ``num_embeddings``, or to
    ``min_rows`` (e.g. the tokenizer's length) when that is larger.
    """
    needed = int(rows["num_embeddings"].item()) if "num_embeddings" in rows else 0
    grow_embeddings(model, max(needed, int(min_rows)))
    weight = model.get_input_embeddings().weight
    ids = rows["ids"].long().to(weight.device)
    weight[ids] = rows["input_embeddings"].to(device=weight.device, dtype=weight.dtype)
    output = model.get_output_embeddings()
    if "output_embeddings" in rows and output is not None and output.weight.data_ptr() != weight.data_ptr():
        output.weight[ids] = rows["output_embeddings"].to(
            device=output.weight.device, dtype=output.weight.dtype
        )


# --------------------------------------------------------------------------------------------------
# The checkpoint's gating record, and whether an adapter fits the model it is attached to
# --------------------------------------------------------------------------------------------------
def _no_record_error(checkpoint) -> ValueError:
    return ValueError(
        f"{checkpoint} is a LoRA adapter with no record of how it was trained: no {GATE_TOKEN_KEY} in "
        f"{ADAPTER_CONFIG_FILE}, no {MARS_ADAPTER_CONFIG_FILE}, no {MARS_MASK_ROWS_FILE}. A mask-gated adapter "
        "loaded as a plain LoRA would change every real token's output (and the reverse breaks the masks), so it "
        "is not guessed, whatever the folder name or block_size says. Say which it is: adapter_gating='none' if "
        "it was trained ungated (a plain LoRA on every position), adapter_gating='mask' if it is gated to mask "
        f"positions (the tokenizer's mask token gates it), or restore {MARS_ADAPTER_CONFIG_FILE} from where the "
        "checkpoint came from (mars_hf.hub.save_pretrained and MARSTrainer write it)."
    )


def read_gating_record(
    checkpoint, hub_kwargs: dict | None = None, *, gating: str | None = None, mask_token_id: int | None = None
) -> dict:
    """The MARS record of an adapter checkpoint (``mars_config.json`` plus what the adapter itself says), checked.

    A mask-gated adapter is recorded in three places: ``gate_token_id`` and the peft_type :data:`MARS_PEFT_TYPE`
    in ``adapter_config.json`` (written from ``MaskGatedLoraConfig``; older adapters: ``gate_token_id`` with
    peft_type ``LORA``), ``adapter_gating``/``mask_token_id`` in ``mars_config.json``, and the
    metadata of the mask-row file. Without a record a gated adapter would load *ungated* and change every real
    token, so files that disagree, a mask-row file without ``mars_config.json`` and (for an adapter, i.e. a
    folder with ``adapter_config.json``) no record at all are refused with the fix. ``gating``: what the caller
    knows, ``"mask"`` or ``"none"`` (``NO_GATING``); it stands in for a missing record (``"mask"`` gates on
    ``mask_token_id``) and must agree with one that exists. Returns the ``mars_config.json`` dict (``{}`` for an
    ungated adapter without one).
    """
    if gating not in (None, MASK_GATING, NO_GATING):
        raise ValueError(f"adapter_gating must be {MASK_GATING!r}, {NO_GATING!r} or None, not {gating!r}.")
    hub_kwargs = hub_kwargs or {}
    mars_path = _resolve(checkpoint, MARS_ADAPTER_CONFIG_FILE, hub_kwargs)
    mars = _read_json(mars_path) if mars_path else {}
    config_path = _resolve(checkpoint, ADAPTER_CONFIG_FILE, hub_kwargs)
    adapter_config = _read_json(config_path) if config_path else {}
    marker = adapter_config.get(GATE_TOKEN_KEY)
    if marker is None and is_mars_peft_type(adapter_config.get("peft_type")):
        marker = mars.get("mask_token_id", mask_token_id)
        if marker is None:
            raise ValueError(
                f"{checkpoint}: {ADAPTER_CONFIG_FILE} says peft_type {MARS_PEFT_TYPE_PREFIX} (a LoRA gated to mask "
                f"positions) but names no {GATE_TOKEN_KEY}, and there is no {MARS_ADAPTER_CONFIG_FILE} with the mask "
                f'token id. Restore "{GATE_TOKEN_KEY}": <the mask token id> in {ADAPTER_CONFIG_FILE}.'
            )
    rows_path = _resolve(checkpoint, MARS_MASK_ROWS_FILE, hub_kwargs)
    claimed = None
    if rows_path is not None:
        from safetensors import safe_open

        with safe_open(rows_path, framework="pt") as handle:
            claimed = (handle.metadata() or {}).get(GATING_METADATA_KEY)
    recorded = mars.get(GATING_KEY)
    if marker is not None:
        if mars_path is None:
            mars = {GATING_KEY: MASK_GATING, "mask_token_id": int(marker)}
        elif recorded != MASK_GATING or int(mars.get("mask_token_id", marker)) != int(marker):
            raise ValueError(
                f"{checkpoint}: {ADAPTER_CONFIG_FILE} says the adapter is gated to token {marker} ({GATE_TOKEN_KEY}) "
                f"but {MARS_ADAPTER_CONFIG_FILE} says adapter_gating={recorded!r}, mask_token_id="
                f"{mars.get('mask_token_id')!r}; the files come from different checkpoints. Restore "
                f'{MARS_ADAPTER_CONFIG_FILE} with "adapter_gating": "mask", "mask_token_id": {marker}.'
            )
        recorded = MASK_GATING
    elif rows_path is not None and mars_path is None:
        said = (
            f"its {MARS_MASK_ROWS_FILE} says the adapter is gated to mask positions (adapter_gating={claimed!r})"
            if claimed
            else f"it has the MARS mask-row file {MARS_MASK_ROWS_FILE}"
        )
        raise ValueError(
            f"{checkpoint}: {said} but has no {MARS_ADAPTER_CONFIG_FILE}, the record of its block size, mask token "
            "and adapter gating. Loaded without it, a mask-gated adapter would run ungated and change every real "
            f"token's output, so it is refused. Restore {MARS_ADAPTER_CONFIG_FILE} from where the checkpoint came "
            "from (mars_hf.hub.save_pretrained and MARSTrainer write it), or write it yourself, e.g. "
            '{"adapter_gating": "mask", "block_size": <the block size it was trained with>, "mask_token_id": '
            "<the tokenizer's mask token id>} (leave adapter_gating out only for an adapter trained ungated)."
        )
    if claimed is not None and claimed != recorded:
        raise ValueError(
            f"{checkpoint}: {MARS_MASK_ROWS_FILE} says adapter_gating={claimed!r} but {MARS_ADAPTER_CONFIG_FILE} "
            f"says {recorded!r}; the files come from different checkpoints. Restore {MARS_ADAPTER_CONFIG_FILE} "
            f'with "adapter_gating": {json.dumps(claimed)} (the adapter was trained that way).'
        )
    if recorded is not None and recorded != MASK_GATING:
        raise ValueError(
            f"{checkpoint}: unknown adapter_gating {recorded!r} in {MARS_ADAPTER_CONFIG_FILE} (known: {MASK_GATING!r})."
        )
    if recorded == MASK_GATING and "mask_token_id" not in mars:
        raise ValueError(
            f"{checkpoint}: a mask-gated adapter needs mask_token_id in {MARS_ADAPTER_CONFIG_FILE}."
        )
    has_record = marker is not None or mars_path is not None
    if has_record and gating is not None and (gating == MASK_GATING) != (recorded == MASK_GATING):
        raise ValueError(
            f"{checkpoint} records adapter_gating={recorded or NO_GATING!r}, not the adapter_gating={gating!r} "
            "passed; drop adapter_gating= (the record says how the adapter was trained)."
        )
    if not has_record and config_path is not None:
        if gating is None:
            raise _no_record_error(checkpoint)
        if gating == MASK_GATING:
            if mask_token_id is None:
                raise ValueError(
                    f"{checkpoint}: adapter_gating='mask' without a record needs the mask token id "
                    "(mask_token_id=, or a tokenizer with a mask token)."
                )
            return {GATING_KEY: MASK_GATING, "mask_token_id": int(mask_token_id)}
    return mars


def _base_mismatch(checkpoint, what: str, model, named: str | None, given: str | None) -> ValueError:
    given = given or getattr(getattr(model, "config", None), "_name_or_path", None) or type(model).__name__
    names = (
        f"The adapter names its base {named!r} ({ADAPTER_CONFIG_FILE} base_model_name_or_path)"
        if named
        else f"The adapter does not name its base ({ADAPTER_CONFIG_FILE} has no base_model_name_or_path)"
    )
    return ValueError(
        f"{checkpoint} does not fit this model: {what}. {names}; the model given is {given!r}. Load the adapter "
        "onto the base model it was trained on (e.g. load_mars_model(adapter, base_model_name_or_path=<that base>))."
    )


def check_factor_shapes(
    path: str, a_shape, b_shape, in_features: int, out_features: int, rank: int | None, where
):
    """Raise unless ``lora_A`` is ``[r, in_features]`` and ``lora_B`` ``[out_features, r]`` with one rank ``r``
    (``rank``, when the adapter's config gives it): a kernel or matmul reading factors of other shapes reads past
    them or fails with a bare shape error."""
    a_shape, b_shape = tuple(a_shape), tuple(b_shape)
    r = a_shape[0] if rank is None else int(rank)
    if len(a_shape) == 2 and len(b_shape) == 2 and a_shape[0] == r and b_shape[1] == r:
        return
    raise ValueError(
        f"{where}: the LoRA factors of {path} do not agree: lora_A is {list(a_shape)} and lora_B is {list(b_shape)}, "
        f"but lora_A must be [r, in_features] = [{r}, {in_features}] and lora_B [out_features, r] = "
        f"[{out_features}, {r}]{'' if rank is None else f' (r = {r} in its config)'}. The adapter file is damaged or "
        "was edited; save it again from the trained model (mars_hf.hub.save_pretrained)."
    )


def adapter_shapes(checkpoint, hub_kwargs: dict | None = None) -> tuple[dict, dict]:
    """``({module path: {"A": shape, "B": shape}}, {other tensor name: shape})`` of a saved adapter, from the
    safetensors header (no tensor is read)."""
    from safetensors import safe_open

    weights_path = _resolve(checkpoint, ADAPTER_WEIGHTS_FILE, hub_kwargs or {})
    if weights_path is None:
        raise OSError(f"{checkpoint} has no {ADAPTER_WEIGHTS_FILE}.")
    pairs: dict[str, dict] = {}
    others: dict[str, tuple] = {}
    with safe_open(weights_path, framework="pt") as handle:
        for key in handle.keys():
            shape = tuple(handle.get_slice(key).get_shape())
            part = next((p for p in (".lora_A.weight", ".lora_B.weight") if key.endswith(p)), None)
            if part is None:
                others[key] = shape
                continue
            path = key[: -len(part)]
            path = path[len("base_model.model.") :] if path.startswith("base_model.model.") else path
            pairs.setdefault(path, {})[part[6]] = shape
    return pairs, others


def _in_out(module) -> tuple[int, int] | None:
    """(inputs, outputs) of a linear layer (``nn.Linear``, or transformers' ``Conv1D``); None for other modules."""
    if isinstance(module, torch.nn.Linear):
        return module.in_features, module.out_features
    if hasattr(module, "nf") and getattr(module, "weight", None) is not None:  # Conv1D: weight is [in, out]
        return module.weight.shape[0], module.nf
    return None


def check_adapter_fits(model, checkpoint, hub_kwargs: dict | None = None, given: str | None = None) -> None:
    """Raise, naming the layer and the fix, unless the adapter saved in ``checkpoint`` fits ``model``.

    Every adapted linear layer must have ``lora_A`` ``[r, in_features]`` and ``lora_B`` ``[out_features, r]``;
    the trained mask rows and PEFT's trainable-token rows must have the embeddings' width. Factors whose ranks
    disagree are a damaged adapter; factors or rows of other widths, or modules the model lacks, are the wrong
    base model (the error names the base the adapter was trained on and ``given``, the model it was given).
    """
    hub_kwargs = hub_kwargs or {}
    config_path = _resolve(checkpoint, ADAPTER_CONFIG_FILE, hub_kwargs)
    config = _read_json(config_path) if config_path else {}
    named = config.get("base_model_name_or_path")
    rank = None if config.get("rank_pattern") else config.get("r")
    pairs, others = adapter_shapes(checkpoint, hub_kwargs)
    modules = dict(model.named_modules())
    missing = [path for path in pairs if path not in modules]
    if missing:
        what = f"it adapts modules this model does not have: {missing[:4]}"
        raise _base_mismatch(checkpoint, what, model, named, given)
    for path, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(
                f"{checkpoint}: the adapter has lora_{''.join(pair)} but not both factors for {path}."
            )
        sizes = _in_out(modules[path])
        if sizes is None:
            continue
        a_shape, b_shape = pair["A"], pair["B"]
        if len(a_shape) == 2 and len(b_shape) == 2 and (a_shape[1], b_shape[0]) != sizes:
            what = (
                f"{path} has {sizes[0]} inputs and {sizes[1]} outputs here, but the adapter's lora_A is "
                f"{list(a_shape)} and lora_B {list(b_shape)} (a layer of {a_shape[1]} inputs and {b_shape[0]} outputs)"
            )
            raise _base_mismatch(checkpoint, what, model, named, given)
        check_factor_shapes(path, a_shape, b_shape, sizes[0], sizes[1], rank, checkpoint)
    width = model.get_input_embeddings().weight.shape[-1]
    rows = {
        f"{MARS_MASK_ROWS_FILE} {key}": shape
        for key, shape in _mask_row_shapes(checkpoint, hub_kwargs).items()
    }
    rows.update({key: shape for key, shape in others.items() if "trainable_tokens" in key})
    for name, shape in rows.items():
        if shape and shape[-1] != width:
            what = f"its trained token rows ({name}) have {shape[-1]} values where this model's embeddings have {width}"
            raise _base_mismatch(checkpoint, what, model, named, given)


def _mask_row_shapes(checkpoint, hub_kwargs: dict) -> dict:
    path = _resolve(checkpoint, MARS_MASK_ROWS_FILE, hub_kwargs)
    if path is None:
        return {}
    from safetensors import safe_open

    with safe_open(path, framework="pt") as handle:
        return {
            key: tuple(handle.get_slice(key).get_shape())
            for key in handle.keys()
            if key in ("input_embeddings", "output_embeddings")
        }


# --------------------------------------------------------------------------------------------------
# A saved adapter on a plain transformers model: AdaptedLinear layers in place of the adapted nn.Linear
# --------------------------------------------------------------------------------------------------
# Sibling layers that read the same input tensor: their A's are stacked into one matmul. Only a
# guess from the names; the forward checks that the input really is the same tensor.
SHARED_INPUT_NAMES = (
    ("q_proj", "k_proj", "v_proj"),
    ("gate_proj", "up_proj"),
    ("query", "key", "value"),
    ("wq", "wk", "wv"),
    ("w1", "w3"),
)


class _SharedInput:
    """Adapted sibling layers fed the same input: ``x @ A.T`` for all of them in one matmul, once per forward.

    ``leader`` carries the stacked ``mars_lora_A`` (``ranks x inputs``; both forms read it) as a (non-persistent)
    buffer, so ``model.to()`` moves it. The product (with autograd on), or in inference every member's adapted
    output, is kept in the forward's :class:`ForwardGate` (so per thread), with the input it was computed from and
    the form that computed it, until every sibling has taken its part (no activation outlives its forward).
    ``plan``: the C kernel's call for the group (opt-in, see ``gated_kernel``), built at first use, dropped when
    a member's matrix is replaced or moved (:class:`AdaptedLinear`); its argument struct is filled per call, so
    calls hold ``lock``.
    """

    __slots__ = ("leader", "members", "ranks", "kernel_dtype", "plan", "lock", "traced")

    def __init__(self, members: list, ranks: list[int], kernel_dtype: torch.dtype | None = None):
        self.leader, self.members, self.ranks = members[0], list(members), list(ranks)
        self.kernel_dtype = kernel_dtype  # the model dtype the C kernel serves (None: torch form only)
        self.plan = None
        self.lock = threading.Lock()
        # (traced forwards) (input, every member's gated x Aᵀ, takes left) until every sibling took its block
        self.traced = None

    def __getstate__(self) -> dict:
        """No plan (a C struct of this process's addresses) and no lock: a copy builds its own."""
        return {"members": self.members, "ranks": self.ranks, "kernel_dtype": self.kernel_dtype}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["members"], state["ranks"], state["kernel_dtype"])

    def _take(self, record: ForwardGate, x: torch.Tensor, form: str):
        """What a sibling kept for input ``x`` of this forward in ``form`` (None: nothing), counting this take;
        dropped once every sibling has taken it."""
        kept = record.kept.get(self)
        if kept is None or kept[0] is not x or kept[2] != form:
            return None
        if kept[3] <= 1:
            del record.kept[self]
        else:
            record.kept[self] = (*kept[:3], kept[3] - 1)
        return kept[1]

    def _keep(self, record: ForwardGate, x: torch.Tensor, parts, form: str) -> None:
        record.kept[self] = (x, parts, form, len(self.ranks) - 1)

    def part(self, x: torch.Tensor, record: ForwardGate | None, member: int) -> torch.Tensor:
        """Member ``member``'s block of ``gate * (x @ A.T)`` over flattened rows (ungated: its own ``x @ A.T``)."""
        if record is None:
            start = sum(self.ranks[:member])
            return F.linear(
                self._rows(x), self.leader._buffers["mars_lora_A"][start : start + self.ranks[member]]
            )
        parts = self._take(record, x, "torch")
        if parts is None:
            parts = self._products(x, record)
            if len(parts) > 1:
                self._keep(record, x, parts, "torch")
        return parts[member]

    def traced_part(self, x: torch.Tensor, gate, member: int) -> torch.Tensor:
        """(traced forwards) Member ``member``'s block of ``gate · (x Aᵀ)``: the first sibling to see ``x`` computes
        every member's block in one matmul, the others take theirs (the graph then holds one product per group,
        as the eager form does); the tracer records the hand-over, so nothing outlives the traced forward."""
        kept = self.traced
        if kept is None or kept[0] is not x:
            a = self.leader._buffers["mars_lora_A"]
            x2 = x.reshape(-1, x.shape[-1])
            dtype = _traced_dtype(x2, a)
            xa = F.linear(x2.to(dtype), a.to(dtype))
            if gate is not None:
                xa = xa * gate.traced_gate(xa.shape[0], xa.dtype)
            parts, left = xa.split(self.ranks, dim=1), len(self.ranks)
        else:
            parts, left = kept[1], kept[2]
        self.traced = None if left <= 1 else (x, parts, left - 1)
        return parts[member]

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as flattened rows in the dtype of the adapter's arithmetic."""
        x2 = x.reshape(-1, x.shape[-1])
        dtype = self.leader._buffers["mars_lora_A"].dtype
        return x2 if x2.dtype == dtype else x2.to(dtype)

    def _products(self, x: torch.Tensor, record: ForwardGate) -> tuple:
        """Every member's block of ``gate * (x @ A.T)`` over flattened rows, in one matmul."""
        xa = F.linear(self._rows(x), self.leader._buffers["mars_lora_A"])
        xa.mul_(_require_rows(record, xa.shape[0]).gate_for(xa.dtype))
        return xa.split(self.ranks, dim=1) if len(self.ranks) > 1 else (xa,)

    def adapted_output(self, x: torch.Tensor, record: ForwardGate, member: int, args: tuple, kwargs: dict):
        """(inference, masks in this forward) member ``member``'s output for ``x`` with its mask rows adapted: the
        output a sibling kept for this ``x``, else the whole group's, computed now (:meth:`adapt_group`)."""
        outputs = self._take(record, x, "outputs")
        if outputs is None:
            outputs = self.adapt_group(x, record, args, kwargs)
        return outputs[member]

    def adapt_group(self, x: torch.Tensor, record: ForwardGate, args: tuple, kwargs: dict) -> list:
        """(inference) Every member's base output for ``x``, its mask rows adapted in one pass over the group's
        ``x @ A.T``, kept for the siblings: per forward one Python call per group does the work, not one per layer.
        With the opt-in C kernel (CPU, the kernel's dtype) the mask rows only are written; otherwise the torch form
        adds ``gate * (x @ A.T) @ B^T`` to every row, an exact 0 at real rows."""
        outputs = [_base_output(module, x, args, kwargs).contiguous() for module in self.members]
        if x.dtype == outputs[0].dtype == self.kernel_dtype and x.is_cpu:
            index = _require_rows(record, x.numel() // x.shape[-1]).positions()
            with self.lock:
                plan = self.plan
                if plan is None:
                    from .gated_kernel import GroupPlan

                    bts = [module._buffers["mars_lora_BT"] for module in self.members]
                    plan = self.plan = GroupPlan(x.dtype, self.leader._buffers["mars_lora_A"], bts)
                mask_rows_group_delta(plan, x.contiguous(), index, outputs)
        else:
            for module, output, part in zip(self.members, outputs, self._products(x, record)):
                _add_delta_in_place(output, part, module._buffers["mars_lora_BT"])
        if len(outputs) > 1:
            self._keep(record, x, outputs, "outputs")
        return outputs


def mask_rows_group_delta(plan, x: torch.Tensor, index: torch.Tensor, outputs: list) -> None:
    """The C kernel's call for a sibling group (``gated_kernel.mask_rows_group_delta``), imported on first use."""
    from .gated_kernel import mask_rows_group_delta as group_delta

    group_delta(plan, x, index, outputs)


class _Adapter:
    """What one adapted layer needs in its forward (kept in the module's ``__dict__``). ``base_forward``: what
    computes the base layer's output (``None``: ``F.linear`` on the layer's own weight and bias; an accelerator may
    route it, e.g. ``cpu_kernels``; or the replaced module itself when it was not a plain ``nn.Linear``)."""

    __slots__ = ("base_forward", "gate", "group", "member")

    def __init__(self, base_forward, gate, group, member):
        self.base_forward, self.gate, self.group, self.member = base_forward, gate, group, member


def _base_output(module, x: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
    base = module.__dict__["_mars_adapter"].base_forward
    return F.linear(x, module.weight, module.bias) if base is None else base(x, *args, **kwargs)


class AdaptedLinear(torch.nn.Linear):
    """A linear layer with a saved LoRA adapter attached (gated to mask positions, or not).

    It holds the replaced layer's own ``weight`` and ``bias`` Parameters, so the state dict, ``model.to`` and
    anything that edits the weights see the base model's; the adapter's matrices are non-persistent buffers:
    ``mars_lora_A`` (on the first layer of a group of siblings that read one input, their A's stacked) and
    ``mars_lora_BT`` (``(s·B)ᵀ``, the scale folded in once). Forward: ``y = base(x)``; then, only if this
    thread's forward holds mask tokens, ``y += (gate · x Aᵀ) (s·B)ᵀ``: at real positions the gate row is 0, so the
    added row is exactly 0 and ``y`` keeps the base layer's bits. A forward without masks costs the base layer.
    """

    def __init__(self, linear: torch.nn.Linear):
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.register_parameter("bias", linear.bias)

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        adapter = self.__dict__["_mars_adapter"]
        gate, group = adapter.gate, adapter.group
        if torch.compiler.is_compiling():
            if gate is not None and not gate.traced_masks:
                return _base_output(self, x, args, kwargs)
            return self._traced_forward(x, adapter, args, kwargs)
        record = None
        if gate is not None:
            record = gate.require()
            if record.gate is None:
                return _base_output(self, x, args, kwargs)
            if not torch.is_grad_enabled():
                return group.adapted_output(x, record, adapter.member, args, kwargs)
        y = _base_output(self, x, args, kwargs)
        xa, bt = group.part(x, record, adapter.member), self._buffers["mars_lora_BT"]
        if not torch.is_grad_enabled():
            _add_delta_in_place(y, xa, bt)
            return y
        y2 = y.reshape(-1, y.shape[-1])
        if xa.dtype != y.dtype:  # float32 LoRA arithmetic on a 16-bit model (lora_dtype): add, round once
            return (y2 + torch.mm(xa, bt)).to(y.dtype).view(y.shape)
        return torch.addmm(y2, xa, bt).view(y.shape)

    def _traced_forward(self, x: torch.Tensor, adapter, args: tuple, kwargs: dict) -> torch.Tensor:
        """The forward a compiler traces: ``y = base(x) + (gate · x Aᵀ) (s·B)ᵀ`` over every row, the gate a tensor
        of the same graph (exactly 0 at real rows, so they add an exact 0 and keep the base layer's bits);
        siblings share one ``x Aᵀ`` (:meth:`_SharedInput.traced_part`)."""
        y = _base_output(self, x, args, kwargs)
        xa = adapter.group.traced_part(x, adapter.gate, adapter.member)
        flat = y.reshape(-1, y.shape[-1])
        delta = torch.mm(xa, self._buffers["mars_lora_BT"].to(xa.dtype))
        return (flat + delta).to(y.dtype).view(y.shape)  # a float32 delta on a 16-bit y: rounded once

    def _apply(self, fn, recurse=True):
        """``nn.Module._apply`` (``model.to``, ``half``, ``share_memory``), then the group's kernel plan is dropped:
        it holds the matrices' addresses, which ``_apply`` may move without replacing the tensors."""
        result = super()._apply(fn, recurse)
        self._drop_plan()
        return result

    def register_buffer(self, name, tensor, persistent=True):
        """``nn.Module.register_buffer`` (what ``module.mars_lora_BT = t`` runs too), then the group's kernel plan
        is dropped: it holds the matrices it was built from."""
        super().register_buffer(name, tensor, persistent)
        self._drop_plan()

    def _drop_plan(self) -> None:
        adapter = self.__dict__.get("_mars_adapter")
        if adapter is not None:
            adapter.group.plan = None


def _traced_dtype(x: torch.Tensor, a: torch.Tensor) -> torch.dtype:
    """(traced forwards) The dtype of the low-rank products: the model's where Inductor freezes the weights (the
    factors become constants it prepacks for the model's dtype: in bf16 on a CPU the adapter then costs about a
    third of what its float32 products cost in a verify step), else the adapter's own (``lora_dtype``: float32 for
    a 16-bit model on a CPU, where an unfrozen 16-bit product reorders its factor on every call)."""
    return x.dtype if torch._inductor.config.freezing and not torch.is_grad_enabled() else a.dtype


def _add_delta_in_place(y: torch.Tensor, xa: torch.Tensor, bt: torch.Tensor) -> None:
    """``y += xa @ bt`` in place over flattened rows; a float32 product on a 16-bit ``y`` (see lora_dtype) is
    added, then rounded once."""
    flat = y.view(-1, y.shape[-1])
    if xa.dtype == flat.dtype:
        flat.addmm_(xa, bt)
    else:
        flat.add_(torch.mm(xa, bt))


def _shared_input_groups(paths) -> list[list[str]]:
    """Adapted module paths grouped by parent and by :data:`SHARED_INPUT_NAMES`; others alone."""
    groups: dict[tuple, list[str]] = {}
    for path in paths:
        parent, _, leaf = path.rpartition(".")
        tag = next((names for names in SHARED_INPUT_NAMES if leaf in names), leaf)
        groups.setdefault((parent, tag), []).append(path)
    order = {name: i for names in SHARED_INPUT_NAMES for i, name in enumerate(names)}
    return [
        sorted(paths, key=lambda path: order.get(path.rpartition(".")[2], 0)) for paths in groups.values()
    ]


def _lora_dtype(weight: torch.Tensor, requested: torch.dtype | None) -> torch.dtype:
    """The dtype of the LoRA arithmetic: ``requested``, else float32 for a 16-bit model on CPU (a small
    bf16/fp16 matmul there costs more than a float32 one; the result is rounded to the model's dtype once),
    else the model's dtype."""
    if requested is not None:
        return requested
    if weight.device.type == "cpu" and weight.dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return weight.dtype


def _is_plain_linear(module) -> bool:
    """An ``nn.Linear`` whose forward is ``F.linear`` on its own parameters (no subclass, hooks or wrapper)."""
    hooks = (
        module._forward_hooks,
        module._forward_pre_hooks,
        module._backward_hooks,
        module._backward_pre_hooks,
    )
    return type(module) is torch.nn.Linear and "forward" not in module.__dict__ and not any(hooks)


@torch.no_grad()
def _install_adapter(
    model,
    pairs: dict,
    scaling: float,
    gate: MaskGate | None,
    lora_dtype: torch.dtype | None = None,
    kernel: str | None = None,
) -> None:
    """Put an :class:`AdaptedLinear` in the place of each adapted linear layer of ``model`` (shapes checked first).

    ``kernel`` (``auto``/``c``/``torch``, default ``$MARS_HF_GATED_KERNEL`` or ``torch``): whether a gated
    adapter's inference forwards on CPU run the opt-in C kernel of :mod:`gated_kernel`."""
    kernel = kernel or os.environ.get(KERNEL_ENV) or "torch"
    if kernel != "torch":
        from .gated_kernel import kernel_mode

        kernel = kernel_mode(kernel)  # checks the name
    modules = dict(model.named_modules())
    for path, pair in pairs.items():
        module = modules.get(path)
        if not isinstance(module, torch.nn.Linear) or isinstance(module, AdaptedLinear):
            raise ValueError(f"{path} is not a linear layer without an adapter: {type(module).__name__}.")
        a_shape, b_shape = tuple(pair["A"].shape), tuple(pair["B"].shape)
        check_factor_shapes(
            path, a_shape, b_shape, module.in_features, module.out_features, None, "the adapter"
        )
        if (a_shape[1], b_shape[0]) != (module.in_features, module.out_features):
            raise ValueError(
                f"{path} is {module}, but the adapter's factors are for a layer of {a_shape[1]} inputs and "
                f"{b_shape[0]} outputs: the adapter belongs to another base model."
            )
    for paths in _shared_input_groups(pairs):
        members = [modules[path] for path in paths]
        first = members[0].weight
        if all(
            m.in_features == members[0].in_features
            and m.weight.device == first.device
            and m.weight.dtype == first.dtype
            for m in members
        ):
            _install_group(
                model, paths, members, [pairs[path] for path in paths], scaling, gate, lora_dtype, kernel
            )
        else:
            for module, path in zip(members, paths):
                _install_group(model, [path], [module], [pairs[path]], scaling, gate, lora_dtype, kernel)


def _uses_kernel(kernel: str, weight: torch.Tensor) -> bool:
    from .gated_kernel import use_kernel

    return use_kernel(kernel, weight.device, weight.dtype)


def _install_group(
    model, paths, linears: list, pairs: list[dict], scaling: float, gate, lora_dtype, kernel
) -> None:
    weight = linears[0].weight
    dtype = _lora_dtype(weight, lora_dtype)
    kernel_dtype = None
    if gate is not None and kernel != "torch" and _uses_kernel(kernel, weight):
        from .gated_kernel import matrix_dtype

        matrices = matrix_dtype(weight.dtype, lora_dtype)
        if matrices is not None:
            kernel_dtype, dtype = weight.dtype, matrices
        elif kernel == "c":
            raise ValueError(
                f"The gated C kernel does not keep a {weight.dtype} model's adapter in {lora_dtype}: drop lora_dtype "
                "or use kernel='torch'."
            )
    adapted = [AdaptedLinear(linear) for linear in linears]
    group = _SharedInput(adapted, [pair["A"].shape[0] for pair in pairs], kernel_dtype)
    for member, (module, linear, pair, path) in enumerate(zip(adapted, linears, pairs, paths)):
        base = None if _is_plain_linear(linear) else linear  # a wrapped layer keeps running its own forward
        module._mars_adapter = _Adapter(base, gate, group, member)
        bt = (pair["B"].to(torch.float64) * scaling).t()  # the scale folded into B once, not per forward
        module.register_buffer(
            "mars_lora_BT", bt.to(device=weight.device, dtype=dtype).contiguous(), persistent=False
        )
        parent, _, leaf = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, module)
    stacked = torch.cat([pair["A"] for pair in pairs]).to(device=weight.device, dtype=dtype)
    adapted[0].register_buffer("mars_lora_A", stacked.contiguous(), persistent=False)


# Real tokens of the load-time check (any ids of the vocabulary serve; the masks follow them).
_PROBE_REAL_TOKENS = 5
_PROBE_MASKS = 2


@torch.no_grad()
def _probe_logits(model, mask_token_id: int) -> torch.Tensor:
    """Logits of one small forward: a few real tokens, then masks (as a MARS window feeds them)."""
    device = model.get_input_embeddings().weight.device
    real = [i for i in range(1, _PROBE_REAL_TOKENS + 2) if i != mask_token_id][:_PROBE_REAL_TOKENS]
    ids = torch.tensor([real + [mask_token_id] * _PROBE_MASKS], device=device)
    training = model.training
    model.eval()
    try:
        return model(input_ids=ids, use_cache=False).logits
    finally:
        model.train(training)


def attach_shipped_adapter(
    model,
    checkpoint,
    *,
    lora_dtype: torch.dtype | None = None,
    kernel: str | None = None,
    adapter_gating: str | None = None,
    mask_token_id: int | None = None,
    **hub_kwargs,
) -> bool:
    """Apply the LoRA adapter saved in ``checkpoint`` (folder or Hub id) to a plain transformers model.

    Reads ``adapter_config.json``, ``adapter_model.safetensors``, ``mars_config.json`` and the trained
    mask row (``mars_mask_token.safetensors``), checks that the adapter fits the model
    (:func:`check_adapter_fits`), resizes the embeddings if the checkpoint's vocabulary is larger, writes the
    mask row, records ``config.mars``, suppresses the mask token as an output and puts an :class:`AdaptedLinear`
    in the place of each adapted linear layer (gated to mask positions when the record says so), so the
    model's weights and state dict stay the base model's. A gated adapter is checked once: a forward of a few
    real tokens and masks must give the base model's logits at the real positions, bit for bit, or it is
    refused. Idempotent: returns False when the model already carries this checkpoint's adapter or the
    checkpoint is not an adapter (a full checkpoint needs nothing), True when it attached it.

    ``lora_dtype``: dtype of the adapter's own arithmetic (default: float32 for a bf16/fp16 model on CPU, else
    the model's dtype). ``kernel``: ``"torch"`` (default, or ``$MARS_HF_GATED_KERNEL``), ``"auto"`` or ``"c"``:
    whether inference forwards on CPU compute the gated delta with the opt-in C kernel of ``gated_kernel``.
    ``adapter_gating`` / ``mask_token_id``: how an adapter without a gating record was trained (see
    :func:`read_gating_record`). No PEFT needed.
    """
    key = str(checkpoint)
    attached = getattr(model, "_mars_shipped_adapter", None)
    if attached is not None:
        if attached != key:
            raise ValueError(f"The model already carries the adapter of {attached}; load a fresh base model.")
        return False
    if _resolve(checkpoint, ADAPTER_CONFIG_FILE, hub_kwargs) is None:
        return False
    mars = read_gating_record(checkpoint, hub_kwargs, gating=adapter_gating, mask_token_id=mask_token_id)
    check_adapter_fits(model, checkpoint, hub_kwargs)
    pairs, scaling = read_adapter_weights(checkpoint, hub_kwargs)
    rows = read_mask_rows_file(checkpoint, hub_kwargs)
    if rows is not None:
        apply_mask_rows(model, rows)
    if mars:
        model.config.mars = {**(getattr(model.config, "mars", None) or {}), **mars}
        mask_id = int(mars["mask_token_id"])
        suppressed = list(model.generation_config.suppress_tokens or [])
        if mask_id not in suppressed:
            model.generation_config.suppress_tokens = [*suppressed, mask_id]
    gated = mars.get(GATING_KEY) == MASK_GATING
    if gated:
        mask_id = int(mars["mask_token_id"])
        before = _probe_logits(model, mask_id)
        gate = install_mask_gate(model, mask_id, reset_per_forward=True)
    else:
        gate = None
    _install_adapter(model, pairs, scaling, gate, lora_dtype, kernel)
    object.__setattr__(model, "_mars_shipped_adapter", key)
    if gated:
        after = _probe_logits(model, mask_id)
        real = slice(0, after.shape[1] - _PROBE_MASKS)
        if not torch.equal(after[:, real], before[:, real]):
            raise RuntimeError(
                f"{checkpoint}: with its mask-gated adapter attached, this model's logits at real positions "
                "differ from the base model's (largest difference "
                f"{(after[:, real] - before[:, real]).abs().max().item():.3g}), so the adapter is not gated here and "
                "would change every real token; refusing it. Load the adapter onto a plain transformers model "
                "of the architecture it was trained on (no other hooks or adapters on its linear layers)."
            )
    logger.info(
        "Attached the %sLoRA adapter of %s to %d linear layers%s.",
        "mask-gated " if gated else "",
        checkpoint,
        len(pairs),
        " (real positions checked equal to the base model)" if gated else "",
    )
    return True
