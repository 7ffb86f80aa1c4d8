"""Typed errors: what the server said, as an exception a caller can catch by kind."""

from __future__ import annotations

import json

from tritonclient.utils import InferenceServerException


class GlmError(Exception):
    """Any error from the server or the connection to it; `message` is the server's own words."""

    def __init__(self, message: str, status: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status


class InvalidRequestError(GlmError):
    """The server refused the request's inputs (HTTP 400, gRPC INVALID_ARGUMENT): fix the request."""


class ModelNotReadyError(GlmError):
    """The model (or that version of it) is unknown or not loaded."""


class OverloadedError(GlmError):
    """The server is shedding load (queue full, HTTP 503/429): retry later."""


class RequestCancelledError(GlmError):
    """The request was cancelled before it finished."""


class RequestTimeoutError(GlmError):
    """No answer within the client's timeout; the request was cancelled on the server."""


class ServerUnavailableError(GlmError):
    """No server answers at that address, or it is shutting down: retry later or on another replica."""


class ServerError(GlmError):
    """The server failed while serving a valid request."""


_HTTP_STATUS = {400: InvalidRequestError, 404: ModelNotReadyError, 429: OverloadedError, 499: RequestCancelledError,
                503: OverloadedError, 504: RequestTimeoutError}
_GRPC_STATUS = {"INVALID_ARGUMENT": InvalidRequestError, "NOT_FOUND": ModelNotReadyError,
                "RESOURCE_EXHAUSTED": OverloadedError, "CANCELLED": RequestCancelledError,
                "DEADLINE_EXCEEDED": RequestTimeoutError, "UNAVAILABLE": ServerUnavailableError,
                "INTERNAL": ServerError}


def _from_message(message: str) -> type[GlmError]:
    """Triton's gRPC stream carries only a message, no status code: tell the kind from Triton's wording."""
    lowered = message.lower()
    if "unknown model" in lowered or "is not ready" in lowered or "is not found" in lowered:
        return ModelNotReadyError
    if "maximum queue size" in lowered or "overloaded" in lowered:
        return OverloadedError
    if "shutting down" in lowered:
        return ServerUnavailableError
    if "cancelled" in lowered:
        return RequestCancelledError
    if lowered.startswith("engine failure") or "internal" in lowered:
        return ServerError
    # Everything else the pipeline refuses is about the request: a bad value, a prompt too long for the cache.
    return InvalidRequestError


def message_from_body(body: str) -> str:
    """The server's message from an HTTP error body: JSON, or one server-sent event holding JSON."""
    text = body.strip()
    if text.startswith("data: "):
        text = text[len("data: "):]
    try:
        return json.loads(text)["error"]
    except (ValueError, KeyError, TypeError):
        return text or "no message"


def from_http(status_code: int, message: str) -> GlmError:
    kind = _HTTP_STATUS.get(status_code) or (ServerError if status_code >= 500 else _from_message(message))
    if "overloaded" in message.lower():  # Triton 2.51's generate endpoints may answer it with 400
        kind = OverloadedError
    elif "shutting down" in message.lower():  # a draining server's 503 (or the generate endpoints' 400)
        kind = ServerUnavailableError
    return kind(message, str(status_code))


def from_triton(error: Exception) -> GlmError:
    """An exception raised by tritonclient (or its transport) as one of ours."""
    if isinstance(error, GlmError):
        return error
    if isinstance(error, InferenceServerException):
        status = error.status() or ""
        message = error.message() or str(error)
        code = status.rsplit(".", 1)[-1]
        if code.isdigit():
            return from_http(int(code), message)
        kind = _GRPC_STATUS.get(code) or _from_message(message)
        if code == "UNAVAILABLE" and "overloaded" in message.lower():  # the engine's admission limit, not a dead server
            kind = OverloadedError
        return kind(message, status or None)
    if isinstance(error, (ConnectionError, OSError)):
        return ServerUnavailableError(str(error))
    return GlmError(str(error))
