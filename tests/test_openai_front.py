"""The OpenAI-compatible front (openai_front/), driven by the official `openai` package against the real server:
sync, async and streaming, n > 1, tools with a stub tool round trip, log-probs, errors in OpenAI's shape, the API
key, and a client that goes away (its KV blocks are freed)."""

from __future__ import annotations

import asyncio
import json
import socket

import openai
import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.checkpoints import make_tool_calling_checkpoint
from support.server import OPENAI_API_KEY, metric, metrics, running_openai_front, running_server, wait_for

from clients import ChatTemplate, GrpcClient
from glm_engine.tokenizer import GlmTokenizer
from glm_tools.launcher import free_port, start_openai_front
from openai_front.chat import might_become_a_call, tool_calls_in

KEY = OPENAI_API_KEY
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def front(openai_front):
    return openai_front


@pytest.fixture(scope="module")
def client(front):
    return openai.OpenAI(base_url=f"{front}/v1", api_key=KEY, max_retries=0)


def prompt_tokens(model_dir: str, prompt: str) -> int:
    return len(GlmTokenizer(model_dir).encode(prompt, add_special_tokens=False))


def test_models_and_the_api_key(front, client):
    assert [model.id for model in client.models.list()] == ["glm"]
    for key in ("wrong", ""):
        with pytest.raises(openai.AuthenticationError) as refused:
            openai.OpenAI(base_url=f"{front}/v1", api_key=key or "x", max_retries=0,
                          default_headers={} if key else {"Authorization": ""}).models.list()
        assert refused.value.status_code == 401 and refused.value.body["code"] == "invalid_api_key"


def test_a_chat_answer_is_the_ensembles_answer_to_the_rendered_prompt(client, triton_server, demo_model_dir):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "你好"}]
    reply = client.chat.completions.create(model="glm", messages=messages, max_tokens=12, temperature=0)
    prompt = ChatTemplate.from_checkpoint(demo_model_dir).render(messages)
    direct = GrpcClient(triton_server.grpc_url).generate(prompt, max_tokens=12)
    assert reply.choices[0].message.content == direct.text and reply.choices[0].finish_reason == direct.finish_reason
    assert reply.usage.prompt_tokens == prompt_tokens(demo_model_dir, prompt)
    assert reply.usage.completion_tokens == direct.num_output_tokens == 12


def test_streaming_with_usage_gives_the_same_text(client):
    kwargs = dict(model="glm", messages=[{"role": "user", "content": "hi"}], max_tokens=10, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_streamed_log_probs_cover_every_piece_once(client):
    chunks = list(client.completions.create(model="glm", prompt="def main():", max_tokens=12, temperature=0,
                                            logprobs=1, stream=True))
    text = "".join(chunk.choices[0].text for chunk in chunks)
    logprobs = [chunk.choices[0].logprobs for chunk in chunks if chunk.choices[0].logprobs]
    assert "".join(token for lp in logprobs for token in lp.tokens) == text
    assert all(value <= 0 for lp in logprobs for value in lp.token_logprobs)


def test_n_answers_with_a_seed_are_different_and_reproducible(client):
    kwargs = dict(model="glm", messages=[{"role": "user", "content": "tell me"}], max_tokens=8, n=3, seed=7,
                  temperature=1.0)
    first, again = client.chat.completions.create(**kwargs), client.chat.completions.create(**kwargs)
    texts = [choice.message.content for choice in first.choices]
    assert [choice.index for choice in first.choices] == [0, 1, 2] and len(set(texts)) == 3
    assert texts == [choice.message.content for choice in again.choices]
    assert first.usage.completion_tokens == 24
    streamed = {}
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + (choice.delta.content or "")
    assert [streamed[i] for i in range(3)] == texts


def test_async_completions_with_stop_echo_and_logprobs(front):
    async def run():
        async with openai.AsyncOpenAI(base_url=f"{front}/v1", api_key=KEY, max_retries=0) as client:
            plain = await client.completions.create(model="glm", prompt="def main():", max_tokens=16, temperature=0)
            word = plain.choices[0].text[4:9]
            stopped, echoed = await asyncio.gather(
                client.completions.create(model="glm", prompt="def main():", max_tokens=16, temperature=0,
                                          stop=[word]),
                client.completions.create(model="glm", prompt="def main():", max_tokens=5, temperature=0, echo=True,
                                          logprobs=1))
            return plain, word, stopped, echoed

    plain, word, stopped, echoed = asyncio.run(run())
    assert word and stopped.choices[0].text == plain.choices[0].text[:plain.choices[0].text.index(word)]
    assert stopped.choices[0].finish_reason == "stop"
    logprobs = echoed.choices[0].logprobs
    assert echoed.choices[0].text.startswith("def main():")
    assert "".join(logprobs.tokens) == echoed.choices[0].text[len("def main():"):]
    assert all(lp <= 0 for lp in logprobs.token_logprobs) and logprobs.text_offset[0] == len("def main():")


def test_several_prompts_in_one_completion_request(client, demo_model_dir):
    prompts = ["def main():", "你好", "class Config:"]
    kwargs = dict(model="glm", max_tokens=6, temperature=0, n=2)
    alone = [client.completions.create(prompt=prompt, **kwargs).choices[0].text for prompt in prompts]
    together = client.completions.create(prompt=prompts, **kwargs)
    assert [choice.index for choice in together.choices] == list(range(6))
    assert [choice.text for choice in together.choices] == [text for text in alone for _ in range(2)]
    assert together.usage.prompt_tokens == sum(prompt_tokens(demo_model_dir, "[gMASK]<sop>" + p) for p in prompts)
    streamed = {}
    for chunk in client.completions.create(prompt=prompts, stream=True, **kwargs):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert [streamed[i] for i in range(6)] == [choice.text for choice in together.choices]


def test_a_forced_tool_call_and_the_tool_result_round_trip(client, demo_model_dir):
    question = [{"role": "user", "content": "Weather in Paris?"}]
    first = client.chat.completions.create(model="glm", messages=question, tools=[WEATHER], max_tokens=8,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = first.choices[0].message.tool_calls
    assert first.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert first.choices[0].message.content is None

    # The stub tool answers; the front renders the call and its result as GLM-4's turns.
    messages = [*question, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 °C"}]
    second = client.chat.completions.create(model="glm", messages=messages, tools=[WEATHER], tool_choice="none",
                                            max_tokens=4)
    rendered = ("[gMASK]<sop><|user|>\nWeather in Paris?<|assistant|>get_weather\n{\"city\": \"Paris\"}"
                "<|observation|>\nsunny, 21 °C<|assistant|>")
    assert second.usage.prompt_tokens == prompt_tokens(demo_model_dir, rendered)
    assert second.choices[0].message.tool_calls is None


def test_a_streamed_tool_call_comes_as_openai_streams_one(client):
    chunks = list(client.chat.completions.create(
        model="glm", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER], max_tokens=8,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, stream=True))
    assert not any(c.choices[0].delta.content for c in chunks)  # held back: the answer is the call's arguments
    (last,) = [c for c in chunks if c.choices[0].finish_reason]
    assert last.choices[0].finish_reason == "tool_calls"
    (call,) = last.choices[0].delta.tool_calls
    assert call.index == 0 and call.id.startswith("call_") and call.function.name == "get_weather"


@pytest.fixture(scope="module")
def tool_caller(demo_model_dir, tmp_path_factory):
    """An OpenAI client of a server whose model calls get_weather({"days": 3}) whenever it answers (a bigram stub:
    support.checkpoints.make_tool_calling_checkpoint)."""
    model_dir = make_tool_calling_checkpoint(str(tmp_path_factory.mktemp("tool-caller")), demo_model_dir)
    with running_server(model_dir, str(tmp_path_factory.mktemp("tool-server"))) as server, \
            running_openai_front(server, model_dir) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)


def test_a_call_the_model_writes_becomes_tool_calls(tool_caller):
    question = [{"role": "user", "content": "Weather for the next days?"}]
    plain = tool_caller.chat.completions.create(model="glm", messages=question, max_tokens=20, temperature=0)
    assert plain.choices[0].message.content == 'get_weather\n{"days": 3}'  # without tools, it is only text
    reply = tool_caller.chat.completions.create(model="glm", messages=question, tools=[WEATHER], max_tokens=20,
                                                temperature=0)
    (call,) = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls" and reply.choices[0].message.content is None
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"days": 3}

    chunks = list(tool_caller.chat.completions.create(model="glm", messages=question, tools=[WEATHER],
                                                      max_tokens=20, temperature=0, stream=True))
    assert not any(c.choices[0].delta.content for c in chunks)  # it might have been a call, and was
    (streamed,) = [c.choices[0].delta.tool_calls for c in chunks if c.choices[0].delta.tool_calls][0]
    assert streamed.function.name == "get_weather" and streamed.function.arguments == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_glm4_tool_calls_are_recognised_in_answers():
    tools = [WEATHER]
    assert tool_calls_in('get_weather\n{"city": "Paris"}', tools, None)[0]["function"] == {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert tool_calls_in("get_weather\nnot json", tools, None) is None
    assert tool_calls_in("Just text.", tools, None) is None
    assert might_become_a_call("get_wea", tools) and might_become_a_call("get_weather\n{", tools)
    assert not might_become_a_call("Sunny", tools) and not might_become_a_call("get_weather now\n", tools)


@pytest.mark.parametrize("body, status, param", [
    ({"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
    ({"model": "glm", "messages": [{"role": "user", "content": "hi"}], "temperature": 3}, 400, "temperature"),
    ({"model": "glm", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}, 400, "top_logprobs"),
    ({"model": "glm", "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    ({"model": "glm", "messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": 3}}, 400, "logit_bias"),
    ({"model": "glm", "prompt": [1, 2, 3]}, 400, "prompt"),
    ({"model": "glm", "prompt": ["x"] * 65}, 400, "prompt"),
    ({"model": "glm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**9}, 400, None),
    ({"model": "glm", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content"),
    ({"model": "glm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**40}, 400, "max_tokens"),
    ({"model": "glm", "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400, "temperature"),
    ({"model": "glm", "messages": [{"role": "user", "content": "hi"}], "seed": "x"}, 400, "seed"),
    ({"model": "glm", "messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, 400, "stream"),
    ({"model": "glm", "messages": [{"role": "user", "content": "hi"}], "n": 65}, 400, "n"),
    ({"model": "glm", "messages": []}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}]}, 400, "model"),
    ({"model": "glm", "messages": [{"role": ["user"], "content": "hi"}]}, 400, "messages[0].role"),
    ({"model": "glm", "messages": [{"role": "assistant", "content": None, "tool_calls": "get_weather"}]}, 400,
     "messages[0].tool_calls"),
    ({"model": "glm", "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER],
      "tool_choice": {"type": "function", "function": "get_weather"}}, 400, "tool_choice"),
    ({"model": "glm", "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER],
      "tool_choice": {"type": "function", "function": {"name": "launch"}}}, 400, "tool_choice"),
])
def test_errors_have_openais_shape_and_status(front, body, status, param):
    endpoint = "completions" if "prompt" in body else "chat/completions"
    response = requests.post(f"{front}/v1/{endpoint}", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["param"] == param and "Traceback" not in error["message"]


@pytest.mark.parametrize("body", [
    {"model": "glm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**9},
    {"model": "glm", "prompt": "word " * 5000, "max_tokens": 8},
    {"model": "glm", "prompt": "word " * 100_000, "max_tokens": 8},  # refused before it is tokenized
])
def test_a_prompt_past_the_context_is_openais_context_length_exceeded(front, body):
    endpoint = "completions" if "prompt" in body else "chat/completions"
    response = requests.post(f"{front}/v1/{endpoint}", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded", response.text


@pytest.mark.parametrize("logprobs", [5, -1, "yes"])
def test_completion_logprobs_beyond_the_chosen_token_are_refused(front, logprobs):
    response = requests.post(f"{front}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                             json={"model": "glm", "prompt": "hi", "logprobs": logprobs})
    assert response.status_code == 400 and response.json()["error"]["param"] == "logprobs"


def test_a_body_that_is_not_json_is_a_400(front):
    response = requests.post(f"{front}/v1/completions", data=b"{oops", headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("data, param", [
    ('{"model": "glm", "prompt": "\\ud800 hi", "max_tokens": 2}', "prompt"),
    ('{"model": "glm", "messages": [{"role": "user", "content": "ok \\udc00"}]}', "messages"),
    ('{"model": "glm", "prompt": "hi", "stop": ["ok", "\\ud83d"]}', "stop"),
    ('{"model": "glm", "prompt": "hi", "metadata": {"\\ud800": 1}}', "metadata"),
    ('{"model": "glm", "prompt": "hi", "\\ud800": 1}', "the request body"),
    ('{"model": "glm", "prompt": ' + "[" * 100_000 + "]" * 100_000 + "}", None),
])
def test_json_that_python_reads_but_is_no_text_or_too_deep_is_a_named_400(front, data, param):
    """JSON lets a lone surrogate through (no UTF-8 encoder takes it), and json.loads raises RecursionError, not
    ValueError, past Python's recursion limit: both were 500s."""
    response = requests.post(f"{front}/v1/{'chat/completions' if 'messages' in data else 'completions'}", data=data,
                             headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


def test_without_a_triton_server_the_front_says_503(demo_model_dir):
    port = free_port()
    front = start_openai_front(f"127.0.0.1:{free_port()}", port, model_dir=demo_model_dir)  # nobody on that port
    try:
        url = f"http://127.0.0.1:{port}"

        def health() -> int:
            try:
                return requests.get(f"{url}/health", timeout=5).status_code
            except requests.ConnectionError:
                return 0

        assert wait_for(lambda: health() == 503, timeout=30)
        response = requests.post(f"{url}/v1/completions", json={"model": "glm", "prompt": "hi"}, timeout=30)
        assert response.status_code == 503 and response.json()["error"]["code"] == "unavailable"
    finally:
        front.terminate()
        front.wait(timeout=30)


def test_a_client_that_goes_away_frees_its_kv_blocks(front, triton_server):
    body = json.dumps({"model": "glm", "prompt": "a long story", "max_tokens": 3000, "stream": True,
                       "ignore_eos": True}).encode()
    host, port = front.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as connection:
        connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: " +
                           str(len(body)).encode() + b"\r\n\r\n" + body)
        received = b""
        while b"data: " not in received:
            received += connection.recv(4096)
        assert wait_for(lambda: metric(metrics(triton_server), "glm_kv_blocks_used") > 0, timeout=10)
    assert wait_for(lambda: metric(metrics(triton_server), "glm_kv_blocks_used") == 0, timeout=20)


JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True)
                           | st.text(max_size=12), lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=6)
FIELDS = ("max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "seed", "stop", "stream",
          "stream_options", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "tools",
          "tool_choice", "top_k", "min_tokens", "ignore_eos", "response_format", "user", "logit_bias", "echo")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fields=st.dictionaries(st.sampled_from(FIELDS), JSON_VALUES, max_size=5),
       messages=st.one_of(JSON_VALUES, st.just([{"role": "user", "content": "hi"}])))
def test_hostile_bodies_get_an_answer_or_a_named_400_never_a_500(front, fields, messages):
    for name in ("max_tokens", "max_completion_tokens"):  # legal lengths stay short: this is not a load test
        if isinstance(fields.get(name), int) and not isinstance(fields[name], bool):
            fields[name] = min(fields[name], 8)
    body = {"model": "glm", "messages": messages, **fields}
    # json.dumps, not requests' json=: it writes NaN and Infinity, which Python's (and aiohttp's) JSON reader takes.
    response = requests.post(f"{front}/v1/chat/completions", data=json.dumps(body),
                             headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
                             timeout=120)
    assert response.status_code in (200, 400), (body, response.status_code, response.text[:300])
    if response.status_code == 400:
        error = response.json()["error"]
        assert error["message"] and "Traceback" not in error["message"] and "/" not in (error["param"] or "")
