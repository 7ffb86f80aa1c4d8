"""The OpenAI-compatible front: an aiohttp server speaking /v1/chat/completions, /v1/completions, /v1/models and
/health, forwarding each request to Triton's ensemble over gRPC streaming through the client SDK (clients/), so it
runs beside any Triton server, local or remote.

    python -m openai_front --triton localhost:8001 --model-dir checkpoints/glm-demo --port 9000

Every request streams from Triton, whether or not the client streams: the pieces carry the text, the log-probs and
the figures. A client that goes away (a closed connection) cancels its request on the server: aiohttp cancels the
handler, and leaving the SDK's stream sends TensorRT-LLM's `stop` for it, so its KV blocks are free within a step.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid

from aiohttp import web

from clients import AsyncGrpcClient, ChatTemplate
from clients.errors import (GlmError, InvalidRequestError, ModelNotReadyError, OverloadedError,
                            ServerUnavailableError)

from .chat import chat_generation, might_become_a_call, tool_calls_in
from .protocol import MAX_PROMPTS, ApiError, Generation, invalid, parse_body, sampling_keywords, stream_options

log = logging.getLogger("openai_front")


class Answer:
    """One choice as its pieces arrive: its text, log-probs, figures, and what has been streamed of it. `echo`: the
    prompt it starts with (completions' echo)."""

    def __init__(self, echo: str = ""):
        self.echo = echo
        self.text = ""
        self.streamed = 0  # characters of text already sent in chunks
        self.tokens: list[tuple[str, float]] = []  # (piece text, its log-prob), with logprobs on
        self.reported = 0  # tokens whose log-probs have been streamed
        self.finish_reason: str | None = None
        self.num_output_tokens = 0
        self.started = False  # a streamed chat choice sends its role first


class OpenAiFront:
    def __init__(self, triton_url: str, template: ChatTemplate, model_name: str, api_key: str | None = None,
                 triton_model: str = "ensemble"):
        self.triton_url = triton_url
        self.template = template
        self.model_name = model_name
        self.api_key = api_key
        self.triton_model = triton_model
        self.created = int(time.time())
        self.client: AsyncGrpcClient | None = None

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.errors, self.authenticate], client_max_size=8 * 2**20)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model}", self.model)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.on_startup.append(self._open_client)
        app.on_cleanup.append(self._close_client)
        return app

    async def _open_client(self, _app) -> None:
        self.client = AsyncGrpcClient(self.triton_url, model=self.triton_model)

    async def _close_client(self, _app) -> None:
        await self.client.close()

    # -- middlewares ----------------------------------------------------------------------------------------------
    @web.middleware
    async def errors(self, request: web.Request, handler):
        """Every failure as OpenAI's error JSON, with the status OpenAI's clients expect; never a traceback."""
        try:
            return await handler(request)
        except ApiError as exc:
            return web.json_response(exc.body(), status=exc.status)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            message = "no such endpoint" if exc.status == 404 else exc.reason
            return web.json_response(ApiError(exc.status, message).body(), status=exc.status)
        except GlmError as exc:
            error = api_error(exc)
            return web.json_response(error.body(), status=error.status)
        except Exception:
            log.exception("unexpected error on %s", request.path)
            return web.json_response(ApiError(500, "internal server error; the server's log has the details").body(),
                                     status=500)

    @web.middleware
    async def authenticate(self, request: web.Request, handler):
        if self.api_key and request.path.startswith("/v1/"):
            scheme, _, key = request.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), self.api_key.encode()):
                raise ApiError(401, "a valid API key is required: send it as 'Authorization: Bearer <key>'",
                               code="invalid_api_key")
        return await handler(request)

    # -- endpoints ------------------------------------------------------------------------------------------------
    async def health(self, _request) -> web.Response:
        health = await self.client.health()
        ready = all(health.values())
        return web.json_response({"status": "ok" if ready else "unavailable", "triton": health},
                                 status=200 if ready else 503)

    async def models(self, _request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def model(self, request: web.Request) -> web.Response:
        if request.match_info["model"] != self.model_name:
            raise model_not_found(request.match_info["model"])
        return web.json_response(self._model_card())

    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "open-autoglm"}

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        generation = chat_generation(body, self.template)
        return await self._answer(request, generation, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        prompts = body.get("prompt")
        prompts = [prompts] if isinstance(prompts, str) else prompts
        if not isinstance(prompts, list) or not 1 <= len(prompts) <= MAX_PROMPTS or \
                not all(isinstance(prompt, str) for prompt in prompts):
            raise invalid("prompt", f"must be a string or a list of 1 to {MAX_PROMPTS} strings (token ids are not "
                          "taken)")
        sampling, n = sampling_keywords(body, "max_tokens")
        stream, include_usage = stream_options(body)
        logprobs = body.get("logprobs")
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                     or not 0 <= logprobs <= 1):
            raise invalid("logprobs", "must be 0 or 1: this server reports only the chosen tokens' log-probs")
        sampling["return_log_probs"] = bool(logprobs) or None
        generation = Generation(prompts, sampling, n, stream, include_usage, bool(logprobs),
                                echo=body.get("echo") is True)
        return await self._answer(request, generation, chat=False)

    async def _body(self, request: web.Request) -> dict:
        try:
            text = await request.text()
        except ValueError:  # bytes that are not text in the body's charset
            raise ApiError(400, "the request body must be JSON") from None
        body = parse_body(text)
        model = body.get("model")
        if not isinstance(model, str):
            raise invalid("model", "is required: the name /v1/models lists")
        if model != self.model_name:
            raise model_not_found(model)
        return body

    # -- answering ------------------------------------------------------------------------------------------------
    async def _answer(self, request: web.Request, generation: Generation, chat: bool):
        reply = Reply(chat, self.model_name, generation)
        pieces = self._pieces(generation)
        try:
            if not generation.stream:
                async for prompt_index, piece in pieces:
                    reply.add(piece, prompt_index)
                return web.json_response(reply.whole())
            first = await anext(pieces, None)  # an error before the first piece is still an HTTP error
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await response.prepare(request)
            try:
                for prompt_index, piece in [first] if first is not None else []:
                    await self._send(response, reply.add(piece, prompt_index))
                async for prompt_index, piece in pieces:
                    await self._send(response, reply.add(piece, prompt_index))
                await self._send(response, reply.last_chunks())
                await response.write(b"data: [DONE]\n\n")
            except (GlmError, ApiError) as exc:  # failed mid-stream: the status is sent, so the error goes in an event
                await self._send(response, [(exc if isinstance(exc, ApiError) else api_error(exc)).body()])
                await response.write(b"data: [DONE]\n\n")
            except ConnectionResetError:  # the client went away: leaving the SDK's streams cancels the requests
                return response
            await response.write_eof()
            return response
        finally:
            await pieces.aclose()

    async def _pieces(self, generation: Generation):
        """(prompt index, piece) of each prompt's stream from Triton, all running at once, as the pieces come. The
        first error ends them all; so does closing this generator (each stream, left, cancels its request)."""
        sampling = {key: value for key, value in generation.sampling.items() if value is not None}
        arrivals: asyncio.Queue = asyncio.Queue()

        async def run(index: int, prompt: str) -> None:
            try:
                async with self.client.stream(prompt, **sampling) as stream:
                    async for piece in stream.pieces():
                        await arrivals.put((index, piece))
                await arrivals.put((index, None))
            except Exception as exc:
                await arrivals.put((index, exc))

        tasks = [asyncio.create_task(run(index, prompt)) for index, prompt in enumerate(generation.prompts)]
        try:
            running = len(tasks)
            while running:
                index, item = await arrivals.get()
                if isinstance(item, Exception):
                    raise item
                if item is None:
                    running -= 1
                else:
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    @staticmethod
    async def _send(response: web.StreamResponse, events: list[dict]) -> None:
        for event in events:
            # ASCII JSON: a client that splits the stream with str.splitlines() (requests' iter_lines does) would
            # break an event at a raw U+2028 or U+0085 in the text; escaped, every event is one line.
            await response.write(f"data: {json.dumps(event)}\n\n".encode())


class Reply:
    """What one request's pieces add up to, in OpenAI's shapes: chunks while streaming, or the whole response."""

    def __init__(self, chat: bool, model: str, generation: Generation):
        self.chat = chat
        self.generation = generation
        # n choices per prompt, in order: choice prompt_index * n + sequence_index.
        self.answers = [Answer(prompt if generation.echo else "") for prompt in generation.prompts
                        for _ in range(generation.n)]
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.base = {"id": self.id, "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": int(time.time()), "model": model}
        self.prompt_tokens: dict[int, int] = {}  # by prompt index

    def add(self, piece, prompt_index: int = 0) -> list[dict]:
        """Take one piece of a prompt's answers; the chunks to stream for it now."""
        index = prompt_index * self.generation.n + piece.sequence_index
        answer = self.answers[index]
        self.prompt_tokens[prompt_index] = piece.num_input_tokens or self.prompt_tokens.get(prompt_index, 0)
        answer.text += piece.text
        answer.num_output_tokens = piece.num_output_tokens
        if self.generation.logprobs and piece.text:
            answer.tokens.append((piece.text, float(sum(piece.log_probs))))
        if piece.finish_reason:
            answer.finish_reason = {"cancelled": "stop"}.get(piece.finish_reason, piece.finish_reason)
            if piece.finish_reason == "error":
                raise ApiError(500, "the engine failed while generating; the server's log has the details")
        if not self.generation.stream:
            return []
        return self._new_text_chunks(index, answer)

    def _new_text_chunks(self, index: int, answer: Answer) -> list[dict]:
        chunks = []
        if not answer.started:  # a chat choice starts with its role; a completion with the echoed prompt, if asked
            answer.started = True
            if self.chat:
                chunks.append(self._chunk(index, {"role": "assistant", "content": ""}))
            elif answer.echo:
                chunks.append(self._chunk(index, answer.echo))
        held = self.chat and (self.generation.forced_tool is not None or
                              might_become_a_call(answer.text, self.generation.tools))
        if not held and len(answer.text) > answer.streamed:
            text = answer.text[answer.streamed:]
            offset = answer.streamed + len(answer.echo)
            chunks.append(self._chunk(index, {"content": text} if self.chat else text, self._unreported(answer),
                                      offset))
            answer.streamed = len(answer.text)
        if answer.finish_reason is not None:
            chunks.append(self._final_chunk(index, answer))
        return chunks

    def _final_chunk(self, index: int, answer: Answer) -> dict:
        """The last chunk of a choice: a tool call held back until the answer was whole, or text held back because it
        might have been one, and the finish reason."""
        calls = self._calls(answer) if self.chat else None
        if calls:
            delta = {"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}
        elif len(answer.text) > answer.streamed:
            delta = {"content": answer.text[answer.streamed:]} if self.chat else answer.text[answer.streamed:]
        else:
            delta = {} if self.chat else ""
        tokens, offset = self._unreported(answer), answer.streamed + len(answer.echo)
        answer.streamed = len(answer.text)
        return self._chunk(index, delta, tokens, offset, finish_reason="tool_calls" if calls else answer.finish_reason)

    @staticmethod
    def _unreported(answer: Answer) -> list[tuple[str, float]]:
        """The pieces whose log-probs no chunk has carried yet (several, when text was held back)."""
        tokens, answer.reported = answer.tokens[answer.reported:], len(answer.tokens)
        return tokens

    def _chunk(self, index: int, delta, tokens: list[tuple[str, float]] | None = None, offset: int = 0,
               finish_reason: str | None = None) -> dict:
        """A streamed chunk of one choice: `delta` is a chat delta (a dict) or a completion's text; `tokens`: the
        pieces whose log-probs it reports, with logprobs on."""
        logprobs = None
        if tokens and self.generation.logprobs:
            logprobs = ({"content": self._logprob_entries(tokens)} if self.chat else
                        self._completion_logprobs(tokens, offset))
        if self.chat:
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return {**self.base, "choices": [choice], **({"usage": None} if self.generation.include_usage else {})}

    def last_chunks(self) -> list[dict]:
        if not self.generation.include_usage:
            return []
        return [{**self.base, "choices": [], "usage": self._usage()}]

    def whole(self) -> dict:
        choices = []
        for index, answer in enumerate(self.answers):
            text = answer.echo + answer.text
            if self.chat:
                calls = self._calls(answer)
                message = {"role": "assistant", "content": None if calls else text}
                if calls:
                    message["tool_calls"] = calls
                logprobs = {"content": self._logprob_entries(answer.tokens)} if self.generation.logprobs else None
                choices.append({"index": index, "message": message, "logprobs": logprobs,
                                "finish_reason": "tool_calls" if calls else answer.finish_reason})
            else:
                logprobs = (self._completion_logprobs(answer.tokens, len(answer.echo)) if self.generation.logprobs
                            else None)
                choices.append({"index": index, "text": text, "logprobs": logprobs,
                                "finish_reason": answer.finish_reason})
        return {**self.base, "object": "chat.completion" if self.chat else "text_completion", "choices": choices,
                "usage": self._usage()}

    def _calls(self, answer: Answer) -> list[dict] | None:
        if not self.generation.tools:
            return None
        return tool_calls_in(answer.text, self.generation.tools, self.generation.forced_tool)

    def _usage(self) -> dict:
        prompt = sum(self.prompt_tokens.values())
        completion = sum(answer.num_output_tokens for answer in self.answers)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    @staticmethod
    def _logprob_entries(tokens: list[tuple[str, float]]) -> list[dict]:
        """Chat log-probs: one entry per piece of text the engine sent (a token, or the few that make whole
        characters), with its log-prob; no alternatives (top_logprobs)."""
        return [{"token": text, "logprob": logprob, "bytes": list(text.encode()), "top_logprobs": []}
                for text, logprob in tokens]

    @staticmethod
    def _completion_logprobs(tokens: list[tuple[str, float]], offset: int) -> dict:
        offsets = []
        for text, _ in tokens:
            offsets.append(offset)
            offset += len(text)
        return {"tokens": [text for text, _ in tokens], "token_logprobs": [logprob for _, logprob in tokens],
                "top_logprobs": None, "text_offset": offsets}


def model_not_found(model: str) -> ApiError:
    return ApiError(404, f"the model '{model}' does not exist; /v1/models lists the one served here", param="model",
                    code="model_not_found")


def api_error(exc: GlmError) -> ApiError:
    """The SDK's errors (Triton's answers) as OpenAI's."""
    if isinstance(exc, InvalidRequestError):
        # OpenAI's code for a prompt plus max_tokens past the context, which its clients look for by name.
        too_long = "over the model's limit" in exc.message
        return ApiError(400, exc.message, code="context_length_exceeded" if too_long else None)
    if isinstance(exc, OverloadedError):
        return ApiError(429, exc.message, code="overloaded", kind="rate_limit_error")
    if isinstance(exc, (ServerUnavailableError, ModelNotReadyError)):
        return ApiError(503, exc.message, code="unavailable", kind="server_error")
    return ApiError(500, exc.message)


async def serve(front: OpenAiFront, host: str, port: int) -> None:
    """Run until cancelled. Handlers are cancelled when their client disconnects (aiohttp's default is to let them
    run), which is what cancels the request on Triton."""
    runner = web.AppRunner(front.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
