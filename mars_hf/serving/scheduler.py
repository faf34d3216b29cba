"""Continuous batching at MARS-step granularity.

One thread owns the engine. Between two steps it drops rows whose client went away or whose deadline
passed, admits waiting requests into free slots (the engine prefills them in the next step), asks the
τ controller for the τ in force and hands it to every unpinned row, then runs one step and routes
each row's new tokens to its request's asyncio queue (thread-safe, on the request's event loop).
Finished rows leave at once, so their slot serves the next request; KV memory is the engine's fixed
slots, never grown per request.

The parts: `WaitingQueue` (admission: the bounded queue the HTTP side submits to), `Scheduler`'s step
loop (sweep, admit, τ, step, route) and its drain.

A row the engine reports as failed (a `RowFailure`) ends its request alone with a JSON 500; only
an engine whose step raises fails every running row. Draining (SIGTERM): new requests get 503, queued
ones get 503 at once (both with ``Retry-After``), running rows go on for the grace period, then each
remaining request gets a 503 event (a JSON 503, or an SSE error event then ``[DONE]``).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable

from mars_hf.decoding.decoder import RowSettings, RowUpdate
from mars_hf.serving.controller import TauController
from mars_hf.serving.engine import Engine, RowFailure
from mars_hf.serving.metrics import ServingMetrics
from mars_hf.serving.request import Done, Failed, GenerationRequest, Tokens

logger = logging.getLogger(__name__)
SHUTDOWN_RETRY_AFTER_S = 5  # what a 503 during shutdown tells clients (another instance, or this one back)
SHUTDOWN_MESSAGE = "The server shut down before this request finished; retry it."


class QueueFull(Exception):
    """The waiting queue is at its bound (HTTP 429)."""


class ServerClosing(Exception):
    """The server is shutting down (HTTP 503)."""


class WaitingQueue:
    """Requests waiting for a slot: bounded, closed for good when the server drains.

    Shared by the HTTP side (`put`) and the scheduler thread (everything else); its condition is also
    the thread's doorbell (`ring`, `wait`), so that a request or a cancel wakes an idle scheduler.
    """

    def __init__(self, max_size: int, metrics: ServingMetrics):
        self.max_size = max_size
        self.metrics = metrics
        self.closed = False
        self._requests: collections.deque[GenerationRequest] = collections.deque()
        self._cond = threading.Condition()

    def __len__(self) -> int:
        return len(self._requests)

    def put(self, request: GenerationRequest) -> None:
        with self._cond:
            if self.closed:
                raise ServerClosing("the server is shutting down")
            if len(self._requests) >= self.max_size:
                raise QueueFull(
                    f"{len(self._requests)} requests are already waiting (--max-queue {self.max_size})"
                )
            self._requests.append(request)
            self._publish()
            self._cond.notify()

    def pop(self) -> GenerationRequest | None:
        """The oldest waiting request, or None."""
        with self._cond:
            request = self._requests.popleft() if self._requests else None
            self._publish()
            return request

    def remove_where(self, ended: Callable[[GenerationRequest], bool]) -> None:
        """Remove the requests for which ``ended`` (which answers them) returns True."""
        with self._cond:
            self._requests = collections.deque(r for r in self._requests if not ended(r))
            self._publish()

    def close(self) -> list[GenerationRequest]:
        """Refuse every later `put`; returns (and removes) the requests still waiting."""
        with self._cond:
            self.closed = True
            waiting = list(self._requests)
            self._requests.clear()
            self._publish()
            self._cond.notify()
            return waiting

    def oldest_wait(self, now: float) -> float:
        with self._cond:
            return now - self._requests[0].arrival if self._requests else 0.0

    def wait(self, timeout_s: float, *, unless: Callable[[], bool]) -> None:
        """Sleep until a request arrives, `ring` is called or ``timeout_s`` passes (not if ``unless()``)."""
        with self._cond:
            if not self._requests and not unless():
                self._cond.wait(timeout_s)

    def ring(self) -> None:
        with self._cond:
            self._cond.notify()

    def _publish(self) -> None:
        self.metrics.queue_depth.set(len(self._requests))


class RunningRows:
    """The batch: rows in the engine and the requests they answer.

    A request takes a slot (`add`), gets each step's tokens (`route`) and leaves when its row finishes or
    fails, or when the scheduler ends it (`end`); `finish` answers any request and counts its outcome.
    Used by the scheduler thread only.
    """

    def __init__(self, engine: Engine, metrics: ServingMetrics):
        self.engine = engine
        self.metrics = metrics
        self.requests: dict[int, GenerationRequest] = {}
        self.avg_latency_s = 1.0  # of requests that finished, for `Scheduler.retry_after_s`

    def __len__(self) -> int:
        return len(self.requests)

    def add(self, request: GenerationRequest, settings: RowSettings, now: float) -> None:
        """Give ``request`` a row; raises ValueError when the engine refuses its settings."""
        row_id = self.engine.add_row(request.prompt_ids, settings)
        request.row_id = row_id
        request.started_at = now
        self.metrics.queue_wait.observe(now - request.arrival)
        self.requests[row_id] = request
        self.metrics.running_rows.set(len(self.requests))

    def set_threshold(self, tau: float) -> None:
        """Hand τ to every row whose request did not pin its own."""
        for row_id, request in self.requests.items():
            if not request.pinned and request.settings.threshold != tau:
                self.engine.set_threshold(row_id, tau)
                request.settings.threshold = tau

    def route(self, updates: list[RowUpdate | RowFailure], now: float) -> None:
        """Hand each row's update to its request; count the step in the metrics."""
        rows_in_step = len(self.requests)
        for request in self.requests.values():
            request.record_step()
        emitted = sum(self._deliver(update, now) for update in updates)
        self.metrics.record_step(emitted, rows_in_step, now)
        self.metrics.running_rows.set(len(self.requests))

    def _deliver(self, update: RowUpdate | RowFailure, now: float) -> int:
        """One row's update to its request (tokens, then the end if it ended); returns the tokens sent."""
        request = self.requests.get(update.row_id)
        if request is None:
            return 0
        if isinstance(update, RowFailure):
            kind = update.error.split(":", 1)[0]
            message = (
                f"Decoding this request failed on the server ({kind}); the other requests were not "
                "affected. See the server log."
            )
            self.end(update.row_id, Failed(500, message), "error")
            return 0
        if update.drafts_proposed:
            request.record_drafts(update.draft_source, update.drafts_proposed, update.drafts_accepted)
            self.metrics.record_drafts(update.draft_source, update.drafts_proposed, update.drafts_accepted)
        if update.tokens:
            if request.first_token_at is None:
                request.first_token_at = now
                self.metrics.ttft.observe(now - request.arrival)
            request.record_tokens(len(update.tokens))
            request.deliver(Tokens(list(update.tokens), request.progress))
        if update.finished:
            self.end(update.row_id, Done(update.finish_reason or "stop"), "ok")
        return len(update.tokens)

    def end(self, row_id: int, event, outcome: str) -> None:
        """Free the row and answer its request with ``event``."""
        request = self.requests.get(row_id)
        self.drop(row_id)
        if request is not None:
            self.finish(request, event, outcome)

    def end_all(self, event, outcome: str) -> None:
        for row_id in list(self.requests):
            self.end(row_id, event, outcome)

    def drop(self, row_id: int) -> None:
        """Free the row (its request is answered separately)."""
        self.requests.pop(row_id, None)
        self.metrics.running_rows.set(len(self.requests))
        try:
            self.engine.drop_row(row_id)
        except (KeyError, ValueError):
            pass

    def finish(self, request: GenerationRequest, event, outcome: str) -> None:
        """Deliver the request's last event and count its outcome (and its latency when it succeeded)."""
        request.finished_at = time.monotonic()
        self.metrics.requests.labels(outcome).inc()
        if isinstance(event, Done) and outcome == "ok":
            request.finish_reason = event.finish_reason
            latency = request.finished_at - request.arrival
            self.metrics.latency.observe(latency)
            self.avg_latency_s = 0.9 * self.avg_latency_s + 0.1 * latency
        request.deliver(event)


class Scheduler:
    """Owns the engine on its own thread; the HTTP layer only calls `submit` and `cancel`.

    Between two steps the thread sweeps cancelled and timed-out requests, admits waiting ones into free
    slots (`WaitingQueue` → `RunningRows`), hands the controller's τ to unpinned rows, then steps.
    """

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
        self.idle_poll_s = idle_poll_s
        self.waiting = WaitingQueue(max_queue, self.metrics)
        self.rows = RunningRows(engine, self.metrics)
        self.tau = controller.tau
        self._stop = False
        self._drain_lock = threading.Lock()
        self._drain_deadline: float | None = None
        self._grace_s = 0.0
        self._drained = threading.Event()
        self._thread: threading.Thread | None = None
        self.metrics.slots.set(engine.max_rows)
        self.metrics.tau.set(self.tau)

    @property
    def running(self) -> dict[int, GenerationRequest]:
        """The requests with a row in the engine, by row id."""
        return self.rows.requests

    # ----- called from the HTTP side -----

    def submit(self, request: GenerationRequest) -> None:
        """Queue ``request``; raises `QueueFull` (429) or `ServerClosing` (503)."""
        self.waiting.put(request)

    def cancel(self, request: GenerationRequest, outcome: str = "cancelled") -> None:
        """Free the request's row at the next step boundary (client gone: "cancelled"; stop string: "ok")."""
        if request.finished_at is not None or request.cancelled:
            return
        request.cancel_outcome = outcome
        request.cancelled = True
        self.waiting.ring()

    def retry_after_s(self) -> int:
        """A rough wait before retrying: the queue ahead divided by the slots, times a request's latency."""
        ahead = len(self.waiting) / max(1, self.engine.max_rows)
        return max(1, round(ahead * self.rows.avg_latency_s))

    @property
    def closing(self) -> bool:
        return self.waiting.closed

    def is_running(self) -> bool:
        """Whether the scheduler thread is alive (started, and neither stopped nor crashed)."""
        return self._thread is not None and self._thread.is_alive()

    # ----- the step loop -----

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="mars-scheduler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with self.engine.kernels():  # the engine's per-step setup, done once for the thread's life
            while True:
                if not self.rows and not self.waiting:
                    self.metrics.idle()
                    self.waiting.wait(self.idle_poll_s, unless=lambda: self._stop)
                if self._stop:
                    break
                self._turn(time.monotonic())
        self._cancel_all(SHUTDOWN_MESSAGE)

    def _turn(self, now: float) -> None:
        """One step boundary: sweep, admit (or drain), hand out τ, then one step if any row runs."""
        self._drop_cancelled_and_expired(now)
        if self.closing:
            self._drain_step(now)
        else:
            self._admit(now)
        self._set_tau(now)  # also while idle: τ keeps climbing back to τ_max
        if not self.rows:
            return
        try:
            updates = self.engine.step()
        except Exception as error:  # the engine could not isolate the failing row(s)
            logger.error(
                "A decoding step failed (%s: %s); failing the %d running requests.",
                type(error).__name__,
                error,
                len(self.rows),
                exc_info=error,
            )
            self.rows.end_all(Failed(500, "decoding failed on the server; see its log"), "error")
            return
        self.rows.route(updates, time.monotonic())

    def _drop_cancelled_and_expired(self, now: float) -> None:
        self.waiting.remove_where(lambda request: self._end_if_over(request, now))
        for row_id, request in list(self.rows.requests.items()):
            if request.cancelled or self._expired(request, now):
                self.rows.drop(row_id)
                self._end_if_over(request, now)

    def _end_if_over(self, request: GenerationRequest, now: float) -> bool:
        """Answer a cancelled or timed-out request; False (untouched) otherwise."""
        if request.cancelled:
            self.rows.finish(request, Done("cancelled"), request.cancel_outcome)
        elif self._expired(request, now):
            message = (
                f"the request did not finish within the server's request timeout ({request.timeout_s:g} s)"
            )
            self.rows.finish(request, Failed(504, message), "timeout")
        else:
            return False
        return True

    @staticmethod
    def _expired(request: GenerationRequest, now: float) -> bool:
        return request.deadline is not None and now > request.deadline

    def _admit(self, now: float) -> None:
        """Fill free slots from the queue; unpinned rows start at the τ in force."""
        while self.engine.free_slots > 0 and not self._stop:
            request = self.waiting.pop()
            if request is None:
                return
            settings = request.settings
            if not request.pinned:
                settings = dataclasses.replace(settings, threshold=self.tau)
            try:
                self.rows.add(request, settings, now)
            except ValueError as error:
                self.rows.finish(request, Failed(400, str(error)), "bad_request")

    def _set_tau(self, now: float) -> None:
        """Ask the controller for τ under the current queue and hand it to every unpinned row."""
        tau = self.controller.update(len(self.waiting), self.waiting.oldest_wait(now), now)
        self.metrics.pressure.set(self.controller.pressure)
        if tau != self.tau:
            self.tau = tau
            self.metrics.tau.set(tau)
        self.rows.set_threshold(tau)

    # ----- draining and shutdown -----

    def begin_drain(self, grace_s: float) -> None:
        """Stop admitting (new and queued requests get 503); running rows have ``grace_s`` to finish."""
        with self._drain_lock:
            if self.closing:
                return
            self._grace_s = max(0.0, float(grace_s))
            self._drain_deadline = time.monotonic() + self._grace_s
            queued = self.waiting.close()
        message = "The server is shutting down; this request was not started. Retry it."
        for request in queued:
            self.rows.finish(request, Failed(503, message, SHUTDOWN_RETRY_AFTER_S), "shutdown")
        logger.info(
            "Draining: %d running, %d queued; running rows have %g s to finish.",
            len(self.rows),
            len(queued),
            self._grace_s,
        )

    def drain(self, grace_s: float, *, stuck_s: float = 30.0) -> bool:
        """`begin_drain`, then wait until every request has its answer (bounded: grace + ``stuck_s``).

        Returns False when the scheduler thread did not get there (a step that never returns).
        """
        self.begin_drain(grace_s)
        if not self.is_running():
            self._cancel_all(SHUTDOWN_MESSAGE)
            self._drained.set()
            return True
        done = self._drained.wait(self._grace_s + stuck_s)
        if not done:
            logger.error("Drain: the scheduler did not finish within %g s of the grace period.", stuck_s)
        return done

    def shutdown(self, grace_s: float = 10.0) -> None:
        """Drain (see `drain`), then stop the scheduler thread."""
        self.drain(grace_s)
        self._stop = True
        self.waiting.ring()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _drain_step(self, now: float) -> None:
        """While draining, past the deadline: the rows still running get 503."""
        if self.rows and self._drain_deadline is not None and now >= self._drain_deadline:
            logger.info("Drain: ending %d rows still running after the grace period.", len(self.rows))
            message = (
                "The server is shutting down and this request did not finish within its shutdown grace "
                f"period ({self._grace_s:g} s). Retry it."
            )
            self.rows.end_all(Failed(503, message, SHUTDOWN_RETRY_AFTER_S), "shutdown")
        if not self.rows:
            self._drained.set()

    def _cancel_all(self, message: str) -> None:
        event = Failed(503, message, SHUTDOWN_RETRY_AFTER_S)
        for request in self.waiting.close():
            self.rows.finish(request, event, "shutdown")
        self.rows.end_all(event, "shutdown")
