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
import dataclasses
import gc
import json
import logging
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx2
import openai
import torch

from mars_hf.serving.controller import ControllerConfig
from mars_hf.serving.protocol import chat_prompt_ids, completion_prompt_ids
from mars_hf.serving.server import BackgroundServer, ServerConfig, build_server, model_position_limit
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


# --------------------------------------------------------------------------------------------------
# Fault run: a scripted mix of valid, malformed, over-long, disconnecting and failing requests, then a
# drain under load. Every request is checked by a raw HTTP client on loopback.
# --------------------------------------------------------------------------------------------------

MALFORMED = [
    b"{not json",
    b'{"messages": "hello"}',
    b'{"messages": [{"role": "user", "content": "x"}], "mars_threshold": 7}',
    b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": "many"}',
    b'{"messages": [{"role": "user", "content": "x"}], "mars_acceptance": "guess"}',
]
# kind -> weight in the mix. "raises*": the prompt holds a marker token that makes the model raise
# (see `inject_faults`); "overlong": a prompt past the model's positions; "mask": the mask token.
FAULT_MIX = {
    "plain": 3,
    "stream": 3,
    "disconnect": 1,
    "malformed": 1,
    "overlong": 1,
    "mask": 1,
    "raises": 1,
    "raises-stream": 1,
}
ROW_FAILED = "Decoding this request failed"


def _rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def inject_faults(model, marker_token_id: int) -> list:
    """Make ``model`` raise inside its forward whenever its input holds ``marker_token_id`` twice in a row.

    Twice in a row, not once: other forwards (the decoder's cost probe feeds arbitrary token ids) never
    repeat a token back to back. The marker's logit is also set to -inf, so no row ever generates it:
    only prompts that hold the pair fail. Returns the hook handles (``handle.remove()`` undoes it).
    """

    def raise_on_marker(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and bool(
            ((ids[..., 1:] == marker_token_id) & (ids[..., :-1] == marker_token_id)).any()
        ):
            raise RuntimeError(f"injected fault: token {marker_token_id} twice in a row in the model's input")

    def never_generate_marker(module, args, kwargs, output):
        output.logits[..., marker_token_id] = float("-inf")

    return [
        model.register_forward_pre_hook(raise_on_marker, with_kwargs=True),
        model.register_forward_hook(never_generate_marker, with_kwargs=True),
    ]


def greedy_reference(model, prompt_ids: list[int], max_new_tokens: int, eos_token_ids=()) -> list[int]:
    """Plain greedy decoding by full forwards (no cache, no MARS): the answer a lossless row must give."""
    ids, out = list(prompt_ids), []
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            logits = model(input_ids=torch.tensor([ids], device=model.device)).logits[0, -1]
            token = int(logits.argmax())
            out.append(token)
            ids.append(token)
            if token in eos_token_ids:
                break
    return out


def parse_sse(lines: list[str]) -> dict:
    """What a stream's lines say: text, finish chunks, error events, ``[DONE]`` count and position."""
    events = [line[len("data: ") :] for line in lines if line.startswith("data: ")]
    text, finishes, errors, done_at = "", 0, 0, []
    for i, data in enumerate(events):
        if data == "[DONE]":
            done_at.append(i)
            continue
        payload = json.loads(data)
        if "error" in payload:
            errors += 1
            continue
        for choice in payload.get("choices", []):
            text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            finishes += choice.get("finish_reason") is not None
    done_last = len(done_at) == 1 and done_at[0] == len(events) - 1
    return {"text": text, "finishes": finishes, "errors": errors, "done_once_last": done_last}


async def _post(http, url: str, body, stream: bool) -> dict:
    """One request; ``{"status", "json" (or None), "plain_text", "sse" (streams with status 200)}``."""
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    headers = {"content-type": "application/json"}
    if stream:
        async with http.stream("POST", url, headers=headers, **kwargs) as response:
            if response.status_code == 200:
                lines = [line async for line in response.aiter_lines()]
                return {"status": 200, "sse": parse_sse(lines), "headers": dict(response.headers)}
            await response.aread()
    else:
        response = await http.post(url, headers=headers, **kwargs)
    try:
        payload = response.json()
    except ValueError:
        payload = None
    return {"status": response.status_code, "json": payload, "headers": dict(response.headers)}


def _is_json_error(answer: dict, status: int) -> bool:
    return answer["status"] == status and isinstance(answer.get("json"), dict) and "error" in answer["json"]


def classify_drain_answer(answer: dict | None) -> str:
    """A drain answer's class; the bad ones start with ``BAD``."""
    if answer is None:
        return "BAD no answer"
    if "exception" in answer:
        return f"BAD {answer['exception']}"
    if "sse" in answer:
        sse = answer["sse"]
        if not sse["done_once_last"]:
            return "BAD stream without a final [DONE]"
        if sse["finishes"] == 1 and sse["errors"] == 0:
            return "stream completed"
        if sse["errors"] == 1 and sse["finishes"] == 0:
            return "stream ended by an error event"
        return "BAD stream with several or no final events"
    if answer["status"] == 200 and isinstance(answer.get("json"), dict) and "choices" in answer["json"]:
        return "completed"
    if _is_json_error(answer, 503) and "retry-after" in answer["headers"]:
        return "JSON 503 with Retry-After"
    if answer.get("json") is None:
        return f"BAD plain-text {answer['status']}"
    return f"BAD JSON {answer['status']}"


async def _drain_drive(base_url: str, jobs: list[tuple[str, dict, bool]], trigger, timeout_s: float):
    """Send ``jobs`` (path, body, stream), wait until the server holds them all, ``trigger()``, collect."""
    async with httpx2.AsyncClient(timeout=timeout_s) as http:

        async def one(path, body, stream):
            try:
                return await _post(http, base_url + path, body, stream)
            except Exception as error:
                return {"exception": type(error).__name__}

        tasks = [asyncio.create_task(one(*job)) for job in jobs]
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            health = (await http.get(base_url + "/health")).json()
            finished = sum(t.done() for t in tasks)
            if health.get("running", 0) + health.get("waiting", 0) + finished >= len(jobs):
                break
            await asyncio.sleep(0.02)
        trigger()
        done, pending = await asyncio.wait(tasks, timeout=timeout_s)
        for task in pending:
            task.cancel()
        return [t.result() if t in done else None for t in tasks]


def drain_under_load(base_url: str, jobs: list[tuple[str, dict, bool]], trigger, timeout_s: float = 120.0):
    """SIGTERM (``trigger``) with ``jobs`` running or queued; ``{class: count}`` of the answers."""
    answers = asyncio.run(_drain_drive(base_url, jobs, trigger, timeout_s))
    classes: dict[str, int] = {}
    for answer in answers:
        label = classify_drain_answer(answer)
        classes[label] = classes.get(label, 0) + 1
    return classes


class _ErrorLog(logging.Handler):
    """Counts log records at ERROR and above, and those carrying a traceback."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.errors = 0
        self.tracebacks = 0

    def emit(self, record):
        self.errors += record.levelno >= logging.ERROR
        self.tracebacks += bool(record.exc_info) or "Traceback" in record.getMessage()


def _pick_marker(tokenizer, prompt_id_lists: list[list[int]], reserved: set[int]) -> int:
    used = set().union(*map(set, prompt_id_lists)) | reserved
    for token_id in range(len(tokenizer) - 1, -1, -1):
        if token_id not in used and token_id not in tokenizer.all_special_ids:
            return token_id
    raise ValueError("No token id is free to serve as the fault marker.")


@dataclass
class FaultRequest:
    """One request of a fault run: what it sends and, for a valid one, the text it must get back."""

    kind: str
    path: str
    body: dict | bytes
    stream: bool
    expected_text: str | None = None


class FaultPlan:
    """The requests of a fault run (kinds drawn from ``mix``, seeded) and the check of each answer.

    Valid requests (τ = 1 or verify, lossless) must equal ``reference(prompt_ids, max_tokens)``, computed
    here before serving; ``marker``: the token whose pair makes the model raise (`inject_faults`);
    ``positions``: the model's position limit, named in an over-long prompt's 400.
    """

    def __init__(
        self,
        tokenizer,
        prompts: list[str],
        *,
        total: int,
        mix: dict[str, int],
        max_tokens: int,
        seed: int,
        reference,
        limits,
        marker: int | None,
        positions: int | None,
    ):
        self.rng = random.Random(seed)
        self.names = list(mix)
        drawn = self.rng.choices(self.names, weights=[mix[k] for k in self.names], k=max(0, total - len(mix)))
        self.kinds = (self.names + drawn)[:total]
        self.prompts, self.max_tokens, self.limits, self.marker = prompts, max_tokens, limits, marker
        self.positions = positions
        self.too_long = (positions or limits.max_prompt_tokens) + 10
        self.chat_ids = [
            chat_prompt_ids({"messages": [{"role": "user", "content": p}]}, tokenizer) for p in prompts
        ]
        self.plain_ids = [completion_prompt_ids({"prompt": p}, tokenizer) for p in prompts]
        self.expected = {
            (route, i): tokenizer.decode(reference(ids[i], max_tokens), skip_special_tokens=True)
            for route, ids in (("chat", self.chat_ids), ("plain", self.plain_ids))
            for i in range(len(prompts))
        }
        self.requests = [self._request(i) for i in range(len(self.kinds))]

    def count(self, kind: str) -> int:
        return self.kinds.count(kind)

    def _request(self, i: int) -> FaultRequest:
        kind, p = self.kinds[i], i % len(self.prompts)
        lossless = {"mars_acceptance": "verify"} if i % 2 else {"mars_threshold": 1.0}
        if kind == "plain":
            body = {"prompt": self.prompts[p], "max_tokens": self.max_tokens, **lossless}
            return FaultRequest(kind, "/v1/completions", body, False, self.expected[("plain", p)])
        if kind in ("stream", "disconnect"):
            messages = [{"role": "user", "content": self.prompts[p]}]
            body = {"messages": messages, "max_tokens": self.max_tokens, **lossless, "stream": True}
            return FaultRequest(kind, "/v1/chat/completions", body, True, self.expected[("chat", p)])
        if kind == "malformed":
            return FaultRequest(kind, "/v1/chat/completions", self.rng.choice(MALFORMED), False)
        if kind == "overlong":
            body = {"prompt": [self.plain_ids[p][0]] * self.too_long, "max_tokens": 2}
            return FaultRequest(kind, "/v1/completions", body, False)
        if kind == "mask":
            body = {"prompt": self.plain_ids[p] + [self.limits.mask_token_id], "max_tokens": 2}
            return FaultRequest(kind, "/v1/completions", body, False)
        stream = kind == "raises-stream"
        prompt = self.plain_ids[p] + [self.marker, self.marker]
        body = {"prompt": prompt, "max_tokens": self.max_tokens, **lossless, "stream": stream}
        return FaultRequest(kind, "/v1/completions", body, stream)

    def check(self, i: int, answer: dict) -> str | None:
        """None when request ``i``'s answer is right, else what is wrong."""
        request = self.requests[i]
        if "exception" in answer:
            return f"{request.kind}: {answer['exception']}"
        if request.kind in ("plain", "stream"):
            return self._check_text(request, answer)
        if request.kind in ("malformed", "overlong", "mask"):
            return self._check_refused(request.kind, answer)
        if request.kind == "raises":
            ok = _is_json_error(answer, 500) and ROW_FAILED in answer["json"]["error"]["message"]
            return None if ok else f"raises: status {answer['status']} (want a JSON 500)"
        if request.kind == "raises-stream":
            sse = answer.get("sse")
            ok = sse is not None and sse["done_once_last"] and sse["errors"] == 1 and sse["finishes"] == 0
            return None if ok else "raises-stream: not one error event then [DONE]"
        return None

    @staticmethod
    def _check_text(request: FaultRequest, answer: dict) -> str | None:
        """A valid request: its text, and for a stream exactly one final chunk then ``[DONE]``."""
        if request.kind == "stream":
            sse = answer.get("sse")
            if sse is None:
                return f"stream: status {answer['status']}"
            if not (sse["done_once_last"] and sse["finishes"] == 1 and sse["errors"] == 0):
                return "stream: not exactly one final chunk then [DONE]"
            got = sse["text"]
        else:
            if answer["status"] != 200:
                return f"plain: status {answer['status']}"
            got = answer["json"]["choices"][0]["text"]
        return None if got == request.expected_text else f"{request.kind}: wrong text"

    def _check_refused(self, kind: str, answer: dict) -> str | None:
        """A JSON 400 whose message names what is wrong."""
        if not _is_json_error(answer, 400):
            return f"{kind}: status {answer['status']} (want a JSON 400)"
        message = answer["json"]["error"]["message"]
        if (
            kind == "overlong"
            and self.positions
            and not (str(self.too_long) in message and str(self.positions) in message)
        ):
            return "overlong: the 400 does not name the prompt length and the model's positions"
        if kind == "mask" and "mask token" not in message:
            return "mask: the 400 does not name the mask token"
        return None


async def _send_fault_requests(
    base_url: str, plan: FaultPlan, indices, answers: list, concurrency: int, limit_s: float
):
    """Send requests ``indices`` of ``plan``, ``concurrency`` at a time; a disconnect reads one line and hangs up."""
    gate = asyncio.Semaphore(concurrency)
    async with httpx2.AsyncClient(timeout=limit_s) as http:

        async def one(i):
            request = plan.requests[i]
            async with gate:
                try:
                    if request.kind == "disconnect":
                        async with http.stream(
                            "POST", base_url + request.path, json=request.body
                        ) as response:
                            async for _ in response.aiter_lines():
                                break  # first line, then hang up
                        answers[i] = {"status": response.status_code, "disconnected": True}
                    else:
                        answers[i] = await _post(http, base_url + request.path, request.body, request.stream)
                except Exception as error:
                    answers[i] = {"exception": type(error).__name__}

        await asyncio.wait_for(asyncio.gather(*(one(i) for i in indices)), limit_s)


def _serve_fault_plan(
    app, scheduler, plan: FaultPlan, *, concurrency: int, limit_s: float, warmup_fraction: float
):
    """Serve ``plan`` on a fresh server: a warm-up share first (RSS measured after it), then the rest."""
    total = len(plan.kinds)
    answers: list[dict | None] = [None] * total
    warm = min(total, max(len(plan.names), int(total * warmup_fraction)))
    with BackgroundServer(app) as server:
        base = server.base_url
        t0 = time.monotonic()
        asyncio.run(_send_fault_requests(base, plan, range(warm), answers, concurrency, limit_s))
        gc.collect()
        rss_warm = _rss_mb()
        asyncio.run(_send_fault_requests(base, plan, range(warm, total), answers, concurrency, limit_s))
        wall = time.monotonic() - t0
        end = time.monotonic() + 30  # cancelled rows leave at the next step boundary
        while (scheduler.running or scheduler.waiting) and time.monotonic() < end:
            time.sleep(0.02)
        gc.collect()
        rss_end = _rss_mb()
        health = httpx2.get(base + "/health").json()
        metrics_text = httpx2.get(base + "/metrics").text
    outcomes = {
        line.split('"')[1]: float(line.rsplit(" ", 1)[1])
        for line in metrics_text.splitlines()
        if line.startswith("mars_requests_total{")
    }
    return {
        "answers": answers,
        "rss_warm": rss_warm,
        "rss_end": rss_end,
        "wall": wall,
        "health": health,
        "outcomes": outcomes,
    }


def fault_run(
    model,
    tokenizer,
    *,
    total: int = 1000,
    max_tokens: int = 16,
    max_rows: int = 8,
    concurrency: int = 32,
    seed: int = 0,
    prompts: list[str] | None = None,
    engine_factory=None,
    reference=None,
    kinds: dict[str, int] | None = None,
    warmup_fraction: float = 0.2,
    drain: bool = True,
    drain_grace_s: float = 0.2,
    drain_max_tokens: int | None = None,
    time_limit_s: float = 1800.0,
) -> dict:
    """Send ``total`` mixed requests (see `FAULT_MIX`) to a fresh server, then drain one under load.

    Checked per request (`FaultPlan.check`): valid ones (τ = 1 or verify, lossless) equal ``reference(prompt_ids,
    max_tokens)`` (default: `greedy_reference` on ``model``) and streams end with exactly one final
    chunk then ``[DONE]``; malformed / over-long / mask-token requests get a JSON 400; requests whose
    row raises inside the model get a JSON 500 (streams: one error event, then ``[DONE]``); nobody else
    is affected. Memory: RSS after a warm-up (the first ``warmup_fraction`` of the requests, every kind
    among them) against RSS at the end. ``engine_factory``: a scripted `Engine` instead of ``model``
    (then no marker faults). Returns a report; ``report["ok"]`` says whether every check held.
    """
    mix = dict(kinds or FAULT_MIX)
    if engine_factory is not None:
        mix = {k: w for k, w in mix.items() if k not in ("raises", "raises-stream", "mask")}
    config = LoadTestConfig(max_rows=max_rows, max_tokens=max_tokens, time_limit_s=time_limit_s)
    server_cfg = server_config("controller", config)
    server_cfg.max_prompt_tokens = 256
    app, scheduler = build_server(
        engine_factory() if engine_factory is not None else model, tokenizer, server_cfg
    )
    limits = app.state.serving.limits
    prompts = prompts or GENERIC_PROMPTS
    if reference is None:
        eos = () if tokenizer.eos_token_id is None else (int(tokenizer.eos_token_id),)

        def reference(ids, n):
            return greedy_reference(model, ids, n, eos)

    marker, handles = None, []
    if engine_factory is None:
        all_ids = [completion_prompt_ids({"prompt": p}, tokenizer) for p in prompts] + [
            chat_prompt_ids({"messages": [{"role": "user", "content": p}]}, tokenizer) for p in prompts
        ]
        reserved = {limits.mask_token_id} if limits.mask_token_id is not None else set()
        marker = _pick_marker(tokenizer, all_ids, reserved)
        handles = inject_faults(model, marker)
    positions = model_position_limit(model.config) if model is not None else None
    try:
        plan = FaultPlan(  # the expected texts are computed with the fault hooks on
            tokenizer,
            prompts,
            total=total,
            mix=mix,
            max_tokens=max_tokens,
            seed=seed,
            reference=reference,
            limits=limits,
            marker=marker,
            positions=positions[0] if positions else None,
        )
        served = _serve_fault_plan(
            app,
            scheduler,
            plan,
            concurrency=concurrency,
            limit_s=time_limit_s,
            warmup_fraction=warmup_fraction,
        )
        drain_report = None
        if drain:
            drain_report = _drain_check(
                engine_factory() if engine_factory is not None else model,
                tokenizer,
                server_cfg,
                prompts,
                drain_grace_s,
                drain_max_tokens or max(max_tokens, min(64, server_cfg.max_length - 64)),
            )
    finally:
        for handle in handles:
            handle.remove()
    return _fault_report(plan, served, scheduler.engine.num_rows, drain_report)


def _fault_report(plan: FaultPlan, served: dict, rows_left: int, drain_report: dict | None) -> dict:
    """The fault run's report; ``ok`` when every request got its right answer and nothing leaked."""
    problems: dict[str, int] = {}
    for i, answer in enumerate(served["answers"]):
        if plan.kinds[i] == "disconnect":
            continue
        problem = "no answer" if answer is None else plan.check(i, answer)
        if problem:
            problems[problem] = problems.get(problem, 0) + 1
    total, health, outcomes = len(plan.kinds), served["health"], served["outcomes"]
    growth = (served["rss_end"] - served["rss_warm"]) / served["rss_warm"]
    failing = plan.count("raises") + plan.count("raises-stream")
    report = {
        "requests": total,
        "by_kind": {k: plan.count(k) for k in plan.names},
        "failing_in_model_fraction": round(failing / total, 3) if total else 0.0,
        "valid": plan.count("plain") + plan.count("stream"),
        "answered_correctly": total - plan.count("disconnect") - sum(problems.values()),
        "answerable": total - plan.count("disconnect"),
        "problems": problems,
        "server_outcomes": outcomes,
        "server_outcomes_total": sum(outcomes.values()),
        "health": health,
        "rows_left_in_engine": rows_left,
        "rss_mb_after_warmup": round(served["rss_warm"], 1),
        "rss_mb_end": round(served["rss_end"], 1),
        "rss_growth_after_warmup": round(growth, 4),
        "wall_s": round(served["wall"], 1),
        "drain": drain_report,
    }
    report["ok"] = (
        not problems
        and report["server_outcomes_total"] == total  # every request counted once, by one outcome
        and health.get("status") == "ok"
        and health.get("running") == 0
        and rows_left == 0
        and growth < 0.05
        and (drain_report is None or drain_report["bad"] == 0)
    )
    return report


def _drain_check(model_or_engine, tokenizer, server_cfg, prompts, grace_s: float, max_tokens: int) -> dict:
    """A fresh server, ``3 × slots`` long requests (half streamed), SIGTERM when they are all in."""
    cfg = dataclasses.replace(server_cfg, shutdown_grace_s=grace_s, max_new_tokens=max_tokens)
    app, scheduler = build_server(model_or_engine, tokenizer, cfg)
    jobs = []
    for i in range(3 * scheduler.engine.max_rows):
        body = {
            "messages": [{"role": "user", "content": prompts[i % len(prompts)]}],
            "max_tokens": max_tokens,
            "mars_threshold": 1.0,
            "stream": i % 2 == 0,
        }
        jobs.append(("/v1/chat/completions", body, i % 2 == 0))
    log = _ErrorLog()
    watched = [logging.getLogger(), logging.getLogger("uvicorn"), logging.getLogger("uvicorn.error")]
    server = BackgroundServer(app).start()
    for logger_ in watched:
        logger_.addHandler(log)
    try:
        classes = drain_under_load(server.base_url, jobs, server.terminate)
        server.thread.join(60)
    finally:
        for logger_ in watched:
            logger_.removeHandler(log)
        server.stop()
    bad = sum(n for label, n in classes.items() if label.startswith("BAD"))
    return {
        "requests": len(jobs),
        "grace_s": grace_s,
        "classes": classes,
        "bad": bad + log.errors + log.tracebacks,
        "error_log_records": log.errors,
        "tracebacks_in_log": log.tracebacks,
        "server_stopped": not server.thread.is_alive(),
    }
