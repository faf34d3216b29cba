"""OpenAI request validation: a request body into the decoder's `RowSettings` (response shapes: `responses`).

Bodies are validated by hand rather than by pydantic models so that every refusal is a 400 whose
message names the field and the fix (OpenAI's error shape), and so that the extra top-level MARS
fields (``mars_threshold``, ``mars_acceptance``, like vLLM's extra sampling parameters) sit beside the
standard ones. Fields the OpenAI clients send by default and that do not change decoding are ignored;
fields that would change it and are not supported (``n > 1``, ``logprobs``, tools) are refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mars_hf.decoding.acceptance import ACCEPTANCE_RULES
from mars_hf.decoding.decoder import RowSettings


class RequestError(Exception):
    """An invalid request: becomes an OpenAI-style error response with ``status``."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code

    def body(self) -> dict:
        code = self.code
        if self.status == 429:  # OpenAI's rate-limit shape: clients retry these, not fix the request
            kind, code = RATE_LIMIT, code or RATE_LIMIT
        else:
            kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": code}}


RATE_LIMIT = "rate_limit_exceeded"


def check_text(text: str, where: str, param: str) -> str:
    """``text`` when it is Unicode text the tokenizer can read; a lone surrogate (JSON may spell
    ``"\\ud800"``) is no such text, and reached the tokenizer as a 500 "internal server error"."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise RequestError(
            f"`{where}` holds a lone surrogate ({ascii(text[error.start])} at character {error.start}), which "
            "is not Unicode text: send valid UTF-16 pairs (or the character itself) instead.",
            param=param,
        ) from None
    return text


def error_body(message: str, status: int, code: str | None = None) -> dict:
    return RequestError(message, status=status, code=code).body()


@dataclass
class Limits:
    """Server limits a request is checked against.

    ``model_positions`` / ``positions_field``: the model's position limit and the config field it comes
    from (``max_length`` is already capped by it; named in the error so users see the real bound).
    ``mask_token_id``: MARS's mask token, refused in prompts (see `check_prompt_ids`).
    """

    max_prompt_tokens: int
    max_new_tokens: int
    max_length: int
    default_max_tokens: int = 256
    model_positions: int | None = None
    positions_field: str = "max_position_embeddings"
    mask_token_id: int | None = None
    mask_token: str | None = None
    max_body_bytes: int = 1 << 20


@dataclass
class ParsedRequest:
    """What the HTTP layer needs after validation."""

    prompt_ids: list[int]
    settings: RowSettings
    pinned: bool
    stream: bool
    include_usage: bool
    stop: list[str]


def _number(body: dict, name: str, low: float | None = None, high: float | None = None, *, default=None):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(f"`{name}` must be a number, got {value!r}.", param=name)
    if (low is not None and value < low) or (high is not None and value > high):
        raise RequestError(f"`{name}` must lie in [{low}, {high}], got {value}.", param=name)
    return float(value)


def _integer(body: dict, name: str, low: int | None = None, high: int | None = None, *, default=None):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"`{name}` must be an integer, got {value!r}.", param=name)
    if low is not None and value < low:
        raise RequestError(f"`{name}` must be >= {low}, got {value}.", param=name)
    if high is not None and value > high:
        raise RequestError(f"`{name}` must be <= {high} on this server, got {value}.", param=name)
    return value


def _mars_fields(body: dict) -> tuple[float | None, str, bool]:
    """``(threshold, acceptance, pinned)`` from the extra MARS fields; None threshold = controller's."""
    acceptance = body.get("mars_acceptance", "probability")
    if acceptance is None:
        acceptance = "probability"
    if not isinstance(acceptance, str) or acceptance not in ACCEPTANCE_RULES:
        raise RequestError(
            f"`mars_acceptance` must be one of {list(ACCEPTANCE_RULES)}, got {acceptance!r}.",
            param="mars_acceptance",
        )
    if acceptance == "entropy":
        threshold = _number(body, "mars_threshold", 0.0, None)
        if threshold is None:
            raise RequestError(
                '`mars_acceptance: "entropy"` needs an explicit `mars_threshold` (an entropy bound >= 0).',
                param="mars_threshold",
            )
    else:
        threshold = _number(body, "mars_threshold", 0.0, 1.0)
        if acceptance == "margin" and threshold is None:
            raise RequestError(
                '`mars_acceptance: "margin"` needs an explicit `mars_threshold` in [0, 1].',
                param="mars_threshold",
            )
    pinned = threshold is not None or acceptance != "probability"
    return threshold, acceptance, pinned


MAX_LOOKUP_TOKENS = 64  # prompt-lookup drafts per step at most (each is a column of the forward)


def _prompt_lookup(body: dict, acceptance: str) -> tuple[int | None, int]:
    """``prompt_lookup_num_tokens`` / ``max_matching_ngram_size`` (transformers' names): n-gram drafts,
    checked by verified decoding only."""
    lookup = _integer(body, "prompt_lookup_num_tokens", 1, MAX_LOOKUP_TOKENS)
    ngram = _integer(body, "max_matching_ngram_size", 1, 16)
    if lookup is not None and acceptance != "verify":
        raise RequestError(
            "`prompt_lookup_num_tokens` proposes drafts that only verified decoding checks; add "
            '`mars_acceptance: "verify"`.',
            param="prompt_lookup_num_tokens",
        )
    if ngram is not None and lookup is None:
        raise RequestError(
            "`max_matching_ngram_size` only applies with `prompt_lookup_num_tokens`.",
            param="max_matching_ngram_size",
        )
    return lookup, ngram if ngram is not None else 2


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
        raise RequestError("`stop` must be a non-empty string or a list of up to 4 of them.", param="stop")
    return [check_text(s, "stop", "stop") for s in stop]


def _refuse_unsupported(body: dict, *, chat: bool) -> None:
    n = body.get("n")
    if n not in (None, 1):
        raise RequestError("Only `n: 1` is supported; send several requests instead.", param="n")
    if body.get("best_of") not in (None, 1):
        raise RequestError("`best_of` is not supported by this server.", param="best_of")
    for name in ("logprobs", "top_logprobs", "echo", "suffix"):
        if body.get(name):
            raise RequestError(f"`{name}` is not supported by this server.", param=name)
    if not chat and body.get("logprobs") is not None:  # completions: 0 asks for the chosen token's
        raise RequestError("`logprobs` is not supported by this server.", param="logprobs")
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) not in (None, 0):
            raise RequestError(f"`{name}` is not supported by this server; leave it at 0.", param=name)
    if body.get("logit_bias") not in (None, {}):
        raise RequestError("`logit_bias` is not supported by this server.", param="logit_bias")
    if body.get("tools") or body.get("functions"):
        raise RequestError("Tool calls are not supported by this server.", param="tools")
    response_format = body.get("response_format")
    if response_format not in (None, {"type": "text"}):
        raise RequestError('Only `response_format: {"type": "text"}` is supported.', param="response_format")


def _message_text(message, index: int) -> dict:
    if not isinstance(message, dict):
        raise RequestError(
            f"`messages[{index}]` must be an object with `role` and `content`.", param="messages"
        )
    role, content = message.get("role"), message.get("content")
    if role not in ("system", "developer", "user", "assistant"):
        raise RequestError(
            f"`messages[{index}].role` must be system, developer, user or assistant, got {role!r}.",
            param="messages",
        )
    if isinstance(content, list):
        parts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise RequestError(
                    f'`messages[{index}].content` parts must be {{"type": "text", "text": ...}} (text only).',
                    param="messages",
                )
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise RequestError(f"`messages[{index}].content` must be a string.", param="messages")
    check_text(content, f"messages[{index}].content", "messages")
    return {"role": "system" if role == "developer" else role, "content": content}


def chat_prompt_ids(body: dict, tokenizer) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("`messages` must be a non-empty list.", param="messages")
    messages = [_message_text(m, i) for i, m in enumerate(messages)]
    if not getattr(tokenizer, "chat_template", None):
        raise RequestError(
            "This model has no chat template; use /v1/completions with a plain `prompt`.", param="messages"
        )
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def completion_prompt_ids(body: dict, tokenizer) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError("`prompt` must not be empty.", param="prompt")
        return list(tokenizer(check_text(prompt, "prompt", "prompt"))["input_ids"])
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        vocab = len(tokenizer)
        if not all(0 <= t < vocab for t in prompt):
            raise RequestError(f"`prompt` token ids must lie in [0, {vocab}).", param="prompt")
        return list(prompt)
    raise RequestError(
        "`prompt` must be a string or a list of token ids (one prompt per request).", param="prompt"
    )


def check_prompt_ids(prompt_ids: list[int], limits: Limits, *, param: str) -> None:
    """Refuse prompts the model cannot read: past its positions, or holding the mask token.

    The mask token is refused (400), not escaped: MARS feeds it at the positions it is drafting, so a
    prompt that holds it asks the model to fill that position in rather than to read it (and the
    tokenizer cannot spell it any other way). A user who wants the literal text must avoid it.
    """
    if not prompt_ids:
        raise RequestError("The prompt has no tokens (only whitespace?); send some text.", param=param)
    positions = limits.model_positions
    if positions is not None and len(prompt_ids) >= positions:
        raise RequestError(
            f"The prompt has {len(prompt_ids)} tokens; the model reads at most {positions} positions "
            f"({limits.positions_field}), which must hold the prompt and at least one new token. "
            "Shorten the prompt.",
            param=param,
            code="context_length_exceeded",
        )
    mask = limits.mask_token_id
    if mask is not None and mask in prompt_ids:
        where = prompt_ids.index(mask)
        name = f"{limits.mask_token!r} " if limits.mask_token else ""
        raise RequestError(
            f"The prompt holds the MARS mask token {name}(id {mask}) at token {where}; MARS reserves it for the "
            "positions it drafts, so it cannot be read as prompt text. Remove it from the prompt.",
            param=param,
            code="mask_token_in_prompt",
        )


def parse_request(body, tokenizer, limits: Limits, *, chat: bool) -> ParsedRequest:
    """Validate an OpenAI (chat) completions body; raises `RequestError` with a clear message."""
    if not isinstance(body, dict):
        raise RequestError("The request body must be a JSON object.")
    _refuse_unsupported(body, chat=chat)
    stream, include_usage = _stream_fields(body)
    threshold, acceptance, pinned = _mars_fields(body)
    temperature = _number(body, "temperature", 0.0, 2.0)
    top_p = _number(body, "top_p", 0.0, 1.0, default=1.0)
    if top_p == 0.0:
        raise RequestError("`top_p` must be > 0.", param="top_p")
    top_k = _integer(body, "top_k", 0, None, default=0)
    seed = _integer(body, "seed", -(1 << 63), (1 << 63) - 1)  # a 64-bit generator seed
    lookup, ngram = _prompt_lookup(body, acceptance)
    stop = _stop(body)
    prompt_ids = _prompt_ids(body, tokenizer, limits, chat=chat)
    max_tokens = _max_tokens(body, limits, len(prompt_ids), chat=chat)

    # Every field is set here, from the request or the server's default: a request without `temperature`
    # decodes greedily, one without `mars_threshold` gets the controller's τ (the scheduler sets it).
    eos = tokenizer.eos_token_id
    settings = RowSettings(
        threshold=threshold,
        acceptance=acceptance,
        max_new_tokens=max_tokens,
        eos_token_ids=() if eos is None else (int(eos),),
        do_sample=bool(temperature) if temperature is not None else False,
        temperature=temperature if temperature else 1.0,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        prompt_lookup_num_tokens=lookup,
        max_matching_ngram_size=ngram,
    )
    return ParsedRequest(prompt_ids, settings, pinned, stream, include_usage, stop)


def _stream_fields(body: dict) -> tuple[bool, bool]:
    """``(stream, include_usage)``."""
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError("`stream` must be true or false.", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise RequestError("`stream_options` must be an object.", param="stream_options")
    return stream, bool(options.get("include_usage", False))


def _prompt_ids(body: dict, tokenizer, limits: Limits, *, chat: bool) -> list[int]:
    """The prompt's token ids, checked against the model (`check_prompt_ids`) and the server's limit."""
    prompt_ids = chat_prompt_ids(body, tokenizer) if chat else completion_prompt_ids(body, tokenizer)
    param = "messages" if chat else "prompt"
    check_prompt_ids(prompt_ids, limits, param=param)
    if len(prompt_ids) > limits.max_prompt_tokens:
        raise RequestError(
            f"The prompt has {len(prompt_ids)} tokens; this server accepts at most {limits.max_prompt_tokens} "
            "(--max-prompt-tokens). Shorten the prompt.",
            param=param,
            code="context_length_exceeded",
        )
    return prompt_ids


def _max_tokens(body: dict, limits: Limits, prompt_length: int, *, chat: bool) -> int:
    """``max_tokens`` (chat: or ``max_completion_tokens``), default the server's; it must fit the row."""
    room = limits.max_length - prompt_length
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _integer(body, name, 1, limits.max_new_tokens)
    if max_tokens is None:
        max_tokens = min(limits.default_max_tokens, limits.max_new_tokens, room)
    if max_tokens > room or room < 1:
        bound = (
            f"the model's {limits.max_length} positions ({limits.positions_field})"
            if limits.model_positions == limits.max_length
            else f"the server's {limits.max_length}-token rows (--max-length)"
        )
        raise RequestError(
            f"The prompt ({prompt_length} tokens) plus `{name}` ({max_tokens}) exceeds {bound}. "
            f"Lower `{name}` or shorten the prompt.",
            param=name,
            code="context_length_exceeded",
        )
    return max_tokens
