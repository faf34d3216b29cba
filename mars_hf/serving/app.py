"""The FastAPI application: OpenAI-compatible routes over the `Scheduler`.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (both with SSE streaming),
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text). Each route is a module-level
handler on `router`; what they share (tokenizer, scheduler, limits) is one `ServingState` on
``app.state.serving``, handed to them as a dependency. A completion is answered by a `Reply`, which
turns the request's events into one JSON response or an SSE stream. Request bodies and generated text
are never logged.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from mars_hf.serving.protocol import Limits, ParsedRequest, RequestError, error_body, parse_request
from mars_hf.serving.request import Done, Failed, GenerationRequest, Progress, Tokens
from mars_hf.serving.responses import (
    TextAssembler,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    new_id,
    usage,
)
from mars_hf.serving.scheduler import SHUTDOWN_RETRY_AFTER_S, QueueFull, Scheduler, ServerClosing
from mars_hf.serving.security import RequestGuard, SecurityConfig

logger = logging.getLogger(__name__)
DISCONNECT_POLL_S = 0.5
SSE_DONE = "data: [DONE]\n\n"


@dataclass
class ServingState:
    """What the routes share, set on ``app.state.serving`` by `build_app`."""

    tokenizer: object
    scheduler: Scheduler
    model_id: str
    limits: Limits
    request_timeout_s: float | None = 120.0
    shutdown_grace_s: float = 10.0

    @property
    def metrics(self):
        return self.scheduler.metrics


def serving_state(request: Request) -> ServingState:
    return request.app.state.serving


Serving = Annotated[ServingState, Depends(serving_state)]
router = APIRouter()


def build_app(
    tokenizer,
    scheduler: Scheduler,
    *,
    model_id: str,
    limits: Limits,
    request_timeout_s: float | None = 120.0,
    shutdown_grace_s: float = 10.0,
    security: SecurityConfig | None = None,
    bind_host: str = "127.0.0.1",
) -> FastAPI:
    """An app whose lifespan starts the scheduler thread and, on shutdown, drains or cancels its rows.

    Every request first passes `RequestGuard` (Host, Origin, API key, content type: ``security``; ``bind_host``
    is one of the names it answers to); with ``security.allowed_origins``, CORS preflights of those origins are
    answered (Starlette's `CORSMiddleware`).
    """
    security = security or SecurityConfig()
    app = FastAPI(title="mars-hf serve", lifespan=_lifespan)
    app.state.serving = ServingState(
        tokenizer,
        scheduler,
        model_id,
        limits,
        request_timeout_s=request_timeout_s,
        shutdown_grace_s=shutdown_grace_s,
    )
    app.include_router(router)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
    if security.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(security.allowed_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["authorization", "content-type"],
        )
    # added last, so outermost: nothing (CORS included) runs for a request it refuses
    app.add_middleware(RequestGuard, security=security, bind_host=bind_host, metrics=scheduler.metrics)
    return app


async def _http_error(request: Request, exc: StarletteHTTPException):
    """An unknown route or method in OpenAI's error shape (FastAPI's own is ``{"detail": ...}``), counted."""
    request.app.state.serving.metrics.requests.labels("bad_request").inc()
    return _error(f"{exc.detail}: {request.method} {request.url.path}", exc.status_code)


@asynccontextmanager
async def _lifespan(app: FastAPI):
    state: ServingState = app.state.serving
    state.scheduler.start()
    yield
    await asyncio.to_thread(state.scheduler.shutdown, state.shutdown_grace_s)


async def _unexpected(request: Request, exc: Exception):
    """Never a crash, never the body in the log: a JSON 500 and one log line."""
    logger.error("Unhandled %s on %s %s", type(exc).__name__, request.method, request.url.path)
    request.app.state.serving.metrics.requests.labels("error").inc()  # every response is counted
    return _error("internal server error", 500)


def _error(
    message: str, status: int, *, code: str | None = None, retry_after: int | None = None
) -> JSONResponse:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse(error_body(message, status, code), status_code=status, headers=headers)


def _sse(payload) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


# ----- routes -----


@router.get("/health")
async def health(state: Serving):
    """503 while draining or when the scheduler thread is not running; else the load at a glance."""
    scheduler = state.scheduler
    if scheduler.closing or not scheduler.is_running():
        return JSONResponse({"status": "unavailable"}, status_code=503, headers={"Retry-After": "5"})
    return {
        "status": "ok",
        "running": len(scheduler.running),
        "waiting": len(scheduler.waiting),
        "slots": scheduler.engine.max_rows,
        "mars_threshold": scheduler.tau,
    }


@router.get("/v1/models")
async def models(state: Serving):
    return {
        "object": "list",
        "data": [{"id": state.model_id, "object": "model", "created": 0, "owned_by": "mars-hf"}],
    }


@router.get("/metrics")
async def metrics(state: Serving):
    return Response(state.metrics.render(), media_type=state.metrics.content_type)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, state: Serving):
    return await _complete(request, state, chat=True)


@router.post("/v1/completions")
async def completions(request: Request, state: Serving):
    return await _complete(request, state, chat=False)


# ----- a completion: parse, queue, answer -----


async def _complete(http_request: Request, state: ServingState, *, chat: bool):
    """Both completion routes: validate the body, queue the request, answer it (JSON or a stream)."""
    try:
        raw = await _read_body(http_request, state.limits.max_body_bytes)
        if raw is None:  # the client went away while sending: nobody reads an answer
            logger.info("Client disconnected while sending a request to %s", http_request.url.path)
            state.metrics.requests.labels("cancelled").inc()  # as one that goes while queued or decoding
            return Response(status_code=499)
        parsed = _parse(raw, state, chat=chat)
    except RequestError as error:
        state.metrics.requests.labels("bad_request").inc()
        return JSONResponse(error.body(), status_code=error.status)
    request = GenerationRequest(
        parsed.prompt_ids, parsed.settings, parsed.pinned, timeout_s=state.request_timeout_s
    )
    request.bind()
    refusal = _submit(state, request)
    if refusal is not None:
        return refusal
    reply = Reply(state, request, parsed, chat=chat)
    if parsed.stream:
        return StreamingResponse(
            reply.stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
    return await reply.collect(http_request)


async def _read_body(http_request: Request, limit: int) -> bytes | None:
    """The body, at most ``limit`` bytes (413 above: parsing and tokenizing a huge prompt would hold up every
    stream on the event loop before its length could be refused); None when the client disconnected."""
    declared = http_request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    try:
        async for chunk in http_request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
    except ClientDisconnect:
        return None
    return b"".join(chunks)


def _too_large(limit: int) -> RequestError:
    return RequestError(
        f"The request body is over {limit} bytes, this server's limit (--max-body-bytes).", status=413
    )


def _parse(raw: bytes, state: ServingState, *, chat: bool) -> ParsedRequest:
    """The validated request; `RequestError` (with its HTTP status) for anything this server refuses."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):  # RecursionError: nested too deeply
        raise RequestError("The request body is not valid JSON (or nests too deeply).") from None
    if isinstance(body, dict) and body.get("model") not in (None, state.model_id):
        raise RequestError(
            f"This server serves the model {state.model_id!r}, not {body.get('model')!r} (see /v1/models).",
            param="model",
            status=404,
            code="model_not_found",
        )
    return parse_request(body, state.tokenizer, state.limits, chat=chat)


def _submit(state: ServingState, request: GenerationRequest) -> JSONResponse | None:
    """Queue ``request``; the refusal to send instead when the queue is full (429) or closing (503)."""
    try:
        state.scheduler.submit(request)
    except QueueFull as error:
        state.metrics.requests.labels("rejected").inc()
        return _error(f"Server busy: {error}. Retry later.", 429, retry_after=state.scheduler.retry_after_s())
    except ServerClosing:
        state.metrics.requests.labels("shutdown").inc()
        return _error("The server is shutting down. Retry later.", 503, retry_after=SHUTDOWN_RETRY_AFTER_S)
    return None


@dataclass
class Reply:
    """Answers one queued request from its events: the whole text as JSON (`collect`) or SSE (`stream`).

    Whichever way it ends (finished, stop string, failure, client gone), the row is cancelled on the
    way out, so that the scheduler frees its slot at the next step boundary.
    """

    state: ServingState
    request: GenerationRequest
    parsed: ParsedRequest
    chat: bool
    request_id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    finish_reason: str | None = None
    failure: Failed | None = None
    billed: Progress | None = None  # at a stop string: the progress of the tokens up to it

    def __post_init__(self):
        self.request_id = new_id("chatcmpl" if self.chat else "cmpl")
        self.assembler = TextAssembler(self.state.tokenizer, self.parsed.stop)

    def take(self, event) -> str:
        """Apply one event; returns the new text it makes sendable (a stop string ends the row)."""
        if isinstance(event, Tokens):
            stopped = self.assembler.stopped
            delta = self.assembler.add(event.tokens)
            if self.assembler.stopped and not stopped:
                self.state.scheduler.cancel(self.request, outcome="ok")
                self.finish_reason = "stop"
                self.billed = dataclasses.replace(
                    event.progress, completion_tokens=self.assembler.stop_tokens
                )
            return delta
        if isinstance(event, Done):
            self.finish_reason = event.finish_reason
        elif isinstance(event, Failed):
            self.failure = event
        return ""

    @property
    def over(self) -> bool:
        return self.finish_reason is not None or self.failure is not None

    def usage(self) -> dict:
        progress = self.billed if self.billed is not None else self.request.progress
        return usage(progress, len(self.request.prompt_ids), self.parsed.settings.acceptance)

    async def collect(self, http_request: Request) -> Response:
        """The whole completion as one JSON response (499, unsent, when the client went away)."""
        try:
            while not self.over:
                event = await self._next_event(http_request)
                if event is None:  # client disconnected: nobody reads this response
                    return Response(status_code=499)
                self.take(event)
        finally:
            self.state.scheduler.cancel(self.request)
        if self.failure is not None:
            return _error(self.failure.message, self.failure.status, retry_after=self.failure.retry_after)
        build = chat_response if self.chat else completion_response
        text = self.assembler.text
        return JSONResponse(
            build(self.request_id, self.state.model_id, text, self.finish_reason, self.usage())
        )

    async def _next_event(self, http_request: Request):
        """The request's next event, or None once the client has gone away (the row is then cancelled)."""
        while True:
            try:
                return await asyncio.wait_for(self.request.queue.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await http_request.is_disconnected():
                    self.state.scheduler.cancel(self.request)
                    return None

    async def stream(self):
        """SSE chunks as text becomes sendable; a failure is an error event; always ends with ``[DONE]``."""
        try:
            if self.chat:
                yield self._chunk(role=True)
            while not self.over:
                delta = self.take(await self.request.queue.get())
                if self.failure is not None:
                    yield _sse(error_body(self.failure.message, self.failure.status))
                    yield SSE_DONE
                    return
                if delta:
                    yield self._chunk(delta)
            yield self._chunk(self.assembler.flush() or "", self.finish_reason)
            if self.parsed.include_usage:
                yield self._chunk(usage_=self.usage())
            yield SSE_DONE
        finally:  # also on a client disconnect (the generator is cancelled): free the row
            self.state.scheduler.cancel(self.request)

    def _chunk(self, text=None, finish_reason=None, usage_=None, *, role: bool = False) -> str:
        """One SSE event: new text, the finish reason, the usage, or (chat) the opening role."""
        model_id, common = self.state.model_id, {"usage_": usage_, "created": self.created}
        if not self.chat:
            chunk = completion_chunk(
                self.request_id, model_id, text=text, finish_reason=finish_reason, **common
            )
            return _sse(chunk)
        if role:
            delta = {"role": "assistant", "content": ""}
        elif text is None and finish_reason is None:
            delta = None
        else:
            delta = {"content": text} if text else {}
        return _sse(chat_chunk(self.request_id, model_id, delta=delta, finish_reason=finish_reason, **common))
