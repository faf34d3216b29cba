"""The fault run of `mars-hf serve`: a scripted mix of valid, malformed, over-long, disconnecting and
model-failing requests on loopback, each answer checked by a raw HTTP client, then a drain under load.
The server has an API key; requests without it, with a foreign Host or Origin or a non-JSON content type must
be refused, and the mask token (whose logit the run boosts above every other) must never come out.

`fault_run` builds a `FaultPlan` (which request is which kind, what it sends, the answer it must get),
serves it on a fresh server (RSS after a warm-up against the end), checks every answer and drains a
second server under load (`drain_under_load`, every answer classified). `mars-hf loadtest
--fault-requests N` runs it; tests/test_serving_faults.py drives its parts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import logging
import random
import secrets
import time
from dataclasses import dataclass, field

import httpx2
import torch

from mars_hf.serving.protocol import chat_prompt_ids, completion_prompt_ids
from mars_hf.serving.security import SecurityConfig
from mars_hf.serving.server import BackgroundServer, build_server, model_position_limit
from mars_hf.tools.loadtest import GENERIC_PROMPTS, LoadTestConfig, server_config

logger = logging.getLogger(__name__)
MALFORMED = [
    b"{not json",
    b'{"messages": "hello"}',
    b'{"messages": [{"role": "user", "content": "x"}], "mars_threshold": 7}',
    b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": "many"}',
    b'{"messages": [{"role": "user", "content": "x"}], "mars_acceptance": "guess"}',
]
# kind -> weight in the mix. "raises*": the prompt holds a marker token that makes the model raise
# (see `inject_faults`); "surrogate": a lone surrogate in a prompt or a chat message (sent escaped, as JSON allows);
# "disconnect": a stream the client leaves after its first line; "overlong": a prompt past the model's positions;
# "mask": the mask token in the prompt;
# "suppressed": a valid request whose usage must count no mask token (the run boosts the mask logit, which the
# model's suppress_tokens must hold back); then what a server must refuse before decoding: no or a wrong API key,
# a foreign Host (DNS rebinding), a foreign Origin (a cross-site page), a text/plain body.
FAULT_MIX = {
    "plain": 3,
    "stream": 3,
    "disconnect": 1,
    "malformed": 1,
    "surrogate": 1,
    "overlong": 1,
    "mask": 1,
    "suppressed": 1,
    "raises": 1,
    "raises-stream": 1,
    "unauthorized": 1,
    "foreign-host": 1,
    "foreign-origin": 1,
    "text-plain": 1,
}
MODEL_KINDS = ("raises", "raises-stream", "mask", "suppressed")  # need a real model, not a scripted engine
# kind -> (status, error code) of the refusal it must get
REFUSALS = {
    "unauthorized": (401, "invalid_api_key"),
    "foreign-host": (421, "invalid_host"),
    "foreign-origin": (403, "forbidden_origin"),
    "text-plain": (415, "unsupported_media_type"),
}
FOREIGN = "attacker.example"
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


def boost_token(model, token_id: int):
    """Make ``token_id`` every prediction's top logit (a model that wants to emit it: a trained MARS checkpoint's
    mask token can rank high). Returns the hook handle."""

    def boost(module, args, kwargs, output):
        logits = output.logits
        logits[..., token_id] = logits.max(dim=-1).values + 5.0

    return model.register_forward_hook(boost, with_kwargs=True)


def greedy_reference(model, prompt_ids: list[int], max_new_tokens: int, eos_token_ids=()) -> list[int]:
    """Plain greedy decoding by full forwards (no cache, no MARS): the answer a lossless row must give. The
    model's ``generation_config.suppress_tokens`` (its mask token) are never chosen, as in ``generate``."""
    ids, out = list(prompt_ids), []
    suppressed = list(getattr(model.generation_config, "suppress_tokens", None) or [])
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            logits = model(input_ids=torch.tensor([ids], device=model.device)).logits[0, -1]
            logits[suppressed] = float("-inf")
            token = int(logits.argmax())
            out.append(token)
            ids.append(token)
            if token in eos_token_ids:
                break
    return out


def parse_sse(lines: list[str]) -> dict:
    """What a stream's lines say: text, finish chunks, error events, ``[DONE]`` count and position, and the
    completion tokens of its usage chunk (None without one)."""
    events = [line[len("data: ") :] for line in lines if line.startswith("data: ")]
    text, finishes, errors, done_at, tokens = "", 0, 0, [], None
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
        if payload.get("usage"):
            tokens = payload["usage"].get("completion_tokens")
    done_last = len(done_at) == 1 and done_at[0] == len(events) - 1
    return {
        "text": text,
        "finishes": finishes,
        "errors": errors,
        "done_once_last": done_last,
        "completion_tokens": tokens,
    }


async def post_request(http, url: str, body, stream: bool, headers: dict | None = None) -> dict:
    """One request; ``{"status", "json" (or None), "plain_text", "sse" (streams with status 200)}``.

    ``headers`` are sent besides (or instead of) ``Content-Type: application/json``."""
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    headers = {"content-type": "application/json", **(headers or {})}
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


def is_json_error(answer: dict, status: int) -> bool:
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
    if is_json_error(answer, 503) and "retry-after" in answer["headers"]:
        return "JSON 503 with Retry-After"
    if answer.get("json") is None:
        return f"BAD plain-text {answer['status']}"
    return f"BAD JSON {answer['status']}"


async def _drain_drive(
    base_url: str, jobs: list[tuple[str, dict, bool]], trigger, timeout_s: float, headers: dict | None
):
    """Send ``jobs`` (path, body, stream), wait until the server holds them all, ``trigger()``, collect."""
    async with httpx2.AsyncClient(timeout=timeout_s) as http:

        async def one(path, body, stream):
            try:
                return await post_request(http, base_url + path, body, stream, headers)
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


def drain_under_load(
    base_url: str,
    jobs: list[tuple[str, dict, bool]],
    trigger,
    timeout_s: float = 120.0,
    headers: dict | None = None,
):
    """SIGTERM (``trigger``) with ``jobs`` running or queued; ``{class: count}`` of the answers."""
    answers = asyncio.run(_drain_drive(base_url, jobs, trigger, timeout_s, headers))
    classes: dict[str, int] = {}
    for answer in answers:
        label = classify_drain_answer(answer)
        classes[label] = classes.get(label, 0) + 1
    return classes


class ErrorLog(logging.Handler):
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
    """One request of a fault run: what it sends and, for a valid one, the text (and token count) it must get."""

    kind: str
    path: str
    body: dict | bytes
    stream: bool
    expected_text: str | None = None
    headers: dict = field(default_factory=dict)
    expected_tokens: int | None = None


class FaultPlan:
    """The requests of a fault run (kinds drawn from ``mix``, seeded) and the check of each answer.

    Valid requests (τ = 1 or verify, lossless) must equal ``reference(prompt_ids, max_tokens)``, computed
    here before serving; ``marker``: the token whose pair makes the model raise (`inject_faults`);
    ``positions``: the model's position limit, named in an over-long prompt's 400; ``api_key``: the server's,
    sent by every request but the ``unauthorized`` ones.
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
        api_key: str | None = None,
    ):
        self.rng = random.Random(seed)
        self.auth = {"authorization": f"Bearer {api_key}"} if api_key else {}
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
        self.expected_ids = {
            (route, i): reference(ids[i], max_tokens)
            for route, ids in (("chat", self.chat_ids), ("plain", self.plain_ids))
            for i in range(len(prompts))
        }
        self.expected = {
            key: tokenizer.decode(ids, skip_special_tokens=True) for key, ids in self.expected_ids.items()
        }
        self.requests = [self._request(i) for i in range(len(self.kinds))]
        for request in self.requests:
            if request.kind != "unauthorized":
                request.headers = {**self.auth, **request.headers}

    def count(self, kind: str) -> int:
        return self.kinds.count(kind)

    def _request(self, i: int) -> FaultRequest:
        kind, p = self.kinds[i], i % len(self.prompts)
        lossless = {"mars_acceptance": "verify"} if i % 2 else {"mars_threshold": 1.0}
        if kind in ("plain", "suppressed"):
            body = {"prompt": self.prompts[p], "max_tokens": self.max_tokens, **lossless}
            count = len(self.expected_ids[("plain", p)])
            return FaultRequest(
                kind, "/v1/completions", body, False, self.expected[("plain", p)], expected_tokens=count
            )
        if kind in REFUSALS:
            return self._refused_request(kind, p)
        if kind in ("stream", "disconnect"):
            messages = [{"role": "user", "content": self.prompts[p]}]
            body = {"messages": messages, "max_tokens": self.max_tokens, **lossless, "stream": True}
            if kind == "disconnect":
                return FaultRequest(kind, "/v1/chat/completions", body, True)
            body["stream_options"] = {"include_usage": True}
            count = len(self.expected_ids[("chat", p)])
            return FaultRequest(
                kind, "/v1/chat/completions", body, True, self.expected[("chat", p)], expected_tokens=count
            )
        if kind == "malformed":
            return FaultRequest(kind, "/v1/chat/completions", self.rng.choice(MALFORMED), False)
        if kind == "surrogate":  # "\ud800" escaped in the JSON: a body any client may send
            lone = "\ud800 " + self.prompts[p]
            if i % 2:
                body = {"messages": [{"role": "user", "content": lone}], "max_tokens": 2}
                return FaultRequest(kind, "/v1/chat/completions", json.dumps(body).encode(), False)
            body = {"prompt": lone, "max_tokens": 2}
            return FaultRequest(kind, "/v1/completions", json.dumps(body).encode(), False)
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

    def _refused_request(self, kind: str, p: int) -> FaultRequest:
        """A valid body sent as a web page or a stranger would: each must be refused before decoding."""
        body = {"prompt": self.prompts[p], "max_tokens": self.max_tokens}
        if kind == "unauthorized":  # no key, or a wrong one (the plan's key is sent only to the others)
            headers = {"authorization": "Bearer wrong-key"} if p % 2 else {}
            return FaultRequest(kind, "/v1/completions", body, False, headers=headers)
        headers = {
            "foreign-host": {"host": FOREIGN},
            "foreign-origin": {"origin": f"http://{FOREIGN}"},
            "text-plain": {"content-type": "text/plain"},
        }[kind]
        return FaultRequest(kind, "/v1/completions", json.dumps(body).encode(), False, headers=headers)

    def check(self, i: int, answer: dict) -> str | None:
        """None when request ``i``'s answer is right, else what is wrong."""
        request = self.requests[i]
        if "exception" in answer:
            return f"{request.kind}: {answer['exception']}"
        if request.kind in ("plain", "stream", "suppressed"):
            return self._check_text(request, answer)
        if request.kind in REFUSALS:
            status, code = REFUSALS[request.kind]
            ok = is_json_error(answer, status) and answer["json"]["error"].get("code") == code
            return None if ok else f"{request.kind}: status {answer['status']} (want a JSON {status} {code})"
        if request.kind in ("malformed", "surrogate", "overlong", "mask"):
            return self._check_refused(request.kind, answer)
        if request.kind == "raises":
            ok = is_json_error(answer, 500) and ROW_FAILED in answer["json"]["error"]["message"]
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
            got, count = sse["text"], sse["completion_tokens"]
        else:
            if answer["status"] != 200:
                return f"{request.kind}: status {answer['status']}"
            got, count = answer["json"]["choices"][0]["text"], answer["json"]["usage"]["completion_tokens"]
        if got != request.expected_text:
            return f"{request.kind}: wrong text"
        # the text hides special tokens (a mask token emitted, then skipped); the count does not
        if request.expected_tokens is not None and count != request.expected_tokens:
            return f"{request.kind}: wrong completion_tokens"
        return None

    def _check_refused(self, kind: str, answer: dict) -> str | None:
        """A JSON 400 whose message names what is wrong."""
        if not is_json_error(answer, 400):
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
        if kind == "surrogate" and not (
            "lone surrogate" in message and answer["json"]["error"].get("param") in ("prompt", "messages")
        ):
            return "surrogate: the 400 does not name the field and the lone surrogate"
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
                            "POST", base_url + request.path, json=request.body, headers=request.headers
                        ) as response:
                            async for _ in response.aiter_lines():
                                break  # first line, then hang up
                        answers[i] = {"status": response.status_code, "disconnected": True}
                    else:
                        answers[i] = await post_request(
                            http, base_url + request.path, request.body, request.stream, request.headers
                        )
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
        metrics_text = httpx2.get(base + "/metrics", headers=plan.auth).text
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
    is affected. The server has an API key (drawn here): requests without it get a 401, those with a foreign
    Host, a foreign Origin or a text/plain body a 421, 403 or 415. The mask token's logit is boosted above
    every other while the run lasts (when the model suppresses it, as MARS checkpoints do): valid answers must
    still equal the reference, and ``suppressed`` ones count no mask token in ``usage``. Memory: RSS after a
    warm-up (the first ``warmup_fraction`` of the requests, every kind among them) against RSS at the end.
    ``engine_factory``: a scripted `Engine` instead of ``model`` (then no model faults). Returns a report;
    ``report["ok"]`` says whether every check held.
    """
    mix = dict(kinds or FAULT_MIX)
    if engine_factory is not None:
        mix = {k: w for k, w in mix.items() if k not in MODEL_KINDS}
    config = LoadTestConfig(max_rows=max_rows, max_tokens=max_tokens, time_limit_s=time_limit_s)
    server_cfg = server_config("controller", config)
    server_cfg.max_prompt_tokens = 256
    api_key = secrets.token_urlsafe(16)
    server_cfg.security = SecurityConfig(api_key=api_key)
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
        mask = limits.mask_token_id
        if mask is not None and mask in (model.generation_config.suppress_tokens or []):
            handles.append(boost_token(model, mask))
        elif mix.pop("suppressed", None) is not None:
            logger.warning(
                "The model does not suppress its mask token (generation_config.suppress_tokens), as MARS "
                "checkpoints do (mars_hf.models.mask_token.suppress_mask_token): the fault run leaves out the "
                "mask-token suppression check."
            )
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
            api_key=api_key,
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
        # every 400 (and the guard's 415) counted as a bad request: a lone surrogate was a 500, answered but not
        # counted
        "refused_counted": outcomes.get("bad_request", 0)
        == sum(plan.count(k) for k in ("malformed", "surrogate", "overlong", "mask", "text-plain")),
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
        and report["refused_counted"]
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
    log = ErrorLog()
    watched = [logging.getLogger(), logging.getLogger("uvicorn"), logging.getLogger("uvicorn.error")]
    server = BackgroundServer(app).start()
    for logger_ in watched:
        logger_.addHandler(log)
    try:
        key = server_cfg.security.api_key
        auth = {"authorization": f"Bearer {key}"} if key else None
        classes = drain_under_load(server.base_url, jobs, server.terminate, headers=auth)
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
