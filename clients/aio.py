"""asyncio clients: the methods of clients.client, as coroutines, over tritonclient.grpc.aio and aiohttp.

    async with AsyncGrpcClient("localhost:8001") as client:
        async with client.stream("Hello", max_tokens=32) as stream:
            async for text in stream:
                print(text, end="")
"""

from __future__ import annotations

import asyncio

import aiohttp
import grpc
import tritonclient.grpc.aio as aiogrpc
from tritonclient.utils import InferenceServerException

from .client import CANCEL_TIMEOUT_S, ClientSettings, Deadline, event_piece
from .errors import GlmError, RequestTimeoutError, ServerUnavailableError, from_http, from_triton, message_from_body
from .request import Generation, Piece, answers_asked, generate_body, model_url, stop_body, stop_inputs, triton_inputs
from .stream import AsyncTextStream


class AsyncClientBase(ClientSettings):
    """See clients.client.ClientBase: the same options and methods, awaited."""

    async def generate(self, prompt: str, **sampling) -> Generation:
        return await self._open(prompt, False, sampling).until_done()

    def stream(self, prompt: str, **sampling) -> AsyncTextStream:
        return self._open(prompt, True, sampling)

    async def chat(self, messages: list[dict], **sampling) -> Generation:
        return await self.generate(self.chat_template.render(messages), **sampling)

    def stream_chat(self, messages: list[dict], **sampling) -> AsyncTextStream:
        return self.stream(self.chat_template.render(messages), **sampling)

    def _open(self, prompt: str, stream: bool, sampling: dict) -> AsyncTextStream:
        values, request_id = self._request(prompt, sampling)
        return AsyncTextStream(self._pieces(prompt, stream, values, request_id), bool(values.get("return_log_probs")),
                               request_id)

    async def health(self) -> dict[str, bool]:
        """{"live", "ready", "model_ready"}; all False when no server answers."""
        try:
            return {"live": await self.is_server_live(), "ready": await self.is_server_ready(),
                    "model_ready": await self.is_model_ready()}
        except ServerUnavailableError:
            return {"live": False, "ready": False, "model_ready": False}

    async def _with_deadline(self, deadline: Deadline, awaitable):
        try:
            return await asyncio.wait_for(awaitable, deadline.remaining())
        except asyncio.TimeoutError:
            deadline.remaining()  # raises RequestTimeoutError
            raise

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()


class AsyncGrpcClient(AsyncClientBase):
    def __init__(self, url: str = "localhost:8001", **options):
        super().__init__(url, **options)
        self._client = aiogrpc.InferenceServerClient(self.url)

    async def is_server_live(self) -> bool:
        return await self._call(self._client.is_server_live())

    async def is_server_ready(self) -> bool:
        return await self._call(self._client.is_server_ready())

    async def is_model_ready(self, model: str | None = None) -> bool:
        return await self._call(self._client.is_model_ready(model or self.model, self.model_version))

    async def _call(self, awaitable):
        try:
            return await awaitable
        except InferenceServerException as exc:
            raise from_triton(exc) from None

    async def _pieces(self, prompt: str, stream: bool, values: dict, request_id: str):
        deadline = Deadline(self.timeout)
        request = {"model_name": self.model, "model_version": self.model_version, "request_id": request_id,
                   "inputs": triton_inputs(aiogrpc, prompt, stream, values)}
        over = asyncio.Event()
        call = self._client.stream_infer(_one(request, over))
        finished = False
        unfinished = answers_asked(values)
        try:
            while True:
                try:
                    result, error = await self._with_deadline(deadline, call.__anext__())
                except StopAsyncIteration:
                    finished = True
                    return
                except grpc.RpcError as exc:
                    finished = True
                    raise from_triton(InferenceServerException(exc.details(), str(exc.code()))) from None
                if error is not None:
                    finished = True
                    raise from_triton(error)
                piece = Piece.from_outputs(result.as_numpy)
                # Without empty final responses (not offered by the aio client), the request is over when each of
                # its answers has sent the piece that says why it ended.
                unfinished -= bool(piece.finish_reason)
                finished = unfinished == 0
                yield piece
                if finished:
                    return
        finally:
            over.set()
            call.cancel()
            if not finished:
                await self.cancel(request_id)

    async def cancel(self, request_id: str) -> bool:
        """See GrpcClient.cancel."""
        over = asyncio.Event()
        call = self._client.stream_infer(_one({"model_name": self.engine_model, "inputs": stop_inputs(aiogrpc),
                                               "request_id": request_id}, over))
        try:
            _, error = await asyncio.wait_for(call.__anext__(), CANCEL_TIMEOUT_S)
            return error is None
        except (asyncio.TimeoutError, StopAsyncIteration, grpc.RpcError):
            return False
        finally:
            over.set()
            call.cancel()

    async def close(self) -> None:
        await self._client.close()


class AsyncHttpClient(AsyncClientBase):
    def __init__(self, url: str = "localhost:8000", **options):
        super().__init__(url, **options)
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:  # created inside the running loop, as aiohttp wants
            self._session = aiohttp.ClientSession()
        return self._session

    async def is_server_live(self) -> bool:
        return await self._get_ok(f"http://{self.url}/v2/health/live")

    async def is_server_ready(self) -> bool:
        return await self._get_ok(f"http://{self.url}/v2/health/ready")

    async def is_model_ready(self, model: str | None = None) -> bool:
        return await self._get_ok(model_url(self.url, model or self.model, "ready", self.model_version))

    async def _get_ok(self, url: str) -> bool:
        try:
            async with self._http().get(url) as response:
                return response.status == 200
        except aiohttp.ClientConnectionError as exc:
            raise ServerUnavailableError(f"no server at {self.url}: {exc}") from None

    async def _pieces(self, prompt: str, stream: bool, values: dict, request_id: str):
        deadline = Deadline(self.timeout)
        url = model_url(self.url, self.model, "generate_stream" if stream else "generate", self.model_version)
        finished = False
        unfinished = answers_asked(values)
        try:
            response = await self._with_deadline(
                deadline, self._http().post(url, json=generate_body(prompt, stream, values, request_id)))
            async with response:
                if response.status != 200:
                    raise from_http(response.status, message_from_body(await response.text()))
                if not stream:
                    finished = True
                    yield Piece.from_outputs((await response.json()).get)
                    return
                while True:
                    line = await self._with_deadline(deadline, response.content.readline())
                    if not line:
                        finished = True
                        return
                    piece = event_piece(line.decode().strip())
                    if piece is not None:
                        unfinished -= bool(piece.finish_reason)
                        finished = unfinished == 0
                        yield piece
        except RequestTimeoutError:
            raise  # still running on the server: cancelled below
        except GlmError:
            finished = True  # the server refused the request, or it failed there: nothing runs to cancel
            raise
        except aiohttp.ClientConnectionError as exc:
            finished = True
            raise ServerUnavailableError(f"no server at {self.url}: {exc}") from None
        finally:
            if not finished:
                await self.cancel(request_id)

    async def cancel(self, request_id: str) -> bool:
        """See HttpClient.cancel."""
        try:
            async with self._http().post(model_url(self.url, self.engine_model, "generate"),
                                         json=stop_body(request_id),
                                         timeout=aiohttp.ClientTimeout(total=CANCEL_TIMEOUT_S)) as reply:
                return reply.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


async def _one(request: dict, over: asyncio.Event):
    """The request iterator of a gRPC stream that carries one request; it stays open until `over` is set."""
    yield request
    await over.wait()
