"""LoRA adapters gated to mask positions (MARS_SPEC §7): ``h = W x + g · B A x``, ``g = [input is MASK]``.

Real tokens never see the adapter: at every position whose *input* token is not the mask token the
adapted layer returns the base layer's output bits (the added delta row is exactly zero there), so
logits and keys/values at real positions are the base model's, bit for bit, and one-token decoding,
τ = 1 and verified decoding are the base model's output. The masks get the adapter's capacity.

Two ways in, one gate:

* training: :func:`gate_peft_model` gates the LoRA layers of a PEFT model in place (the delta is
  computed for the mask rows only: index_select / index_add);
* loading (mars_hf's loaders and a checkpoint's ``custom_generate/``, torch + transformers only):
  :func:`attach_shipped_adapter` reads the checkpoint's ``adapter_model.safetensors``,
  ``adapter_config.json``, trained mask row and ``mars_config.json`` and wraps each adapted linear
  layer of a plain transformers model, without PEFT. The wrapped forward is lean: ``y = base(x)``,
  and only when the forward holds a mask token ``y += (g · x Aᵀ)(s B)ᵀ`` with the (rows, 1) 0/1 gate
  ``g`` built once per forward; layers that read one input (q/k/v, gate/up) share one ``x Aᵀ``. A
  forward without masks costs the base model's.

Which positions are masks is recorded by a forward pre-hook on the input embedding (it sees the
``input_ids`` of every forward). A gated adapter cannot be merged into the weights (the delta depends
on the input token); every merge entry point raises.

On CPU, inference forwards compute the gated delta with the small C kernel of ``gated_kernel.py`` (mask
rows only; ``kernel=`` / ``$MARS_HF_GATED_KERNEL`` choose), else with the torch ops above.

This file ships verbatim in checkpoints (``custom_generate/gated_lora.py``, beside ``gated_kernel.py``): it
imports only torch, transformers, safetensors, the standard library and that sibling.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os

import torch
import torch.nn.functional as F

from .gated_kernel import GroupPlan, kernel_mode, mask_rows_group_delta, matrix_dtype, use_kernel

logger = logging.getLogger(__name__)

GATING_KEY = "adapter_gating"
MASK_GATING = "mask"
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


def _refuse_merge(*args, **kwargs):
    raise MergeRefusedError(MERGE_REFUSED)


class MaskGate:
    """What the current forward's ``input_ids`` say about mask positions, computed once per forward.

    Set by a forward pre-hook on the input embedding (it sees the ``input_ids`` of every forward):
    ``rows`` (flattened positions; ``None`` until the input embedding has run in this forward, when
    ``reset_per_forward``), ``gate`` (``None`` when no position holds the mask token, else a
    ``(rows, 1)`` 0/1 tensor in the embedding's dtype), and, on request, the mask positions' ``index``.
    """

    def __init__(self, mask_token_id: int):
        self.mask_token_id = int(mask_token_id)
        self.rows: int | None = None
        self.gate: torch.Tensor | None = None
        self.serial = 0  # counts forwards: cached per-forward products are keyed by it
        self._index: torch.Tensor | None = None
        self._converted: dict = {}

    def record(self, module, args, kwargs):
        """Forward pre-hook of the input embedding: its first input is ``input_ids``."""
        input_ids = args[0] if args else kwargs.get("input", kwargs.get("input_ids"))
        flat = input_ids.reshape(-1)
        is_mask = flat == self.mask_token_id
        self.rows = flat.numel()
        self.serial += 1
        self._index = None
        self._converted = {}
        # One host sync per forward; without masks every adapted layer is its base layer.
        if bool(is_mask.any()):
            weight = getattr(module, "weight", None)
            self.gate = is_mask.unsqueeze(1).to(
                weight.dtype if isinstance(weight, torch.Tensor) else torch.float32
            )
        else:
            self.gate = None

    def reset(self, *args):
        """Forward pre-hook of the model: a forward without ``input_ids`` finds no stale gate."""
        self.rows = None
        self.gate = None
        self._index = None

    def gate_for(self, dtype: torch.dtype) -> torch.Tensor:
        """The gate in ``dtype`` (converted once per forward)."""
        gate = self.gate
        if gate.dtype == dtype:
            return gate
        converted = self._converted.get(dtype)
        if converted is None:
            converted = self._converted[dtype] = gate.to(dtype)
        return converted

    def check_rows(self, rows: int) -> None:
        if self.rows is None or rows != self.rows:
            raise RuntimeError(
                f"A mask-gated adapter layer got {rows} positions but the last input_ids had {self.rows}: the "
                "gate reads input_ids through the input embedding, so call the model with `input_ids` (not "
                "`inputs_embeds`)."
            )

    def positions_for(self, x: torch.Tensor) -> torch.Tensor | None:
        """Flattened mask positions for an input ``x`` of this forward (``None``: none). The rows are checked
        once per forward, by the first layer that asks (every layer of a forward sees as many rows)."""
        index = self._index
        if index is not None:
            return index
        self.check_rows(x.numel() // x.shape[-1])
        if self.gate is None:
            return None
        index = self._index = self.gate.reshape(-1).nonzero().flatten()
        return index


def gated_add(gate: MaskGate, x: torch.Tensor, result: torch.Tensor, delta_fn) -> torch.Tensor:
    """``result`` plus ``delta_fn(x)`` at mask positions only; other rows are ``result``'s own values."""
    index = gate.positions_for(x)
    if index is None:
        return result
    flat_x = x.reshape(-1, x.shape[-1]).index_select(0, index)
    delta = delta_fn(flat_x).to(result.dtype)
    flat = result.reshape(-1, result.shape[-1])
    return flat.index_add(0, index, delta).view_as(result)


def install_mask_gate(model, mask_token_id: int, reset_per_forward: bool = False) -> MaskGate:
    """Attach (once) the pre-hook that records mask positions; returns the model's gate.

    ``reset_per_forward`` also forgets the gate when ``model``'s forward starts, so a forward with
    ``inputs_embeds`` fails loudly even right after an ``input_ids`` forward (or an embedding call) of the
    same size. Training leaves it off: gradient checkpointing re-runs layers during backward, outside
    any forward, with that forward's gate.
    """
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
    if reset_per_forward:
        model.register_forward_pre_hook(gate.reset)
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


def check_adapter_config(config: dict, checkpoint) -> float:
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
            f"The adapter of {checkpoint} uses {', '.join(unsupported)}, which the torch-only loader that "
            "custom_generate/ and mars_hf share does not implement; retrain the adapter without them."
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
    output, is kept, with the input it was computed from and the form that computed it, only until every sibling
    has taken its part (no activation outlives its forward).
    """

    __slots__ = ("leader", "members", "ranks", "kernel_dtype", "x", "parts", "serial", "waiting", "form", "plan")

    def __init__(self, members: list, ranks: list[int], kernel_dtype: torch.dtype | None = None):
        self.leader, self.members, self.ranks = members[0], list(members), list(ranks)
        self.kernel_dtype = kernel_dtype  # the model dtype the C kernel serves (None: torch form only)
        self.x = self.parts = self.serial = self.form = self.plan = None
        self.waiting = 0

    def _take(self, x: torch.Tensor, serial, form: str):
        """The product kept for input ``x`` of this forward by ``form`` (None: none), counting this sibling's
        take; dropped once every sibling has taken it."""
        if not (x is self.x and serial == self.serial and self.form == form):
            return None
        parts = self.parts
        self.waiting -= 1
        if self.waiting <= 0:
            self.x = self.parts = None
        return parts

    def _keep(self, x: torch.Tensor, parts, serial, form: str) -> None:
        """Keep ``parts`` (computed by ``form`` from ``x``) for the other siblings of this forward."""
        self.x, self.parts, self.serial, self.form, self.waiting = x, parts, serial, form, len(self.ranks) - 1

    def part(self, x: torch.Tensor, gate: MaskGate | None, member: int) -> torch.Tensor:
        """Member ``member``'s block of ``gate * (x @ A.T)`` over flattened rows (all rows when ungated)."""
        serial = gate.serial if gate is not None else None
        parts = self._take(x, serial, "torch")
        if parts is None:
            parts = self._products(x, gate)
            if len(parts) > 1:
                self._keep(x, parts, serial, "torch")
        return parts[member]

    def _products(self, x: torch.Tensor, gate: MaskGate | None) -> tuple:
        """Every member's block of ``gate * (x @ A.T)`` over flattened rows (all rows when ungated), in one matmul."""
        A = self.leader._buffers["mars_lora_A"]
        x2 = x.reshape(-1, x.shape[-1])
        xa = F.linear(x2 if x2.dtype == A.dtype else x2.to(A.dtype), A)
        if gate is not None:
            gate.check_rows(xa.shape[0])
            xa.mul_(gate.gate_for(xa.dtype))
        return xa.split(self.ranks, dim=1) if len(self.ranks) > 1 else (xa,)

    def adapted_output(self, x: torch.Tensor, gate: MaskGate, member: int, args: tuple, kwargs: dict) -> torch.Tensor:
        """(inference, masks in this forward) member ``member``'s output for ``x`` with its mask rows adapted: the
        output a sibling kept for this ``x``, else the whole group's, computed now (:meth:`adapt_group`)."""
        outputs = self._take(x, gate.serial, "outputs")
        if outputs is None:
            outputs = self.adapt_group(x, gate, args, kwargs)
        return outputs[member]

    def adapt_group(self, x: torch.Tensor, gate: MaskGate, args: tuple, kwargs: dict) -> list:
        """(inference) Every member's base output for ``x``, its mask rows adapted in one pass over the group's
        ``x @ A.T``, kept for the siblings: per forward one Python call per group does the work, not one per layer.
        On CPU in the kernel's dtype the C kernel writes the mask rows only; otherwise the torch form adds
        ``gate * (x @ A.T) @ B^T`` to every row, an exact 0 at real rows."""
        outputs = [
            module.__dict__["_mars_adapter"].base_forward(x, *args, **kwargs).contiguous() for module in self.members
        ]
        if x.dtype == outputs[0].dtype == self.kernel_dtype and x.is_cpu:
            # dropped whenever a member's matrix is replaced or moved: _register_buffer_dropping_plan, _apply_dropping_plan
            plan = self.plan
            if plan is None:
                bts = [module._buffers["mars_lora_BT"] for module in self.members]
                plan = self.plan = GroupPlan(x.dtype, self.leader._buffers["mars_lora_A"], bts)
            mask_rows_group_delta(plan, x.contiguous(), gate.positions_for(x), outputs)
        else:
            self._add_torch(x, gate, outputs)
        if len(outputs) > 1:
            self._keep(x, outputs, gate.serial, "outputs")
        return outputs

    def _add_torch(self, x: torch.Tensor, gate: MaskGate, outputs: list) -> None:
        for module, output, part in zip(self.members, outputs, self._products(x, gate)):
            _add_delta_in_place(output, part, module._buffers["mars_lora_BT"])


class _Adapter:
    """What one adapted linear layer needs in its forward (kept in the module's ``__dict__``)."""

    __slots__ = ("base_forward", "gate", "group", "member")

    def __init__(self, base_forward, gate, group, member):
        self.base_forward, self.gate, self.group, self.member = base_forward, gate, group, member


def _adapted_forward(self, x, *args, **kwargs):
    """``y = base(x)``; then, only if this forward holds mask tokens, ``y += (gate · x Aᵀ) (s·B)ᵀ`` in place.

    At real positions the gate row is 0, so the added product row is exactly 0 and ``y`` keeps the
    base layer's bits. Without masks the adapter is skipped: the layer costs its base layer. In inference a
    sibling group is adapted in one pass (:meth:`_SharedInput.adapt_group`); otherwise (autograd on, or an
    ungated adapter) each layer adds its own delta.
    """
    adapter = self.__dict__["_mars_adapter"]
    gate = adapter.gate
    if gate is not None and gate.gate is not None and not torch.is_grad_enabled():
        return adapter.group.adapted_output(x, gate, adapter.member, args, kwargs)
    y = adapter.base_forward(x, *args, **kwargs)
    if gate is not None and gate.gate is None:
        if gate.rows is None:
            gate.check_rows(x.numel() // x.shape[-1])  # raises: no input_ids seen for this forward
        return y
    xa = adapter.group.part(x, gate, adapter.member)
    bt = self._buffers["mars_lora_BT"]
    if not torch.is_grad_enabled():
        _add_delta_in_place(y, xa, bt)
        return y
    y2 = y.view(-1, y.shape[-1])
    if xa.dtype != y.dtype:  # float32 LoRA arithmetic on a 16-bit model (see lora_dtype): add, then round once
        return (y2 + torch.mm(xa, bt)).to(y.dtype).view(y.shape)
    return torch.addmm(y2, xa, bt).view(y.shape)


def _apply_dropping_plan(self, fn, *args, **kwargs):
    """``nn.Module._apply`` (what ``model.to``, ``half`` and ``share_memory`` run), then the group's kernel plan is
    dropped: it holds the matrices' addresses, which ``_apply`` may move without replacing the tensors."""
    result = type(self)._apply(self, fn, *args, **kwargs)
    self.__dict__["_mars_adapter"].group.plan = None
    return result


def _register_buffer_dropping_plan(self, name, tensor, persistent=True):
    """``nn.Module.register_buffer`` (what ``module.mars_lora_BT = t`` runs too), then the group's kernel plan is
    dropped: it holds the matrices it was built from. Dropping it here, not checking the matrices' identity every
    forward, saves ≈ 0.3-0.6 ms of a 31 ms bf16 forward: the layers' buffer dicts are cold by the time a group runs
    (docs/gated_adapters.md, "Seventh pass")."""
    type(self).register_buffer(self, name, tensor, persistent)
    self.__dict__["_mars_adapter"].group.plan = None


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


@torch.no_grad()
def _install_adapter(
    model,
    pairs: dict,
    scaling: float,
    gate: MaskGate | None,
    lora_dtype: torch.dtype | None = None,
    kernel: str | None = None,
) -> None:
    """Wrap each adapted linear layer's forward (see :func:`_adapted_forward`); no hooks, no new weights.

    ``kernel`` (``auto``/``c``/``torch``, default ``$MARS_HF_GATED_KERNEL`` or ``auto``): whether a gated
    adapter's inference forwards on CPU run the C kernel of :mod:`gated_kernel`."""
    kernel = kernel_mode(kernel)
    modules = dict(model.named_modules())
    for paths in _shared_input_groups(pairs):
        members = [modules[path] for path in paths]
        first = members[0].weight
        if all(
            m.in_features == members[0].in_features
            and m.weight.device == first.device
            and m.weight.dtype == first.dtype
            for m in members
        ):
            _install_group(members, [pairs[path] for path in paths], scaling, gate, lora_dtype, kernel)
        else:
            for module, path in zip(members, paths):
                _install_group([module], [pairs[path]], scaling, gate, lora_dtype, kernel)


def _install_group(members: list, pairs: list[dict], scaling: float, gate, lora_dtype, kernel: str) -> None:
    leader = members[0]
    weight = leader.weight
    dtype = _lora_dtype(weight, lora_dtype)
    kernel_dtype = None
    if gate is not None and use_kernel(kernel, weight.device, weight.dtype):
        matrices = matrix_dtype(weight.dtype, lora_dtype)
        if matrices is not None:
            kernel_dtype, dtype = weight.dtype, matrices
        elif kernel == "c":
            raise ValueError(
                f"The gated C kernel does not keep a {weight.dtype} model's adapter in {lora_dtype}: drop lora_dtype "
                "or use kernel='torch'."
            )
    stacked = torch.cat([pair["A"] for pair in pairs]).to(device=weight.device, dtype=dtype)
    leader.register_buffer("mars_lora_A", stacked.contiguous(), persistent=False)
    group = _SharedInput(members, [pair["A"].shape[0] for pair in pairs], kernel_dtype)
    for member, (module, pair) in enumerate(zip(members, pairs)):
        bt = (pair["B"].to(torch.float64) * scaling).t()  # the scale folded into B once, not per forward
        module.register_buffer(
            "mars_lora_BT",
            bt.to(device=module.weight.device, dtype=dtype).contiguous(),
            persistent=False,
        )
        adapter = _Adapter(_own_forward(module), gate, group, member)
        object.__setattr__(module, "_mars_adapter", adapter)
        # partials of module-level functions, not bound methods: a model holding them pickles (torch.save)
        module.forward = functools.partial(_adapted_forward, module)
        module._apply = functools.partial(_apply_dropping_plan, module)
        module.register_buffer = functools.partial(_register_buffer_dropping_plan, module)


def _own_forward(module):
    """``module.forward`` as a picklable callable: a partial of its class's ``forward`` when it is the class's own (a
    bound method pickles as a lookup of ``forward``, which would find the wrapper installed in its place), else
    whatever the module holds."""
    forward = module.forward
    if getattr(forward, "__self__", None) is module and getattr(forward, "__func__", None) is type(module).forward:
        return functools.partial(type(module).forward, module)
    return forward


def read_gating_record(checkpoint, hub_kwargs: dict | None = None) -> dict:
    """``mars_config.json`` of an adapter checkpoint (``{}`` if it is no MARS adapter), after checking it.

    A MARS adapter's gating is recorded in ``mars_config.json`` (``adapter_gating``); its mask-row file
    (``mars_mask_token.safetensors``) also says so in its metadata. Without the record a gated adapter
    would load *ungated* and change every real token, so a checkpoint whose files disagree, or that has
    the mask-row file but no ``mars_config.json``, is refused with the fix.
    """
    hub_kwargs = hub_kwargs or {}
    mars_path = _resolve(checkpoint, MARS_ADAPTER_CONFIG_FILE, hub_kwargs)
    mars = _read_json(mars_path) if mars_path else {}
    rows_path = _resolve(checkpoint, MARS_MASK_ROWS_FILE, hub_kwargs)
    claimed = None
    if rows_path is not None:
        from safetensors import safe_open

        with safe_open(rows_path, framework="pt") as handle:
            claimed = (handle.metadata() or {}).get(GATING_METADATA_KEY)
    recorded = mars.get(GATING_KEY)
    if rows_path is not None and mars_path is None:
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
    return mars


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
    model, checkpoint, *, lora_dtype: torch.dtype | None = None, kernel: str | None = None, **hub_kwargs
) -> bool:
    """Apply the LoRA adapter saved in ``checkpoint`` (folder or Hub id) to a plain transformers model.

    Reads ``adapter_config.json``, ``adapter_model.safetensors``, ``mars_config.json`` and the trained
    mask row (``mars_mask_token.safetensors``): resizes the embeddings if the checkpoint's vocabulary is
    larger, writes the mask row, records ``config.mars``, suppresses the mask token as an output and
    wraps each adapted linear layer's forward (gated to mask positions when ``adapter_gating == "mask"``),
    so the model's weights and state dict stay the base model's. A gated adapter is checked once: a
    forward of a few real tokens and masks must give the base model's logits at the real positions,
    bit for bit, or it is refused. Idempotent: returns False when the model already carries this
    checkpoint's adapter or the checkpoint is not an adapter (a full checkpoint needs nothing), True
    when it attached it. ``lora_dtype``: dtype of the adapter's own arithmetic (default: float32 for a
    bf16/fp16 model on CPU, else the model's dtype). ``kernel``: ``"auto"`` (default, or
    ``$MARS_HF_GATED_KERNEL``), ``"c"`` or ``"torch"``: whether inference forwards on CPU compute the gated
    delta with the C kernel of ``gated_kernel`` (mask rows only). No PEFT needed.
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
    pairs, scaling = read_adapter_weights(checkpoint, hub_kwargs)
    mars = read_gating_record(checkpoint, hub_kwargs)
    modules = dict(model.named_modules())
    missing = [path for path in pairs if not isinstance(modules.get(path), torch.nn.Linear)]
    if missing:
        raise ValueError(
            f"{checkpoint}: the adapter targets modules this model has no linear layer for: {missing[:4]}; "
            "load the base model the adapter was trained on."
        )
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
