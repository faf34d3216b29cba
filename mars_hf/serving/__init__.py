"""OpenAI-compatible serving of MARS models with continuous batching and a load-adaptive τ.

``mars-hf serve MODEL``: `server` wires the pieces, `app` holds the HTTP routes, `security` who may call
them (API key, Host, Origin, content type), `protocol` the request validation, `responses` the response
shapes, `request` a request as the HTTP side and the scheduler share it, `scheduler` the step-level
continuous batching, `controller` the τ controller, `metrics` the Prometheus metrics, `engine` the decoder
interface (rows travel as `mars_hf.RowSettings`) and `processors` the model's generation-config processors
every row gets; the load test and the fault run are `mars_hf.tools.loadtest` and `mars_hf.tools.fault_run`.
FastAPI, uvicorn and prometheus_client are needed (``pip install mars-hf[serve]``).
"""

from mars_hf.serving.controller import ControllerConfig, TauController
from mars_hf.serving.engine import DecoderEngine, Engine, RowFailure
from mars_hf.serving.scheduler import GenerationRequest, Scheduler
from mars_hf.serving.security import SecurityConfig
from mars_hf.serving.server import BackgroundServer, ServerConfig, build_server, serve

__all__ = [
    "BackgroundServer",
    "ControllerConfig",
    "DecoderEngine",
    "Engine",
    "GenerationRequest",
    "RowFailure",
    "Scheduler",
    "SecurityConfig",
    "ServerConfig",
    "TauController",
    "build_server",
    "serve",
]
