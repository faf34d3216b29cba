"""``enable_mars``: MARS ``generate`` for a model object that was built without it.

Kept apart from :mod:`mars_hf.decoding.generation` because it is the one place that changes an existing
object's class; the loaders and ``generate``'s default path never import it (``AutoMARSModelForCausalLM``
loads the MARS class itself, ``generation.mars_class``).
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
    """Make ``model.generate(mars_threshold=τ)`` decode with MARS; returns the same model object.

    Reads ``config.mars`` (``block_size``, ``mask_token_id``); keyword arguments override it for this
    model object only (``config.mars`` is not modified). ``acceptance``, ``cache`` and
    ``cache_block`` and ``layout`` set defaults for ``mars_acceptance``, ``mars_cache``,
    ``mars_cache_block`` and ``mars_layout``.
    This converts a model object you already hold, so it swaps the object's class for
    ``mars_class(type(model))`` (same name: ``save_pretrained`` still records the original architecture).
    Loading needs no such change: ``AutoMARSModelForCausalLM.from_pretrained`` builds the model as that class
    from the start, and ``generate(custom_generate=mars_generate, ...)`` decodes any model with MARS as it is.
    """
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
    model._mars_overrides = {**(getattr(model, "_mars_overrides", None) or {}), **overrides}
    check_model_window(model, resolve_window(model, None), "The window W (`config.mars['block_size']`)")
    resolve_mask_token(model, None)
    for name, value, allowed in (
        ("acceptance", acceptance, ACCEPTANCE_RULES),
        ("cache", cache, CACHE_SCHEMES),
        ("layout", layout, LAYOUT_CHOICES),
    ):
        if value is not None:
            check_choice(name, value, allowed=allowed)
    if not isinstance(model, MARSGenerationMixin):
        model.__class__ = mars_class(type(model))
    return model
