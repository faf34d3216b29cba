"""The FastAPI application: OpenAI-compatible routes over the `Scheduler`.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (both with SSE streaming),
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text). Request bodies and generated
text are never logged.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from mars_hf.serving.protocol import (
    Limits,
    RequestError,
    TextAssembler,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    error_body,
    new_id,
    parse_request,
    usage,
)
from mars_hf.serving.scheduler import (
    SHUTDOWN_RETRY_AFTER_S,
    Done,
    Failed,
    GenerationRequest,
    QueueFull,
    Scheduler,
    ServerClosing,
    Tokens,
)

logger = logging.getLogger(__name__)
DISCONNECT_POLL_S = 0.5


def _sse(payload) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _error(
    message: str, status: int, *, code: str | None = None, retry_after: int | None = None
) -> JSONResponse:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse(error_body(message, status, code), status_code=status, headers=headers)


def build_app(
    tokenizer,
    scheduler: Scheduler,
    *,
    model_id: str,
    limits: Limits,
    request_timeout_s: float | None = 120.0,
    shutdown_grace_s: float = 10.0,
) -> FastAPI:
    """An app whose lifespan starts the scheduler thread and, on shutdown, drains or cancels its rows."""
    metrics = scheduler.metrics

    @asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        yield
        await asyncio.to_thread(scheduler.shutdown, shutdown_grace_s)

    app = FastAPI(title="mars-hf serve", lifespan=lifespan)
    app.state.scheduler = scheduler
    app.state.shutdown_grace_s = shutdown_grace_s
    app.state.limits = limits

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):  # never a crash, never the body in the log
        logger.error("Unhandled %s on %s %s", type(exc).__name__, request.method, request.url.path)
        return _error("internal server error", 500)

    @app.get("/health")
    async def health():
        if scheduler.closing or not scheduler.is_running():
            return JSONResponse({"status": "unavailable"}, status_code=503, headers={"Retry-After": "5"})
        return {
            "status": "ok",
            "running": len(scheduler.running),
            "waiting": len(scheduler.waiting),
            "slots": scheduler.engine.max_rows,
            "mars_threshold": scheduler.tau,
        }

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [{"id": model_id, "object": "model", "created": 0, "owned_by": "mars-hf"}],
        }

    @app.get("/metrics")
    async def metrics_route():
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _handle(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _handle(request, chat=False)

    async def _handle(http_request: Request, *, chat: bool):
        try:
            body = json.loads(await http_request.body())
        except (json.JSONDecodeError, UnicodeDecodeError):
            metrics.requests.labels("bad_request").inc()
            return _error("The request body is not valid JSON.", 400)
        try:
            if isinstance(body, dict) and body.get("model") not in (None, model_id):
                raise RequestError(
                    f"This server serves the model {model_id!r}, not {body.get('model')!r} (see /v1/models).",
                    param="model",
                    status=404,
                    code="model_not_found",
                )
            parsed = parse_request(body, tokenizer, limits, chat=chat)
        except RequestError as error:
            metrics.requests.labels("bad_request").inc()
            return JSONResponse(error.body(), status_code=error.status)

        request = GenerationRequest(
            parsed.prompt_ids, parsed.settings, parsed.pinned, timeout_s=request_timeout_s
        )
        request.bind()
        try:
            scheduler.submit(request)
        except QueueFull as error:
            metrics.requests.labels("rejected").inc()
            return _error(f"Server busy: {error}. Retry later.", 429, retry_after=scheduler.retry_after_s())
        except ServerClosing:
            metrics.requests.labels("shutdown").inc()
            return _error(
                "The server is shutting down. Retry later.", 503, retry_after=SHUTDOWN_RETRY_AFTER_S
            )

        request_id = new_id("chatcmpl" if chat else "cmpl")
        acceptance = parsed.settings.acceptance
        assembler = TextAssembler(tokenizer, parsed.stop)
        if parsed.stream:
            return StreamingResponse(
                _stream(request, request_id, chat, assembler, acceptance, parsed.include_usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        return await _collect(http_request, request, request_id, chat, assembler, acceptance)

    async def _next_event(request: GenerationRequest, http_request: Request | None):
        """The request's next event; with ``http_request``, a client gone away cancels the row."""
        while True:
            try:
                return await asyncio.wait_for(request.queue.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if http_request is not None and await http_request.is_disconnected():
                    scheduler.cancel(request)
                    return None

    async def _collect(http_request, request, request_id, chat, assembler, acceptance):
        text, finish_reason = "", None
        try:
            while finish_reason is None:
                event = await _next_event(request, http_request)
                if event is None:  # client disconnected: nobody reads this response
                    return Response(status_code=499)
                if isinstance(event, Tokens):
                    assembler.add(event.tokens)
                    if assembler.stopped:
                        scheduler.cancel(request, outcome="ok")
                        finish_reason = "stop"
                elif isinstance(event, Done):
                    finish_reason = event.finish_reason
                elif isinstance(event, Failed):
                    return _error(event.message, event.status, retry_after=event.retry_after)
        finally:
            scheduler.cancel(request)
        text = assembler.text
        build = chat_response if chat else completion_response
        return JSONResponse(build(request_id, model_id, text, finish_reason, usage(request, acceptance)))

    async def _stream(request, request_id, chat, assembler, acceptance, include_usage):
        created = int(time.time())

        def chunk(text=None, finish_reason=None, usage_=None):
            if chat:
                delta = (
                    None if text is None and finish_reason is None else ({"content": text} if text else {})
                )
                return _sse(
                    chat_chunk(
                        request_id,
                        model_id,
                        delta=delta,
                        finish_reason=finish_reason,
                        usage_=usage_,
                        created=created,
                    )
                )
            return _sse(
                completion_chunk(
                    request_id,
                    model_id,
                    text=text,
                    finish_reason=finish_reason,
                    usage_=usage_,
                    created=created,
                )
            )

        try:
            if chat:
                yield _sse(
                    chat_chunk(
                        request_id, model_id, delta={"role": "assistant", "content": ""}, created=created
                    )
                )
            finish_reason = None
            while finish_reason is None:
                event = await request.queue.get()
                if isinstance(event, Tokens):
                    delta = assembler.add(event.tokens)
                    if delta:
                        yield chunk(delta)
                    if assembler.stopped:
                        scheduler.cancel(request, outcome="ok")
                        finish_reason = "stop"
                elif isinstance(event, Done):
                    finish_reason = event.finish_reason
                elif isinstance(event, Failed):
                    yield _sse(error_body(event.message, event.status))
                    yield "data: [DONE]\n\n"
                    return
            tail = assembler.flush()
            yield chunk(tail or "", finish_reason)
            if include_usage:
                yield chunk(usage_=usage(request, acceptance))
            yield "data: [DONE]\n\n"
        finally:  # also on a client disconnect (the generator is cancelled): free the row
            scheduler.cancel(request)

    return app
