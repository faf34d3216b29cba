"""What the scheduler needs from a decoder: rows added and dropped between MARS steps.

The scheduler is written against the small `Engine` protocol below, so that it can be tested with a
scripted engine and run on the real one, `DecoderEngine`, a thin adapter over the step-level
`mars_hf.decoding.generation.MARSBatchDecoder` (the decoding itself lives there, not here).

A step that raises is the engine's to contain: `DecoderEngine` finds the row(s) that make the model
fail and reports them as failed `RowUpdate`s (``error`` set), so that one bad request never fails the
others. An engine whose ``step`` raises leaves the scheduler no choice but to fail every running row.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Protocol

logger = logging.getLogger(__name__)

ACCEPTANCE_CHOICES = ("probability", "entropy", "margin", "verify")


@dataclass
class RowSettings:
    """Per-request decoding settings (the fields of `mars_hf.decoding.generation.RowSettings`)."""

    threshold: float | None = 1.0
    acceptance: str = "probability"
    max_new_tokens: int = 128
    eos_token_ids: tuple[int, ...] = ()
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    prompt_lookup_num_tokens: int | None = None  # verify only: prompt-lookup drafts too
    max_matching_ngram_size: int = 2


@dataclass
class RowUpdate:
    """New tokens of one row after a step; ``finish_reason`` is ``"stop"`` or ``"length"`` when finished.

    ``error`` set: decoding this row failed (the row is gone from the engine; its request gets an error).
    """

    row_id: int
    tokens: list[int]
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    drafts_proposed: int = 0  # verify: drafts checked this step, from ``draft_source``
    drafts_accepted: int = 0
    draft_source: str = "masks"  # "masks" or "lookup"


class Engine(Protocol):
    """A batch of rows advanced one MARS step at a time (the `MARSBatchDecoder` interface)."""

    max_rows: int
    max_length: int
    mask_token_id: int | None  # refused in prompts (None: the engine reserves no token)

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


@dataclass
class _RowRecord:
    """What `DecoderEngine` needs to rebuild a row: its prompt, settings and the tokens it produced."""

    prompt: list[int]
    settings: object  # mars_hf.decoding.decoder.RowSettings
    generated: list[int] = dataclasses.field(default_factory=list)

    def remaining(self):
        """The row as a fresh one: prompt + generated so far, and the tokens still allowed."""
        left = self.settings.max_new_tokens - len(self.generated)
        return self.prompt + self.generated, dataclasses.replace(self.settings, max_new_tokens=left)


class DecoderEngine:
    """`Engine` over `mars_hf.decoding.generation.MARSBatchDecoder`: a fixed number of KV slots, reused by rows.

    The window, mask token and padding id come from the model (``config.mars``, its generation config).
    Every call into the decoder runs under ``torch.inference_mode()``: ``generate`` switches autograd off
    for its decoder, but a server drives the decoder directly, and with autograd on the in-place KV
    writes chain a graph through the cache that keeps every step's tensors alive (measured here: about
    1 MB more resident memory per served request on the synthetic model, flat under inference mode).

    A step that raises (a row past the model's positions, an input the model rejects, a fault) is
    isolated: the decoder's state after a failed step is not trusted, so every row is re-run alone
    from what it has produced so far (prompt + generated tokens, as a new row in a fresh decoder over
    the same KV buffer); a row that still raises alone is failed (an ``error`` update), the others
    keep the step's tokens and continue in a rebuilt batch. A MARS row's next tokens depend only on
    its tokens so far, so greedy, τ and verify rows decode as they would have (a sampled row's random
    stream is re-seeded from its seed, so it stays a valid sample but not the one it would have drawn).
    """

    def __init__(self, model, *, max_rows: int = 8, max_length: int = 2048, cache: str = "cursor"):
        import torch

        from mars_hf.decoding.generation import MARSBatchDecoder
        from mars_hf.decoding.generation import RowSettings as DecoderRowSettings

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
        self.mask_token_id = int(mars["mask_token_id"])
        self._make_decoder = lambda kv_cache=None: MARSBatchDecoder(
            model,
            max_rows=max_rows,
            max_length=max_length,
            window=int(mars["block_size"]),
            mask_token_id=self.mask_token_id,
            pad_token_id=int(pad if pad is not None else 0),
            cache=cache,
            kv_cache=kv_cache,
        )
        with self._no_grad():
            self.decoder = self._make_decoder()
        self.max_rows = max_rows
        self.max_length = max_length
        self._rows: dict[int, _RowRecord] = {}
        self._next_row_id = 0
        self._retired_forwards = 0  # forwards of decoders replaced after a failed step
        self._logged_tracebacks: set[str] = set()

    def add_row(self, prompt_ids: list[int], settings: RowSettings) -> int:
        values = dataclasses.asdict(settings)
        unsupported = [k for k, v in values.items() if k not in self._fields and v is not None]
        if unsupported:
            raise ValueError(f"{unsupported} are not supported by this server's decoder; leave them out.")
        values = {k: v for k, v in values.items() if k in self._fields}
        decoder_settings = self._row_settings_class(**values)
        row_id = self._next_row_id  # ids are the engine's, so that a rebuilt decoder keeps them
        with self._no_grad():
            self.decoder.add_row(list(prompt_ids), decoder_settings, row_id=row_id)
        self._next_row_id += 1
        self._rows[row_id] = _RowRecord(list(prompt_ids), dataclasses.replace(decoder_settings))
        return row_id

    def step(self) -> list[RowUpdate]:
        try:
            with self._no_grad():
                updates = self.decoder.step()
        except Exception as error:
            return self._isolate(error)
        out = []
        for u in updates:
            record = self._rows.get(u.row_id)
            if record is not None:
                record.generated += list(u.tokens)
            out.append(
                RowUpdate(
                    u.row_id,
                    list(u.tokens),
                    bool(u.finished),
                    u.finish_reason if u.finished else None,
                    drafts_proposed=u.drafts_proposed,
                    drafts_accepted=u.drafts_accepted,
                    draft_source=u.draft_source,
                )
            )
        return out

    def _log_failure(self, what: str, error: Exception) -> None:
        """One line per failure; the traceback once per exception type (a bad row can repeat often)."""
        kind = type(error).__name__
        first = kind not in self._logged_tracebacks
        self._logged_tracebacks.add(kind)
        logger.error("%s (%s: %s)", what, kind, error, exc_info=error if first else None)

    def _isolate(self, error: Exception) -> list[RowUpdate]:
        """Re-run each row alone after a failed step; fail the rows that raise alone, keep the rest."""
        self._log_failure(
            f"A decoding step over {len(self._rows)} rows failed; re-running each row alone to find the "
            "failing one(s)",
            error,
        )
        kv = self.decoder.kv
        self._retired_forwards += self.decoder.num_forwards
        updates, survivors = [], []
        with self._no_grad():
            for row_id, record in list(self._rows.items()):
                probe = self._make_decoder(kv)
                prompt, settings = record.remaining()
                try:
                    probe.add_row(prompt, settings, row_id=row_id)
                    (update,) = probe.step()
                except Exception as row_error:
                    self._log_failure(f"Row {row_id} fails on its own; failing its request alone", row_error)
                    del self._rows[row_id]
                    updates.append(
                        RowUpdate(row_id, [], True, "error", error=f"{type(row_error).__name__}: {row_error}")
                    )
                    continue
                finally:
                    self._retired_forwards += probe.num_forwards
                record.generated += list(update.tokens)
                updates.append(
                    RowUpdate(row_id, list(update.tokens), bool(update.finished), update.finish_reason)
                )
                if not update.finished:
                    survivors.append(row_id)
            self.decoder = self._make_decoder(kv)
            for row_id in survivors:
                prompt, settings = self._rows[row_id].remaining()
                self.decoder.add_row(prompt, settings, row_id=row_id)
        logger.warning(
            "After the failed step: %d row(s) failed, %d continue.",
            sum(1 for u in updates if u.error),
            len(survivors),
        )
        return updates

    def drop_row(self, row_id: int) -> None:
        self._rows.pop(row_id, None)
        with self._no_grad():
            try:
                self.decoder.drop_row(row_id)
            except KeyError:  # already gone (finished inside a failed step's re-run, or failed)
                pass

    def set_threshold(self, row_id: int, tau: float) -> None:
        self.decoder.set_threshold(row_id, tau)
        record = self._rows.get(row_id)
        if record is not None:
            record.settings.threshold = tau

    @property
    def num_rows(self) -> int:
        return self.decoder.num_rows

    @property
    def free_slots(self) -> int:
        return self.decoder.free_slots

    @property
    def num_forwards(self) -> int:
        return self._retired_forwards + self.decoder.num_forwards
