"""Local ``evaluate`` metric modules (the Hub's metric scripts cannot be downloaded here).

Load one with :func:`mars_hf.evaluation.metrics.load_metric` (``evaluate.load`` on the folder's path)."""

from __future__ import annotations

from pathlib import Path

METRICS_DIR = Path(__file__).parent
METRIC_NAMES = ("token_agreement", "tokens_per_forward", "code_pass_at_k")


def metric_path(name: str) -> str:
    """Local path of the metric script ``name`` (one of :data:`METRIC_NAMES`)."""
    if name not in METRIC_NAMES:
        raise ValueError(f"Unknown metric {name!r}; choose one of {', '.join(METRIC_NAMES)}.")
    return str(METRICS_DIR / name / f"{name}.py")


def load_metric(name: str, **kwargs):
    """``evaluate.load`` of a local metric script: works offline."""
    import evaluate

    return evaluate.load(metric_path(name), **kwargs)
