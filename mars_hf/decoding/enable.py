"""``enable_mars``: MARS ``generate`` for a model object that was built without it.

It returns a :class:`MARSModel` that owns the model, the way ``peft.get_peft_model`` returns a ``PeftModel``: one
object with its own settings (``block_size``, ``acceptance``...), ``get_base_model()``, ``forward`` and every other
attribute the model's own. Nothing is written into the model and no class is changed, so two ``enable_mars``
results of one model each keep their settings, and a ``MARSModel`` pickles like any ``nn.Module``. The loaders
build the MARS class from the start (``AutoMARSModelForCausalLM``) and need no wrapper;
``generate(custom_generate=mars_generate, ...)`` decodes any model with MARS as it is, a PEFT model included.
"""

from __future__ import annotations

import inspect

import torch
from transformers import GenerationMixin

from .acceptance import ACCEPTANCE_RULES
from .cache import CACHE_SCHEMES
from .generation import _call_values, _route_to_mars, _stock, _wants_mars, mars_generate
from .layouts import LAYOUT_CHOICES
from .settings import check_choice, check_model_window, resolve_mask_token, resolve_window


class _DecodeWith:
    """``mars_generate`` as ``custom_generate`` of a call transformers prepares on the base model, decoding with
    ``owner`` (the :class:`MARSModel`) as the model, so its settings are the call's defaults. Its signature is
    ``mars_generate``'s: transformers reads the extra keywords of a decoding callable from it."""

    __signature__ = inspect.signature(mars_generate)

    def __init__(self, owner: MARSModel):
        self.owner = owner

    def __call__(self, model, *args, **kwargs):
        return mars_generate(self.owner, *args, **kwargs)


class MARSModel(torch.nn.Module):
    """A model with MARS ``generate`` and settings of its own: what :func:`enable_mars` returns.

    ``generate(mars_threshold=τ)`` or ``generate(mars_acceptance="verify")`` decodes with MARS (``mars_generate``),
    with ``mars_settings`` as defaults below the call's keywords and generation config and above ``config.mars``;
    without them it is the model's stock ``generate``. ``forward`` is the model's; any attribute this object lacks
    is the model's (``config``, ``generation_config``, ``get_input_embeddings``...), as with ``PeftModel``.
    """

    def __init__(self, model, settings: dict | None = None):
        super().__init__()
        self.base_model = model
        self.mars_settings = dict(settings or {})

    def get_base_model(self):
        """The model this object owns (its weights and modules)."""
        return self.base_model

    @property
    def _mars_overrides(self) -> dict:
        """The settings as ``settings.model_defaults`` and ``calibration`` read them from the model they decode."""
        return self.mars_settings

    @_mars_overrides.setter
    def _mars_overrides(self, value) -> None:  # calibration.calibration_disabled sets it for a while
        self.mars_settings = dict(value or {})

    def forward(self, *args, **kwargs):
        return self.base_model(*args, **kwargs)

    def register_forward_pre_hook(self, *args, **kwargs):
        """On the model: every forward, stock ``generate``'s included, is the model's (this object adds none)."""
        return self.base_model.register_forward_pre_hook(*args, **kwargs)

    def register_forward_hook(self, *args, **kwargs):
        """On the model, as :meth:`register_forward_pre_hook`."""
        return self.base_model.register_forward_hook(*args, **kwargs)

    def __setattr__(self, name: str, value) -> None:
        """An attribute the model has (``generation_config``, ``config``...) is set on the model, as if set there;
        this object's own (``mars_settings``, its module state) stay its own."""
        base = self.__dict__.get("_modules", {}).get("base_model")
        if (
            base is not None
            and not name.startswith("_")
            and name not in self.__dict__
            and not hasattr(type(self), name)
            and hasattr(base, name)
        ):
            setattr(base, name, value)
        else:
            super().__setattr__(name, value)

    def state_dict(self, *args, **kwargs):
        """The model's state dict, its own keys (the wrapper holds no weights): it loads into the model's class."""
        return self.base_model.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, *args, **kwargs):
        """Into the model, with the model's own keys (what :meth:`state_dict` gives)."""
        return self.base_model.load_state_dict(state_dict, *args, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)  # parameters, buffers and modules of this nn.Module
        except AttributeError:
            if name == "base_model":  # not set yet (e.g. while unpickling): never recurse
                raise
            return getattr(self.base_model, name)

    def generate(self, *args, **kwargs):
        """MARS with ``mars_threshold`` / ``mars_acceptance="verify"`` (keywords or a generation config) or
        ``custom_generate=mars_generate``; otherwise the model's stock ``generate``."""
        base = self.base_model
        custom = kwargs.get("custom_generate")
        values = _call_values(base, args, kwargs)
        if custom is mars_generate or (custom is None and _wants_mars(values)):
            return _route_to_mars(base, args, kwargs, values, decode=_DecodeWith(self))
        if kwargs.get("mars_threshold", 0) is None:
            kwargs.pop("mars_threshold")
        if custom is not None:
            return GenerationMixin.generate(base, *args, **kwargs)
        return _stock(base, args, kwargs)

    def __repr__(self) -> str:
        return f"MARSModel(settings={self.mars_settings!r}, base_model={self.base_model!r})"


def enable_mars(
    model,
    block_size: int | None = None,
    mask_token_id: int | None = None,
    *,
    acceptance: str | None = None,
    cache: str | None = None,
    cache_block: int | None = None,
    layout: str | None = None,
) -> MARSModel:
    """A :class:`MARSModel` owning ``model``: ``mars_model.generate(mars_threshold=τ)`` decodes with MARS.

    Use the returned object (``model = enable_mars(model)``, as with ``peft.get_peft_model``);
    ``get_base_model()`` gives the model back, unchanged. Reads ``config.mars`` (``block_size``,
    ``mask_token_id``); keyword arguments override it for the returned object only (``config.mars`` is not
    modified). ``acceptance``, ``cache``, ``cache_block`` and ``layout`` set defaults for ``mars_acceptance``,
    ``mars_cache``, ``mars_cache_block`` and ``mars_layout``. Given a ``MARSModel``, returns a new one for the
    same model with its settings updated by these (the one given keeps its own).

    A PEFT model is refused: give its base model MARS before wrapping it (load it with
    ``AutoMARSModelForCausalLM.from_pretrained``), or call ``peft_model.generate(custom_generate=mars_generate,
    ...)``.
    """
    if hasattr(model, "peft_config") and hasattr(model, "get_base_model"):
        raise TypeError(
            "enable_mars got a PEFT model: load the checkpoint with `AutoMARSModelForCausalLM.from_pretrained`, or "
            "decode with `peft_model.generate(custom_generate=mars_hf.mars_generate, ...)`."
        )
    given = dict(
        block_size=block_size,
        mask_token_id=mask_token_id,
        acceptance=acceptance,
        cache=cache,
        cache_block=cache_block,
        layout=layout,
    )
    settings = dict(model.mars_settings) if isinstance(model, MARSModel) else {}
    settings.update({key: value for key, value in given.items() if value is not None})
    if block_size is not None:
        check_model_window(model, block_size, "`block_size` (the window W)")
    for name, value, allowed in (
        ("acceptance", acceptance, ACCEPTANCE_RULES),
        ("cache", cache, CACHE_SCHEMES),
        ("layout", layout, LAYOUT_CHOICES),
    ):
        if value is not None:
            check_choice(name, value, allowed=allowed)
    base = model.get_base_model() if isinstance(model, MARSModel) else model
    wrapped = MARSModel(base, settings)
    check_model_window(wrapped, resolve_window(wrapped, None), "The window W (`config.mars['block_size']`)")
    resolve_mask_token(wrapped, None)
    return wrapped
