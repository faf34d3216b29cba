"""Prometheus metrics of one server (own registry, so several servers can live in one process, e.g. tests)."""

from __future__ import annotations

import collections
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
RATE_WINDOW_S = 10.0


class ServingMetrics:
    """Gauges, counters and histograms the scheduler and the HTTP layer update."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        self.registry = registry = CollectorRegistry()
        self.queue_depth = Gauge("mars_queue_depth", "Requests waiting for a slot.", registry=registry)
        self.running_rows = Gauge("mars_running_rows", "Rows in the running batch.", registry=registry)
        self.slots = Gauge("mars_slots", "KV slots (maximum running rows).", registry=registry)
        self.tau = Gauge(
            "mars_threshold", "τ the controller has in force for unpinned rows.", registry=registry
        )
        self.pressure = Gauge(
            "mars_controller_pressure", "Load pressure seen by the controller (0-1).", registry=registry
        )
        self.tokens_per_second = Gauge(
            "mars_output_tokens_per_second",
            f"Output tokens per second over the last {RATE_WINDOW_S:g} s.",
            registry=registry,
        )
        self.tokens_per_forward = Gauge(
            "mars_tokens_per_forward",
            f"Tokens a row gained per forward (step), averaged over the last {RATE_WINDOW_S:g} s.",
            registry=registry,
        )
        self.output_tokens = Counter("mars_output_tokens", "Output tokens generated.", registry=registry)
        self.forwards = Counter("mars_forwards", "Batch forwards (MARS steps) run.", registry=registry)
        self.requests = Counter("mars_requests", "Requests by outcome.", ["outcome"], registry=registry)
        self.drafts_proposed = Counter(
            "mars_drafts_proposed",
            "Drafts verify checked, by source (masks, lookup).",
            ["source"],
            registry=registry,
        )
        self.drafts_accepted = Counter(
            "mars_drafts_accepted",
            "Drafts verify kept, by source (masks, lookup).",
            ["source"],
            registry=registry,
        )
        self.ttft = Histogram(
            "mars_time_to_first_token_seconds",
            "Arrival to first token.",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.latency = Histogram(
            "mars_request_latency_seconds",
            "Arrival to last token.",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.queue_wait = Histogram(
            "mars_queue_wait_seconds",
            "Arrival to joining the batch.",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self._window: collections.deque = collections.deque()
        self._lock = threading.Lock()

    def record_step(self, tokens: int, row_steps: int, now: float | None = None) -> None:
        """One step: ``tokens`` emitted by ``row_steps`` rows; refreshes the windowed rates."""
        now = time.monotonic() if now is None else now
        self.forwards.inc()
        self.output_tokens.inc(tokens)
        with self._lock:
            self._window.append((now, tokens, row_steps))
            while self._window and self._window[0][0] < now - RATE_WINDOW_S:
                self._window.popleft()
            total_tokens = sum(item[1] for item in self._window)
            total_row_steps = sum(item[2] for item in self._window)
            span = max(now - self._window[0][0], 1e-3) if len(self._window) > 1 else RATE_WINDOW_S
        self.tokens_per_second.set(total_tokens / max(span, 1e-3))
        self.tokens_per_forward.set(total_tokens / total_row_steps if total_row_steps else 0.0)

    def record_drafts(self, source: str, proposed: int, accepted: int) -> None:
        """Drafts one row checked and kept in one step (acceptance by source = accepted / proposed)."""
        self.drafts_proposed.labels(source=source).inc(proposed)
        self.drafts_accepted.labels(source=source).inc(accepted)

    def idle(self) -> None:
        """No rows: the windowed rate decays to zero instead of showing the last busy value."""
        with self._lock:
            self._window.clear()
        self.tokens_per_second.set(0.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
