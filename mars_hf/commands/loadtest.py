"""`mars-hf loadtest`: a bounded loopback load test of the server, controller on vs off vs τ = 1."""

from __future__ import annotations

import argparse
import logging

HELP = "Load-test `mars-hf serve` on loopback at several arrival rates (controller vs fixed τ); JSON + PNG."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default="synthetic", help="MODEL as for `mars-hf serve` (default synthetic)."
    )
    parser.add_argument(
        "--rates", type=float, nargs="+", default=[2.0, 8.0, 32.0], help="Requests per second."
    )
    parser.add_argument("--requests", type=int, default=48, help="Requests per (mode, rate) run.")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--modes", nargs="+", default=["controller", "fixed-max", "tau1"])
    parser.add_argument("--tau-min", type=float, default=0.7)
    parser.add_argument("--tau-max", type=float, default=0.95)
    parser.add_argument("--max-rows", type=int, default=8)
    parser.add_argument("--time-limit", type=float, default=120.0, help="Seconds per run (then cancelled).")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "float64"])
    parser.add_argument("--out", default="loadtest_out", help="Folder for loadtest.json and loadtest.png.")


def run(args) -> int:
    from mars_hf.serving.loadtest import LoadTestConfig, format_table, run_loadtest

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    config = LoadTestConfig(
        model=args.model,
        rates=tuple(args.rates),
        requests=args.requests,
        max_tokens=args.max_tokens,
        modes=tuple(args.modes),
        tau_min=args.tau_min,
        tau_max=args.tau_max,
        max_rows=args.max_rows,
        time_limit_s=args.time_limit,
        seed=args.seed,
        dtype=args.dtype,
    )
    result = run_loadtest(config, args.out)
    print(format_table(result))
    print(f"Wrote {args.out}/loadtest.json and {args.out}/loadtest.png")
    return 0
