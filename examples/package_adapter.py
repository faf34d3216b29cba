"""Package a trained gated-adapter run for shipping inside mars_hf (`mars_hf/models/embedded_mars/`).

PEFT saves a full copy of the resized embedding and head next to the mask row's delta (265 MB for
SmolLM2-135M); the base model already has them, so the package keeps only the adapter's own tensors
(39 MB) and names its base ``embedded`` (resolved offline by `mars_hf.models.embedded_model`). The model
card (``README.md``) of the target folder is left as it is: it is written by hand from measurements.

Usage::

    python examples/package_adapter.py embedded-mars-run mars_hf/models/embedded_mars
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

COPIED = [
    "chat_template.jinja",
    "mars_config.json",
    "mars_mask_token.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
]
FROZEN_COPY_SUFFIX = "token_adapter.base_layer.weight"  # PEFT's copy of the frozen embedding / head


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="Output folder of `mars-hf train` (its final adapter).")
    parser.add_argument("target", type=Path, help="Folder to write (files are replaced, README.md kept).")
    args = parser.parse_args()

    args.target.mkdir(parents=True, exist_ok=True)
    weights = load_file(args.run_dir / "adapter_model.safetensors")
    kept = {
        name: tensor.contiguous() for name, tensor in weights.items() if not name.endswith(FROZEN_COPY_SUFFIX)
    }
    save_file(kept, args.target / "adapter_model.safetensors", metadata={"format": "pt"})
    config = json.loads((args.run_dir / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = "embedded"
    (args.target / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in COPIED:
        shutil.copyfile(args.run_dir / name, args.target / name)
    print(f"{args.target}: {len(kept)} of {len(weights)} adapter tensors kept")


if __name__ == "__main__":
    main()
