"""The client SDK and CLI in clients/, against the real tritonserver of the `triton_server` fixture."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest
from tritonclient.utils import InferenceServerException

from clients import (AsyncGrpcClient, AsyncHttpClient, ChatTemplate, GrpcClient, HttpClient, InvalidRequestError,
                     ModelNotReadyError, OverloadedError, RequestCancelledError, RequestTimeoutError, ServerError,
                     ServerUnavailableError)
from clients.errors import from_http, from_triton
from glm_tools.launcher import free_port
from support import REPO
from support.server import metric, metrics, wait_for

pytestmark = pytest.mark.integration
PROTOCOLS = ["grpc", "http"]

# Streams that tests stop early: near the demo model's 4,096 positions, so that they outlast the stop however fast
# the engine (2,000 tokens took about a second on the C kernels).
LONG_STORY = 4000


def client_for(server, protocol: str, **options):
    if protocol == "grpc":
        return GrpcClient(server.grpc_url, **options)
    return HttpClient(server.http_url, **options)


def async_client_for(server, protocol: str, **options):
    if protocol == "grpc":
        return AsyncGrpcClient(server.grpc_url, **options)
    return AsyncHttpClient(server.http_url, **options)


def blocks_used(server) -> float:
    return metric(metrics(server), "glm_kv_blocks_used")


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_generate_and_stream_give_the_same_answer_and_figures(triton_server, demo_model_dir, protocol):
    from glm_engine.tokenizer import GlmTokenizer

    prompt_tokens = len(GlmTokenizer(demo_model_dir).encode("Once upon a time"))
    with client_for(triton_server, protocol) as client:
        assert client.health() == {"live": True, "ready": True, "model_ready": True}
        whole = client.generate("Once upon a time", max_tokens=24, ignore_eos=True)
        assert whole.text and whole.finish_reason == "length"
        assert (whole.num_input_tokens, whole.num_output_tokens, whole.cum_log_prob) == (prompt_tokens, 24, None)
        with client.stream("Once upon a time", max_tokens=24, ignore_eos=True) as stream:
            pieces = list(stream)
        assert len(pieces) > 5 and "".join(pieces) == whole.text
        assert stream.generation == whole
        # bls answers the same requests.
        bls = client_for(triton_server, protocol, model="bls")
        assert bls.generate("Once upon a time", max_tokens=24, ignore_eos=True).text == whole.text


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_async_clients_match_the_sync_ones(triton_server, protocol):
    expected = client_for(triton_server, protocol).generate("大家好", max_tokens=16, return_log_probs=True)
    assert expected.cum_log_prob < 0

    async def run():
        async with async_client_for(triton_server, protocol) as client:
            assert await client.health() == {"live": True, "ready": True, "model_ready": True}
            whole = await client.generate("大家好", max_tokens=16, return_log_probs=True)
            async with client.stream("大家好", max_tokens=16) as stream:
                pieces = [piece async for piece in stream]
            return whole, pieces

    whole, pieces = asyncio.run(run())
    assert whole.text == expected.text and abs(whole.cum_log_prob - expected.cum_log_prob) < 1e-4
    assert "".join(pieces) == expected.text


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_leaving_a_stream_early_frees_its_blocks(triton_server, protocol):
    cancelled = metric(metrics(triton_server), "glm_requests_finished_total", finish_reason="cancelled")
    client = client_for(triton_server, protocol)
    with client.stream("a very long story", max_tokens=LONG_STORY, ignore_eos=True) as stream:
        next(stream)
        assert blocks_used(triton_server) > 0
    # The ensemble's request is stopped in the engine, not left to run to max_tokens.
    assert wait_for(lambda: blocks_used(triton_server) == 0, timeout=5)
    # The counter moves when the request's last output is processed, which may follow the step that freed its blocks.
    assert wait_for(lambda: metric(metrics(triton_server), "glm_requests_finished_total",
                                   finish_reason="cancelled") == cancelled + 1, timeout=5)
    assert client.generate("still serving?", max_tokens=4).num_output_tokens == 4


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_cancel_by_the_streams_request_id_ends_it_with_what_was_generated(triton_server, protocol):
    client = client_for(triton_server, protocol)
    with client.stream("a very long story", max_tokens=LONG_STORY, ignore_eos=True) as stream:
        first = next(stream)
        assert client.cancel(stream.request_id)
        rest = list(stream)  # the stream ends by itself, with the text generated until the stop
    assert stream.generation.finish_reason == "cancelled" and stream.generation.text == first + "".join(rest)
    assert stream.generation.num_output_tokens < LONG_STORY
    assert wait_for(lambda: blocks_used(triton_server) == 0, timeout=5)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_leaving_an_async_stream_early_frees_its_blocks(triton_server, protocol):
    async def run():
        async with async_client_for(triton_server, protocol) as client:
            async with client.stream("a very long story", max_tokens=LONG_STORY, ignore_eos=True) as stream:
                await stream.__anext__()
                assert blocks_used(triton_server) > 0

    asyncio.run(run())
    assert wait_for(lambda: blocks_used(triton_server) == 0, timeout=5)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_timeout_cancels_the_request(triton_server, protocol):
    client = client_for(triton_server, protocol, timeout=0.5)
    with pytest.raises(RequestTimeoutError, match="0.5 s"):
        client.generate("a very long story", max_tokens=LONG_STORY, ignore_eos=True)
    assert wait_for(lambda: blocks_used(triton_server) == 0, timeout=5)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_server_errors_are_typed_and_carry_the_servers_message(triton_server, protocol):
    client = client_for(triton_server, protocol)
    with pytest.raises(InvalidRequestError, match="top_p must lie in"):
        client.generate("hi", top_p=1.5)
    with pytest.raises(InvalidRequestError, match="text_input' is empty"):
        list(client.stream("   "))
    with pytest.raises(ModelNotReadyError, match="unknown model|not found"):
        client_for(triton_server, protocol, model="no_such_model").generate("hi")
    with pytest.raises(TypeError, match="unknown sampling option"):  # refused before anything is sent
        client.generate("hi", temprature=0.5)
    no_server = SimpleNamespace(grpc_url=f"localhost:{free_port()}", http_url=f"localhost:{free_port()}")
    nobody = client_for(no_server, protocol)
    with pytest.raises(ServerUnavailableError):
        nobody.generate("hi")
    assert nobody.health() == {"live": False, "ready": False, "model_ready": False}

    async def nobody_async():
        async with async_client_for(no_server, protocol) as client:
            return await client.health()

    assert asyncio.run(nobody_async()) == {"live": False, "ready": False, "model_ready": False}


def test_chat_uses_the_checkpoints_template_with_one_glm_prefix(triton_server, demo_model_dir):
    template = ChatTemplate.from_checkpoint(demo_model_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "你好"}]
    prompt = template.render(messages)
    assert prompt == "[gMASK]<sop><|system|>\nBe brief.<|user|>\n你好<|assistant|>"
    from glm_engine.tokenizer import GlmTokenizer

    expected_tokens = len(GlmTokenizer(demo_model_dir).encode(prompt, add_special_tokens=False))
    client = GrpcClient(triton_server.grpc_url, chat_template=template)
    reply = client.chat(messages, max_tokens=8)
    # The template already starts with [gMASK]<sop>; the server does not add a second one.
    assert reply.num_input_tokens == expected_tokens
    assert reply.text == client.generate(prompt, max_tokens=8).text
    with pytest.raises(ValueError, match="unknown chat role"):
        template.render([{"role": "robot", "content": "hi"}])


def cli(server, *args, stdin: str | None = None) -> subprocess.CompletedProcess:
    url = server.grpc_url if "http" not in args else server.http_url
    return subprocess.run([sys.executable, "-m", "clients", *args, "--url", url], cwd=REPO, input=stdin,
                          capture_output=True, text=True, timeout=120)


def test_cli_generate_stream_chat_and_health(triton_server, demo_model_dir):
    health = cli(triton_server, "health")
    assert health.returncode == 0 and json.loads(health.stdout)["model_ready"] is True

    generated = cli(triton_server, "generate", "Hello, GLM", "--max-tokens", "12", "--json")
    assert generated.returncode == 0, generated.stderr
    answer = json.loads(generated.stdout)
    assert answer["finish_reason"] in ("length", "stop") and answer["num_output_tokens"] <= 12

    streamed = cli(triton_server, "stream", "Hello, GLM", "--max-tokens", "12", "--protocol", "http")
    assert streamed.returncode == 0, streamed.stderr
    assert streamed.stdout.rstrip("\n") == answer["text"]
    assert "generated tokens" in streamed.stderr

    chat = cli(triton_server, "chat", "--checkpoint", demo_model_dir, "--max-tokens", "6", "--system", "Be brief.",
               stdin="Hello\nAnd again\n")
    assert chat.returncode == 0, chat.stderr
    assert chat.stdout.count("glm> ") == 2

    refused = cli(triton_server, "generate", "hi", "--temperature", "-1")
    assert refused.returncode == 1
    assert refused.stderr.startswith("error (InvalidRequestError):") and "temperature" in refused.stderr
    assert "Traceback" not in refused.stderr


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_ctrl_c_in_the_cli_cancels_the_stream_on_the_server(triton_server, protocol):
    url = triton_server.grpc_url if protocol == "grpc" else triton_server.http_url
    process = subprocess.Popen([sys.executable, "-m", "clients", "stream", "a very long story", "--max-tokens",
                                str(LONG_STORY), "--ignore-eos", "--protocol", protocol, "--url", url], cwd=REPO,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        process.stdout.read(1)  # text is arriving: the request runs and holds blocks
        assert blocks_used(triton_server) > 0
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=30)
    finally:
        process.kill()
    assert process.returncode == 130 and "[cancelled]" in stderr and "Traceback" not in stderr
    assert wait_for(lambda: blocks_used(triton_server) == 0, timeout=5)


def test_status_codes_and_messages_map_to_error_kinds():
    assert isinstance(from_http(400, "bad"), InvalidRequestError)
    assert isinstance(from_http(404, "Request for unknown model"), ModelNotReadyError)
    assert isinstance(from_http(503, "Exceeds maximum queue size"), OverloadedError)
    assert isinstance(from_http(500, "boom"), ServerError)
    for status in (400, 503):  # a draining server, through the generate endpoints and /infer
        assert isinstance(from_http(status, "the server is shutting down; retry on another replica"),
                          ServerUnavailableError)
    grpc_error = from_triton(InferenceServerException("queue full", "StatusCode.RESOURCE_EXHAUSTED"))
    assert isinstance(grpc_error, OverloadedError) and grpc_error.message == "queue full"
    # Errors on Triton's gRPC stream come without a status: the kind is told from Triton's wording.
    for message, kind in (("Request for unknown model: 'x' is not found", ModelNotReadyError),
                          ("Exceeds maximum queue size", OverloadedError),
                          ("Request was cancelled", RequestCancelledError),
                          ("the server is shutting down; retry on another replica", ServerUnavailableError),
                          ("engine failure: out of memory", ServerError),
                          ("in ensemble 'ensemble', top_p must lie in (0, 1], got 2.0", InvalidRequestError)):
        error = from_triton(InferenceServerException(message))
        assert type(error) is kind and error.message == message
