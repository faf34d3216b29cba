"""Put it together: load a model, build engine + controller + scheduler + app, run uvicorn.

`BackgroundServer` runs the same uvicorn server on a thread (loopback, a free port), for the tests
and the load test.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass, field

from .app import build_app
from .controller import ControllerConfig, TauController
from .engine import DecoderEngine, Engine
from .metrics import ServingMetrics
from .protocol import Limits
from .scheduler import Scheduler

logger = logging.getLogger(__name__)


@dataclass
class ServerConfig:
    """Settings of one `mars-hf serve` process (the command-line flags)."""

    model_id: str = field(default="mars", metadata={"help": "Model name reported by /v1/models."})
    max_rows: int = field(default=8, metadata={"help": "KV slots: rows decoded together."})
    max_length: int = field(default=2048, metadata={"help": "Tokens per slot (prompt + output)."})
    max_queue: int = field(default=64, metadata={"help": "Waiting requests before 429."})
    max_prompt_tokens: int = field(default=1536, metadata={"help": "Longest prompt accepted."})
    max_new_tokens: int = field(default=512, metadata={"help": "Largest max_tokens accepted."})
    default_max_tokens: int = field(default=256, metadata={"help": "max_tokens when a request gives none."})
    request_timeout_s: float | None = field(default=300.0, metadata={"help": "Arrival to last token."})
    shutdown_grace_s: float = field(default=10.0, metadata={"help": "Drain time on shutdown."})
    controller: ControllerConfig = field(default_factory=ControllerConfig)

    def __post_init__(self):
        for name in ("max_rows", "max_length", "max_queue", "max_prompt_tokens", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"`{name}` must be >= 1.")
        if self.max_prompt_tokens >= self.max_length:
            self.max_prompt_tokens = self.max_length - 1

    @property
    def limits(self) -> Limits:
        return Limits(
            max_prompt_tokens=self.max_prompt_tokens,
            max_new_tokens=self.max_new_tokens,
            max_length=self.max_length,
            default_max_tokens=self.default_max_tokens,
        )


def load_model(name_or_path: str, dtype: str = "float32"):
    """``(model, tokenizer)`` for a MARS checkpoint folder / Hub id, ``embedded`` or ``synthetic``."""
    from mars_hf.commands.generate import load_model_and_tokenizer

    model, tokenizer, trained = load_model_and_tokenizer(name_or_path, dtype=dtype)
    if not trained:
        logger.warning("Serving a model without MARS training: expect about one token per forward.")
    return model, tokenizer


def build_server(model_or_engine, tokenizer, config: ServerConfig):
    """``(app, scheduler)``; ``model_or_engine`` is a MARS model or anything implementing `Engine`."""
    if hasattr(model_or_engine, "step") and hasattr(model_or_engine, "add_row"):
        engine: Engine = model_or_engine
    else:
        engine = DecoderEngine(model_or_engine, max_rows=config.max_rows, max_length=config.max_length)
    controller = TauController(config.controller, slots=engine.max_rows)
    scheduler = Scheduler(engine, controller, ServingMetrics(), max_queue=config.max_queue)
    limits = config.limits
    limits.max_length = min(limits.max_length, engine.max_length)
    app = build_app(
        tokenizer,
        scheduler,
        model_id=config.model_id,
        limits=limits,
        request_timeout_s=config.request_timeout_s,
        shutdown_grace_s=config.shutdown_grace_s,
    )
    return app, scheduler


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class BackgroundServer:
    """A real uvicorn server on a thread: ``with BackgroundServer(app) as server: server.base_url``."""

    def __init__(self, app, host: str = "127.0.0.1", port: int | None = None, graceful_s: float = 5.0):
        import uvicorn

        self.host, self.port = host, port or free_port(host)
        config = uvicorn.Config(
            app,
            host=self.host,
            port=self.port,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=graceful_s,
        )
        self.server = uvicorn.Server(config)
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

    def stop(self, timeout_s: float = 60.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def serve(name_or_path: str, config: ServerConfig, *, host: str, port: int, dtype: str = "float32") -> None:
    """Load the model and run the server in the foreground until SIGINT/SIGTERM (then drain)."""
    import uvicorn

    model, tokenizer = load_model(name_or_path, dtype)
    app, _ = build_server(model, tokenizer, config)
    logger.info("Serving %s on http://%s:%d (slots %d).", config.model_id, host, port, config.max_rows)
    uvicorn.run(
        app, host=host, port=port, log_level="info", timeout_graceful_shutdown=config.shutdown_grace_s
    )
