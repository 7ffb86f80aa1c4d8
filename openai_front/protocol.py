"""OpenAI's request bodies read into what the Triton SDK sends, and its error body: no networking here.

What OpenAI's API has and this server does not do is refused with a 400 that names the field, as OpenAI's servers
do; fields that change nothing here (`user`, `store`, `metadata`, `parallel_tool_calls`, ...) are ignored. vLLM's
extensions (`top_k`, `min_p`, `repetition_penalty`, `min_tokens`, `ignore_eos`) are taken too.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

# The most answers one request may ask for (the engine's own limit: SamplingParams' rule for n).
MAX_N = 64
# The most prompts one completions request may carry.
MAX_PROMPTS = 64


class ApiError(Exception):
    """An error as OpenAI reports it: HTTP status, and {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.kind = kind or {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                             429: "rate_limit_error"}.get(status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def invalid(param: str, rule: str) -> ApiError:
    return ApiError(400, f"'{param}' {rule}", param=param, code="invalid_value")


@dataclass
class Generation:
    """One OpenAI request, as read from its body: its prompts (one for chat; completions may send several, each its own
    request to Triton), the SDK's sampling keywords, and how to answer."""

    prompts: list[str]
    sampling: dict
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    tools: list[dict] = field(default_factory=list)
    forced_tool: str | None = None  # tool_choice naming a function: the prompt already holds its name
    echo: bool = False  # completions: each answer starts with its prompt


INT32_MAX = 2**31 - 1  # the integer settings travel to Triton as INT32 tensors


def parse_body(text: str) -> dict:
    """A request body as a JSON object, or an ApiError 400 saying what is wrong with it: not JSON, nested past
    Python's recursion limit, not an object, or a field holding a string that is no Unicode text (JSON lets a lone
    surrogate through as \\ud800, which no UTF-8 encoder takes). Each check runs at json's C speed: an 8 MB body
    costs about what reading it costs."""
    try:
        body = json.loads(text)
    except ValueError:
        raise ApiError(400, "the request body must be JSON") from None
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for key, value in body.items():
        try:
            json.dumps([key, value], ensure_ascii=False).encode()
        except UnicodeEncodeError as exc:
            raise invalid(key if key.isprintable() else "the request body",
                          f"must be Unicode text: it holds a lone surrogate (U+{ord(exc.object[exc.start]):04X})") \
                from None
        except RecursionError:
            raise ApiError(400, "the request body is nested too deeply") from None
    return body


def _number(body: dict, name: str, kind=float, low=None, high=None):
    """A number field, None when absent; `kind` int: a whole number within INT32 unless `high` says otherwise."""
    value = body.get(name)
    if value is None:
        return None
    finite = isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))
    whole = isinstance(value, int) or (finite and value.is_integer())
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not finite or (kind is int and not whole):
        raise invalid(name, f"must be {'an integer' if kind is int else 'a finite number'}, got "
                      f"{json.dumps(value)[:40]}")
    if kind is int and high is None:
        high = INT32_MAX
    if (low is not None and value < low) or (high is not None and value > high):
        shown = str(value) if abs(value) < 1e15 else f"{value:.3g}"
        raise invalid(name, f"must lie in [{low}, {high}], got {shown}" if high is not None else
                      f"must be at least {low}, got {shown}")
    return kind(value)


def _boolean(body: dict, name: str) -> bool | None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise invalid(name, "must be true or false")
    return value


def _stop_words(body: dict) -> list[str] | None:
    stop = body.get("stop")
    if stop is None:
        return None
    words = [stop] if isinstance(stop, str) else stop
    if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
        raise invalid("stop", "must be a string or a list of strings")
    return [w for w in words if w] or None


def refuse_unsupported(body: dict) -> None:
    """Fields of OpenAI's that ask for what this server cannot do: refused rather than silently ignored."""
    if body.get("logit_bias"):
        raise invalid("logit_bias", "is not supported by this server")
    if body.get("suffix"):
        raise invalid("suffix", "is not supported by this server")
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type", "text") != "text":
        raise invalid("response_format", "must be {\"type\": \"text\"}: structured outputs are not supported")
    if body.get("functions") or body.get("function_call"):
        raise invalid("functions", "is deprecated by OpenAI and not supported: use 'tools'")
    modalities = body.get("modalities")
    if modalities not in (None, ["text"]):
        raise invalid("modalities", "must be [\"text\"]")
    best_of = body.get("best_of")
    if best_of not in (None, body.get("n", 1)):
        raise invalid("best_of", "must equal n: answers are not ranked here")


def sampling_keywords(body: dict, max_tokens_field: str) -> tuple[dict, int]:
    """The SDK's keywords for the settings both endpoints share, and n."""
    refuse_unsupported(body)
    max_tokens = _number(body, max_tokens_field, int, 1)
    if max_tokens is None and max_tokens_field != "max_tokens":
        max_tokens = _number(body, "max_tokens", int, 1)
    n = _number(body, "n", int, 1, MAX_N) or 1
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise invalid("seed", "must be an integer")
    sampling = {
        "max_tokens": max_tokens,
        "temperature": _number(body, "temperature", float, 0, 2),
        "top_p": _number(body, "top_p", float, 0, 1),
        "presence_penalty": _number(body, "presence_penalty", float, -2, 2),
        "frequency_penalty": _number(body, "frequency_penalty", float, -2, 2),
        # OpenAI's seed may be negative; the engine's lies in [0, 2**64).
        "seed": None if seed is None else seed % 2**64,
        "stop_words": _stop_words(body),
        "num_return_sequences": n if n > 1 else None,
    }
    # vLLM's extensions of OpenAI's API, which its clients (and genai-perf's --extra-inputs) send.
    sampling.update({
        "top_k": _number(body, "top_k", int, -1),
        "min_p": _number(body, "min_p", float, 0, 1),
        "repetition_penalty": _number(body, "repetition_penalty", float, 0),
        "min_tokens": _number(body, "min_tokens", int, 0),
        "ignore_eos": _boolean(body, "ignore_eos"),
    })
    if sampling["top_k"] == -1:
        sampling["top_k"] = 0  # vLLM turns top-k off with -1, the engine with 0
    if sampling["top_p"] == 0:
        raise invalid("top_p", "must be above 0")
    # OpenAI's default temperature is 1 (sampling); the engine's own default is greedy.
    if sampling["temperature"] is None:
        sampling["temperature"] = 1.0
    return sampling, n


def stream_options(body: dict) -> tuple[bool, bool]:
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise invalid("stream", "must be true or false")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise invalid("stream_options", "must be an object")
    if options and not stream:
        raise invalid("stream_options", "is only allowed when 'stream' is true")
    return stream, bool(options.get("include_usage"))


def text_of_content(content, where: str) -> str:
    """A message's content: a string, or a list of text parts (OpenAI's content parts); nothing else is understood by
    a text model."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise invalid(where, "may hold only text parts ({\"type\": \"text\", \"text\": ...}): this model reads "
                              "text only")
            texts.append(part["text"])
        return "".join(texts)
    raise invalid(where, "must be a string or a list of text parts")
