"""Continuous batching at MARS-step granularity.

One thread owns the engine. Between two steps it drops rows whose client went away or whose deadline
passed, admits waiting requests into free slots (the engine prefills them in the next step), asks the
τ controller for the τ in force and hands it to every unpinned row, then runs one step and routes
each row's new tokens to its request's asyncio queue (thread-safe, on the request's event loop).
Finished rows leave at once, so their slot serves the next request; KV memory is the engine's fixed
slots, never grown per request.

A row the engine reports as failed (a `RowFailure`) ends its request alone with a JSON 500; only
an engine whose step raises fails every running row. Draining (SIGTERM): new requests get 503, queued
ones get 503 at once (both with ``Retry-After``), running rows go on for the grace period, then each
remaining request gets a 503 event (a JSON 503, or an SSE error event then ``[DONE]``).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field

from mars_hf.decoding.decoder import RowSettings
from mars_hf.serving.controller import TauController
from mars_hf.serving.engine import Engine, RowFailure
from mars_hf.serving.metrics import ServingMetrics

logger = logging.getLogger(__name__)
SHUTDOWN_RETRY_AFTER_S = 5  # what a 503 during shutdown tells clients (another instance, or this one back)


class QueueFull(Exception):
    """The waiting queue is at its bound (HTTP 429)."""


class ServerClosing(Exception):
    """The server is shutting down (HTTP 503)."""


@dataclass
class Tokens:
    tokens: list[int]


@dataclass
class Done:
    finish_reason: str


@dataclass
class Failed:
    status: int
    message: str
    retry_after: int | None = None


@dataclass(eq=False)
class GenerationRequest:
    """One request's row settings, its delivery queue and the statistics reported in ``usage``."""

    prompt_ids: list[int]
    settings: RowSettings
    pinned: bool
    timeout_s: float | None = None
    loop: asyncio.AbstractEventLoop | None = None
    queue: asyncio.Queue | None = None
    arrival: float = field(default_factory=time.monotonic)
    row_id: int | None = None
    started_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    cancelled: bool = False
    cancel_outcome: str = "cancelled"
    completion_tokens: int = 0
    steps: int = 0
    tau_sum: float = 0.0
    tau_steps: int = 0
    finish_reason: str | None = None
    # verify: drafts checked and kept per source ("masks", "lookup"), reported in ``usage``
    drafts: dict = field(default_factory=dict)

    @property
    def deadline(self) -> float | None:
        return None if self.timeout_s is None else self.arrival + self.timeout_s

    def bind(self) -> None:
        """Attach to the running event loop (the HTTP side calls this before submitting)."""
        self.loop = asyncio.get_running_loop()
        self.queue = asyncio.Queue()

    def deliver(self, event) -> None:
        if self.loop is None or self.queue is None:
            return
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    @property
    def tokens_per_forward(self) -> float | None:
        return self.completion_tokens / self.steps if self.steps else None

    @property
    def mean_tau(self) -> float | None:
        return self.tau_sum / self.tau_steps if self.tau_steps else None


class Scheduler:
    """Owns the engine on its own thread; the HTTP layer only calls `submit` and `cancel`."""

    def __init__(
        self,
        engine: Engine,
        controller: TauController,
        metrics: ServingMetrics | None = None,
        *,
        max_queue: int = 64,
        idle_poll_s: float = 0.05,
    ):
        self.engine = engine
        self.controller = controller
        self.metrics = metrics or ServingMetrics()
        self.max_queue = max_queue
        self.idle_poll_s = idle_poll_s
        self.waiting: collections.deque[GenerationRequest] = collections.deque()
        self.running: dict[int, GenerationRequest] = {}
        self.tau = controller.tau
        self._cond = threading.Condition()
        self._closing = False
        self._stop = False
        self._drain_deadline: float | None = None
        self._grace_s = 0.0
        self._drained = threading.Event()
        self._thread: threading.Thread | None = None
        self.metrics.slots.set(engine.max_rows)
        self.metrics.tau.set(self.tau)
        self.avg_latency_s = 1.0

    # ----- called from the HTTP side -----

    def submit(self, request: GenerationRequest) -> None:
        with self._cond:
            if self._closing:
                raise ServerClosing("the server is shutting down")
            if len(self.waiting) >= self.max_queue:
                raise QueueFull(
                    f"{len(self.waiting)} requests are already waiting (--max-queue {self.max_queue})"
                )
            self.waiting.append(request)
            self.metrics.queue_depth.set(len(self.waiting))
            self._cond.notify()

    def cancel(self, request: GenerationRequest, outcome: str = "cancelled") -> None:
        """Free the request's row at the next step boundary (client gone: "cancelled"; stop string: "ok")."""
        if request.finished_at is not None or request.cancelled:
            return
        request.cancel_outcome = outcome
        request.cancelled = True
        with self._cond:
            self._cond.notify()

    def retry_after_s(self) -> int:
        """A rough wait before retrying: the queue ahead divided by the slots, times a request's latency."""
        ahead = len(self.waiting) / max(1, self.engine.max_rows)
        return max(1, round(ahead * self.avg_latency_s))

    @property
    def closing(self) -> bool:
        return self._closing

    def is_running(self) -> bool:
        """Whether the scheduler thread is alive (started, and neither stopped nor crashed)."""
        return self._thread is not None and self._thread.is_alive()

    # ----- lifecycle -----

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="mars-scheduler", daemon=True)
        self._thread.start()

    def begin_drain(self, grace_s: float) -> None:
        """Stop admitting (new and queued requests get 503); running rows have ``grace_s`` to finish."""
        with self._cond:
            if self._closing:
                return
            self._closing = True
            self._grace_s = max(0.0, float(grace_s))
            self._drain_deadline = time.monotonic() + self._grace_s
            self._cond.notify()
        logger.info(
            "Draining: %d running, %d queued; running rows have %g s to finish.",
            len(self.running),
            len(self.waiting),
            self._grace_s,
        )

    def drain(self, grace_s: float, *, stuck_s: float = 30.0) -> bool:
        """`begin_drain`, then wait until every request has its answer (bounded: grace + ``stuck_s``).

        Returns False when the scheduler thread did not get there (a step that never returns).
        """
        self.begin_drain(grace_s)
        if not self.is_running():
            self._cancel_all("The server shut down before this request finished; retry it.")
            self._drained.set()
            return True
        with self._cond:
            grace = self._grace_s
        done = self._drained.wait(grace + stuck_s)
        if not done:
            logger.error("Drain: the scheduler did not finish within %g s of the grace period.", stuck_s)
        return done

    def shutdown(self, grace_s: float = 10.0) -> None:
        """Drain (see `drain`), then stop the scheduler thread."""
        self.drain(grace_s)
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)

    # ----- the loop -----

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self.waiting and not self.running and not self._stop:
                    self.metrics.idle()
                    self._cond.wait(self.idle_poll_s)
                if self._stop:
                    break
            now = time.monotonic()
            self._drop_cancelled_and_expired(now)
            if self._closing:
                self._drain_step(now)
            else:
                self._admit(now)
            if not self.running:
                self._set_tau(now)  # idle: τ keeps climbing back to τ_max
                continue
            self._set_tau(now)
            try:
                updates = self.engine.step()
            except Exception as error:  # the engine could not isolate the failing row(s)
                logger.error(
                    "A decoding step failed (%s: %s); failing the %d running requests.",
                    type(error).__name__,
                    error,
                    len(self.running),
                    exc_info=error,
                )
                for row_id, request in list(self.running.items()):
                    self._drop(row_id)
                    self._finish(request, Failed(500, "decoding failed on the server; see its log"), "error")
                continue
            self._route(updates, time.monotonic())
        self._cancel_all("The server shut down before this request finished; retry it.")

    def _drain_step(self, now: float) -> None:
        """While draining: queued requests get 503; past the deadline, so do the running ones."""
        with self._cond:
            queued = list(self.waiting)
            self.waiting.clear()
            self.metrics.queue_depth.set(0)
        for request in queued:
            message = "The server is shutting down; this request was not started. Retry it."
            self._finish(request, Failed(503, message, SHUTDOWN_RETRY_AFTER_S), "shutdown")
        if self.running and self._drain_deadline is not None and now >= self._drain_deadline:
            logger.info("Drain: ending %d rows still running after the grace period.", len(self.running))
            message = (
                "The server is shutting down and this request did not finish within its shutdown grace "
                f"period ({self._grace_s:g} s). Retry it."
            )
            for row_id, request in list(self.running.items()):
                self._drop(row_id)
                self._finish(request, Failed(503, message, SHUTDOWN_RETRY_AFTER_S), "shutdown")
        if not self.running:
            self._drained.set()

    def _drop(self, row_id: int) -> None:
        self.running.pop(row_id, None)
        self.metrics.running_rows.set(len(self.running))
        try:
            self.engine.drop_row(row_id)
        except (KeyError, ValueError):
            pass

    def _finish(self, request: GenerationRequest, event, outcome: str) -> None:
        request.finished_at = time.monotonic()
        self.metrics.requests.labels(outcome).inc()
        if isinstance(event, Done) and outcome == "ok":
            request.finish_reason = event.finish_reason
            latency = request.finished_at - request.arrival
            self.metrics.latency.observe(latency)
            self.avg_latency_s = 0.9 * self.avg_latency_s + 0.1 * latency
        request.deliver(event)

    def _drop_cancelled_and_expired(self, now: float) -> None:
        with self._cond:
            kept = collections.deque()
            for request in self.waiting:
                if request.cancelled:
                    self._finish(request, Done("cancelled"), request.cancel_outcome)
                elif request.deadline is not None and now > request.deadline:
                    self._finish(request, Failed(504, self._timeout_message(request)), "timeout")
                else:
                    kept.append(request)
            self.waiting = kept
            self.metrics.queue_depth.set(len(kept))
        for row_id, request in list(self.running.items()):
            if request.cancelled:
                self._drop(row_id)
                self._finish(request, Done("cancelled"), request.cancel_outcome)
            elif request.deadline is not None and now > request.deadline:
                self._drop(row_id)
                self._finish(request, Failed(504, self._timeout_message(request)), "timeout")

    @staticmethod
    def _timeout_message(request: GenerationRequest) -> str:
        return f"the request did not finish within the server's request timeout ({request.timeout_s:g} s)"

    def _admit(self, now: float) -> None:
        while True:
            with self._cond:
                if not self.waiting or self.engine.free_slots <= 0 or self._stop:
                    self.metrics.queue_depth.set(len(self.waiting))
                    return
                request = self.waiting.popleft()
            settings = request.settings
            if not request.pinned:
                settings = dataclasses.replace(settings, threshold=self.tau)
            try:
                row_id = self.engine.add_row(request.prompt_ids, settings)
            except ValueError as error:
                self._finish(request, Failed(400, str(error)), "bad_request")
                continue
            request.row_id = row_id
            request.started_at = now
            self.metrics.queue_wait.observe(now - request.arrival)
            self.running[row_id] = request
            self.metrics.running_rows.set(len(self.running))

    def _set_tau(self, now: float) -> None:
        with self._cond:
            depth = len(self.waiting)
            oldest = now - self.waiting[0].arrival if self.waiting else 0.0
        tau = self.controller.update(depth, oldest, now)
        self.metrics.pressure.set(self.controller.pressure)
        if tau != self.tau:
            self.tau = tau
            self.metrics.tau.set(tau)
        for row_id, request in self.running.items():
            if not request.pinned and request.settings.threshold != tau:
                self.engine.set_threshold(row_id, tau)
                request.settings.threshold = tau

    def _route(self, updates, now: float) -> None:
        rows_in_step = len(self.running)
        for request in self.running.values():
            request.steps += 1
            if request.settings.threshold is not None:
                request.tau_sum += request.settings.threshold
                request.tau_steps += 1
        emitted = 0
        for update in updates:
            request = self.running.get(update.row_id)
            if request is None:
                continue
            if isinstance(update, RowFailure):
                self._drop(update.row_id)
                kind = str(update.error).split(":", 1)[0]
                message = (
                    f"Decoding this request failed on the server ({kind}); the other requests were not "
                    "affected. See the server log."
                )
                self._finish(request, Failed(500, message), "error")
                continue
            proposed = update.drafts_proposed
            if proposed:
                accepted, source = update.drafts_accepted, update.draft_source
                counts = request.drafts.setdefault(source, {"proposed": 0, "accepted": 0})
                counts["proposed"] += proposed
                counts["accepted"] += accepted
                self.metrics.record_drafts(source, proposed, accepted)
            if update.tokens:
                if request.first_token_at is None:
                    request.first_token_at = now
                    self.metrics.ttft.observe(now - request.arrival)
                request.completion_tokens += len(update.tokens)
                emitted += len(update.tokens)
                request.deliver(Tokens(list(update.tokens)))
            if update.finished:
                self._drop(update.row_id)
                self._finish(request, Done(update.finish_reason or "stop"), "ok")
        self.metrics.record_step(emitted, rows_in_step, now)
        self.metrics.running_rows.set(len(self.running))

    def _cancel_all(self, message: str) -> None:
        with self._cond:
            pending = list(self.waiting) + list(self.running.values())
            self.waiting.clear()
        for row_id in list(self.running):
            self._drop(row_id)
        for request in pending:
            self._finish(request, Failed(503, message, SHUTDOWN_RETRY_AFTER_S), "shutdown")
        self.metrics.queue_depth.set(0)
        self.metrics.running_rows.set(0)
