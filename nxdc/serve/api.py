"""The OpenAI-compatible surface of ``nxdc serve``: request bodies checked field by field (a
field nxdc does not support is named in a 400, never ignored; a value is refused here, with a
400, whenever the engine would not accept it), and responses and stream chunks shaped as the
OpenAI API (and ``vllm bench serve``, the openai SDK) parse them."""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass


class ApiError(Exception):
    """An OpenAI-style error: HTTP ``status`` and ``{"error": {message, type, param, code}}``."""

    TYPES = {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        405: "invalid_request_error",
        413: "invalid_request_error",
    }

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = self.TYPES.get(self.status, "rate_limit_error" if self.status == 429 else "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


# Fields accepted with effect, per endpoint; ``model``, ``user`` and ``metadata`` are read or ignored.
COMMON = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "ignore_eos",
    "user",
    "metadata",
    "store",
}
FIELDS = {"completion": COMMON | {"prompt"}, "chat": COMMON | {"messages", "max_completion_tokens"}}
# Fields nxdc does not implement, accepted only at the value that changes nothing.
NO_OP = {
    "n": (None, 1),
    "best_of": (None, 1),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "logit_bias": (None, {}),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "parallel_tool_calls": (None, True, False),
    "response_format": (None, {"type": "text"}),
    "min_tokens": (None, 0),
}


# Limits of a request's values (docs/serve.md); the body's size is --max-body-bytes.
MAX_TEMPERATURE = 2.0  # OpenAI's range: 0..2
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes
MAX_TOP_K = 2**31 - 1
MAX_STOPS = 16  # stop strings per request
MAX_STOP_CHARS = 256  # characters of one stop string


def loads(raw: bytes):
    """The request body as JSON: strict (no NaN / Infinity), with a one-line 400 for anything
    that is not, including nesting too deep for the parser."""

    def constant(name: str):
        raise ValueError(f"{name} is not a JSON number")

    try:
        return json.loads(raw, parse_constant=constant)
    except RecursionError:
        raise ApiError(400, "the request body is not valid JSON (nested too deeply)") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON ({e})") from None


def _text(value: str, name: str) -> str:
    """A string that can be encoded (JSON's \\ud800 escapes give lone surrogates, which no
    tokenizer takes)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, f"'{name}' is not valid Unicode text (a lone surrogate)", name) from None
    return value


@dataclass(frozen=True)
class Params:
    """A validated request, before tokenization."""

    chat: bool
    model: str | None
    prompt: str | list[int] | None  # completions: text or token ids
    messages: list[dict] | None  # chat
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    ignore_eos: bool


def _number(body: dict, name: str, default, lo: float | None = None, hi: float | None = None, kind=float):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not isinstance(v, int)):
        raise ApiError(400, f"'{name}' must be {'an integer' if kind is int else 'a number'}", name)
    if isinstance(v, float) and not math.isfinite(v):
        raise ApiError(400, f"'{name}' must be a finite number (got {v})", name)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        span = f"at least {lo}" if hi is None else f"between {lo} and {hi}"
        raise ApiError(400, f"'{name}' must be {span} (got {v})", name)
    return kind(v)


def _flag(body: dict, name: str) -> bool:
    v = body.get(name, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise ApiError(400, f"'{name}' must be true or false", name)
    return v


def _stops(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stop = tuple(stop)
    else:
        raise ApiError(400, "'stop' must be a string or a list of strings", "stop")
    if len(stop) > MAX_STOPS:
        raise ApiError(400, f"'stop' has {len(stop)} strings; at most {MAX_STOPS}", "stop")
    for s in stop:
        if len(_text(s, "stop")) > MAX_STOP_CHARS:
            raise ApiError(400, f"a 'stop' string has {len(s)} characters; at most {MAX_STOP_CHARS}", "stop")
    return stop


def _include_usage(body: dict, stream: bool) -> bool:
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}):
        raise ApiError(400, "'stream_options' takes only 'include_usage'", "stream_options")
    if options is not None and not stream:
        raise ApiError(400, "'stream_options' needs 'stream': true", "stream_options")
    return bool((options or {}).get("include_usage"))


def parse(body, chat: bool) -> Params:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    kind = "chat" if chat else "completion"
    for name, value in body.items():
        if name in FIELDS[kind]:
            continue
        if name in NO_OP:
            if value not in NO_OP[name]:
                raise ApiError(400, f"'{name}' is not supported by nxdc (only {NO_OP[name][1]!r})", name)
            continue
        raise ApiError(400, f"unsupported field '{name}'", name)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "'model' must be a string", "model")
    if model is not None:
        _text(model, "model")
    prompt, messages = (None, _messages(body)) if chat else (_prompt(body), None)
    max_tokens = _number(body, "max_tokens", None, 1, kind=int)
    if chat:
        max_tokens = _number(body, "max_completion_tokens", max_tokens, 1, kind=int)
    elif max_tokens is None:
        max_tokens = 16  # the OpenAI completions default
    stop = _stops(body)
    stream = _flag(body, "stream")
    include_usage = _include_usage(body, stream)
    top_k = _number(body, "top_k", 0, -1, MAX_TOP_K, kind=int)
    seed = _number(body, "seed", None, *SEED_RANGE, kind=int)
    temperature = _number(body, "temperature", 1.0, 0.0, MAX_TEMPERATURE)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0:  # the nucleus shrinks to the likeliest token alone: greedy, whatever the temperature
        temperature, top_p = 0.0, 1.0
    return Params(
        chat=chat,
        model=model,
        prompt=prompt,
        messages=messages,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=max(top_k, 0),
        seed=seed,
        stop=stop,
        stream=stream,
        include_usage=include_usage,
        ignore_eos=_flag(body, "ignore_eos"),
    )


def _prompt(body: dict) -> str | list[int]:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    if isinstance(p, str):
        if not p:
            raise ApiError(400, "'prompt' is empty", "prompt")
        return _text(p, "prompt")
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return p
    if isinstance(p, list) and len(p) > 1:
        raise ApiError(
            400, "several prompts in one request are not supported: send one request each", "prompt"
        )
    raise ApiError(400, "'prompt' must be a string or a list of token ids", "prompt")


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError(400, "'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a 'role'", "messages")
        if m["role"] not in ("system", "user", "assistant", "developer"):
            raise ApiError(400, f"messages[{i}]: role '{m['role']}' is not supported", "messages")
        extra = set(m) - {"role", "content", "name"}
        if extra:
            raise ApiError(400, f"messages[{i}]: unsupported field '{sorted(extra)[0]}'", "messages")
        if m.get("name") is not None and not isinstance(m["name"], str):
            raise ApiError(400, f"messages[{i}]: 'name' must be a string", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(c, dict) and c.get("type") == "text" for c in content):
                raise ApiError(400, f"messages[{i}]: only text content parts are supported", "messages")
            if not all(isinstance(c.get("text", ""), str) for c in content):
                raise ApiError(400, f"messages[{i}]: a text part's 'text' must be a string", "messages")
            content = "".join(c.get("text", "") for c in content)
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}]: 'content' must be a string", "messages")
        _text(content, "messages")
        role = "system" if m["role"] == "developer" else m["role"]
        out.append({"role": role, "content": content})
    return out


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def response(p: Params, rid: str, model: str, text: str, finish: str, use: dict) -> dict:
    """A whole (non-streamed) completion."""
    if p.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None}
        obj = "chat.completion"
    else:
        choice, obj = {"index": 0, "text": text, "logprobs": None}, "text_completion"
    choice["finish_reason"] = finish
    return {
        "id": rid,
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": use,
    }


class Chunks:
    """The SSE events of one streamed completion, in the order clients parse: content chunks
    (chat: the role with the first), the chunk with ``finish_reason``, the usage chunk
    (``choices: []``) when asked for, ``[DONE]``."""

    def __init__(self, p: Params, rid: str, model: str):
        self.p, self.rid, self.model = p, rid, model
        self.created = int(time.time())
        self.role_sent = False

    def _event(self, choices: list, **extra) -> bytes:
        obj = "chat.completion.chunk" if self.p.chat else "text_completion"
        body = {
            "id": self.rid,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.p.include_usage:
            body["usage"] = None
        body.update(extra)
        return b"data: " + json.dumps(body, ensure_ascii=False).encode() + b"\n\n"

    def _choice(self, text: str | None, finish: str | None) -> dict:
        if self.p.chat:
            delta = {}
            if not self.role_sent:
                delta["role"] = "assistant"
                self.role_sent = True
            if text is not None:
                delta["content"] = text
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}

    def text(self, text: str) -> bytes:
        return self._event([self._choice(text, None)])

    def finish(self, reason: str, use: dict) -> bytes:
        out = b""
        if self.p.chat and not self.role_sent:  # no text at all: the role still comes first
            out += self._event([self._choice("", None)])
        out += self._event([self._choice(None, reason)])
        if self.p.include_usage:
            out += self._event([], usage=use)
        return out + DONE

    @staticmethod
    def error(err: ApiError) -> bytes:
        return b"data: " + json.dumps(err.body()).encode() + b"\n\n" + DONE


DONE = b"data: [DONE]\n\n"
