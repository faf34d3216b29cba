"""The source of a checkpoint's ``custom_generate/`` (see :mod:`mars_hf.hub.custom_generate`).

These files are copied into every saved checkpoint and run where mars_hf is not installed: they import only
torch, transformers, safetensors, the standard library and each other. Their ``sampling.py`` sibling is the
library's own ``mars_hf/decoding/sampling.py``, copied beside them when a checkpoint is written (so these modules
run from a written ``custom_generate/`` folder, not from here). This ``__init__`` is not shipped.
"""
