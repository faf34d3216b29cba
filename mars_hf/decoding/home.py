"""Where mars_hf keeps what it builds or converts on this machine: ``$MARS_HF_HOME``, else ``~/.cache/mars_hf``.

One definition for the package and the decoding files that ship in checkpoints (``custom_generate/home.py``;
standard library only), so the embedded model's converted copy, trained caches and the gated C kernel's
builds always land under the same folder. An empty ``MARS_HF_HOME`` counts as unset.
"""

from __future__ import annotations

import os
from pathlib import Path


def mars_hf_home() -> Path:
    return Path(os.environ.get("MARS_HF_HOME") or Path.home() / ".cache" / "mars_hf")
