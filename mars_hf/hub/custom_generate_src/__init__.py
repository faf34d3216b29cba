"""The source of a checkpoint's ``custom_generate/`` (see :mod:`mars_hf.hub.custom_generate`).

These files are copied into every saved checkpoint and run where mars_hf is not installed: they import only
torch, transformers, safetensors, the standard library and each other. This ``__init__`` is not shipped.
"""
