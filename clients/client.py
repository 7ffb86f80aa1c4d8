"""The HTTP and gRPC clients: the same methods over either protocol, on top of tritonclient.

    from clients import GrpcClient
    client = GrpcClient("localhost:8001")
    print(client.generate("Hello, GLM", max_tokens=32).text)
"""

from __future__ import annotations

import json
import queue
import time
import uuid

import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from .chat import ChatTemplate
from .errors import GlmError, RequestTimeoutError, ServerUnavailableError, from_http, from_triton, message_from_body
from .request import (ENGINE_MODEL, Generation, Piece, answers_asked, generate_body, model_url, request_values,
                      stop_body, stop_inputs, triton_inputs)
from .stream import TextStream

# How long a cancellation (the `stop` request) may take before the client gives up on it.
CANCEL_TIMEOUT_S = 10.0


class Deadline:
    """The time left of a request's timeout (None: no limit)."""

    def __init__(self, timeout: float | None):
        self.timeout = timeout
        self._end = None if timeout is None else time.monotonic() + timeout

    def remaining(self) -> float | None:
        if self._end is None:
            return None
        left = self._end - time.monotonic()
        if left <= 0:
            raise self.expired()
        return left

    def expired(self) -> RequestTimeoutError:
        return RequestTimeoutError(f"no complete answer within the {self.timeout} s timeout; it was cancelled")


class ClientSettings:
    """The options of every client, sync or async.

    model / model_version: what to send requests to (the ensemble by default, or bls); timeout: seconds for a
    whole request (None: no limit); chat_template: a ChatTemplate, or GLM-4's when None; engine_model: where
    `stop` requests go."""

    def __init__(self, url: str, model: str = "ensemble", model_version: str = "", timeout: float | None = None,
                 chat_template: ChatTemplate | None = None, engine_model: str = ENGINE_MODEL):
        self.url = url.split("://", 1)[-1].rstrip("/")
        self.model = model
        self.model_version = str(model_version or "")
        self.timeout = timeout
        self.chat_template = chat_template or ChatTemplate()
        self.engine_model = engine_model

    def _request(self, prompt: str, sampling: dict) -> tuple[dict, str]:
        """The checked sampling values and a new request id (which a `stop` request can name)."""
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
        return request_values(sampling), uuid.uuid4().hex


class ClientBase(ClientSettings):
    """What both protocols share: chat, the generate/stream pair and health checks over tritonclient (`_client`,
    a tritonclient.grpc or .http InferenceServerClient); subclasses send the requests (`_pieces`, `cancel`)."""

    def generate(self, prompt: str, **sampling) -> Generation:
        """The whole answer, in one response. Sampling options: see clients/README.md (max_tokens, temperature...)."""
        return self._open(prompt, False, sampling).until_done()

    def stream(self, prompt: str, **sampling) -> TextStream:
        """A TextStream of the answer's pieces as they are generated."""
        return self._open(prompt, True, sampling)

    def chat(self, messages: list[dict], **sampling) -> Generation:
        """The assistant's reply to messages ([{"role": "user", "content": ...}, ...]), by the chat template."""
        return self.generate(self.chat_template.render(messages), **sampling)

    def stream_chat(self, messages: list[dict], **sampling) -> TextStream:
        return self.stream(self.chat_template.render(messages), **sampling)

    def _open(self, prompt: str, stream: bool, sampling: dict) -> TextStream:
        values, request_id = self._request(prompt, sampling)
        return TextStream(self._pieces(prompt, stream, values, request_id), bool(values.get("return_log_probs")),
                          request_id)

    def is_server_live(self) -> bool:
        return self._call(self._client.is_server_live)

    def is_server_ready(self) -> bool:
        return self._call(self._client.is_server_ready)

    def is_model_ready(self, model: str | None = None) -> bool:
        return self._call(self._client.is_model_ready, model or self.model, self.model_version)

    def health(self) -> dict[str, bool]:
        """{"live", "ready", "model_ready"}; all False when no server answers."""
        try:
            return {"live": self.is_server_live(), "ready": self.is_server_ready(),
                    "model_ready": self.is_model_ready()}
        except ServerUnavailableError:
            return {"live": False, "ready": False, "model_ready": False}

    def _call(self, method, *args, **kwargs):
        """A tritonclient call, its errors turned into ours."""
        try:
            return method(*args, **kwargs)
        except (InferenceServerException, OSError) as exc:
            raise from_triton(exc) from None

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class GrpcClient(ClientBase):
    """gRPC: every request goes over Triton's bidirectional stream, which serves the decoupled ensemble."""

    def __init__(self, url: str = "localhost:8001", **options):
        super().__init__(url, **options)
        self._client = grpcclient.InferenceServerClient(self.url)

    def _pieces(self, prompt: str, stream: bool, values: dict, request_id: str):
        deadline = Deadline(self.timeout)
        responses: queue.SimpleQueue = queue.SimpleQueue()
        client = grpcclient.InferenceServerClient(self.url)  # one stream per request, so requests may overlap
        finished = False
        try:
            client.start_stream(callback=lambda result, error: responses.put((result, error)))
            try:
                client.async_stream_infer(self.model, triton_inputs(grpcclient, prompt, stream, values),
                                          model_version=self.model_version, request_id=request_id,
                                          enable_empty_final_response=True)
            except InferenceServerException as exc:  # the stream broke; its callback got the reason
                finished = True
                try:
                    exc = responses.get(timeout=1.0)[1] or exc
                except queue.Empty:
                    pass
                raise from_triton(exc) from None
            while True:
                try:
                    result, error = responses.get(timeout=deadline.remaining())
                except queue.Empty:
                    deadline.remaining()  # raises RequestTimeoutError
                    continue
                if error is not None:
                    finished = True  # an error ends the request on the server too
                    raise from_triton(error)
                response = result.get_response()
                if response.outputs:
                    yield Piece.from_outputs(result.as_numpy)
                if response.parameters["triton_final_response"].bool_param:
                    finished = True
                    return
        finally:
            client.stop_stream(cancel_requests=not finished)
            client.close()
            if not finished:
                self.cancel(request_id)

    def cancel(self, request_id: str) -> bool:
        """Stop a running request by its id: TensorRT-LLM's `stop` input on the engine model. Needed for the
        ensemble, whose cancellation Triton 2.51 does not pass on to the engine. False if it could not be sent."""
        replies: queue.SimpleQueue = queue.SimpleQueue()
        client = grpcclient.InferenceServerClient(self.url)
        try:
            client.start_stream(callback=lambda result, error: replies.put(error))
            client.async_stream_infer(self.engine_model, stop_inputs(grpcclient), request_id=request_id)
            return replies.get(timeout=CANCEL_TIMEOUT_S) is None
        except (queue.Empty, InferenceServerException):
            return False
        finally:
            client.stop_stream()
            client.close()

    def close(self) -> None:
        self._client.close()


class HttpClient(ClientBase):
    """HTTP: Triton's generate and generate_stream endpoints (server-sent events), which serve the decoupled
    ensemble. tritonclient.http has no call for them, and its /infer refuses decoupled models, so these two go
    through `requests`; health checks go through tritonclient.http."""

    def __init__(self, url: str = "localhost:8000", **options):
        super().__init__(url, **options)
        self._client = httpclient.InferenceServerClient(self.url)
        self._session = requests.Session()

    def _pieces(self, prompt: str, stream: bool, values: dict, request_id: str):
        deadline = Deadline(self.timeout)
        url = model_url(self.url, self.model, "generate_stream" if stream else "generate", self.model_version)
        finished = False
        try:
            response = self._session.post(url, json=generate_body(prompt, stream, values, request_id), stream=True,
                                          timeout=(CANCEL_TIMEOUT_S, deadline.remaining()))
            with response:
                if response.status_code != 200:
                    raise from_http(response.status_code, message_from_body(response.text))
                if not stream:
                    finished = True
                    yield Piece.from_outputs(response.json().get)
                    return
                unfinished = answers_asked(values)
                for line in response.iter_lines(decode_unicode=True):
                    deadline.remaining()
                    piece = event_piece(line)
                    if piece is not None:
                        unfinished -= bool(piece.finish_reason)
                        finished = unfinished == 0
                        yield piece
                finished = True
        except RequestTimeoutError:
            raise  # still running on the server: cancelled below
        except GlmError:
            finished = True  # the server refused the request, or it failed there: nothing runs to cancel
            raise
        except requests.ConnectionError as exc:
            if isinstance(exc.__context__, requests.ReadTimeout) or "timed out" in str(exc):
                raise deadline.expired() from None
            finished = True
            raise ServerUnavailableError(f"no server at {self.url}: {exc}") from None
        except requests.Timeout:
            raise deadline.expired() from None
        finally:
            if not finished:
                self.cancel(request_id)

    def cancel(self, request_id: str) -> bool:
        """Stop a running request by its id (see GrpcClient.cancel). Closing an event stream does not stop the
        request in Triton 2.51, so leaving a stream early sends this."""
        try:
            reply = self._session.post(model_url(self.url, self.engine_model, "generate"),
                                       json=stop_body(request_id), timeout=CANCEL_TIMEOUT_S)
            return reply.status_code == 200
        except requests.RequestException:
            return False

    def close(self) -> None:
        self._session.close()
        self._client.close()


def event_piece(line: str) -> Piece | None:
    """The Piece of one server-sent event line of generate_stream (None for other lines); raises its error."""
    if not line.startswith("data: "):
        return None
    event = json.loads(line[len("data: "):])
    if "error" in event:
        raise from_http(200, event["error"])
    return Piece.from_outputs(event.get)
