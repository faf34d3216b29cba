"""``mars-hf push``: write a Hub-ready MARS folder (card, custom_generate/) and upload it."""

from __future__ import annotations

import argparse
import sys

HELP = "Push a MARS checkpoint (full model or LoRA adapter) to the Hugging Face Hub with a model card."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model", help="Local MARS checkpoint folder or Hub id (what `mars_hf.hub.load` takes)."
    )
    parser.add_argument(
        "--repo-id", required=True, help="Target repository, e.g. `user/SmolLM2-135M-MARS-blk4`."
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="Write the folder and list the files that would be uploaded; send nothing, need no token.",
    )
    parser.add_argument(
        "--output-dir",
        default=None,
        help="Where to write the folder (must be empty). Default: a temporary folder (kept on a dry run).",
    )
    parser.add_argument("--private", action="store_true", help="Create the repository as private.")
    parser.add_argument(
        "--create-pr", action="store_true", help="Open a pull request instead of committing to main."
    )
    parser.add_argument("--commit-message", default=None, help="Commit message of the upload.")
    parser.add_argument("--revision", default=None, help="Branch to push to (default: main).")
    parser.add_argument(
        "--block-size", type=int, default=None, help="Only for checkpoints that do not record it."
    )
    parser.add_argument(
        "--base-model", default=None, help="Hub id of the model this one was fine-tuned from."
    )
    parser.add_argument(
        "--dataset", action="append", default=None, help="Training dataset Hub id (repeatable)."
    )
    parser.add_argument("--license", default="apache-2.0", help="License identifier for the card metadata.")
    parser.add_argument(
        "--results",
        default=None,
        help="JSON file with the card's speed/quality table: a list of rows "
        '`{"tau": 0.9, "tokens_per_forward": 1.6, "quality": 0.41}` or an object with `rows`, '
        "`quality_metric` and `description`.",
    )


def run(args: argparse.Namespace) -> int:
    from mars_hf.hub import HubTokenError, load, push_to_hub, read_results_file, resolve_token

    try:
        if not args.dry_run:
            resolve_token()  # fail before loading anything
        model, tokenizer = load(args.model, block_size=args.block_size, enable=False)
        result = push_to_hub(
            model,
            tokenizer,
            args.repo_id,
            private=args.private or None,
            create_pr=args.create_pr,
            commit_message=args.commit_message,
            revision=args.revision,
            dry_run=args.dry_run,
            save_dir=args.output_dir,
            base_model=args.base_model,
            datasets=args.dataset,
            license=args.license,
            **read_results_file(args.results),
        )
    except (HubTokenError, FileExistsError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if result.dry_run:
        print(
            f"Dry run: wrote {len(result.files)} files to {result.folder}; would upload to {result.repo_id}:"
        )
    else:
        url = (
            getattr(result.commit, "pr_url", None)
            or getattr(result.commit, "commit_url", None)
            or result.repo_id
        )
        print(f"Uploaded {len(result.files)} files to {result.repo_id} ({url}):")
    for name in result.files:
        print(f"  {name}")
    return 0
