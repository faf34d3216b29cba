"""``enable_mars``: MARS ``generate`` for a model object that was built without it.

It returns the same model under the MARS class (``generation.mars_class``) and leaves the object it was given
as it was: no class is swapped and no method assigned (the library rules). The loaders build the MARS class
from the start (``AutoMARSModelForCausalLM``) and never need it; ``generate(custom_generate=mars_generate,
...)`` decodes any model with MARS as it is, a PEFT model included.
"""

from __future__ import annotations

from .acceptance import ACCEPTANCE_RULES
from .cache import CACHE_SCHEMES
from .generation import MARSGenerationMixin, mars_class
from .layouts import LAYOUT_CHOICES
from .settings import check_choice, check_model_window, resolve_mask_token, resolve_window


def enable_mars(
    model,
    block_size: int | None = None,
    mask_token_id: int | None = None,
    *,
    acceptance: str | None = None,
    cache: str | None = None,
    cache_block: int | None = None,
    layout: str | None = None,
):
    """Return ``model`` as a MARS model: ``mars_model.generate(mars_threshold=τ)`` decodes with MARS.

    Use the returned object (``model = enable_mars(model)``, as with ``peft.get_peft_model``): it is the same
    model — the same modules, weights, config and state, one object's attributes seen through two — under the
    class ``mars_class(type(model))``, whose ``generate`` routes MARS keywords to MARS. The object passed in
    keeps its own class and its stock ``generate``. A model that already has MARS ``generate`` is returned
    itself.

    Reads ``config.mars`` (``block_size``, ``mask_token_id``); keyword arguments override it for this model
    (``config.mars`` is not modified). ``acceptance``, ``cache``, ``cache_block`` and ``layout`` set
    defaults for ``mars_acceptance``, ``mars_cache``, ``mars_cache_block`` and ``mars_layout``.

    A PEFT model is refused: give its base model the MARS class before wrapping it
    (``PeftModel.from_pretrained(enable_mars(base), adapter)``), load it with
    ``AutoMARSModelForCausalLM.from_pretrained``, or call
    ``peft_model.generate(custom_generate=mars_generate, ...)``.
    """
    if hasattr(model, "peft_config") and hasattr(model, "get_base_model"):
        raise TypeError(
            "enable_mars got a PEFT model: give its base model MARS generate before wrapping it "
            "(`PeftModel.from_pretrained(enable_mars(base_model), adapter)`), load the checkpoint with "
            "`AutoMARSModelForCausalLM.from_pretrained`, or decode with "
            "`peft_model.generate(custom_generate=mars_hf.mars_generate, ...)`."
        )
    overrides = {
        key: value
        for key, value in (
            ("block_size", block_size),
            ("mask_token_id", mask_token_id),
            ("acceptance", acceptance),
            ("cache", cache),
            ("cache_block", cache_block),
            ("layout", layout),
        )
        if value is not None
    }
    if block_size is not None:
        check_model_window(model, block_size, "`block_size` (the window W)")
    for name, value, allowed in (
        ("acceptance", acceptance, ACCEPTANCE_RULES),
        ("cache", cache, CACHE_SCHEMES),
        ("layout", layout, LAYOUT_CHOICES),
    ):
        if value is not None:
            check_choice(name, value, allowed=allowed)
    previous = getattr(model, "_mars_overrides", None)
    model._mars_overrides = {**(previous or {}), **overrides}
    try:
        check_model_window(model, resolve_window(model, None), "The window W (`config.mars['block_size']`)")
        resolve_mask_token(model, None)
    except Exception:
        model._mars_overrides = previous
        raise
    return model if isinstance(model, MARSGenerationMixin) else same_model_as(mars_class(type(model)), model)


def same_model_as(cls: type, model):
    """``model`` seen as an instance of ``cls`` (a subclass of its class, here ``mars_class``'s): a new object whose attributes are
    ``model``'s own (one ``__dict__``: modules, parameters, hooks, config, training flag), so nothing can
    drift apart between the two, and ``model`` itself is not changed."""
    view = cls.__new__(cls)
    view.__dict__ = model.__dict__
    return view
