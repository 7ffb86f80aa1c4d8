"""Against the real tritonserver (started by the `triton_server` fixture on free ports, serving the demo checkpoint):
the generate endpoints, tritonclient over HTTP and gRPC (streaming too), concurrency, Chinese streaming and errors."""

from __future__ import annotations

import contextlib
import json
import os
import queue
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from clients.request import SAMPLING_INPUTS, Piece
from support.server import glm_answer, glm_inputs, grpc_inputs, metric, metrics, running_server, wait_for

pytestmark = pytest.mark.integration

CHINESE_PROMPTS = ["用中文讲一个故事", "今天天气很好", "请介绍一下分页缓存", "你好，世界", "晚上大家一起吃饭"]


# -- small clients close to the raw protocols (the SDK in clients/ has its own tests: test_clients.py) -----------
def generate(server, **body) -> requests.Response:
    return requests.post(f"http://{server.http_url}/v2/models/ensemble/generate", json=body, timeout=120)


def generate_text(server, prompt, **params) -> str:
    response = generate(server, text_input=prompt, exclude_input_in_output=True, **params)
    assert response.status_code == 200, response.text
    return response.json()["text_output"]


def generate_stream(server, **body) -> list[str]:
    """The text of each server-sent event of /generate_stream."""
    pieces = []
    with requests.post(f"http://{server.http_url}/v2/models/ensemble/generate_stream", json=body, stream=True,
                       timeout=120) as response:
        assert response.status_code == 200, response.text
        for line in response.iter_lines(decode_unicode=True):
            if line.startswith("data: "):
                event = json.loads(line[len("data: "):])
                assert "error" not in event, event
                pieces.append(event["text_output"])
    return pieces


def ensemble_inputs(module, prompt: str, **params):
    types = {**SAMPLING_INPUTS, "stream": ("BOOL", bool)}
    text = module.InferInput("text_input", [1, 1], "BYTES")
    text.set_data_from_numpy(np.array([[prompt.encode()]], dtype=np.object_))
    inputs = [text]
    for name, value in params.items():
        datatype, numpy_type = types[name]
        tensor = module.InferInput(name, [1, 1], datatype)
        tensor.set_data_from_numpy(np.array([[value]], dtype=numpy_type))
        inputs.append(tensor)
    return inputs


def stream_results(server, model: str, inputs) -> list:
    """Every result of one request over gRPC bidirectional streaming (start_stream / async_stream_infer), up to the
    one with Triton's final flag."""
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        client.async_stream_infer(model, inputs, enable_empty_final_response=True)
        received = []
        while True:
            result, error = results.get(timeout=120)
            if error is not None:
                raise error
            received.append(result)
            if result.get_response().parameters["triton_final_response"].bool_param:
                return received
    finally:
        client.stop_stream()
        client.close()


def grpc_stream(server, prompt: str, **params) -> list[str]:
    """Pieces of one streamed request to the ensemble over gRPC."""
    results = stream_results(server, "ensemble", ensemble_inputs(grpcclient, prompt, stream=True, **params))
    return [result.as_numpy("text_output").reshape(-1)[0].decode() for result in results
            if result.get_response().outputs]


def assert_still_serving(server):
    assert server.is_ready()
    assert generate_text(server, "still there?", max_tokens=4)


# -- the endpoints -------------------------------------------------------------------------------------------------
def test_http_generate_returns_the_whole_answer_in_one_response(triton_server):
    response = generate(triton_server, text_input="Hello, GLM", max_tokens=16)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["model_name"] == "ensemble"
    # By default the prompt is echoed, as TensorRT-LLM's ensemble does; exclude_input_in_output drops it.
    assert body["text_output"].startswith("Hello, GLM")
    answer = generate_text(triton_server, "Hello, GLM", max_tokens=16)
    assert answer and body["text_output"] == "Hello, GLM" + answer


def test_generate_stream_sends_pieces_that_add_up_to_the_answer(triton_server):
    whole = generate_text(triton_server, "Once upon a time", max_tokens=24)
    pieces = generate_stream(triton_server, text_input="Once upon a time", max_tokens=24, stream=True)
    assert len(pieces) > 5
    assert "".join(pieces) == whole


def test_many_streams_at_once_add_up_to_their_answers_with_several_tokens_in_some_responses(triton_server):
    """coalesce_stream_responses: 48 streams at once on the small test model make responses faster than glm's outbox
    sends them (each send a round trip to the server's process), so responses carry several tokens. Each stream
    still adds up to its answer alone, with each token's log-prob in the response that carries the token."""
    prompts = [f"Stream {index} says" for index in range(48)]
    expected = [generate_text(triton_server, prompt, max_tokens=24, ignore_eos=True) for prompt in prompts]

    def streamed(prompt: str) -> list[Piece]:
        results = stream_results(triton_server, "ensemble", ensemble_inputs(
            grpcclient, prompt, stream=True, max_tokens=24, ignore_eos=True, return_log_probs=True))
        return [Piece.from_outputs(result.as_numpy) for result in results if result.get_response().outputs]

    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(streamed, prompts))
    for answer, whole in zip(answers, expected):
        assert "".join(piece.text for piece in answer) == whole
        sent = [piece.num_output_tokens for piece in answer]
        assert sent[-1] == 24 and [len(piece.log_probs) for piece in answer] == np.diff([0] + sent).tolist()
    responses = sum(len(answer) for answer in answers)
    print(f"\n[coalescing] {48 * 24} tokens in {responses} responses")
    # Without coalescing: 1,119 (a response a token, or a character's tokens together); with it, about 440.
    assert responses < 0.9 * 48 * 24


def test_glms_response_thread_alone_stands_back_for_the_engine(triton_server):
    """response_thread_nice (10 in glm's config.pbtxt): after a burst of streams, of the threads of glm's process
    only the one that sends responses runs at a nice value 10 above the process's (docs/performance.md)."""
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda index: generate_stream(triton_server, text_input=f"Stream {index}", max_tokens=8,
                                                    stream=True), range(8)))
    (glm,) = [pid for pid, stub in triton_server.stub_processes().items() if stub.model == "glm"]
    nices = []
    for thread in os.listdir(f"/proc/{glm}/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            nices.append(os.getpriority(os.PRIO_PROCESS, int(thread)))
    process = os.getpriority(os.PRIO_PROCESS, glm)
    assert sorted(nices) == [process] * (len(nices) - 1) + [min(19, process + 10)], nices


def test_streams_of_several_answers_each_end_every_answer_before_the_final_flag(triton_server):
    """Answers of one request (num_return_sequences) share its response sender and coalesce each on its own: under
    load the answer that ended last may be sent before another's last tokens. Triton's final flag must still come
    last, after every answer's end (sent before, it left those tokens with a closed sender: CI met it)."""
    def streamed(index: int) -> dict[int, tuple[int, str]]:
        """(output tokens, finish reason) of each answer's last response."""
        results = stream_results(triton_server, "ensemble", ensemble_inputs(
            grpcclient, f"Answer {index}:", stream=True, max_tokens=12, ignore_eos=True, temperature=1.0,
            seed=index, num_return_sequences=3))
        pieces = [Piece.from_outputs(result.as_numpy) for result in results if result.get_response().outputs]
        return {piece.sequence_index: (piece.num_output_tokens, piece.finish_reason) for piece in pieces}

    with ThreadPoolExecutor(16) as pool:
        for answers in pool.map(streamed, range(16)):
            assert answers == {index: (12, "length") for index in range(3)}


def test_tritonclient_http_grpc_and_grpc_streaming_agree(triton_server):
    prompt = "The paged KV cache"
    whole = generate_text(triton_server, prompt, max_tokens=20)

    # /infer refuses decoupled models (so the ensemble); the non-decoupled bls model answers it.
    for module, url in ((httpclient, triton_server.http_url), (grpcclient, triton_server.grpc_url)):
        client = module.InferenceServerClient(url)
        result = client.infer("bls", ensemble_inputs(module, prompt, max_tokens=20, exclude_input_in_output=True))
        assert result.as_numpy("text_output").reshape(-1)[0].decode() == whole, module.__name__

    pieces = grpc_stream(triton_server, prompt, max_tokens=20)
    assert len(pieces) > 5 and "".join(pieces) == whole


def test_bls_checks_its_input_like_the_ensemble(triton_server):
    client = httpclient.InferenceServerClient(triton_server.http_url)
    with pytest.raises(InferenceServerException, match="'text_input' is empty"):
        client.infer("bls", ensemble_inputs(httpclient, " "))
    with pytest.raises(InferenceServerException, match="top_p must lie in"):
        client.infer("bls", ensemble_inputs(httpclient, "hi", top_p=2.0))
    with pytest.raises(InferenceServerException, match="stream through the 'ensemble'"):
        client.infer("bls", ensemble_inputs(httpclient, "hi", stream=True))
    assert_still_serving(triton_server)


def test_sixteen_concurrent_requests_give_the_texts_they_give_alone(triton_server):
    prompts = [f"Request number {i}: tell me about {topic}" for i, topic in
               enumerate(["caches", "schedulers", "GPUs", "tokens"] * 4)]
    alone = [generate_text(triton_server, p, max_tokens=24) for p in prompts]

    def concurrent(index):
        # Half over HTTP generate, half over gRPC streaming, all at once.
        if index % 2:
            return "".join(grpc_stream(triton_server, prompts[index], max_tokens=24))
        return generate_text(triton_server, prompts[index], max_tokens=24)

    with ThreadPoolExecutor(max_workers=16) as pool:
        together = list(pool.map(concurrent, range(16)))
    assert together == alone


def test_same_seed_same_sampled_text(triton_server):
    params = dict(max_tokens=20, temperature=1.0, top_p=0.9, seed=42)
    first = generate_text(triton_server, "Sample me", **params)
    assert generate_text(triton_server, "Sample me", **params) == first
    assert generate_text(triton_server, "Sample me", **{**params, "seed": 43}) != first


def test_streamed_chinese_equals_the_whole_answer(triton_server):
    answers = []
    for prompt in CHINESE_PROMPTS:
        whole = generate_text(triton_server, prompt, max_tokens=48)
        assert "".join(grpc_stream(triton_server, prompt, max_tokens=48)) == whole, prompt
        assert "".join(generate_stream(triton_server, text_input=prompt, max_tokens=48, stream=True)) == whole
        answers.append(whole)
    # The check means something only if the answers hold multi-byte characters.
    assert any("\u4e00" <= char <= "\u9fff" for answer in answers for char in answer)


def first_generated_token(server, demo_model_dir, prompt: str) -> int:
    """The first token the glm model generates for `prompt`, read from its own output_ids."""
    return int(glm_answer(server, demo_model_dir, prompt, 12).as_numpy("output_ids").reshape(-1)[0])


def test_postprocessing_decodes_glm_ids_to_the_text_glm_and_the_ensemble_send(triton_server, demo_model_dir):
    """The ensemble takes its text from glm; the postprocessing model (kept for clients that call it) decodes glm's
    output_ids to the same text."""
    prompt = "天气 and weather"
    result = glm_answer(triton_server, demo_model_dir, prompt, 24)
    ids, text = result.as_numpy("output_ids"), result.as_numpy("text_output").reshape(-1)[0].decode()
    inputs = [grpcclient.InferInput("TOKENS_BATCH", list(ids.shape), "INT32"),
              grpcclient.InferInput("SEQUENCE_LENGTH", [1, 1], "INT32")]
    inputs[0].set_data_from_numpy(ids)
    inputs[1].set_data_from_numpy(np.array([[ids.shape[-1]]], dtype=np.int32))
    decoded = grpcclient.InferenceServerClient(triton_server.grpc_url).infer("postprocessing", inputs)
    assert decoded.as_numpy("OUTPUT").reshape(-1)[0].decode() == text
    assert text == generate_text(triton_server, prompt, max_tokens=24) and text


def test_end_id_stops_and_ignore_eos_overrides_it(triton_server, demo_model_dir):
    first_token = first_generated_token(triton_server, demo_model_dir, "Stop me")

    answer = generate_text(triton_server, "Stop me", max_tokens=12)
    stopped = generate(triton_server, text_input="Stop me", max_tokens=12, end_id=first_token,
                       exclude_input_in_output=True).json()
    assert stopped["text_output"] == "" and stopped["finish_reason"] == "stop" and stopped["num_output_tokens"] == 0
    assert generate_text(triton_server, "Stop me", max_tokens=12, end_id=first_token, ignore_eos=True) == answer
    client = httpclient.InferenceServerClient(triton_server.http_url)
    result = client.infer("bls", ensemble_inputs(httpclient, "Stop me", max_tokens=12, end_id=first_token,
                                                 exclude_input_in_output=True))
    assert result.as_numpy("text_output").reshape(-1)[0].decode() == ""


def test_finish_reason_token_counts_and_log_probs(triton_server):
    body = generate(triton_server, text_input="Count me", max_tokens=10, return_log_probs=True,
                    exclude_input_in_output=True).json()
    assert body["finish_reason"] == "length" and body["num_output_tokens"] == 10 and body["num_input_tokens"] > 2
    assert len(body["output_log_probs"]) == 10 and all(lp <= 0 for lp in body["output_log_probs"])
    assert body["cum_log_probs"] == pytest.approx(sum(body["output_log_probs"]), abs=1e-3)

    events = []
    with requests.post(f"http://{triton_server.http_url}/v2/models/ensemble/generate_stream", stream=True,
                       json={"text_input": "Count me", "max_tokens": 10, "stream": True, "return_log_probs": True},
                       timeout=120) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines(decode_unicode=True)
                  if line.startswith("data: ")]
    streamed = [lp for e in events for lp in np.atleast_1d(e["output_log_probs"]).tolist()]
    assert streamed == pytest.approx(body["output_log_probs"], abs=1e-6)
    assert [e["finish_reason"] for e in events][-1] == "length" and events[-1]["num_output_tokens"] == 10
    assert all(e["finish_reason"] == "" for e in events[:-1])

    client = httpclient.InferenceServerClient(triton_server.http_url)
    result = client.infer("bls", ensemble_inputs(httpclient, "Count me", max_tokens=10, return_log_probs=True,
                                                 exclude_input_in_output=True))
    assert result.as_numpy("finish_reason").reshape(-1)[0] == b"length"
    assert result.as_numpy("num_output_tokens").item() == 10
    assert result.as_numpy("output_log_probs").reshape(-1).tolist() == pytest.approx(body["output_log_probs"])


def test_no_response_carries_an_empty_output(triton_server, demo_model_dir):
    """An output with nothing in it is left out (common.without_empty): Triton 2.51's HTTP front end leaked a record
    for each, one a streamed event through the ensemble while log probs were off."""
    with requests.post(f"http://{triton_server.http_url}/v2/models/ensemble/generate_stream", stream=True,
                       json={"text_input": "Count me", "max_tokens": 6, "stream": True}, timeout=120) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines(decode_unicode=True)
                  if line.startswith("data: ")]
    assert len(events) >= 2 and all("output_log_probs" not in event for event in events)
    assert all(value != [] for event in events for value in event.values())
    body = requests.post(f"http://{triton_server.http_url}/v2/models/bls/generate", timeout=120,
                         json={"text_input": "Count me", "max_tokens": 6}).json()
    assert body["text_output"] and "output_log_probs" not in body

    results = stream_results(triton_server, "glm", glm_inputs(demo_model_dir, "Count me", 6, streaming=True))
    outputs = [(output.name, result.as_numpy(output.name)) for result in results
               for output in result.get_response().outputs]
    assert {name for name, _ in outputs} >= {"output_ids", "text_output", "finish_reason"}
    assert all(array.size for _, array in outputs), [name for name, array in outputs if not array.size]


def test_vllm_backend_request_style_works_unchanged(triton_server):
    expected = generate_text(triton_server, "Same either way", max_tokens=12, temperature=0.0)
    vllm_style = {"text_input": "Same either way", "exclude_input_in_output": True,
                  "sampling_parameters": json.dumps({"max_tokens": "12", "temperature": "0", "top_k": "-1"}),
                  "return_finish_reason": True, "return_num_output_tokens": True}
    body = generate(triton_server, **vllm_style).json()
    assert body["text_output"] == expected and body["num_output_tokens"] == 12
    pieces = generate_stream(triton_server, **vllm_style, stream=True)
    assert "".join(pieces) == expected

    response = generate(triton_server, text_input="hi", sampling_parameters=json.dumps({"best_of": 2}))
    assert response.status_code == 400 and "unsupported keys ['best_of']" in response.json()["error"]


def test_stop_words_end_the_answer_before_them_on_every_path(triton_server):
    answer = generate_text(triton_server, "Tell me more", max_tokens=32)
    stop = answer[6:10]  # some text from the middle, wherever token boundaries fall
    expected = answer[:answer.index(stop)]

    body = generate(triton_server, text_input="Tell me more", max_tokens=32, stop_words=[stop],
                    exclude_input_in_output=True).json()
    assert body["text_output"] == expected and body["finish_reason"] == "stop"
    pieces = generate_stream(triton_server, text_input="Tell me more", max_tokens=32, stop_words=[stop], stream=True)
    assert "".join(pieces) == expected
    vllm_style = generate(triton_server, text_input="Tell me more", exclude_input_in_output=True,
                          sampling_parameters=json.dumps({"max_tokens": 32, "stop": stop})).json()
    assert vllm_style["text_output"] == expected
    echoed = generate(triton_server, text_input="Tell me more", max_tokens=32, stop_words=[stop]).json()
    assert echoed["text_output"] == "Tell me more" + expected

    client = httpclient.InferenceServerClient(triton_server.http_url)
    words = httpclient.InferInput("stop_words", [1, 1], "BYTES")
    words.set_data_from_numpy(np.array([[stop.encode()]], dtype=np.object_))
    result = client.infer("bls", [*ensemble_inputs(httpclient, "Tell me more", max_tokens=32,
                                                   exclude_input_in_output=True), words])
    assert result.as_numpy("text_output").reshape(-1)[0].decode() == expected


def test_bad_words_change_the_answer(triton_server, demo_model_dir):
    from glm_engine.tokenizer import GlmTokenizer

    answer = generate_text(triton_server, "Say something", max_tokens=16)
    first_word = GlmTokenizer(demo_model_dir).decode([first_generated_token(triton_server, demo_model_dir,
                                                                            "Say something")])
    steered = generate_text(triton_server, "Say something", max_tokens=16, bad_words=[first_word])
    assert steered != answer and not steered.startswith(first_word)


def test_penalties_reach_the_engine_through_ensemble_and_bls(triton_server):
    plain = generate_text(triton_server, "Repeat after me", max_tokens=24)
    params = dict(max_tokens=24, repetition_penalty=1.8, presence_penalty=1.5, frequency_penalty=1.0, min_p=0.05)
    penalized = generate_text(triton_server, "Repeat after me", **params)
    assert penalized != plain  # the demo model loops; penalties change its greedy path
    client = httpclient.InferenceServerClient(triton_server.http_url)
    result = client.infer("bls", ensemble_inputs(httpclient, "Repeat after me", exclude_input_in_output=True, **params))
    assert result.as_numpy("text_output").reshape(-1)[0].decode() == penalized


# -- bad input: a clear error, and the server goes on ----------------------------------------------------------------
@pytest.mark.parametrize("body, expected", [
    ({"text_input": "", "max_tokens": 8}, "'text_input' is empty"),
    ({"text_input": "   ", "max_tokens": 8}, "'text_input' is empty"),
    ({"text_input": "hi", "max_tokens": 0}, "max_tokens must be at least 1"),
    ({"text_input": "hi", "max_tokens": -3}, "max_tokens must be at least 1"),
    ({"text_input": "hi", "max_tokens": 100000}, "over the model's limit"),
    ({"text_input": "hi", "top_p": -0.1}, "top_p must lie in (0, 1]"),
    ({"text_input": "hi", "temperature": -1.0}, "temperature must be"),
    ({"text_input": "hi", "top_k": -2}, "top_k must be"),
    ({"text_input": "hi", "min_p": 2.0}, "min_p must lie in [0, 1]"),
    ({"text_input": "hi", "repetition_penalty": 0.0}, "repetition_penalty must be"),
    ({"text_input": "hi", "presence_penalty": 5.0}, "presence_penalty must lie in [-2, 2]"),
    ({"text_input": "hi", "frequency_penalty": -5.0}, "frequency_penalty must lie in [-2, 2]"),
    ({"text_input": "hi", "max_tokens": 4, "min_tokens": 9}, "min_tokens must lie in [0, max_tokens=4]"),
])
def test_bad_values_get_a_clear_error(triton_server, body, expected):
    response = generate(triton_server, **body)
    assert response.status_code == 400, response.text
    assert expected in response.json()["error"]
    assert_still_serving(triton_server)


def test_over_long_prompt_is_refused(triton_server):
    response = generate(triton_server, text_input="word " * 5000, max_tokens=8)
    assert response.status_code == 400 and "over the model's limit" in response.json()["error"]
    assert_still_serving(triton_server)


def test_a_prompt_of_more_bytes_than_the_context_can_hold_is_refused_before_tokenizing(triton_server):
    """4.2 MB: tokenizing it takes seconds (about one a megabyte), in which the model instance's other requests
    waited; its byte count alone shows that it cannot fit (GlmTokenizer.fewest_tokens)."""
    text = "hello world " * 350_000
    response = generate(triton_server, text_input=text, max_tokens=8)
    assert response.status_code == 400 and "refused before tokenizing" in response.json()["error"], response.text
    client = httpclient.InferenceServerClient(triton_server.http_url, network_timeout=120)
    with pytest.raises(InferenceServerException) as error:
        client.infer("bls", ensemble_inputs(httpclient, text))
    assert_clear(error.value.message(), "text_input", "refused before tokenizing")
    assert_clear(grpc_stream_error(triton_server, vllm_model_inputs(text, 8), "vllm_model"), "text_input",
                 "refused before tokenizing")
    assert_still_serving(triton_server)


@pytest.mark.parametrize("ids, length, expected", [
    ([], 0, "input_ids is empty: a prompt needs at least one token"),
    ([5, 6], 9, "input_lengths must lie in [1, 2], got 9"),
    ([5, 6], 0, "input_lengths must lie in [1, 2], got 0"),
    ([5, -1], 2, "prompt token ids must lie in [0, "),
])
def test_bad_token_ids_to_glm_get_a_clear_error(triton_server, ids, length, expected):
    inputs = grpc_inputs(("input_ids", np.array([ids], np.int32).reshape(1, len(ids)), "INT32"),
                         ("input_lengths", np.array([[length]], np.int32), "INT32"),
                         ("request_output_len", np.array([[4]], np.int32), "INT32"))
    assert_clear(grpc_stream_error(triton_server, inputs, "glm"), expected)
    assert_still_serving(triton_server)


def grpc_stream_error(server, inputs, model: str = "ensemble") -> str:
    """Send one streamed request to `model` and return the error it gets."""
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: results.put(error))
    try:
        client.async_stream_infer(model, inputs)
        error = results.get(timeout=60)
        assert error is not None
        return str(error)
    finally:
        client.stop_stream()
        client.close()


def assert_clear(message: str, *names: str) -> None:
    """An error message that names what it should and shows nothing of the server's insides."""
    for name in names:
        assert name in message, message
    assert not any(leak in message for leak in ("Traceback", "At:", ".py", "/root", "site-packages")), message


@pytest.mark.parametrize("module", [httpclient, grpcclient])
def test_bls_keeps_the_error_codes_of_the_engine(triton_server, module):
    """Triton 2.51 turns every error a BLS call receives into INTERNAL; bls restores the engine's own code."""
    url = triton_server.http_url if module is httpclient else triton_server.grpc_url
    client = module.InferenceServerClient(url)
    for inputs, expected in ((ensemble_inputs(module, "hi", top_p=5.0), "top_p must lie in"),
                             (ensemble_inputs(module, "word " * 5000), "over the model's limit")):
        with pytest.raises(InferenceServerException) as error:
            client.infer("bls", inputs)
        assert error.value.status() in ("400", "StatusCode.INVALID_ARGUMENT"), error.value
        assert_clear(error.value.message(), expected)
        assert not error.value.message().startswith("[")  # the code travels in the message only inside the server
    assert_still_serving(triton_server)


@pytest.mark.parametrize("sampling_parameters, expected", [
    ("[" * 100000 + "]" * 100000, "input 'sampling_parameters' holds a number too long or nesting too deep"),
    ('{"max_tokens": ' + "9" * 5000 + "}", "input 'sampling_parameters' holds a number too long"),
    ('{"n": 1e400}', "sampling_parameters: 'n' has an unusable value"),
    ('{"stop_token_ids": [1e400]}', "sampling_parameters: 'stop_token_ids' has an unusable value"),
    ('{"temperature": 1e400}', "temperature must be a finite number"),
    ('{"stop": "' + "x" * 300000 + '"}', "input 'sampling_parameters' must be at most 262144 characters"),
])
def test_unreadable_sampling_parameters_get_a_400_without_a_traceback(triton_server, sampling_parameters, expected):
    for model in ("ensemble", "bls"):
        response = requests.post(f"http://{triton_server.http_url}/v2/models/{model}/generate", timeout=60,
                                 json={"text_input": "hi", "sampling_parameters": sampling_parameters})
        assert response.status_code == 400, (model, response.text[:300])
        assert_clear(response.json()["error"], expected)
    assert_still_serving(triton_server)


def test_text_that_is_not_utf8_is_refused_naming_the_input(triton_server):
    client = httpclient.InferenceServerClient(triton_server.http_url)
    bad_prompt = ensemble_inputs(httpclient, "hi")
    bad_prompt[0].set_data_from_numpy(np.array([[b"caf\xe9"]], dtype=np.object_))
    stop_words = httpclient.InferInput("stop_words", [1, 1], "BYTES")
    stop_words.set_data_from_numpy(np.array([[b"\xff"]], dtype=np.object_))
    for inputs, name in ((bad_prompt, "text_input"), ([*ensemble_inputs(httpclient, "hi"), stop_words], "stop_words")):
        with pytest.raises(InferenceServerException) as error:
            client.infer("bls", inputs)
        assert error.value.status() == "400"
        assert_clear(error.value.message(), f"input '{name}' is not valid UTF-8")
    grpc_prompt = ensemble_inputs(grpcclient, "hi")
    grpc_prompt[0].set_data_from_numpy(np.array([[b"caf\xe9"]], dtype=np.object_))
    assert_clear(grpc_stream_error(triton_server, grpc_prompt), "input 'text_input' is not valid UTF-8")
    assert_still_serving(triton_server)


def test_a_request_without_text_input_is_refused_on_every_endpoint(triton_server):
    """Triton's ensemble answers a request that lacks a required input with an empty response, so text_input is
    optional there and checked by the models; the ensemble's error comes from Triton, which cannot run its first
    step without an input."""
    for model in ("ensemble", "bls"):
        response = requests.post(f"http://{triton_server.http_url}/v2/models/{model}/generate",
                                 json={"max_tokens": 4}, timeout=60)
        assert response.status_code == 400, (model, response.text)
    stream = requests.post(f"http://{triton_server.http_url}/v2/models/ensemble/generate_stream",
                           json={"max_tokens": 4, "stream": True}, timeout=60)
    assert stream.status_code == 400, stream.text
    max_tokens = grpcclient.InferInput("max_tokens", [1, 1], "INT32")
    max_tokens.set_data_from_numpy(np.array([[4]], dtype=np.int32))
    assert grpc_stream_error(triton_server, [max_tokens])
    client = httpclient.InferenceServerClient(triton_server.http_url)
    with pytest.raises(InferenceServerException) as error:
        client.infer("bls", ensemble_inputs(httpclient, "hi")[1:])
    assert error.value.status() == "400"
    assert_still_serving(triton_server)


def test_wrong_dtype_and_shape_are_refused(triton_server):
    def max_tokens(module, shape, datatype, values):
        tensor = module.InferInput("max_tokens", shape, datatype)
        tensor.set_data_from_numpy(values)
        return [*ensemble_inputs(module, "hi"), tensor]

    wrong_dtype = ([1, 1], "FP32", np.array([[8.0]], dtype=np.float32))
    two_values = ([1, 2], "INT32", np.array([[8, 9]], dtype=np.int32))
    client = httpclient.InferenceServerClient(triton_server.http_url)
    with pytest.raises(InferenceServerException, match="max_tokens.*FP32"):
        client.infer("bls", max_tokens(httpclient, *wrong_dtype))
    assert "max_tokens" in grpc_stream_error(triton_server, max_tokens(grpcclient, *wrong_dtype))
    assert "max_tokens" in grpc_stream_error(triton_server, max_tokens(grpcclient, *two_values))

    # Triton's own JSON parsing of the generate endpoint refuses it (its message does not name the field).
    response = generate(triton_server, text_input="hi", max_tokens="eight")
    assert response.status_code >= 400 and "Unable to parse" in response.json()["error"]
    assert_still_serving(triton_server)


def test_engine_metrics_are_published(triton_server):
    generate_text(triton_server, "metrics, please", max_tokens=8)
    samples = metrics(triton_server)
    assert metric(samples, "glm_kv_blocks_total") > 0
    assert metric(samples, "glm_generation_tokens_total") >= 8
    assert metric(samples, "glm_prompt_tokens_total") > 0
    assert metric(samples, "glm_requests_finished_total", finish_reason="length") >= 1
    for histogram in ("glm_time_to_first_token_seconds", "glm_inter_token_latency_seconds",
                      "glm_request_latency_seconds"):
        assert metric(samples, histogram + "_count") >= 1
    assert wait_for(lambda: metric(metrics(triton_server), "glm_kv_blocks_used") == 0)


def inter_token_observations(server) -> float:
    """glm_inter_token_latency_seconds' count (0 before its first observation), once no request runs."""
    assert wait_for(lambda: metric(metrics(server), "glm_num_requests_running") == 0)
    counts = [value for key, value in metrics(server).items()
              if key.startswith("glm_inter_token_latency_seconds_count{") and 'model="glm"' in key]
    return sum(counts)


def test_the_inter_token_histogram_observes_every_gap_by_default(triton_server):
    before = inter_token_observations(triton_server)
    for max_tokens in (8, 20):  # one engine output, so one gap, a token
        generate_text(triton_server, "count the gaps", max_tokens=max_tokens, ignore_eos=True)
    assert inter_token_observations(triton_server) - before == 7 + 19


@pytest.fixture(scope="module")
def per_request_server(demo_model_dir, tmp_path_factory):
    with running_server(demo_model_dir, str(tmp_path_factory.mktemp("per-request")),
                        {"inter_token_latency_metric": "per_request"}) as server:
        yield server


def test_the_inter_token_histogram_observes_each_request_once_when_asked(per_request_server):
    before = inter_token_observations(per_request_server)
    for max_tokens in (8, 20):
        generate_text(per_request_server, "count the gaps", max_tokens=max_tokens, ignore_eos=True)
    assert inter_token_observations(per_request_server) - before == 2
    latency = metrics(per_request_server)
    mean = (metric(latency, "glm_inter_token_latency_seconds_sum")
            / metric(latency, "glm_inter_token_latency_seconds_count"))
    assert 0 < mean < metric(latency, "glm_request_latency_seconds_sum") / 2


def test_a_shared_prompt_prefix_is_reused(triton_server):
    system = "You are a helpful assistant that answers in one short sentence. " * 4
    before = metric(metrics(triton_server), "glm_prefix_cache_hit_tokens_total")
    first = generate_text(triton_server, system + "First question?", max_tokens=8)
    generate_text(triton_server, system + "Second question?", max_tokens=8)
    assert metric(metrics(triton_server), "glm_prefix_cache_hit_tokens_total") - before >= 32
    assert generate_text(triton_server, system + "First question?", max_tokens=8) == first  # reuse changes nothing


def vllm_model_inputs(prompt: str, max_tokens: int) -> list:
    """A streaming vllm_model request as vllm_backend's clients send it (tensors without a batch dimension)."""
    return grpc_inputs(("text_input", np.array([prompt.encode()], dtype=np.object_), "BYTES"),
                       ("stream", np.array([True]), "BOOL"), ("ignore_eos", np.array([True]), "BOOL"),
                       ("sampling_parameters",
                        np.array([json.dumps({"max_tokens": max_tokens}).encode()], dtype=np.object_), "BYTES"))


@pytest.mark.parametrize("model", ["glm", "vllm_model"])
def test_a_cancelled_stream_frees_its_blocks_within_a_step(triton_server, demo_model_dir, model):
    """A gRPC stream cancelled by its client: glm sees it at its next cancellation check; vllm_model sees it at glm's
    next response and stops glm's request, whose id is vllm_model's own when the client gave none (as here)."""
    inputs = (glm_inputs(demo_model_dir, "a long story", 4000, streaming=True) if model == "glm"
              else vllm_model_inputs("a long story", 4000))  # outlasts the cancel
    cancelled_before = metric(metrics(triton_server), "glm_requests_finished_total", finish_reason="cancelled")
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    client.async_stream_infer(model, inputs)
    results.get(timeout=60)  # the first tokens arrived: the request is running and holds blocks
    assert metric(metrics(triton_server), "glm_kv_blocks_used") > 0
    client.stop_stream(cancel_requests=True)
    client.close()

    def freed():
        samples = metrics(triton_server)
        return (metric(samples, "glm_requests_finished_total", finish_reason="cancelled") == cancelled_before + 1
                and metric(samples, "glm_kv_blocks_used") == 0)

    assert wait_for(freed, timeout=5)
    assert_still_serving(triton_server)


def test_an_ensemble_stream_is_stopped_by_a_stop_request_naming_its_id(triton_server):
    """Triton 2.51 does not pass an ensemble's cancellation on to the running glm step, so a client stops it as
    TensorRT-LLM's do: a request to glm with `stop` and the same request id (what clients/ does on cancel)."""
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    client.async_stream_infer("ensemble", ensemble_inputs(grpcclient, "a story", max_tokens=4000, stream=True,
                                                          ignore_eos=True),
                              request_id="story-1", enable_empty_final_response=True)
    results.get(timeout=60)
    assert metric(metrics(triton_server), "glm_kv_blocks_used") > 0

    stop = grpcclient.InferInput("stop", [1, 1], "BOOL")
    stop.set_data_from_numpy(np.array([[True]]))
    stopper = grpcclient.InferenceServerClient(triton_server.grpc_url)
    replies: queue.Queue = queue.Queue()
    stopper.start_stream(callback=lambda result, error: replies.put(error))
    stopper.async_stream_infer("glm", [stop], request_id="story-1")
    assert replies.get(timeout=30) is None
    stopper.stop_stream()

    reasons = []
    while True:
        result, error = results.get(timeout=30)
        assert error is None
        if result.get_response().outputs:
            reasons.append(result.as_numpy("finish_reason").item().decode())
        if result.get_response().parameters["triton_final_response"].bool_param:
            break
    client.stop_stream()
    # Cut short of its 4,000 tokens; how many came before the stop depends on the machine's load and speed.
    assert reasons[-1] == "cancelled" and len(reasons) < 4000
    assert wait_for(lambda: metric(metrics(triton_server), "glm_kv_blocks_used") == 0, timeout=5)
    # Stopping what has finished (or never ran) is not an error.
    response = requests.post(f"http://{triton_server.http_url}/v2/models/glm/generate",
                             json={"id": "story-1", "stop": True}, timeout=30)
    assert response.status_code == 200, response.text
    response = requests.post(f"http://{triton_server.http_url}/v2/models/glm/generate", json={"stop": True},
                             timeout=30)
    assert response.status_code == 400 and "request id" in response.json()["error"]
    assert_still_serving(triton_server)


def test_only_glms_process_loads_torch_even_after_serving(triton_server):
    """The models that tokenize read glm_engine's config and tokenizer, whose package imports torch only when an
    engine name is asked for (docs/operations.md#start-up): 200 MB and a second of start-up in each of five
    processes. A request through every front first, so that their serving paths have run too."""
    url = f"http://{triton_server.http_url}/v2/models"
    for model, body in (("ensemble", {"text_input": "def f(", "max_tokens": 2}),
                        ("bls", {"text_input": "def f(", "max_tokens": 2}),
                        ("vllm_model", {"text_input": "def f(", "sampling_parameters": '{"max_tokens": 2}'})):
        response = requests.post(f"{url}/{model}/generate", json=body, timeout=60)
        assert response.status_code == 200, response.text
    stubs = triton_server.stub_processes()
    assert {stub.model for stub in stubs.values()} == {"glm", "preprocessing", "postprocessing", "bls", "vllm_model"}
    for pid, stub in stubs.items():
        with open(f"/proc/{pid}/maps") as f:
            loaded_torch = "libtorch_cpu" in f.read()
        assert loaded_torch == (stub.model == "glm"), stub
