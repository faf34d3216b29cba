"""A bounded load test of `mars-hf serve` on loopback: controller on vs off vs fixed τ = 1.

For each server mode a fresh server (same model object, new slots and scheduler) listens on
127.0.0.1; for each arrival rate, requests arrive as a seeded Poisson process and are sent as
streamed chat completions by the `openai` async client. Recorded per request: time to first token,
latency, output tokens, text and the τ it was decoded with (``usage``); per run: output tokens/s,
p50/p95 latency and TTFT, τ over time (polled from /health), and agreement of each output with the
τ = 1 server's output for the same prompt. Everything is bounded: ``requests`` per rate and a time
limit per run, after which outstanding requests are cancelled and counted as unfinished.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx2
import openai

from mars_hf.serving.controller import ControllerConfig
from mars_hf.serving.server import BackgroundServer, ServerConfig, build_server
from mars_hf.tools.loading import load_served_model
from mars_hf.tools.synthetic import synthetic_prompts

logger = logging.getLogger(__name__)

MODES = ("controller", "fixed-max", "tau1")
GENERIC_PROMPTS = [
    "Write a short poem about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three fruits and their colours.",
    "What is the capital of France? Answer briefly.",
    "Give me a haiku about autumn.",
    "Describe a cat to someone who has never seen one.",
    "How do I reverse a list in Python?",
    "Name the planets of the solar system.",
]


@dataclass
class LoadTestConfig:
    """Settings of `mars-hf loadtest`."""

    model: str = field(default="synthetic", metadata={"help": "MODEL as for `mars-hf serve`."})
    rates: tuple[float, ...] = field(
        default=(2.0, 8.0, 32.0), metadata={"help": "Arrival rates (requests/s)."}
    )
    requests: int = field(default=48, metadata={"help": "Requests per (mode, rate) run."})
    max_tokens: int = field(default=48, metadata={"help": "max_tokens of every request."})
    modes: tuple[str, ...] = field(default=MODES, metadata={"help": "Server modes to compare."})
    tau_min: float = field(default=0.7, metadata={"help": "Controller range, low end."})
    tau_max: float = field(default=0.95, metadata={"help": "Controller range, high end (also 'fixed-max')."})
    max_rows: int = field(default=8, metadata={"help": "Server slots."})
    time_limit_s: float = field(
        default=120.0, metadata={"help": "Per run; unfinished requests are cancelled."}
    )
    seed: int = field(default=0, metadata={"help": "Arrival times and prompt order."})
    dtype: str = "float32"

    def __post_init__(self):
        unknown = set(self.modes) - set(MODES)
        if unknown:
            raise ValueError(f"Unknown load-test modes {sorted(unknown)}; choose from {list(MODES)}.")
        if self.requests < 1 or not self.rates or min(self.rates) <= 0:
            raise ValueError("Need requests >= 1 and positive arrival rates.")


def server_config(mode: str, config: LoadTestConfig) -> ServerConfig:
    if mode == "controller":
        controller = ControllerConfig(tau_min=config.tau_min, tau_max=config.tau_max)
    elif mode == "fixed-max":
        controller = ControllerConfig(tau_min=config.tau_max, tau_max=config.tau_max, enabled=False)
    else:
        controller = ControllerConfig(tau_min=1.0, tau_max=1.0, enabled=False)
    return ServerConfig(
        model_id="loadtest",
        max_rows=config.max_rows,
        max_length=512,
        max_queue=10_000,
        max_new_tokens=config.max_tokens,
        request_timeout_s=config.time_limit_s,
        controller=controller,
    )


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    k = (len(values) - 1) * q
    low, high = int(k), min(int(k) + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (k - low)


async def _one(client, prompt: str, max_tokens: int, start: float, record: dict) -> None:
    stream = await client.chat.completions.create(
        model="loadtest",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
    )
    text = []
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if "ttft" not in record:
                record["ttft"] = time.monotonic() - start
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
            record["tokens"] = usage["completion_tokens"]
            record["tau"] = usage.get("mars_threshold")
            record["tokens_per_forward"] = usage.get("mars_tokens_per_forward")
    record["latency"] = time.monotonic() - start
    record["text"] = "".join(text)


async def _drive(base_url: str, prompts: list[str], arrivals: list[float], config: LoadTestConfig):
    client = openai.AsyncOpenAI(
        base_url=base_url + "/v1", api_key="loopback", max_retries=0, timeout=config.time_limit_s
    )
    records = [{"prompt": i} for i in range(len(prompts))]
    tau_trace: list[tuple[float, float]] = []
    t0 = time.monotonic()

    async def launch(i):
        await asyncio.sleep(max(0.0, t0 + arrivals[i] - time.monotonic()))
        records[i]["arrival"] = time.monotonic() - t0
        try:
            await _one(client, prompts[i], config.max_tokens, time.monotonic(), records[i])
        except Exception as error:  # counted, not raised: a load test reports failures
            records[i]["error"] = type(error).__name__

    async def poll(done: asyncio.Event):
        async with httpx2.AsyncClient(timeout=5) as http:
            while not done.is_set():
                try:
                    health = (await http.get(base_url + "/health")).json()
                    tau_trace.append((time.monotonic() - t0, health["mars_threshold"]))
                except Exception:
                    pass
                await asyncio.sleep(0.1)

    done = asyncio.Event()
    poller = asyncio.create_task(poll(done))
    tasks = [asyncio.create_task(launch(i)) for i in range(len(prompts))]
    finished, pending = await asyncio.wait(tasks, timeout=config.time_limit_s)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    wall = time.monotonic() - t0
    done.set()
    await poller
    await client.close()
    return records, tau_trace, wall, len(pending)


def summarise(records: list[dict], wall: float, unfinished: int) -> dict:
    ok = [r for r in records if "latency" in r]
    latencies = [r["latency"] for r in ok]
    ttfts = [r["ttft"] for r in ok if "ttft" in r]
    taus = [r["tau"] for r in ok if r.get("tau") is not None]
    tpf = [r["tokens_per_forward"] for r in ok if r.get("tokens_per_forward") is not None]
    tokens = sum(r.get("tokens", 0) for r in ok)
    return {
        "requests": len(records),
        "completed": len(ok),
        "failed": sum(1 for r in records if "error" in r),
        "unfinished": unfinished,
        "wall_s": round(wall, 3),
        "output_tokens": tokens,
        "output_tokens_per_s": round(tokens / wall, 2) if wall else None,
        "latency_p50_s": percentile(latencies, 0.5),
        "latency_p95_s": percentile(latencies, 0.95),
        "ttft_p50_s": percentile(ttfts, 0.5),
        "ttft_p95_s": percentile(ttfts, 0.95),
        "mean_tau": statistics.fmean(taus) if taus else None,
        "mean_tokens_per_forward": statistics.fmean(tpf) if tpf else None,
    }


def agreement(records: list[dict], reference: list[dict]) -> float | None:
    """Fraction of requests whose text equals the τ = 1 server's text for the same prompt."""
    pairs = [(r["text"], q["text"]) for r, q in zip(records, reference) if "text" in r and "text" in q]
    return sum(a == b for a, b in pairs) / len(pairs) if pairs else None


def run_loadtest(
    config: LoadTestConfig, out_dir: str | Path, model=None, tokenizer=None, engine_factory=None
) -> dict:
    """Run every (mode, rate); write ``loadtest.json`` and ``loadtest.png`` into ``out_dir``.

    ``engine_factory`` (tests) builds a fresh `Engine` per run instead of slots over ``model``.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if model is None and engine_factory is None:
        model, tokenizer = load_served_model(config.model, config.dtype)
    if config.model == "synthetic":
        pool = synthetic_prompts(max(config.requests, 8), seed=config.seed + 1234)
    else:
        pool = GENERIC_PROMPTS
    rng = random.Random(config.seed)
    prompts = [pool[i % len(pool)] for i in range(config.requests)]
    runs = []
    by_key = {}
    for rate in config.rates:
        gaps = [rng.expovariate(rate) for _ in range(config.requests)]
        arrivals = [sum(gaps[:i]) for i in range(config.requests)]
        for mode in config.modes:
            engine = engine_factory() if engine_factory is not None else model
            app, _ = build_server(engine, tokenizer, server_config(mode, config))
            with BackgroundServer(app) as server:
                logger.info("Load test: %s at %.3g requests/s (%d requests).", mode, rate, config.requests)
                records, trace, wall, unfinished = asyncio.run(
                    _drive(server.base_url, prompts, arrivals, config)
                )
            summary = summarise(records, wall, unfinished)
            by_key[(mode, rate)] = records
            runs.append({"mode": mode, "rate": rate, **summary, "tau_trace": trace})
    for run in runs:
        reference = by_key.get(("tau1", run["rate"]))
        run["agreement_with_tau1"] = (
            agreement(by_key[(run["mode"], run["rate"])], reference) if reference else None
        )
    result = {"config": {k: v for k, v in asdict(config).items()}, "runs": runs}
    (out_dir / "loadtest.json").write_text(json.dumps(result, indent=2))
    plot(result, out_dir / "loadtest.png")
    return result


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    modes = list(dict.fromkeys(r["mode"] for r in runs))
    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    for mode in modes:
        mine = sorted((r for r in runs if r["mode"] == mode), key=lambda r: r["rate"])
        rates = [r["rate"] for r in mine]
        axes[0].plot(rates, [r["output_tokens_per_s"] for r in mine], "o-", label=mode)
        axes[1].plot(rates, [r["latency_p95_s"] for r in mine], "o-", label=mode)
        axes[2].plot(rates, [r["ttft_p95_s"] for r in mine], "o-", label=mode)
    controller = [r for r in runs if r["mode"] == "controller"]
    for r in controller:
        if r["tau_trace"]:
            t, tau = zip(*r["tau_trace"])
            axes[3].plot(t, tau, label=f"{r['rate']:g} req/s")
    titles = ["output tokens/s", "p95 latency (s)", "p95 time to first token (s)", "controller τ over time"]
    for ax, title in zip(axes, titles):
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    all_rates = sorted({r["rate"] for r in runs})
    for ax in axes[:3]:
        ax.set_xscale("log")
        ax.set_xticks(all_rates, [f"{rate:g}" for rate in all_rates])
        ax.minorticks_off()
        ax.set_xlabel("arrival rate (requests/s)")
    axes[3].set_xlabel("seconds into the run")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_table(result: dict) -> str:
    lines = [
        f"{'mode':<11} {'rate':>6} {'done':>5} {'tok/s':>8} {'p50 lat':>8} {'p95 lat':>8} {'p95 ttft':>8} "
        f"{'mean τ':>7} {'tok/fwd':>7} {'=τ1':>5}"
    ]

    def f(value, spec):
        return format(value, spec) if value is not None else "-"

    for r in result["runs"]:
        lines.append(
            f"{r['mode']:<11} {r['rate']:>6g} {r['completed']:>5} {f(r['output_tokens_per_s'], '8.1f')} "
            f"{f(r['latency_p50_s'], '8.3f')} {f(r['latency_p95_s'], '8.3f')} {f(r['ttft_p95_s'], '8.3f')} "
            f"{f(r['mean_tau'], '7.3f')} {f(r['mean_tokens_per_forward'], '7.2f')} {f(r['agreement_with_tau1'], '5.2f')}"
        )
    return "\n".join(lines)
