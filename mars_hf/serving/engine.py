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


class DecoderEngine:
    """`Engine` over `mars_hf.generation.MARSBatchDecoder`: a fixed number of KV slots, reused by rows.

    The window, mask token and padding id come from the model (``config.mars``, its generation config).
    Every call into the decoder runs under ``torch.inference_mode()``: ``generate`` switches autograd off
    for its decoder, but a server drives the decoder directly, and with autograd on the in-place KV
    writes chain a graph through the cache that keeps every step's tensors alive (measured here: about
    1 MB more resident memory per served request on the synthetic model, flat under inference mode).
    """

    def __init__(self, model, *, max_rows: int = 8, max_length: int = 2048, cache: str = "cursor"):
        import torch

        from mars_hf.generation import MARSBatchDecoder
        from mars_hf.generation import RowSettings as DecoderRowSettings

        mars = dict(getattr(model.config, "mars", None) or {})
        mars.update(getattr(model, "_mars_overrides", None) or {})
        if "block_size" not in mars or "mask_token_id" not in mars:
            raise ValueError(
                "The model has no MARS metadata (config.mars with block_size and mask_token_id); load it with "
                "`mars_hf.AutoMARSModelForCausalLM` or `mars-hf serve` (which adds it)."
            )
        generation_config = model.generation_config
        eos = generation_config.eos_token_id
        eos = eos[0] if isinstance(eos, (list, tuple)) else eos
        pad = generation_config.pad_token_id if generation_config.pad_token_id is not None else eos
        self._no_grad = torch.inference_mode
        self._row_settings_class = DecoderRowSettings
        self._fields = {field.name for field in dataclasses.fields(DecoderRowSettings)}
        with self._no_grad():
            self.decoder = MARSBatchDecoder(
                model,
                max_rows=max_rows,
                max_length=max_length,
                window=int(mars["block_size"]),
                mask_token_id=int(mars["mask_token_id"]),
                pad_token_id=int(pad if pad is not None else 0),
                cache=cache,
            )
        self.max_rows = max_rows
        self.max_length = max_length

    def add_row(self, prompt_ids: list[int], settings: RowSettings) -> int:
        values = dataclasses.asdict(settings)
        unsupported = [k for k, v in values.items() if k not in self._fields and v is not None]
        if unsupported:
            raise ValueError(f"{unsupported} are not supported by this server's decoder; leave them out.")
        values = {k: v for k, v in values.items() if k in self._fields}
        with self._no_grad():
            return self.decoder.add_row(list(prompt_ids), self._row_settings_class(**values))

    def step(self) -> list[RowUpdate]:
        with self._no_grad():
            updates = self.decoder.step()
        return [
            RowUpdate(u.row_id, list(u.tokens), bool(u.finished), u.finish_reason if u.finished else None)
            for u in updates
        ]

    def drop_row(self, row_id: int) -> None:
        with self._no_grad():
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
