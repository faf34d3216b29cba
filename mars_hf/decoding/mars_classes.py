"""Every class a MARS model has, importable by its name.

``mars_class(LlamaForCausalLM)`` is ``MARSLlamaForCausalLM``: ``LlamaForCausalLM`` with
:class:`~mars_hf.decoding.generation.MARSGenerationMixin` mixed in before it, registered here under that name.
A class built at run time is found again by the name pickle records (``__module__`` + ``__qualname__``): this
module's ``__getattr__`` rebuilds ``MARS<name>`` from transformers' class ``<name>`` on demand, so ``pickle``,
``torch.save`` / ``torch.load(weights_only=False)``, ``copy.deepcopy`` and spawned processes work in a process
that never built it. One class per stock class (no two classes share a name), and none is named like a stock one.

transformers records ``type(model).__name__`` as the checkpoint's architecture; a MARS class's
``save_pretrained`` records the stock class's name instead, so a saved folder loads anywhere as before.
"""

from __future__ import annotations

import os
import threading

import transformers

from .generation import MARSGenerationMixin

PREFIX = "MARS"
_CLASSES: dict[str, type] = {}
_LOCK = threading.Lock()


class _SavesTheStockArchitecture:
    """``save_pretrained`` of a MARS class: ``config.architectures`` names the stock class (``LlamaForCausalLM``,
    not ``MARSLlamaForCausalLM``), which every loader of the folder knows."""

    def save_pretrained(self, save_directory, *args, push_to_hub: bool = False, **kwargs):
        upload = {
            k: kwargs.pop(k) for k in ("repo_id", "commit_message", "create_pr", "private") if k in kwargs
        }
        super().save_pretrained(save_directory, *args, **kwargs)
        self.config.architectures = [stock_class(type(self)).__name__]
        if kwargs.get("is_main_process", True):
            if os.path.isfile(os.path.join(save_directory, "config.json")):  # not for an adapter-only save
                self.config.save_pretrained(save_directory)  # config.json again, with the stock architecture
            if push_to_hub:  # after the fix, so the Hub gets the stock name too
                from huggingface_hub import create_repo, upload_folder

                token = kwargs.get("token")
                repo_id = upload.get("repo_id", str(save_directory).rstrip(os.sep).split(os.sep)[-1])
                repo_id = create_repo(
                    repo_id, exist_ok=True, private=upload.get("private"), token=token
                ).repo_id
                upload_folder(
                    repo_id=repo_id,
                    folder_path=save_directory,
                    commit_message=upload.get("commit_message") or "Upload model",
                    create_pr=upload.get("create_pr", False),
                    token=token,
                )


def stock_class(cls: type) -> type:
    """The transformers class a MARS class was built from (``cls`` itself for any other class)."""
    return getattr(cls, "_mars_stock_class", cls)


def mars_class(cls: type) -> type:
    """``MARS<cls.__name__>``: ``cls`` with MARS ``generate``; built once per class, registered in this module."""
    if issubclass(cls, MARSGenerationMixin):
        return cls
    name = PREFIX + cls.__name__
    with _LOCK:
        built = _CLASSES.get(name)
        if built is None:
            built = type(
                name,
                (MARSGenerationMixin, _SavesTheStockArchitecture, cls),
                {
                    "__module__": __name__,
                    "__qualname__": name,
                    "__doc__": f"``{cls.__name__}`` whose ``generate(mars_threshold=τ)`` decodes with MARS.",
                    "_mars_stock_class": cls,
                },
            )
            _share_weight_conversions(cls.__name__, name)
            _CLASSES[name] = built
    if stock_class(built) is not cls:
        raise TypeError(
            f"Two different classes are named {cls.__name__} ({stock_class(built).__module__} and {cls.__module__}), "
            f"and a MARS class is found by its name ({name}): load one of them with mars_hf per process, or decode "
            "the other with `generate(custom_generate=mars_hf.mars_generate, ...)`."
        )
    return built


def _share_weight_conversions(stock_name: str, name: str) -> None:
    """transformers looks up a class's checkpoint conversions by class name first; the MARS class gets the stock
    class's (most causal LMs have none by class name and use their model type's, which needs nothing here)."""
    from transformers.conversion_mapping import (
        get_checkpoint_conversion_mapping,
        register_checkpoint_conversion_mapping,
    )

    conversions = get_checkpoint_conversion_mapping(stock_name)
    if conversions is not None:
        register_checkpoint_conversion_mapping(name, conversions, overwrite=True)


def __getattr__(name: str):
    """``MARS<name>`` for transformers' class ``<name>``, built on demand (what unpickling asks for)."""
    if name.startswith(PREFIX):
        if name in _CLASSES:
            return _CLASSES[name]
        stock = getattr(transformers, name[len(PREFIX) :], None)
        if isinstance(stock, type) and issubclass(stock, transformers.PreTrainedModel):
            return mars_class(stock)
        raise AttributeError(
            f"{name} is not built in this process and {name[len(PREFIX) :]} is not a transformers class (a model "
            "with its own code, trust_remote_code): load that model once in this process (e.g. with "
            "AutoMARSModelForCausalLM.from_pretrained) before unpickling it."
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
