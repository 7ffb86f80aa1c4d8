"""Fuzzing through the real server: hypothesis sends requests to every input of ensemble, bls and glm (wrong types,
shapes and names, missing inputs, extreme values, hostile JSON) over HTTP's generate and infer endpoints and gRPC
streams. Every answer must be a success or a client error whose message holds no traceback and no server path;
afterwards the server is ready and its engine holds no request and no KV block.

About GLM_FUZZ_SECONDS seconds (default 45) in CI; more for a longer search:
    GLM_FUZZ_SECONDS=1800 .venv/bin/python -m pytest tests/test_fuzz.py
It writes what it tried and saw to GLM_FUZZ_REPORT (default .build/fuzz-report.json).
"""

from __future__ import annotations

import collections
import json
import os
import queue
import time

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import REPO
from support.server import metric, metrics, running_server, wait_for
from tritonclient.utils import InferenceServerException

from triton_glm.request_schema import GLM_ONLY_INPUTS, JSON_ONLY_KEYS, REQUEST_INPUTS

pytestmark = pytest.mark.integration

FUZZ_SECONDS = float(os.environ.get("GLM_FUZZ_SECONDS", 45))
REPORT = os.environ.get("GLM_FUZZ_REPORT", os.path.join(REPO, ".build", "fuzz-report.json"))
MODELS = ("ensemble", "bls", "glm")
INPUT_NAMES = {
    "ensemble": [tensor.name for tensor in REQUEST_INPUTS],
    "bls": [tensor.name for tensor in REQUEST_INPUTS],
    "glm": sorted({tensor.glm_input for tensor in REQUEST_INPUTS if tensor.name not in ("text_input", "stream")}
                  | {tensor.name for tensor in GLM_ONLY_INPUTS}),
}
# What must never reach a client: a Python traceback, or where the server's files are.
LEAKS = ("Traceback", 'File "', REPO, "site-packages", ".py\"", ".py'", ".py:")
# Client errors. Triton 2.51's generate endpoints answer every error with 400 (so do we, through them), except that
# its HTTP frontend answers a body it cannot read as the inputs (JSON it rejects, data that does not fit an input's
# type or shape) with 500, before any model sees it. Those messages are Triton's own, listed here so that nothing
# else may be a 500; docs/requests.md names them.
TRITON_PARSER_500 = ("Unable to parse 'data'", "Unable to parse JSON bytes array",
                     "failed to parse the request JSON buffer", "was not found in the JSON")

EXTREME_NUMBERS = st.sampled_from([0, -1, 1, 2**31 - 1, -2**31, 2**63, 2**64 + 1, 10**400, 1e-45, 1e308, -1e308,
                                   float("inf"), float("-inf"), float("nan"), 0.5, 1e-7])
SMALL_TEXT = st.text(max_size=40) | st.sampled_from(["", " ", "\x00", "\ud800", "你好" * 20, "</s>", "a" * 3000])
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | EXTREME_NUMBERS | SMALL_TEXT,
    lambda children: st.lists(children, max_size=5) | st.dictionaries(SMALL_TEXT, children, max_size=4),
    max_leaves=12)
TENSOR_TYPES = {"BYTES": np.object_, "BOOL": np.bool_, "INT32": np.int32, "INT64": np.int64, "UINT64": np.uint64,
                "FP32": np.float32, "FP16": np.float16, "INT8": np.int8}


def known_or_junk(model: str):
    return st.sampled_from(INPUT_NAMES[model]) | st.sampled_from(["", "junk", "text_input\x00", "a" * 300])


@st.composite
def generate_bodies(draw):
    """A JSON body for /generate: the model's input names (and junk) with any JSON values; text_input usually
    present, sampling_parameters sometimes a JSON text of its own."""
    model = draw(st.sampled_from(MODELS))
    body = draw(st.dictionaries(known_or_junk(model), JSON_VALUES, max_size=6))
    if model != "glm" and draw(st.booleans()):
        body["text_input"] = draw(SMALL_TEXT)
    if model == "glm" and draw(st.booleans()):
        ids = draw(st.lists(st.integers(-5, 9000) | st.sampled_from([2**31 - 1, -2**31]), min_size=0, max_size=20))
        body.update(input_ids=ids, input_lengths=[draw(st.integers(-1, 25))])
    if model != "glm" and draw(st.booleans()):
        keys = st.sampled_from(sorted(JSON_ONLY_KEYS) + ["temperature", "top_p", "top_k", "max_tokens", "seed",
                                                         "stop", "min_p", "repetition_penalty", "ignore_eos"])
        sampling = draw(st.dictionaries(keys, JSON_VALUES, max_size=5))
        body["sampling_parameters"] = draw(st.sampled_from([json.dumps(sampling), "{", "[]", "1e999",
                                                            "[" * 300 + "]" * 300, json.dumps(sampling) * 2]))
    return "generate", model, body


@st.composite
def tensor_requests(draw):
    """Tensors of any type and shape under the model's input names (and junk), sent through a gRPC stream (all
    three models are reached by it; the decoupled ones only by it)."""
    model = draw(st.sampled_from(MODELS))
    tensors = {}
    for name in draw(st.lists(known_or_junk(model), max_size=5, unique=True)):
        datatype = draw(st.sampled_from(sorted(TENSOR_TYPES)))
        shape = draw(st.sampled_from([(1, 1), (1,), (1, 3), (2, 1), (1, 0), (1, 1, 1), (1, 65)]))
        count = int(np.prod(shape))
        if datatype == "BYTES":
            values = draw(st.lists(st.binary(max_size=20) | SMALL_TEXT.map(lambda t: t.encode("utf-8", "replace")),
                                   min_size=count, max_size=count))
            array = np.array(values, dtype=np.object_).reshape(shape)
        else:
            info = np.finfo if datatype.startswith("FP") else np.iinfo if datatype != "BOOL" else None
            if info is None:
                values = draw(st.lists(st.booleans(), min_size=count, max_size=count))
            else:
                limits = info(TENSOR_TYPES[datatype])
                values = draw(st.lists(st.sampled_from([0, 1, limits.max, limits.min]) |
                                       st.integers(-3, 300), min_size=count, max_size=count))
            with np.errstate(invalid="ignore", over="ignore"):  # wrapped and rounded values: hostile on purpose
                array = np.array(values).astype(TENSOR_TYPES[datatype]).reshape(shape)
        tensors[name] = (datatype, array)
    if model != "glm" and "text_input" not in tensors and draw(st.booleans()):
        tensors["text_input"] = ("BYTES", np.array([[draw(SMALL_TEXT).encode("utf-8", "replace")]], dtype=np.object_))
    return "grpc", model, tensors


def check_message(message: str) -> None:
    for leak in LEAKS:
        assert leak not in message, f"the answer shows {leak!r}: {message[:500]}"


def send_generate(server, model: str, body: dict) -> str:
    """POST the body (as JSON that Python's json writes: NaN and Infinity included, as a careless client would)."""
    data = json.dumps(body).encode()
    response = requests.post(f"http://{server.http_url}/v2/models/{model}/generate", data=data, timeout=60,
                             headers={"Content-Type": "application/json"})
    if response.status_code == 200:  # model output: the demo model's corpus has Python tracebacks in it
        answer = response.json()
        assert "text_output" in answer or "output_ids" in answer, answer
        return "200"
    check_message(response.text)
    if response.status_code == 500 and any(text in response.text for text in TRITON_PARSER_500):
        return "500 from Triton's JSON parser"
    assert response.status_code in (400, 404, 503), (response.status_code, response.text[:500], body)
    return str(response.status_code)


def send_grpc(server, model: str, tensors: dict) -> str:
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    inputs = []
    for name, (datatype, array) in tensors.items():
        tensor = grpcclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    try:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        client.async_stream_infer(model, inputs, enable_empty_final_response=True)
        while True:
            result, error = results.get(timeout=60)
            if error is not None:
                message = error.message() if isinstance(error, InferenceServerException) else str(error)
                check_message(message)
                return "error"
            if result.get_response().parameters["triton_final_response"].bool_param:
                return "ok"
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()


@pytest.fixture(scope="module")
def fuzz_server(demo_model_dir, tmp_path_factory):
    """Short answers whatever max_tokens a request asks for (max_model_len 96), so that cases take milliseconds."""
    with running_server(demo_model_dir, str(tmp_path_factory.mktemp("fuzz")), {"max_model_len": "96"}) as server:
        yield server


def test_fuzzed_requests_get_clear_answers_and_harm_nothing(fuzz_server):
    outcomes: collections.Counter = collections.Counter()
    deadline = time.monotonic() + FUZZ_SECONDS

    # Hypothesis has no time budget: rounds of a few cases each, on fresh random seeds, until the time is up.
    @settings(max_examples=20, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(st.one_of(generate_bodies(), tensor_requests()))
    def one_case(case):
        kind, model, payload = case
        outcome = (send_generate if kind == "generate" else send_grpc)(fuzz_server, model, payload)
        outcomes[f"{kind} {model} {outcome}"] += 1

    while time.monotonic() < deadline:
        one_case()
    tried = sum(outcomes.values())
    os.makedirs(os.path.dirname(REPORT), exist_ok=True)
    with open(REPORT, "w") as f:
        json.dump({"seconds": FUZZ_SECONDS, "cases": tried, "outcomes": dict(sorted(outcomes.items()))}, f, indent=1)
    print(f"\n[fuzz] {tried} cases in {FUZZ_SECONDS:.0f}s: {dict(sorted(outcomes.items()))}; report {REPORT}")
    assert tried > 50, outcomes

    assert fuzz_server.is_ready()
    assert wait_for(lambda: metric(metrics(fuzz_server), "glm_num_requests_running") == 0, timeout=60)
    samples = metrics(fuzz_server)
    assert metric(samples, "glm_num_requests_waiting") == 0 and metric(samples, "glm_kv_blocks_used") == 0
    # and it still answers
    response = requests.post(f"http://{fuzz_server.http_url}/v2/models/ensemble/generate", timeout=60,
                             json={"text_input": "still here", "max_tokens": 4})
    assert response.status_code == 200 and response.json()["num_output_tokens"] == 4


@pytest.mark.parametrize("depth", [60_000, 1_000_000])
def test_deeply_nested_json_is_a_client_error_not_a_crash(fuzz_server, depth):
    """Triton 2.51 parses JSON recursively: 60,000 nested brackets (a 120 kB body) crashed it with the usual 8 MiB
    thread stacks; the launcher starts it with larger ones (glm_tools/launcher.py, SERVER_STACK_BYTES)."""
    for endpoint in ("ensemble/generate", "preprocessing/infer"):
        body = '{"text_input": ' + "[" * depth + "]" * depth + ', "max_tokens": 2}' if "generate" in endpoint else \
            '{"inputs": [{"name": "QUERY", "datatype": "BYTES", "shape": [1, 1], "data": ' + "[" * depth + \
            "]" * depth + "}]}"
        response = requests.post(f"http://{fuzz_server.http_url}/v2/models/{endpoint}", data=body, timeout=120)
        assert response.status_code == 400, response.text[:300]
        assert "Traceback" not in response.text
    assert fuzz_server.process.poll() is None and fuzz_server.is_ready()
