"""Put it together: load a model, build engine + controller + scheduler + app, run uvicorn.

`DrainingServer` is uvicorn's server with the drain first: on SIGTERM/SIGINT it keeps listening
while the scheduler drains (new and queued requests get 503 + Retry-After, running rows finish
within ``--shutdown-grace``, the rest get a 503 event), so every request has its answer before
uvicorn closes connections (uvicorn alone cancels handlers past its timeout: plain-text 500s, cut
streams, tracebacks). `BackgroundServer` runs the same server on a thread (loopback, a free port),
for the tests and the load test.
"""

from __future__ import annotations

import asyncio
import logging
import math
import signal
import socket
import threading
import time
from dataclasses import dataclass, field

import uvicorn

from mars_hf.serving.app import build_app
from mars_hf.serving.controller import ControllerConfig, TauController
from mars_hf.serving.engine import DecoderEngine, Engine
from mars_hf.serving.metrics import ServingMetrics
from mars_hf.serving.protocol import Limits
from mars_hf.serving.scheduler import Scheduler
from mars_hf.serving.security import SecurityConfig, bind_warnings

logger = logging.getLogger(__name__)


@dataclass
class ServerConfig:
    """Settings of one `mars-hf serve` process (the command-line flags)."""

    model_id: str = field(default="mars", metadata={"help": "Model name reported by /v1/models."})
    max_rows: int = field(default=8, metadata={"help": "KV slots: rows decoded together."})
    max_length: int = field(default=2048, metadata={"help": "Tokens per slot (prompt + output)."})
    cpu_kernels: str = field(
        default="auto",
        metadata={
            "help": "CPU linear kernels ('auto', 'packed', 'stock'; docs/accelerators.md): the server picks the "
            "packed ones where they measure faster, unlike generate, whose default path is stock."
        },
    )
    tau_window: str = field(
        default="fixed",
        metadata={
            "help": "How rows with τ < 1 feed masks: 'fixed' (W masks every step, the paper's window: a request that "
            "pins τ gets the same text whatever else is served) or 'planned' (the step planner sizes each step's "
            "mask group from what the row keeps and the batch's measured step cost, mars_planner=True: masks that do "
            "not pay are not fed, so τ's text then depends on the batch and the measured costs)."
        },
    )
    max_queue: int = field(default=64, metadata={"help": "Waiting requests before 429."})
    max_prompt_tokens: int = field(default=1536, metadata={"help": "Longest prompt accepted."})
    max_new_tokens: int = field(default=512, metadata={"help": "Largest max_tokens accepted."})
    default_max_tokens: int = field(
        default=Limits.default_max_tokens, metadata={"help": "max_tokens when a request gives none."}
    )
    request_timeout_s: float | None = field(default=300.0, metadata={"help": "Arrival to last token."})
    shutdown_grace_s: float = field(default=10.0, metadata={"help": "Drain time on shutdown."})
    max_body_bytes: int = field(
        default=Limits.max_body_bytes,
        metadata={
            "help": "Largest request body accepted (413 above): a body is parsed and tokenized before the "
            "prompt's length can be checked, on the event loop every stream shares."
        },
    )
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)

    def __post_init__(self):
        if self.tau_window not in ("planned", "fixed"):
            raise ValueError(
                f"`tau_window` (--tau-window) must be 'planned' or 'fixed', got {self.tau_window!r}."
            )
        limits = ("max_rows", "max_length", "max_queue", "max_prompt_tokens", "max_new_tokens")
        for name in limits + ("default_max_tokens", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"`{name}` must be >= 1.")
        timeout = self.request_timeout_s
        if timeout is not None and not (math.isfinite(timeout) and timeout > 0):
            raise ValueError(
                f"`request_timeout_s` (--request-timeout) must be a number of seconds > 0, got {timeout}: "
                "every request would time out (504). Leave it unset for the default."
            )
        if not (math.isfinite(self.shutdown_grace_s) and self.shutdown_grace_s >= 0):
            raise ValueError(
                f"`shutdown_grace_s` (--shutdown-grace) must be a number of seconds >= 0, got {self.shutdown_grace_s}."
            )
        if self.max_prompt_tokens >= self.max_length:
            self.max_prompt_tokens = self.max_length - 1

    @property
    def limits(self) -> Limits:
        return Limits(
            max_prompt_tokens=self.max_prompt_tokens,
            max_new_tokens=self.max_new_tokens,
            max_length=self.max_length,
            default_max_tokens=self.default_max_tokens,
            max_body_bytes=self.max_body_bytes,
        )


# Config fields that bound positions, in the order transformers' configs use them (GPT-2: n_positions).
POSITION_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


def model_position_limit(config) -> tuple[int, str] | None:
    """``(positions, field)``: how many positions the model reads, and the config field that says so."""
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    aliases = getattr(config, "attribute_map", {}) or {}
    for name in POSITION_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value, aliases.get(name, name)
    return None


def cap_to_model_positions(config: ServerConfig, model) -> tuple[int, str] | None:
    """Cap ``config.max_length`` (and the prompt limit) by the model's positions; log when it bites."""
    found = model_position_limit(getattr(model, "config", None))
    if found is None:
        return None
    positions, name = found
    if config.max_length > positions:
        logger.warning(
            "--max-length %d is more than the model's %d positions (%s): rows are capped at %d tokens.",
            config.max_length,
            positions,
            name,
            positions,
        )
        config.max_length = positions
        config.max_prompt_tokens = min(config.max_prompt_tokens, positions - 1)
    return positions, name


def build_server(model_or_engine, tokenizer, config: ServerConfig, *, host: str = "127.0.0.1"):
    """``(app, scheduler)``; ``model_or_engine`` is a MARS model or anything implementing `Engine`.

    With a model, ``config.max_length`` is first capped by the model's position limit (the config is
    changed in place, so the caller sees the limit in force). ``host``: the address the app will be bound
    to, one of the Host names it answers to (``config.security``).
    """
    positions = None
    if hasattr(model_or_engine, "step") and hasattr(model_or_engine, "add_row"):
        engine: Engine = model_or_engine
    else:
        positions = cap_to_model_positions(config, model_or_engine)
        engine = DecoderEngine(
            model_or_engine,
            max_rows=config.max_rows,
            max_length=config.max_length,
            cpu_kernels=config.cpu_kernels,
            plan_tau=config.tau_window == "planned",
        )
    controller = TauController(config.controller, slots=engine.max_rows)
    scheduler = Scheduler(engine, controller, ServingMetrics(), max_queue=config.max_queue)
    limits = config.limits
    limits.max_length = min(limits.max_length, engine.max_length)
    if positions is not None:
        limits.model_positions, limits.positions_field = positions
    mask = getattr(engine, "mask_token_id", None)
    if mask is not None:
        limits.mask_token_id = int(mask)
        limits.mask_token = tokenizer.convert_ids_to_tokens(int(mask))
    app = build_app(
        tokenizer,
        scheduler,
        model_id=config.model_id,
        limits=limits,
        request_timeout_s=config.request_timeout_s,
        shutdown_grace_s=config.shutdown_grace_s,
        security=config.security,
        bind_host=host,
    )
    for warning in bind_warnings(host, config.security):
        logger.warning(warning)
    return app, scheduler


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


# After the drain every request has its answer; uvicorn then waits this long for handlers to send them.
AFTER_DRAIN_S = 10.0


class DrainingServer(uvicorn.Server):
    """uvicorn's server with the drain first: still listening, new requests get 503 while running rows finish."""

    async def shutdown(self, sockets=None):
        serving = getattr(getattr(self.config.app, "state", None), "serving", None)
        if serving is not None:
            await asyncio.to_thread(serving.scheduler.drain, serving.shutdown_grace_s)
        await super().shutdown(sockets=sockets)


class BackgroundServer:
    """A real uvicorn server on a thread: ``with BackgroundServer(app) as server: server.base_url``.

    ``terminate()`` does what SIGTERM does to `mars-hf serve` (signals reach only the main thread).
    """

    def __init__(
        self, app, host: str = "127.0.0.1", port: int | None = None, graceful_s: float = AFTER_DRAIN_S
    ):
        self.host, self.port = host, port or free_port(host)
        config = uvicorn.Config(
            app,
            host=self.host,
            port=self.port,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=graceful_s,
        )
        self.server = DrainingServer(config)
        self.thread = threading.Thread(target=self.server.run, name="mars-uvicorn", daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> BackgroundServer:
        if self.thread.is_alive():
            return self
        self.thread.start()
        end = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > end:
                raise RuntimeError(f"The server did not start on {self.base_url}.")
            time.sleep(0.02)
        return self

    def terminate(self) -> None:
        """Begin the shutdown SIGTERM begins (drain, then close); returns at once."""
        self.server.handle_exit(signal.SIGTERM, None)

    def stop(self, timeout_s: float = 60.0) -> None:
        """Shut down (drain, then close) and wait for the thread; raises if it is still running after ``timeout_s``."""
        self.server.should_exit = True
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            raise RuntimeError(f"The server on {self.base_url} did not stop within {timeout_s:g} s.")

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def serve(model, tokenizer, config: ServerConfig, *, host: str, port: int) -> None:
    """Run the server for ``model`` in the foreground until SIGINT/SIGTERM (then drain)."""
    app, _ = build_server(model, tokenizer, config, host=host)
    logger.info(
        "Serving %s on http://%s:%d (slots %d, rows of %d tokens).",
        config.model_id,
        host,
        port,
        config.max_rows,
        config.max_length,
    )
    run_app(app, host=host, port=port)


def run_app(app, *, host: str, port: int, log_level: str = "info") -> None:
    """Run ``app`` (from `build_server`) in the foreground until SIGINT/SIGTERM, then drain and exit."""
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=AFTER_DRAIN_S
    )
    DrainingServer(config).run()
