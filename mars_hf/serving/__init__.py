"""OpenAI-compatible serving of MARS models with continuous batching and a load-adaptive τ.

``mars-hf serve MODEL``: `server` wires the pieces, `app` holds the HTTP routes, `protocol` the request
validation and response shapes, `scheduler` the step-level continuous batching, `controller` the τ
controller, `metrics` the Prometheus metrics, `engine` the decoder interface, `loadtest` the load test.
FastAPI, uvicorn and prometheus_client are needed (``pip install mars-hf[serving]``).
"""

from mars_hf.serving.controller import ControllerConfig, TauController
from mars_hf.serving.engine import DecoderEngine, Engine, RowSettings, RowUpdate
from mars_hf.serving.scheduler import GenerationRequest, Scheduler
from mars_hf.serving.server import BackgroundServer, ServerConfig, build_server, serve

__all__ = [
    "BackgroundServer",
    "ControllerConfig",
    "DecoderEngine",
    "Engine",
    "GenerationRequest",
    "RowSettings",
    "RowUpdate",
    "Scheduler",
    "ServerConfig",
    "TauController",
    "build_server",
    "serve",
]
