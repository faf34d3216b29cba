"""A virtual environment with only torch and transformers, and a way to run a script in it.

Slow tests use it to prove that a checkpoint's ``custom_generate/`` decodes where mars_hf, peft and trl
are not installed (the ``bare_venv`` fixture lives in ``conftest.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def make_bare_venv(root: Path) -> Path:
    """Create the venv under ``root``; returns its python."""
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True)
    python = root / "bin" / "python"
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "torch==2.13.0", "transformers==5.24.0"],
        check=True,
        timeout=1500,
    )
    return python


def run_in_bare_venv(python: Path, script: str, args, tmp_path: Path, **env) -> dict:
    """Run ``script`` (offline, outside this checkout's environment); return the JSON of its last line."""
    (tmp_path / "run.py").write_text(script)
    environment = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    environment.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"), **env)
    run = subprocess.run(
        [str(python), str(tmp_path / "run.py"), *(str(a) for a in args)],
        cwd=tmp_path,
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])
