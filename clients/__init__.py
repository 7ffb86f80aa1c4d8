"""Python clients for Open-AutoGLM on Triton: HTTP and gRPC, streaming, cancellation, chat; and a CLI
(`python -m clients --help`). See clients/README.md."""

from .aio import AsyncGrpcClient, AsyncHttpClient
from .chat import GLM4_CHAT_TEMPLATE, ChatTemplate
from .client import GrpcClient, HttpClient
from .errors import (GlmError, InvalidRequestError, ModelNotReadyError, OverloadedError, RequestCancelledError,
                     RequestTimeoutError, ServerError, ServerUnavailableError)
from .request import SAMPLING_INPUTS, Generation
from .stream import AsyncTextStream, TextStream


def connect(url: str | None = None, protocol: str = "grpc", **options):
    """A client for `protocol` ("grpc" or "http") at url (default localhost:8001 / localhost:8000)."""
    clients = {"grpc": GrpcClient, "http": HttpClient}
    if protocol not in clients:
        raise ValueError(f"protocol must be 'grpc' or 'http', got {protocol!r}")
    return clients[protocol](url, **options) if url else clients[protocol](**options)


__all__ = ["AsyncGrpcClient", "AsyncHttpClient", "AsyncTextStream", "ChatTemplate", "GLM4_CHAT_TEMPLATE",
           "Generation", "GlmError", "GrpcClient", "HttpClient", "InvalidRequestError", "ModelNotReadyError",
           "OverloadedError", "RequestCancelledError", "RequestTimeoutError", "SAMPLING_INPUTS", "ServerError",
           "ServerUnavailableError", "TextStream", "connect"]
