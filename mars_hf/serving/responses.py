"""OpenAI response shapes: whole completions, SSE chunks, ``usage`` with what MARS did, and the
incremental text of a stream (`TextAssembler`: detokenising, stop strings)."""

from __future__ import annotations

import time
import uuid


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(progress, prompt_tokens: int, acceptance: str) -> dict:
    """Token counts plus what MARS did for this request (τ used, tokens per forward), from its `Progress`."""
    mean_tau = progress.mean_tau
    tpf = progress.tokens_per_forward
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": progress.completion_tokens,
        "total_tokens": prompt_tokens + progress.completion_tokens,
        "mars_threshold": None if mean_tau is None else round(mean_tau, 4),
        "mars_acceptance": acceptance,
        "mars_tokens_per_forward": None if tpf is None else round(tpf, 4),
        "mars_forwards": progress.steps,
        "mars_drafts": {source: dict(counts) for source, counts in progress.drafts.items()},
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
        self.stop_tokens: int | None = None  # tokens up to the one that completed a stop string
        self.text = ""

    def add(self, tokens: list[int]) -> str:
        """New text to send after ``tokens``; sets ``stopped`` (and ``stop_tokens``) when a stop string appeared."""
        if self.stopped:
            return ""
        before = len(self.ids)
        self.ids.extend(tokens)
        text = self._decode(len(self.ids))
        cut = self._stop_at(text)
        if cut is not None:
            self.stopped = True
            text = text[:cut]
            # the fewest tokens whose text holds the stop (a step may have kept tokens past it)
            self.stop_tokens = len(self.ids)
            for count in range(before + 1, len(self.ids)):
                if self._stop_at(self._decode(count)) is not None:
                    self.stop_tokens = count
                    break
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

    def _stop_at(self, text: str) -> int | None:
        """Where the earliest stop string starts in ``text`` (None: none there)."""
        found = [at for at in (text.find(stop) for stop in self.stop) if at != -1]
        return min(found) if found else None

    def _decode(self, count: int) -> str:
        return self.tokenizer.decode(self.ids[:count], skip_special_tokens=True)

    def flush(self) -> str:
        delta, self.sent = self.text[self.sent :], len(self.text)
        return delta
