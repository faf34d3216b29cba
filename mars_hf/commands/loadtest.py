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
    parser.add_argument(
        "--fault-requests",
        type=int,
        default=0,
        help="Instead: a fault run of N requests mixing valid (τ = 1 / verify, checked against plain greedy "
        "decoding), streamed, disconnecting, malformed, over-long, mask-token and model-failing requests (a "
        "marker token injected by a forward hook), requests without the API key or with a foreign Host, Origin "
        "or a text/plain body, with the mask token's logit boosted (it must stay suppressed), then SIGTERM under "
        "load; checks every request is answered once and correctly, the failing rows fail alone, RSS grows < 5%% after warm-up, the drain is clean "
        "(fault.json). Use --dtype float64 for exact greedy equality.",
    )
    parser.add_argument(
        "--fault-concurrency", type=int, default=32, help="Requests in flight in a fault run."
    )
    parser.add_argument(
        "--fault-drain-grace",
        type=float,
        default=0.2,
        help="--shutdown-grace of the fault run's drain check.",
    )


def run(args) -> int:
    from mars_hf.tools.loadtest import LoadTestConfig, format_table, run_loadtest

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
    logging.getLogger("httpx2").setLevel(logging.WARNING)
    if args.fault_requests:
        import json
        from pathlib import Path

        from mars_hf.tools.fault_run import fault_run
        from mars_hf.tools.loading import load_served_model

        model, tokenizer = load_served_model(args.model, args.dtype)
        prompts = None
        if args.model == "synthetic":
            from mars_hf.tools.synthetic import synthetic_prompts

            prompts = synthetic_prompts(64, seed=args.seed + 99)
        logging.getLogger("mars_hf.serving.engine").setLevel(logging.CRITICAL)  # the injected faults' lines
        report = fault_run(
            model,
            tokenizer,
            total=args.fault_requests,
            max_tokens=args.max_tokens,
            max_rows=args.max_rows,
            concurrency=args.fault_concurrency,
            seed=args.seed,
            prompts=prompts,
            drain_grace_s=args.fault_drain_grace,
        )
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "fault.json").write_text(json.dumps(report, indent=2))
        print(json.dumps(report, indent=2))
        print("fault run:", "OK" if report["ok"] else "FAILED", f"(wrote {args.out}/fault.json)")
        return 0 if report["ok"] else 1
    result = run_loadtest(config, args.out)
    print(format_table(result))
    print(f"Wrote {args.out}/loadtest.json and {args.out}/loadtest.png")
    return 0
