"""Push a MARS checkpoint to the Hugging Face Hub: write the folder, then one ``upload_folder`` commit."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from mars_hf.hub.save import save_pretrained

logger = logging.getLogger(__name__)


class HubTokenError(OSError):
    """Pushing needs a Hugging Face token and none was found."""


@dataclass
class PushResult:
    """What :func:`push_to_hub` did: the folder it wrote, its files, and the commit (None on a dry run)."""

    repo_id: str
    folder: Path
    files: list[str] = field(default_factory=list)
    commit: object | None = None
    dry_run: bool = False


def resolve_token(token: str | None = None) -> str:
    """``token``, else huggingface_hub's (``HF_TOKEN`` or ``hf auth login``); never logged."""
    from huggingface_hub import get_token

    token = token or get_token()
    if not token:
        raise HubTokenError(
            "No Hugging Face token found. Run `hf auth login`, or set the HF_TOKEN environment variable to a "
            "token with write access (https://huggingface.co/settings/tokens), or use --dry-run."
        )
    return token


def push_to_hub(
    model,
    tokenizer,
    repo_id: str,
    *,
    private: bool | None = None,
    create_pr: bool = False,
    commit_message: str | None = None,
    token: str | None = None,
    revision: str | None = None,
    dry_run: bool = False,
    save_dir: str | os.PathLike | None = None,
    **save_kwargs,
) -> PushResult:
    """:func:`~mars_hf.hub.save_pretrained` into ``save_dir`` (default: a temporary folder), then
    ``HfApi.upload_folder``.

    With ``dry_run=True`` nothing is sent: the folder is written (kept at ``save_dir``, or a new
    temporary folder) and :attr:`PushResult.files` lists exactly what would be uploaded.
    """
    from huggingface_hub import HfApi

    if "/" not in repo_id:
        raise ValueError(f"repo_id must look like 'user/name', got {repo_id!r}.")
    token = None if dry_run else resolve_token(token)
    temporary = save_dir is None
    folder = Path(tempfile.mkdtemp(prefix="mars_hf_push_")) if temporary else Path(save_dir)
    try:
        files = save_pretrained(model, tokenizer, folder, repo_id=repo_id, **save_kwargs)
        if dry_run:
            return PushResult(repo_id=repo_id, folder=folder, files=files, dry_run=True)
        api = HfApi(token=token)
        api.create_repo(repo_id, private=private, exist_ok=True)
        commit = api.upload_folder(
            repo_id=repo_id,
            folder_path=folder,
            commit_message=commit_message or "Upload MARS checkpoint with mars_hf",
            revision=revision,
            create_pr=create_pr,
        )
        logger.info("Uploaded %d files to %s.", len(files), repo_id)
        return PushResult(repo_id=repo_id, folder=folder, files=files, commit=commit)
    finally:
        if temporary and not dry_run:
            shutil.rmtree(folder, ignore_errors=True)
