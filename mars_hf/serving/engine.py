"""What the scheduler needs from a decoder: rows added and dropped between MARS steps.

The scheduler is written against the small `Engine` protocol below, so that it can be tested with a
scripted engine and run on the real one, `DecoderEngine`, a thin adapter over the step-level
`mars_hf.generation.MARSBatchDecoder` (the decoding itself lives there, not here).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

ACCEPTANCE_CHOICES = ("probability", "entropy", "margin", "verify")


@dataclass
class RowSettings:
    """Per-request decoding settings (the fields of `mars_hf.generation.RowSettings`)."""

    threshold: float | None = 1.0
    acceptance: str = "probability"
    max_new_tokens: int = 128
    eos_token_ids: tuple[int, ...] = ()
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None


@dataclass
class RowUpdate:
    """New tokens of one row after a step; ``finish_reason`` is ``"stop"`` or ``"length"`` when finished."""

    row_id: int
    tokens: list[int]
    finished: bool = False
    finish_reason: str | None = None


class Engine(Protocol):
    """A batch of rows advanced one MARS step at a time (the `MARSBatchDecoder` interface)."""

    max_rows: int
    max_length: int

    def add_row(self, prompt_ids: list[int], settings: RowSettings) -> int: ...

    def step(self) -> list[RowUpdate]: ...

    def drop_row(self, row_id: int) -> None: ...

    def set_threshold(self, row_id: int, tau: float) -> None: ...

    @property
    def num_rows(self) -> int: ...

    @property
    def free_slots(self) -> int: ...

    @property
    def num_forwards(self) -> int: ...


_FINISH_REASONS = {
    "eos": "stop",
    "stop": "stop",
    "stop_string": "stop",
    "length": "length",
    "max_new_tokens": "length",
}


class DecoderEngine:
    """`Engine` over `mars_hf.generation.MARSBatchDecoder`: a fixed number of KV slots, reused by rows."""

    def __init__(self, model, *, max_rows: int = 8, max_length: int = 2048):
        try:
            from mars_hf.generation import MARSBatchDecoder
            from mars_hf.generation import RowSettings as DecoderRowSettings
        except ImportError as error:  # pragma: no cover - only before the step-level decoder exists
            raise ImportError(
                "Serving needs the step-level decoder `mars_hf.generation.MARSBatchDecoder`; update mars_hf."
            ) from error
        self._row_settings_class = DecoderRowSettings
        self._fields = {field.name for field in dataclasses.fields(DecoderRowSettings)}
        self.decoder = MARSBatchDecoder(model, max_rows=max_rows, max_length=max_length)
        self.max_rows = max_rows
        self.max_length = max_length

    def add_row(self, prompt_ids: list[int], settings: RowSettings) -> int:
        values = {k: v for k, v in dataclasses.asdict(settings).items() if k in self._fields}
        return self.decoder.add_row(list(prompt_ids), self._row_settings_class(**values))

    def step(self) -> list[RowUpdate]:
        updates = []
        for update in self.decoder.step():
            reason = update.finish_reason
            if update.finished:
                reason = _FINISH_REASONS.get(str(reason), str(reason) if reason else "stop")
            updates.append(RowUpdate(update.row_id, list(update.tokens), bool(update.finished), reason))
        return updates

    def drop_row(self, row_id: int) -> None:
        self.decoder.drop_row(row_id)

    def set_threshold(self, row_id: int, tau: float) -> None:
        self.decoder.set_threshold(row_id, tau)

    @property
    def num_rows(self) -> int:
        return self.decoder.num_rows

    @property
    def free_slots(self) -> int:
        return self.decoder.free_slots

    @property
    def num_forwards(self) -> int:
        return self.decoder.num_forwards
