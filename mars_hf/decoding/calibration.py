"""Calibrated mask confidence: τ = 0.9 means "accept when >= 90 % likely to be the model's own token".

A trained checkpoint may carry ``config.mars["calibration"]`` (written by ``mars-hf calibrate`` or at
the end of ``mars-hf train``; fitted by ``mars_hf.training.calibration_fit``)::

    {"method": "isotonic", "offsets": [{"x": [...], "y": [...]}, ...],   # mask offsets 1..W
     "num_examples": ..., "num_samples": [...], "reliability": {...}, "condition": "..."}

Offset ``k`` is the ``k``-th mask of a step (prediction 0, the ordinary next-token prediction, is
always kept and never mapped). Its map is monotone, stored as knots and applied by piecewise-linear
interpolation (constant beyond the first and last knot). Decoding applies it to the ``probability``
confidence that τ is compared with, and to verify's proposal floor; ``entropy`` / ``margin`` are
left as they are. A checkpoint without a calibration decodes exactly as before. The maps are fitted
on greedy (argmax) predictions in float32; sampled decoding maps the sampled token's probability the
same way, an approximation.
"""

from __future__ import annotations

import bisect
import logging
from contextlib import contextmanager

logger = logging.getLogger(__name__)

CALIBRATION_KEY = "calibration"
CALIBRATION_METHODS = ("isotonic",)


def interpolate(xs: list[float], ys: list[float], value: float) -> float:
    """Piecewise-linear through the knots ``(xs[i], ys[i])`` (xs increasing), constant outside them."""
    if value <= xs[0]:
        return ys[0]
    if value >= xs[-1]:
        return ys[-1]
    i = bisect.bisect_right(xs, value)  # xs[i-1] <= value < xs[i]
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (value - x0) / (x1 - x0)


class ConfidenceCalibration:
    """Per-offset monotone maps read from ``config.mars["calibration"]``.

    Offsets beyond the fitted ones (decoding with a larger window than the calibration saw) map to
    0: nothing is known about how often those masks are right, so τ never accepts them and verify
    proposes them only with a floor of 0.
    """

    def __init__(self, record: dict):
        method = record.get("method")
        if method not in CALIBRATION_METHODS:
            raise ValueError(
                f"config.mars['calibration'] has method {method!r}; this version applies {CALIBRATION_METHODS}. "
                "Refit it with `mars-hf calibrate CHECKPOINT --data FILE.jsonl`, or delete the entry."
            )
        self.maps: list[tuple[list[float], list[float]]] = []
        for k, entry in enumerate(record.get("offsets") or [], start=1):
            xs, ys = [float(x) for x in entry["x"]], [float(y) for y in entry["y"]]
            if not xs or len(xs) != len(ys) or any(b <= a for a, b in zip(xs, xs[1:])):
                raise ValueError(
                    f"config.mars['calibration'] offset {k}: knots must be non-empty, paired and strictly "
                    "increasing in x; refit it with `mars-hf calibrate`."
                )
            self.maps.append((xs, ys))
        self.record = record

    @property
    def num_offsets(self) -> int:
        return len(self.maps)

    def apply(self, offset: int, value: float) -> float:
        """The calibrated confidence of mask ``offset`` (1-based) whose raw confidence is ``value``."""
        if offset < 1:
            return value
        if offset > len(self.maps):
            return 0.0
        xs, ys = self.maps[offset - 1]
        return interpolate(xs, ys, value)

    def apply_span(self, values: list, start: int, count: int, first_offset: int) -> None:
        """In place: ``values[start + i]`` is the confidence of offset ``first_offset + i``."""
        for i in range(count):
            values[start + i] = self.apply(first_offset + i, values[start + i])


def calibration_for(model, window: int | None = None) -> ConfidenceCalibration | None:
    """The model's calibration (``config.mars`` merged with ``enable_mars`` overrides), or None.

    An override ``calibration=None`` (see :func:`calibration_disabled`) turns it off for that model object.
    """
    mars = dict(getattr(model.config, "mars", None) or {})
    mars.update(getattr(model, "_mars_overrides", None) or {})
    record = mars.get(CALIBRATION_KEY)
    if not record:
        return None
    calibration = ConfidenceCalibration(record)
    if window is not None and window > calibration.num_offsets:
        logger.warning(
            "The confidence calibration covers mask offsets 1..%d but decoding uses W = %d: the masks beyond "
            "offset %d get confidence 0 (never accepted by τ).",
            calibration.num_offsets,
            window,
            calibration.num_offsets,
        )
    return calibration


@contextmanager
def calibration_disabled(model):
    """Decode with raw (uncalibrated) confidences inside the block, e.g. to compare τ curves."""
    overrides = getattr(model, "_mars_overrides", None)
    had = overrides is not None and CALIBRATION_KEY in overrides
    previous = overrides.get(CALIBRATION_KEY) if had else None
    model._mars_overrides = {**(overrides or {}), CALIBRATION_KEY: None}
    try:
        yield model
    finally:
        restored = dict(model._mars_overrides)
        if had:
            restored[CALIBRATION_KEY] = previous
        else:
            restored.pop(CALIBRATION_KEY, None)
        model._mars_overrides = restored
