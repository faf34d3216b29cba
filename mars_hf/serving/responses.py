"""OpenAI response shapes: whole completions, SSE chunks, ``usage`` with what MARS did, and the
incremental text of a stream (`TextAssembler`: detokenising, stop strings)."""

from __future__ import annotations

import time
import uuid


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(request, acceptance: str) -> dict:
    """Token counts plus what MARS did for this request (τ used, tokens per forward)."""
    mean_tau = request.mean_tau
    tpf = request.tokens_per_forward
    prompt = len(request.prompt_ids)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": request.completion_tokens,
        "total_tokens": prompt + request.completion_tokens,
        "mars_threshold": None if mean_tau is None else round(mean_tau, 4),
        "mars_acceptance": acceptance,
        "mars_tokens_per_forward": None if tpf is None else round(tpf, 4),
        "mars_forwards": request.steps,
        "mars_drafts": {source: dict(counts) for source, counts in request.drafts.items()},
    }


def chat_response(request_id: str, model: str, text: str, finish_reason: str, usage_: dict) -> dict:
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": finish_reason,
                "logprobs": None,
            }
        ],
        "usage": usage_,
    }


def completion_response(request_id: str, model: str, text: str, finish_reason: str, usage_: dict) -> dict:
    return {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}],
        "usage": usage_,
    }


def _stream_chunk(request_id, model, kind, choice, usage_, created) -> dict:
    """One SSE chunk; ``choice`` None gives an empty ``choices`` list (the final usage-only chunk)."""
    chunk = {
        "id": request_id,
        "object": kind,
        "created": created or int(time.time()),
        "model": model,
        "choices": [] if choice is None else [{"index": 0, **choice, "logprobs": None}],
    }
    if usage_ is not None:
        chunk["usage"] = usage_
    return chunk


def chat_chunk(request_id, model, *, delta=None, finish_reason=None, usage_=None, created=None) -> dict:
    empty = delta is None and finish_reason is None
    choice = None if empty else {"delta": delta or {}, "finish_reason": finish_reason}
    return _stream_chunk(request_id, model, "chat.completion.chunk", choice, usage_, created)


def completion_chunk(request_id, model, *, text=None, finish_reason=None, usage_=None, created=None) -> dict:
    empty = text is None and finish_reason is None
    choice = None if empty else {"text": text or "", "finish_reason": finish_reason}
    return _stream_chunk(request_id, model, "text_completion", choice, usage_, created)


class TextAssembler:
    """Incremental detokenisation with stop strings.

    Decodes the whole generated sequence each time (so multi-token characters come out whole), holds
    back a trailing replacement character (an incomplete UTF-8 sequence) and, with stop strings, the
    last ``len(longest stop) - 1`` characters, which could be the start of a stop string.
    """

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.ids: list[int] = []
        self.sent = 0
        self.stopped = False
        self.text = ""

    def add(self, tokens: list[int]) -> str:
        """New text to send after ``tokens``; sets ``stopped`` when a stop string appeared."""
        if self.stopped:
            return ""
        self.ids.extend(tokens)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        for stop in self.stop:
            at = text.find(stop)
            if at != -1:
                self.stopped = True
                text = text[:at]
        self.text = text
        if self.stopped:
            end = len(text)
        else:
            end = len(text) - self.hold
            if text.endswith("\ufffd"):
                end = min(end, len(text) - 1)
        if end <= self.sent:
            return ""
        delta, self.sent = text[self.sent : end], end
        return delta

    def flush(self) -> str:
        delta, self.sent = self.text[self.sent :], len(self.text)
        return delta
