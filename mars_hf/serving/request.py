"""One request as the HTTP side and the scheduler thread share it.

The HTTP handler builds a `GenerationRequest`, binds it to its event loop and submits it; the scheduler
thread delivers `Tokens`, then `Done` or `Failed`, onto the request's asyncio queue (thread-safe) and
keeps the statistics a response reports in ``usage``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass, field

from mars_hf.decoding.decoder import RowSettings


@dataclass(frozen=True)
class Progress:
    """What a request's row has done: the counts ``usage`` reports. Immutable, so that each event carries the
    progress of its moment (the scheduler thread replaces the request's, never edits it): a reply that ends at a
    stop string bills the event that completed it, not the tokens the row ran on for until its cancel reached
    the scheduler (a step later or more, depending on timing).

    ``drafts``: verify's drafts checked and kept per source (``"masks"``, ``"lookup"``)."""

    completion_tokens: int = 0
    steps: int = 0
    tau_sum: float = 0.0
    tau_steps: int = 0
    drafts: dict = field(default_factory=dict)

    def after_step(self, threshold: float | None) -> Progress:
        """One more step, at τ ``threshold`` (None: verify, no τ)."""
        if threshold is None:
            return dataclasses.replace(self, steps=self.steps + 1)
        return dataclasses.replace(
            self, steps=self.steps + 1, tau_sum=self.tau_sum + threshold, tau_steps=self.tau_steps + 1
        )

    def with_tokens(self, count: int) -> Progress:
        return dataclasses.replace(self, completion_tokens=self.completion_tokens + count)

    def with_drafts(self, source: str, proposed: int, accepted: int) -> Progress:
        drafts = {name: dict(counts) for name, counts in self.drafts.items()}
        counts = drafts.setdefault(source, {"proposed": 0, "accepted": 0})
        counts["proposed"] += proposed
        counts["accepted"] += accepted
        return dataclasses.replace(self, drafts=drafts)

    @property
    def tokens_per_forward(self) -> float | None:
        return self.completion_tokens / self.steps if self.steps else None

    @property
    def mean_tau(self) -> float | None:
        return self.tau_sum / self.tau_steps if self.tau_steps else None


@dataclass
class Tokens:
    """New final tokens of the request's row, and the row's progress with them."""

    tokens: list[int]
    progress: Progress = field(default_factory=Progress)


@dataclass
class Done:
    """The row ended (``"stop"``, ``"length"``; ``"cancelled"`` when the server freed it)."""

    finish_reason: str


@dataclass
class Failed:
    """The request ends with an HTTP error (``retry_after``: seconds for the ``Retry-After`` header)."""

    status: int
    message: str
    retry_after: int | None = None


@dataclass(eq=False)
class GenerationRequest:
    """One request's row settings, its delivery queue and the statistics reported in ``usage``.

    ``pinned``: the request chose its τ or acceptance itself, so the load controller leaves it alone.
    """

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
    finish_reason: str | None = None
    progress: Progress = field(default_factory=Progress)

    @property
    def deadline(self) -> float | None:
        return None if self.timeout_s is None else self.arrival + self.timeout_s

    def bind(self) -> None:
        """Attach to the running event loop (the HTTP side calls this before submitting)."""
        self.loop = asyncio.get_running_loop()
        self.queue = asyncio.Queue()

    def deliver(self, event) -> None:
        """Put ``event`` on the request's queue from any thread (nothing if nobody listens any more)."""
        if self.loop is None or self.queue is None:
            return
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def record_step(self) -> None:
        """The row took part in one step, at the τ it holds now."""
        self.progress = self.progress.after_step(self.settings.threshold)

    def record_drafts(self, source: str, proposed: int, accepted: int) -> None:
        self.progress = self.progress.with_drafts(source, proposed, accepted)

    def record_tokens(self, count: int) -> None:
        self.progress = self.progress.with_tokens(count)
