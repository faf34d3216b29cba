"""What the scheduler needs from a decoder: rows added and dropped between MARS steps.

The scheduler is written against the small `Engine` protocol below, so that it can be tested with a
scripted engine and run on the real one, `DecoderEngine`, a thin adapter over the step-level
`mars_hf.decoding.decoder.MARSBatchDecoder` (the decoding itself lives there, not here). Rows travel
as the decoder's own `RowSettings` and come back as its `RowUpdate`s.

A step that raises is the engine's to contain: `DecoderEngine` finds the row(s) that make the model
fail and reports them as `RowFailure`s, so that one bad request never fails the others. An engine
whose ``step`` raises leaves the scheduler no choice but to fail every running row.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass
from typing import Protocol

import torch

from mars_hf.decoding.acceptance import POSITION_FREE_PROCESSORS, ScoreProcessing
from mars_hf.decoding.cpu_kernels import packed_linears
from mars_hf.decoding.decoder import MARSBatchDecoder, RowSettings, RowUpdate, sampling_processors
from mars_hf.decoding.memory import PlannerMemory
from mars_hf.decoding.sampling import draw_seed
from mars_hf.decoding.settings import MARSDecodingSettings, model_defaults
from mars_hf.serving.processors import model_processors, token_buffer, unapplied_settings

logger = logging.getLogger(__name__)


@dataclass
class RowFailure:
    """A row whose decoding failed: it is gone from the engine and its request gets an error.

    ``error`` names the exception (``"TypeName: message"``); clients are told only its type.
    """

    row_id: int
    error: str


class Engine(Protocol):
    """A batch of rows advanced one MARS step at a time (the `MARSBatchDecoder` interface)."""

    max_rows: int
    max_length: int
    mask_token_id: int | None  # refused in prompts (None: the engine reserves no token)

    def add_row(self, prompt_ids: list[int], settings: RowSettings) -> int: ...

    def step(self) -> list[RowUpdate | RowFailure]: ...

    def drop_row(self, row_id: int) -> None: ...

    def set_threshold(self, row_id: int, tau: float) -> None: ...

    @property
    def num_rows(self) -> int: ...

    @property
    def free_slots(self) -> int: ...

    @property
    def num_forwards(self) -> int: ...

    def kernels(self) -> contextlib.AbstractContextManager:
        """The context the scheduler's whole step loop runs in: what every step would otherwise set up and
        undo itself (the decoder's packed linears; `contextlib.nullcontext()` where there is nothing)."""
        ...


@dataclass
class _RowRecord:
    """What `DecoderEngine` needs to rebuild a row: its prompt, settings and the tokens it produced; and the
    processors of the decoder row it has now (their token buffer, if any, follows the kept tokens)."""

    prompt: list[int]
    settings: RowSettings
    generated: list[int] = dataclasses.field(default_factory=list)
    processing: ScoreProcessing | None = None

    def remaining(self):
        """The row as a fresh one: prompt + generated so far, and the tokens still allowed."""
        left = self.settings.max_new_tokens - len(self.generated)
        return self.prompt + self.generated, dataclasses.replace(self.settings, max_new_tokens=left)

    def keep(self, tokens: list[int]) -> None:
        """Tokens the row kept in a step; also written into the processors' token buffer, where a step may have
        left provisional tokens (drafts) at their columns and prefix-reading processors look next step."""
        buffer = self.processing.sequences if self.processing is not None else None
        if buffer is not None and tokens:
            start = len(self.prompt) + len(self.generated)
            buffer[0, start : start + len(tokens)] = torch.tensor(
                tokens, dtype=torch.long, device=buffer.device
            )
        self.generated += list(tokens)


class DecoderEngine:
    """`Engine` over `MARSBatchDecoder`: a fixed number of KV slots, reused by rows.

    The window, mask token and padding id come from the model (``config.mars``, its generation config).
    Every call into the decoder runs under ``torch.inference_mode()``: ``generate`` switches autograd off
    for its decoder, but a server drives the decoder directly, and with autograd on the in-place KV
    writes chain a graph through the cache that keeps every step's tensors alive (measured here: about
    1 MB more resident memory per served request on the synthetic model, flat under inference mode).

    A step that raises (a row past the model's positions, an input the model rejects, a fault) is
    isolated: the decoder's state after a failed step is not trusted, so every row is re-run alone
    from what it has produced so far (prompt + generated tokens, as a new row in a fresh decoder over
    the same KV buffer); a row that still raises alone is failed (a `RowFailure`), the others
    keep the step's tokens and continue in a rebuilt batch. A MARS row's next tokens depend only on
    its tokens so far, so greedy, τ and verify rows decode as they would have (a sampled row's draws are
    keyed to its seed and positions, and a request without a seed gets one when it is added, so it draws
    the same tokens too).

    The step planner's cost curves are measured for every batch bucket up to ``max_rows`` when the engine
    is built (``MARSBatchDecoder.measure_costs``), so that no request waits on a probe while serving; they and
    what the planner learns while serving live in the engine's own ``planner_memory`` (``PlannerMemory``).

    Every row gets the processors ``generate`` builds from the model's generation config (``suppress_tokens``:
    how MARS checkpoints keep their mask token out of outputs; ``begin_suppress_tokens``, ``bad_words_ids``;
    see `mars_hf.serving.processors`), then its request's sampling warpers.
    """

    def __init__(
        self,
        model,
        *,
        max_rows: int = 8,
        max_length: int = 2048,
        cache: str = "cursor",
        cpu_kernels: str = "auto",
        plan_tau: bool = False,
    ):
        mars = model_defaults(model)  # config.mars with enable_mars's overrides
        if "block_size" not in mars or "mask_token_id" not in mars:
            raise ValueError(
                "The model has no MARS metadata (config.mars with block_size and mask_token_id); load it with "
                "`mars_hf.AutoMARSModelForCausalLM` or `mars-hf serve` (which adds it)."
            )
        generation_config = model.generation_config
        eos = generation_config.eos_token_id
        eos = eos[0] if isinstance(eos, (list, tuple)) else eos
        pad = generation_config.pad_token_id if generation_config.pad_token_id is not None else eos
        self.mask_token_id = int(mars["mask_token_id"])
        self.model = model
        self.window = int(mars["block_size"])
        model_processors(
            generation_config, 1, model.device
        )  # a config transformers refuses fails here, not per row
        ignored = unapplied_settings(generation_config)
        if ignored:
            logger.warning(
                "The model's generation config sets %s; served requests do not get these (only its "
                "suppress_tokens, begin_suppress_tokens and bad_words_ids are applied, and each request's own "
                "sampling fields).",
                ", ".join(ignored),
            )
        # every row brings its own τ and acceptance (``RowSettings``): the decoder's settings carry none
        # the engine owns the planner's memory: measured once below, shared by every decoder it builds
        self.planner_memory = PlannerMemory()
        settings = MARSDecodingSettings(
            thresholds=(),
            window=self.window,
            mask_token_id=self.mask_token_id,
            cache=cache,
            cpu_kernels=cpu_kernels,
            cost_memory=self.planner_memory,
            planner=plan_tau,  # τ rows' mask groups sized by the planner (`--tau-window planned`), or W every step
        )
        self._make_decoder = lambda kv_cache=None: MARSBatchDecoder(
            model,
            settings,
            max_rows=max_rows,
            max_length=max_length,
            pad_token_id=int(pad if pad is not None else 0),
            kv_cache=kv_cache,
        )
        with torch.inference_mode():
            self.decoder = self._make_decoder()
            # every batch bucket's cost curve now (about 2 s each at most on a CPU), not at the first step
            # that needs it: there, a probe stalls every request in the batch, and a bucket first reached as
            # rows leave would borrow a larger batch's curve for the life of the server
            logger.info("Measuring MARS step costs for batches of up to %d rows", max_rows)
            self.decoder.measure_costs()
        self.max_rows = max_rows
        self.max_length = max_length
        self._rows: dict[int, _RowRecord] = {}
        self._next_row_id = 0
        self._retired_forwards = 0  # forwards of decoders replaced after a failed step
        self._logged_tracebacks: set[str] = set()

    def add_row(self, prompt_ids: list[int], settings: RowSettings) -> int:
        """Queue a row (prefilled in the next step); the decoder and the record each get their own copy
        of ``settings``, since τ is changed on both by `set_threshold`."""
        row_id = self._next_row_id  # ids are the engine's, so that a rebuilt decoder keeps them
        if settings.do_sample and settings.seed is None:  # the request's draws: its seed, row key 0
            settings = dataclasses.replace(settings, seed=draw_seed())
        record = _RowRecord(list(prompt_ids), dataclasses.replace(settings))
        with torch.inference_mode():
            self._place(self.decoder, row_id, record)
        self._next_row_id += 1
        self._rows[row_id] = record
        return row_id

    def _place(self, decoder: MARSBatchDecoder, row_id: int, record: _RowRecord) -> None:
        """Add ``record``'s row as it stands (prompt + tokens so far) to ``decoder``, with fresh processors."""
        tokens, settings = record.remaining()
        record.processing = self._processing(record, tokens, settings)
        decoder.add_row(tokens, settings, processing=record.processing, row_id=row_id)

    def _processing(self, record: _RowRecord, tokens: list[int], settings: RowSettings) -> ScoreProcessing:
        """The model's generation-config processors (as `generate` applies them), then the request's own; with
        a token buffer when one of them reads the prefix."""
        device = self.model.device
        processors = model_processors(self.model.generation_config, len(record.prompt), device)
        processors.extend(settings.logits_processor or sampling_processors(settings))
        if all(isinstance(p, POSITION_FREE_PROCESSORS) for p in processors):
            return ScoreProcessing(processors)
        # room for the new tokens and one step's provisional ones (masks' predictions or drafts)
        room = max(settings.max_new_tokens, 0) + self.window + (settings.prompt_lookup_num_tokens or 0) + 2
        return ScoreProcessing(processors, token_buffer(tokens, room, device))

    def kernels(self) -> contextlib.AbstractContextManager:
        """The decoder's linears routed to their kernels once for as long as the block lasts (a scheduler's
        life), not set up and undone by every step (1.4 ms a step for embedded-mars in float32). The decoder a
        failed step rebuilds is over the same model, so it keeps the routing."""
        return packed_linears(self.decoder.model, self.decoder.cpu_kernels)

    def step(self) -> list[RowUpdate | RowFailure]:
        try:
            with torch.inference_mode():
                updates = self.decoder.step()
        except Exception as error:
            return self._isolate(error)
        with torch.inference_mode():  # a token buffer is an inference tensor
            for update in updates:
                record = self._rows.get(update.row_id)
                if record is not None:
                    record.keep(update.tokens)
        return updates

    def _log_failure(self, what: str, error: Exception) -> None:
        """One line per failure; the traceback once per exception type (a bad row can repeat often)."""
        kind = type(error).__name__
        first = kind not in self._logged_tracebacks
        self._logged_tracebacks.add(kind)
        logger.error("%s (%s: %s)", what, kind, error, exc_info=error if first else None)

    def _isolate(self, error: Exception) -> list[RowUpdate | RowFailure]:
        """Re-run each row alone after a failed step; fail the rows that raise alone, keep the rest."""
        self._log_failure(
            f"A decoding step over {len(self._rows)} rows failed; re-running each row alone to find the "
            "failing one(s)",
            error,
        )
        kv = self.decoder.kv
        self._retired_forwards += self.decoder.num_forwards
        updates, survivors = [], []
        with torch.inference_mode():
            for row_id, record in list(self._rows.items()):
                probe = self._make_decoder(kv)
                try:
                    self._place(probe, row_id, record)
                    (update,) = probe.step()
                except Exception as row_error:
                    self._log_failure(f"Row {row_id} fails on its own; failing its request alone", row_error)
                    del self._rows[row_id]
                    updates.append(RowFailure(row_id, f"{type(row_error).__name__}: {row_error}"))
                    continue
                finally:
                    self._retired_forwards += probe.num_forwards
                record.keep(update.tokens)
                updates.append(update)
                if not update.finished:
                    survivors.append(row_id)
            self.decoder = self._make_decoder(kv)
            for row_id in survivors:
                self._place(self.decoder, row_id, self._rows[row_id])
        logger.warning(
            "After the failed step: %d row(s) failed, %d continue.",
            sum(1 for u in updates if isinstance(u, RowFailure)),
            len(survivors),
        )
        return updates

    def drop_row(self, row_id: int) -> None:
        self._rows.pop(row_id, None)
        with torch.inference_mode():
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
