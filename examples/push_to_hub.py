# /// script
# dependencies = [
#     "mars-hf",
# ]
# ///

"""
Publish a MARS checkpoint (full model or LoRA adapter) on the Hugging Face Hub, with a model card and a
`custom_generate/` folder so that people without mars_hf can decode with it too.

# Look first: write the folder and list what would be uploaded (no token needed)
```bash
python examples/push_to_hub.py \
    --model_name_or_path SmolLM2-135M-MARS \
    --repo_id your-name/SmolLM2-135M-Instruct-MARS-blk4 \
    --base_model HuggingFaceTB/SmolLM2-135M-Instruct \
    --dataset_name openai/gsm8k \
    --output_dir hub_folder --dry_run
```

# Push (token from `hf auth login` or the HF_TOKEN environment variable), as a pull request
```bash
python examples/push_to_hub.py --model_name_or_path SmolLM2-135M-MARS \
    --repo_id your-name/SmolLM2-135M-Instruct-MARS-blk4 --private --create_pr \
    --results_file results.json
```

`results.json` fills the card's speed/quality table: a list of rows such as
`{"tau": 0.9, "tokens_per_forward": 1.6, "quality": 0.41}`, or an object with `rows`,
`quality_metric` and `description`. The same as `mars-hf push`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from transformers import HfArgumentParser

from mars_hf import hub


@dataclass
class PushArguments:
    model_name_or_path: str = field(
        metadata={"help": "MARS checkpoint: local folder or Hub id (adapters too)."}
    )
    repo_id: str = field(metadata={"help": "Target Hub repository, `user/name`."})
    base_model: str | None = field(
        default=None, metadata={"help": "Hub id of the model it was fine-tuned from."}
    )
    dataset_name: list[str] = field(default_factory=list, metadata={"help": "Training dataset Hub id(s)."})
    license: str = field(default="apache-2.0", metadata={"help": "License of the card metadata."})
    results_file: str | None = field(default=None, metadata={"help": "JSON with the speed/quality table."})
    block_size: int | None = field(
        default=None, metadata={"help": "Only for checkpoints that do not record it."}
    )
    output_dir: str | None = field(
        default=None, metadata={"help": "Empty folder to write (default: temporary)."}
    )
    dry_run: bool = field(default=False, metadata={"help": "Write the folder and list it; upload nothing."})
    private: bool = field(default=False, metadata={"help": "Create the repository as private."})
    create_pr: bool = field(
        default=False, metadata={"help": "Open a pull request instead of pushing to main."}
    )
    commit_message: str | None = field(default=None, metadata={"help": "Commit message of the upload."})


def main(args: PushArguments) -> int:
    model, tokenizer = hub.load(args.model_name_or_path, block_size=args.block_size, enable=False)
    result = hub.push_to_hub(
        model,
        tokenizer,
        args.repo_id,
        private=args.private or None,
        create_pr=args.create_pr,
        commit_message=args.commit_message,
        dry_run=args.dry_run,
        save_dir=args.output_dir,
        base_model=args.base_model,
        datasets=args.dataset_name,
        license=args.license,
        **hub.read_results_file(args.results_file),
    )
    verb = "Would upload" if result.dry_run else "Uploaded"
    print(f"{verb} {len(result.files)} files from {result.folder} to {result.repo_id}:")
    for name in result.files:
        print(f"  {name}")
    return 0


if __name__ == "__main__":
    (arguments,) = HfArgumentParser(PushArguments).parse_args_into_dataclasses()
    sys.exit(main(arguments))
