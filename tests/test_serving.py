"""`mars-hf serve`: real uvicorn servers on loopback, driven by the `openai` client and raw HTTP.

These tests use a scripted engine (the `Engine` protocol) so that scheduling, streaming, limits,
disconnects, timeouts and the controller are checked in seconds and exactly; the real decoder is
tested through the same server in tests/test_serving_decoder.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time

import httpx2 as httpx
import openai
import pytest

from mars_hf.decoding.decoder import RowUpdate
from mars_hf.serving import BackgroundServer, ControllerConfig, ServerConfig, TauController, build_server
from mars_hf.serving.responses import TextAssembler
from mars_hf.serving.scheduler import Scheduler
from tests.tiny import tiny_tokenizer

WORD_IDS = list(range(3, 40))  # plain words of the tiny tokenizer
HANG_GUARD_S = 60.0  # waits that only catch a hang: no verdict depends on how fast this host is


class ScriptedEngine:
    """Row ``r`` emits WORD_IDS cyclically from an offset given by its prompt; τ < 1 emits more per step.

    Tokens per step = 1 for τ >= 1 or verify, else 1 + round(4 * (1 - τ)) — a stand-in for MARS
    acceptance that makes lower τ faster, as on a high-acceptance model. Each step sleeps
    ``step_s`` (the cost of one batched forward, independent of the rows in it).

    A queue or a race a test needs is arranged, not hoped for: steps after the first ``hold_after``
    wait for ``release`` (set by the test, or by the engine itself once ``release_at`` requests were
    submitted to the scheduler, accepted or refused: see the ``counted_submissions`` fixture).
    """

    def __init__(
        self, max_rows=4, max_length=256, step_s=0.002, fail_on_step=None, hold_after=None, release_at=None
    ):
        self.max_rows, self.max_length, self.step_s = max_rows, max_length, step_s
        self.rows: dict[int, dict] = {}
        self.added, self.dropped, self.thresholds = [], [], []
        self.next_id, self.forwards, self.max_seen = 0, 0, 0
        self.fail_on_step = fail_on_step
        self.lock = threading.Lock()
        self.hold_after, self.release_at = hold_after, release_at
        self.release = threading.Event()
        self.submitted = 0

    def kernels(self):
        return contextlib.nullcontext()

    def on_submit(self):
        self.submitted += 1
        if self.release_at is not None and self.submitted >= self.release_at:
            self.release.set()

    @staticmethod
    def expected(prompt_ids, max_new_tokens):
        start = sum(prompt_ids) % len(WORD_IDS)
        return [WORD_IDS[(start + i) % len(WORD_IDS)] for i in range(max_new_tokens)]

    def add_row(self, prompt_ids, settings):
        if len(prompt_ids) + settings.max_new_tokens > self.max_length:
            raise ValueError("row too long")
        assert self.free_slots > 0
        rid = self.next_id
        self.next_id += 1
        self.rows[rid] = {
            "out": self.expected(prompt_ids, settings.max_new_tokens),
            "pos": 0,
            "settings": settings,
        }
        self.added.append((rid, settings.threshold, settings.acceptance))
        self.max_seen = max(self.max_seen, len(self.rows))
        return rid

    def step(self):
        self.forwards += 1
        if self.fail_on_step == self.forwards:
            raise RuntimeError("boom")
        if self.hold_after is not None and self.forwards > self.hold_after:
            if not self.release.wait(HANG_GUARD_S):
                raise RuntimeError("the scripted engine was never released (a hang guard)")
        time.sleep(self.step_s)
        updates = []
        for rid, row in list(self.rows.items()):
            s = row["settings"]
            tau = 1.0 if s.acceptance == "verify" or s.threshold is None else s.threshold
            k = 1 if tau >= 1 else 1 + round(4 * (1 - tau))
            tokens = row["out"][row["pos"] : row["pos"] + k]
            row["pos"] += len(tokens)
            done = row["pos"] >= len(row["out"])
            if done:
                del self.rows[rid]
            updates.append(RowUpdate(rid, tokens, done, "length" if done else None))
        return updates

    def drop_row(self, rid):
        self.dropped.append(rid)
        self.rows.pop(rid, None)

    def set_threshold(self, rid, tau):
        self.thresholds.append(tau)
        self.rows[rid]["settings"].threshold = tau

    @property
    def num_rows(self):
        return len(self.rows)

    @property
    def free_slots(self):
        return self.max_rows - len(self.rows)

    @property
    def num_forwards(self):
        return self.forwards


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture
def counted_submissions(monkeypatch):
    """Tell a `ScriptedEngine` of every request handed to its scheduler (queued or refused as full)."""
    submit = Scheduler.submit

    def counted(self, request):
        try:
            submit(self, request)
        finally:
            hook = getattr(self.engine, "on_submit", None)
            if hook is not None:
                hook()

    monkeypatch.setattr(Scheduler, "submit", counted)


class FrozenClock:
    """The controller's time: it passes only when the test says so (``now += seconds``)."""

    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def wait_until(condition, what: str):
    end = time.monotonic() + HANG_GUARD_S
    while not condition():
        assert time.monotonic() < end, f"{what} never happened (a hang guard)"
        time.sleep(0.01)


def start(tok, engine=None, **config):
    controller = config.pop("controller", ControllerConfig(tau_min=0.5, tau_max=1.0))
    engine = engine or ScriptedEngine()
    cfg = ServerConfig(model_id="tiny", max_length=engine.max_length, controller=controller, **config)
    app, scheduler = build_server(engine, tok, cfg)
    return BackgroundServer(app).start(), engine, scheduler


def client(server):
    return openai.OpenAI(
        base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=HANG_GUARD_S
    )


def async_client(server):
    return openai.AsyncOpenAI(
        base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=HANG_GUARD_S
    )


def expected_text(tok, prompt_ids, n):
    return tok.decode(ScriptedEngine.expected(prompt_ids, n), skip_special_tokens=True)


def chat_ids(tok, content):
    text = tok.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    return tok(text, add_special_tokens=False)["input_ids"]


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def test_chat_completion_models_health(tok):
    server, engine, _ = start(tok)
    with server:
        c = client(server)
        assert [m.id for m in c.models.list().data] == ["tiny"]
        out = c.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "the cat sat"}],
            max_tokens=9,
            extra_body={"mars_threshold": 0.75},
        )
        assert out.choices[0].message.content == expected_text(tok, chat_ids(tok, "the cat sat"), 9)
        assert out.choices[0].finish_reason == "length"
        usage = out.usage.model_dump()
        assert usage["completion_tokens"] == 9 and usage["mars_threshold"] == 0.75
        # τ 0.75 -> 2 tokens per step in the scripted engine: 9 tokens in 5 steps
        assert usage["mars_forwards"] == 5 and usage["mars_tokens_per_forward"] == pytest.approx(9 / 5)
        assert engine.added[-1][1:] == (0.75, "probability")
        text = c.completions.create(model="tiny", prompt="hello world", max_tokens=4).choices[0].text
        assert text == expected_text(tok, tok("hello world")["input_ids"], 4)
        health = httpx.get(server.base_url + "/health").json()
        assert health["status"] == "ok" and health["running"] == 0


def test_concurrent_streams_mixed_tau_and_verify(tok):
    server, engine, _ = start(tok, ScriptedEngine(max_rows=3, step_s=0.003))
    prompts = [f"the {w} sat on the mat" for w in ("cat", "dog", "red", "blue", "one", "two", "x")]
    taus = [None, 0.9, 0.5, "verify", 1.0, 0.7, None]

    async def one(ac, prompt, tau):
        extra = (
            {"mars_acceptance": "verify"}
            if tau == "verify"
            else ({} if tau is None else {"mars_threshold": tau})
        )
        stream = await ac.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": prompt}],
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra,
        )
        text, usage, finish = "", None, None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage is not None:
                usage = chunk.usage.model_dump()
        return text, usage, finish

    async def main():
        ac = async_client(server)
        return await asyncio.gather(*(one(ac, p, t) for p, t in zip(prompts, taus)))

    with server:
        results = asyncio.run(main())
    assert engine.max_seen == 3  # never more rows than slots, and the slots were used together
    for prompt, tau, (text, usage, finish) in zip(prompts, taus, results):
        assert text == expected_text(tok, chat_ids(tok, prompt), 12)
        assert finish == "length" and usage["completion_tokens"] == 12
        if tau == "verify":
            assert usage["mars_acceptance"] == "verify" and usage["mars_tokens_per_forward"] == 1.0
        elif tau is not None:
            assert usage["mars_threshold"] == tau
    pinned = {t for _, t, a in engine.added if a == "probability"}
    assert {0.9, 0.5, 1.0, 0.7} <= pinned


BAD_BODIES = [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "JSON object"),
    (json.dumps({"messages": "hi"}).encode(), "`messages`"),
    (json.dumps({"messages": [{"role": "user", "content": 3}]}).encode(), "content"),
    (json.dumps({"messages": [{"role": "wizard", "content": "x"}]}).encode(), "role"),
    (
        json.dumps({"messages": [{"role": "user", "content": "x"}], "mars_threshold": 1.5}).encode(),
        "[0.0, 1.0]",
    ),
    (
        json.dumps({"messages": [{"role": "user", "content": "x"}], "mars_threshold": "high"}).encode(),
        "number",
    ),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "mars_threshold": True}).encode(), "number"),
    (
        json.dumps({"messages": [{"role": "user", "content": "x"}], "mars_acceptance": "vibes"}).encode(),
        "mars_acceptance",
    ),
    (
        json.dumps({"messages": [{"role": "user", "content": "x"}], "mars_acceptance": "entropy"}).encode(),
        "entropy",
    ),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": "10"}).encode(), "integer"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}).encode(), ">= 1"),
    (
        json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**6}).encode(),
        "max_tokens",
    ),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "temperature": -1}).encode(), "temperature"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "n": 2}).encode(), "`n: 1`"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}).encode(), "stream"),
    (json.dumps({"messages": [{"role": "user", "content": " ".join(["cat"] * 300)}]}).encode(), "at most"),
    (b"[" * 100_000 + b"]" * 100_000, "nests too deeply"),  # a RecursionError in json: was a 500
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "seed": 2**70}).encode(), "seed"),
    (
        json.dumps({"messages": [{"role": "user", "content": "x"}], "presence_penalty": 0.5}).encode(),
        "presence_penalty",
    ),
    (
        json.dumps({"messages": [{"role": "user", "content": "x"}], "frequency_penalty": 1}).encode(),
        "frequency_penalty",
    ),
    (
        json.dumps({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": 10}}).encode(),
        "logit_bias",
    ),
]


def test_malformed_requests_are_4xx_with_a_message(tok):
    server, engine, _ = start(tok, max_prompt_tokens=100, max_new_tokens=64)
    with server:
        url = server.base_url + "/v1/chat/completions"
        for body, fragment in BAD_BODIES:
            r = httpx.post(url, content=body, headers={"content-type": "application/json"})
            assert r.status_code == 400, (body[:60], r.status_code, r.text)
            assert fragment in r.json()["error"]["message"], (fragment, r.json())
        r = httpx.post(url, json={"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 404 and "tiny" in r.json()["error"]["message"]
        r = httpx.post(server.base_url + "/v1/completions", json={"prompt": 12})
        assert r.status_code == 400 and "prompt" in r.json()["error"]["message"]
        with pytest.raises(openai.BadRequestError, match="mars_threshold"):
            client(server).chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "x"}], extra_body={"mars_threshold": -0.1}
            )
        assert engine.added == []  # nothing malformed reached the engine
        assert httpx.get(server.base_url + "/health").status_code == 200
        metrics = httpx.get(server.base_url + "/metrics").text
        assert metric(metrics, 'mars_requests_total{outcome="bad_request"}') == len(BAD_BODIES) + 3


def test_what_a_request_cannot_be_is_refused_early_in_openai_shape(tok):
    """A body over the server's limit is a 413 before it is parsed or tokenized (an 8 MB prompt held every other
    stream up for seconds); a prompt of whitespace only, completions' `logprobs`, an unknown route: each a 4xx in
    OpenAI's error shape. Settings that could never serve are refused when the server is configured."""
    server, engine, _ = start(tok, max_body_bytes=2_000)
    with server:
        url = server.base_url + "/v1/completions"
        r = httpx.post(url, json={"prompt": "the " * 1_000, "max_tokens": 2})
        assert r.status_code == 413 and "--max-body-bytes" in r.json()["error"]["message"]
        r = httpx.post(url, json={"prompt": "   ", "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        r = httpx.post(url, json={"prompt": "the cat", "max_tokens": 2, "logprobs": 0})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
        r = httpx.get(server.base_url + "/v1/models/tiny")
        assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
        assert engine.added == []
        out = client(server).completions.create(model="tiny", prompt="the cat", max_tokens=2)
        assert out.choices[0].text == expected_text(tok, tok("the cat")["input_ids"], 2)
    for name in ("default_max_tokens", "max_body_bytes"):
        with pytest.raises(ValueError, match=name):
            ServerConfig(**{name: 0})


def test_full_queue_is_429_with_retry_after(tok, counted_submissions):
    # No step ends before all six requests reached the scheduler: one slot and a queue of two hold
    # two or three of them (three if the first was admitted before the third arrived), the rest are 429.
    engine = ScriptedEngine(max_rows=1, step_s=0.02, hold_after=0, release_at=6)
    server, engine, _ = start(tok, engine, max_queue=2)
    with server:
        url = server.base_url + "/v1/completions"

        async def main():
            async with httpx.AsyncClient(timeout=30) as ac:
                return await asyncio.gather(
                    *(ac.post(url, json={"prompt": "the cat", "max_tokens": 10}) for _ in range(6))
                )

        responses = asyncio.run(main())
        codes = sorted(r.status_code for r in responses)
        assert codes.count(200) in (2, 3) and codes.count(429) == 6 - codes.count(200), codes
        busy = next(r for r in responses if r.status_code == 429)
        assert int(busy.headers["retry-after"]) >= 1 and "Retry later" in busy.json()["error"]["message"]
        # issue 59: typed as OpenAI types a rate limit (it was an `invalid_request_error`: nothing to fix in it)
        error = busy.json()["error"]
        assert error["type"] == "rate_limit_exceeded" and error["code"] == "rate_limit_exceeded", error
        assert httpx.get(server.base_url + "/health").json()["status"] == "ok"


def test_disconnect_mid_stream_frees_the_row(tok):
    # Two steps run (the two chunks the client reads), then the engine holds until the server has seen
    # the client go: the row can neither finish nor be freed first, however slow or fast the host.
    engine = ScriptedEngine(max_rows=2, step_s=0.01, hold_after=2)
    server, engine, scheduler = start(tok, engine, max_new_tokens=200)
    with server:
        with httpx.Client(timeout=HANG_GUARD_S) as hc:
            body = {"prompt": "the cat", "max_tokens": 200, "stream": True}
            with hc.stream("POST", server.base_url + "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                got = [next(lines) for _ in range(3)]
                assert any(line.startswith("data: ") for line in got)
            # the connection is closed here, 200 tokens are far from done
        wait_until(lambda: any(r.cancelled for r in list(scheduler.running.values())), "the disconnect seen")
        assert engine.dropped == [] and engine.num_rows == 1  # freed at the next step boundary, not before
        engine.release.set()
        wait_until(lambda: engine.dropped and not scheduler.running, "the row freed")
        assert engine.dropped == [0] and engine.num_rows == 0 and not scheduler.running
        metrics = httpx.get(server.base_url + "/metrics").text
        assert metric(metrics, "mars_running_rows") == 0
        assert metric(metrics, 'mars_requests_total{outcome="cancelled"}') == 1
        # and the server keeps serving
        out = client(server).completions.create(model="tiny", prompt="a dog", max_tokens=3)
        assert out.choices[0].text == expected_text(tok, tok("a dog")["input_ids"], 3)


def test_request_timeout_is_504(tok):
    server, engine, scheduler = start(tok, ScriptedEngine(max_rows=1, step_s=0.02), request_timeout_s=0.2)
    with server:
        r = httpx.post(
            server.base_url + "/v1/completions", json={"prompt": "the cat", "max_tokens": 100}, timeout=10
        )
        assert r.status_code == 504 and "timeout" in r.json()["error"]["message"]
        assert engine.dropped == [0] and not scheduler.running


def test_stop_strings_end_the_row(tok):
    server, engine, _ = start(tok)
    with server:
        ids = tok("hello")["input_ids"]
        full = expected_text(tok, ids, 20).split()
        stop = " ".join(full[3:5])
        c = client(server)
        out = c.completions.create(model="tiny", prompt="hello", max_tokens=20, stop=stop)
        assert out.choices[0].text == " ".join(full[:3]) + " " and out.choices[0].finish_reason == "stop"
        stream = c.completions.create(model="tiny", prompt="hello", max_tokens=20, stop=[stop], stream=True)
        assert "".join(ch.choices[0].text for ch in stream if ch.choices) == out.choices[0].text


def test_a_stop_string_bills_the_tokens_up_to_it(tok):
    """A step keeps several tokens, and the row runs on until the cancel that the stop string causes reaches the
    scheduler: usage counts the tokens up to the one that completes the stop, and the forwards up to it, the same
    for every repeat of the request however many steps ran after (they used to be billed, a timing-dependent
    number of them)."""
    server, engine, _ = start(tok, ScriptedEngine(step_s=0.0), max_new_tokens=64)
    with server:
        ids = tok("hello")["input_ids"]
        full = ScriptedEngine.expected(ids, 40)
        stop = tok.decode(full[3:5], skip_special_tokens=True)
        upto = next(n for n in range(1, 41) if stop in tok.decode(full[:n], skip_special_tokens=True))
        per_step = 3  # the scripted engine's tokens per step at τ = 0.5
        assert upto % per_step  # the stop completes inside a step: that step kept tokens past it
        c = client(server)
        for _ in range(3):
            out = c.completions.create(
                model="tiny", prompt="hello", max_tokens=40, stop=stop, extra_body={"mars_threshold": 0.5}
            )
            usage = out.usage.model_dump()
            assert out.choices[0].finish_reason == "stop"
            assert usage["completion_tokens"] == upto and usage["mars_forwards"] == -(-upto // per_step)
            stream = c.completions.create(
                model="tiny",
                prompt="hello",
                max_tokens=40,
                stop=stop,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"mars_threshold": 0.5},
            )
            last = [chunk for chunk in stream][-1]
            assert last.usage.completion_tokens == upto


def test_text_assembler_holds_back_partial_stop_strings(tok):
    ids = [tok.convert_tokens_to_ids(w) for w in "the cat sat on the mat".split()]
    assembler = TextAssembler(tok, ["on the"])
    sent = "".join(assembler.add([i]) for i in ids)
    assert assembler.stopped and sent + assembler.flush() == "the cat sat "


def test_controller_keeps_tau_max_at_low_load_and_lowers_it_under_pressure():
    controller = TauController(ControllerConfig(tau_min=0.6, tau_max=0.95, raise_per_second=0.5), slots=4)
    for t in range(10):
        assert controller.update(queue_depth=0, oldest_wait_s=0.0, now=float(t)) == 0.95
    assert controller.update(queue_depth=2, oldest_wait_s=0.1, now=10.0) == pytest.approx(0.95 - 0.35 * 0.5)
    assert controller.update(queue_depth=8, oldest_wait_s=0.1, now=10.1) == pytest.approx(0.6)
    assert controller.update(queue_depth=0, oldest_wait_s=5.0, now=10.2) == pytest.approx(0.6)  # old waiter
    # load gone: τ climbs back at 0.5 per second, not at once
    assert controller.update(queue_depth=0, oldest_wait_s=0.0, now=10.4) == pytest.approx(0.7)
    assert controller.update(queue_depth=0, oldest_wait_s=0.0, now=12.0) == pytest.approx(0.95)
    off = TauController(ControllerConfig(tau_min=0.6, tau_max=0.95, enabled=False), slots=4)
    assert off.update(queue_depth=100, oldest_wait_s=100.0, now=0.0) == 0.95
    with pytest.raises(ValueError, match="tau_min"):
        ControllerConfig(tau_min=0.9, tau_max=0.5)


def test_controller_lowers_tau_of_unpinned_rows_under_load_and_reports_it(tok, counted_submissions):
    """The queue is arranged (no step ends before all nine requests are in: seven or eight wait for
    two slots, full pressure) and the controller's time is frozen (τ cannot climb back during the
    burst), so every unpinned row is lowered, to exactly τ_min, on any host."""
    controller = ControllerConfig(tau_min=0.5, tau_max=1.0, raise_per_second=100.0)
    engine = ScriptedEngine(max_rows=2, step_s=0.01, hold_after=0, release_at=9)
    server, engine, scheduler = start(tok, engine, controller=controller)
    clock = FrozenClock()
    scheduler.controller.clock = clock

    async def main():
        ac = async_client(server)
        unpinned = [
            ac.completions.create(model="tiny", prompt=f"the cat {w}", max_tokens=16)
            for w in ("sat", "on", "the", "mat", "red", "blue", "one", "two")
        ]
        pinned = ac.completions.create(
            model="tiny", prompt="the dog", max_tokens=16, extra_body={"mars_threshold": 1.0}
        )
        return await asyncio.gather(pinned, *unpinned)

    with server:
        results = asyncio.run(main())
        assert scheduler.tau == 0.5  # no controller time has passed: τ has not climbed back
        burst_thresholds = list(engine.thresholds)
        # after the burst, at low load, τ returns to τ_max: 0.01 s at 100 per second is enough
        clock.now += 0.01
        after = client(server).completions.create(model="tiny", prompt="the", max_tokens=2)
        assert scheduler.tau == 1.0 and after.usage.model_dump()["mars_threshold"] == 1.0
    pinned_usage = results[0].usage.model_dump()
    assert pinned_usage["mars_threshold"] == 1.0 and pinned_usage["mars_tokens_per_forward"] == 1.0
    lowered = [r.usage.model_dump()["mars_threshold"] for r in results[1:]]
    assert max(lowered) < 1.0  # the queue pushed τ down for every row that did not pin it
    # rows admitted before the queue was full were lowered too, and with the controller's time frozen τ
    # only fell during the burst, down to τ_min (a row admitted at τ = 1 may be handed that τ first)
    fallen = [t for t in burst_thresholds if t < 1.0]
    assert fallen == sorted(fallen, reverse=True) and fallen[-1] == 0.5, burst_thresholds
    for r, w in zip(results[1:], ("sat", "on", "the", "mat", "red", "blue", "one", "two")):
        assert r.choices[0].text == expected_text(tok, tok(f"the cat {w}")["input_ids"], 16)


def test_metrics_under_load(tok, counted_submissions):
    """The first step holds until all six requests are in, so /metrics shows the queue on any host."""
    server, engine, _ = start(tok, ScriptedEngine(max_rows=2, step_s=0.01, hold_after=0))
    names = [
        "mars_queue_depth",
        "mars_running_rows",
        "mars_threshold",
        "mars_output_tokens_per_second",
        "mars_tokens_per_forward",
        "mars_time_to_first_token_seconds_count",
        "mars_request_latency_seconds_count",
    ]
    with server:

        async def main():
            ac = async_client(server)
            jobs = [
                asyncio.create_task(ac.completions.create(model="tiny", prompt="x y", max_tokens=30))
                for _ in range(6)
            ]
            end = time.monotonic() + HANG_GUARD_S
            async with httpx.AsyncClient(timeout=HANG_GUARD_S) as hc:
                while True:  # the engine holds: this state stays until it is released
                    text = (await hc.get(server.base_url + "/metrics")).text
                    held = (metric(text, "mars_running_rows"), metric(text, "mars_queue_depth"))
                    if engine.submitted == 6 and sum(held) == 6:
                        break
                    assert time.monotonic() < end, "the six requests never reached the server (a hang guard)"
                    await asyncio.sleep(0.01)
            engine.release.set()
            await asyncio.gather(*jobs)
            return held

        running, queued = asyncio.run(main())
        text = httpx.get(server.base_url + "/metrics").text
        for name in names:
            metric(text, name)
        assert metric(text, "mars_request_latency_seconds_count") == 6
        assert metric(text, "mars_output_tokens_total") == 180
        assert running in (1, 2) and queued == 6 - running  # one or both slots taken, the rest queued
        assert engine.max_seen == 2  # once released, both slots ran at once


def test_engine_failure_fails_running_requests_and_the_server_lives_on(tok):
    server, engine, _ = start(tok, ScriptedEngine(fail_on_step=2))
    with server:
        r = httpx.post(server.base_url + "/v1/completions", json={"prompt": "the cat", "max_tokens": 5})
        assert r.status_code == 500 and "decoding failed" in r.json()["error"]["message"]
        r = httpx.post(server.base_url + "/v1/completions", json={"prompt": "the cat", "max_tokens": 5})
        assert r.status_code == 200
        assert httpx.get(server.base_url + "/health").status_code == 200


def test_graceful_shutdown_finishes_running_rows(tok):
    server, engine, scheduler = start(tok, ScriptedEngine(max_rows=2, step_s=0.01))
    results = []

    def call():
        r = httpx.post(
            server.base_url + "/v1/completions", json={"prompt": "a b", "max_tokens": 30}, timeout=30
        )
        results.append(r.status_code)

    threads = [threading.Thread(target=call) for _ in range(2)]
    for t in threads:
        t.start()
    wait_until(lambda: len(scheduler.running) == 2, "the two requests running")
    server.stop()
    for t in threads:
        t.join(HANG_GUARD_S)
        assert not t.is_alive(), "a request never returned (a hang guard)"
    assert results == [200, 200]
    assert not scheduler.is_running() and scheduler.closing


def test_scheduler_is_running_only_between_start_and_shutdown():
    scheduler = Scheduler(ScriptedEngine(), TauController(ControllerConfig(), slots=4))
    assert not scheduler.is_running()
    scheduler.start()
    assert scheduler.is_running()
    scheduler.shutdown(grace_s=0.0)
    assert not scheduler.is_running() and scheduler.closing


def test_loadtest_reports_every_run_and_plots(tok, tmp_path, counted_submissions, monkeypatch):
    """Every run's queue is arranged (no step ends before its eight requests are in, two slots) and the
    controller's time is frozen (τ goes down with pressure and cannot climb back within a run), so
    what each mode does is the same on any host; throughput is compared in tokens per forward."""
    from mars_hf.serving import server as server_module
    from mars_hf.tools.loadtest import MODES, LoadTestConfig, format_table, run_loadtest

    monkeypatch.setattr(
        server_module,
        "TauController",
        lambda config, slots: TauController(config, slots, clock=FrozenClock()),
    )

    config = LoadTestConfig(
        model="scripted",
        rates=(50.0, 400.0),
        requests=8,
        max_tokens=16,
        max_rows=2,
        tau_min=0.5,
        tau_max=0.75,
    )
    result = run_loadtest(
        config,
        tmp_path,
        tokenizer=tok,
        engine_factory=lambda: ScriptedEngine(max_rows=2, step_s=0.004, hold_after=0, release_at=8),
    )
    runs = {(r["mode"], r["rate"]): r for r in result["runs"]}
    assert len(runs) == 6 and all(r["completed"] == 8 and r["failed"] == 0 for r in runs.values())
    for rate in (50.0, 400.0):
        assert runs[("tau1", rate)]["mean_tau"] == 1.0 and runs[("fixed-max", rate)]["mean_tau"] == 0.75
        assert runs[("tau1", rate)]["agreement_with_tau1"] == 1.0
        # the scripted engine's output does not depend on τ, only its speed does
        assert runs[("controller", rate)]["agreement_with_tau1"] == 1.0
        # saturated: the controller went below τ_max, and lower τ is more tokens per forward here
        assert runs[("controller", rate)]["mean_tau"] < 0.75
        tokens_per_forward = {mode: runs[(mode, rate)]["mean_tokens_per_forward"] for mode in MODES}
        assert (
            tokens_per_forward["controller"]
            > tokens_per_forward["fixed-max"]
            > tokens_per_forward["tau1"]
            == 1
        )
        assert all(runs[(mode, rate)]["output_tokens"] == 8 * 16 for mode in MODES)
        assert all(runs[(mode, rate)]["output_tokens_per_s"] > 0 for mode in MODES)
    assert (tmp_path / "loadtest.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "loadtest.json").read_text())["runs"][0]["tau_trace"]
    assert "controller" in format_table(result)


def test_fault_run_answers_every_well_formed_request_once(tok):
    """The fault run on the scripted engine (no model faults); the real decoder's: test_serving_faults.py."""
    from mars_hf.tools.fault_run import REFUSALS, fault_run

    report = fault_run(
        None,
        tok,
        total=60,
        max_tokens=12,
        max_rows=4,
        concurrency=16,
        prompts=["the cat sat", "a dog is red"],
        engine_factory=lambda: ScriptedEngine(max_rows=4, step_s=0.002),
        reference=ScriptedEngine.expected,
    )
    assert report["ok"], report
    assert report["answered_correctly"] == report["answerable"] and not report["problems"]
    assert report["health"]["status"] == "ok" and report["health"]["running"] == 0
    assert report["rows_left_in_engine"] == 0
    assert report["by_kind"].get("disconnect", 0) >= 1
    # a missing or wrong API key, a foreign Host or Origin, a text/plain body: each refused (issue 52, fault 10)
    assert all(report["by_kind"].get(kind, 0) >= 1 for kind in REFUSALS), report["by_kind"]
    assert report["drain"]["bad"] == 0
