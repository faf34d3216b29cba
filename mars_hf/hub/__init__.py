"""Hub helpers: save a Hub-ready MARS folder, render its model card, push it, load any MARS checkpoint.

``from mars_hf import hub`` then ``hub.save_pretrained(model, tokenizer, folder)``,
``hub.push_to_hub(model, tokenizer, "user/name")`` or ``hub.load("user/name")``. The parts:
:mod:`~mars_hf.hub.save` (the folder), :mod:`~mars_hf.hub.card` (the model card),
:mod:`~mars_hf.hub.custom_generate` (the decoding code shipped for users without mars_hf),
:mod:`~mars_hf.hub.push` (the upload) and :mod:`~mars_hf.hub.export` (a vLLM drafter folder).
"""

from mars_hf.hub.card import (
    CARD_TAGS,
    MODEL_CARD_TEMPLATE,
    model_card_template_path,
    read_results_file,
    render_model_card,
)
from mars_hf.hub.custom_generate import CUSTOM_GENERATE_FILES, check_self_contained, write_custom_generate
from mars_hf.hub.push import HubTokenError, PushResult, push_to_hub, resolve_token
from mars_hf.hub.save import list_folder, save_pretrained
from mars_hf.models.adapters import save_mask_rows

# Loading has one definition (it knows every checkpoint format); the Hub helpers name it ``load``.
from mars_hf.models.modeling import load_mars_model as load

__all__ = [
    "CARD_TAGS",
    "CUSTOM_GENERATE_FILES",
    "MODEL_CARD_TEMPLATE",
    "HubTokenError",
    "PushResult",
    "check_self_contained",
    "list_folder",
    "load",
    "model_card_template_path",
    "push_to_hub",
    "read_results_file",
    "render_model_card",
    "resolve_token",
    "save_mask_rows",
    "save_pretrained",
    "write_custom_generate",
]
