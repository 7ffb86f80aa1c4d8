"""Everything that spells out a request agrees with triton_glm/request_schema.py: the config.pbtxt of the ensemble,
bls and glm models (inputs, outputs, the ensemble's name mapping), the client SDK's request builder, and the
tables in docs/requests.md."""

from __future__ import annotations

import os
import re

import pytest
from support import REPO

from clients.request import SAMPLING_INPUTS
from triton_glm.request_schema import (GLM_ONLY_INPUTS, GLM_OUTPUTS, REQUEST_INPUTS, REQUEST_OUTPUTS,
                                       markdown_tables)

TENSOR = re.compile(r'\{ name: "(\w+)", data_type: TYPE_(\w+), dims: \[ ([-\d, ]+) \](, optional: true)? \}')


def config(model: str) -> str:
    with open(os.path.join(REPO, "model_repository", model, "config.pbtxt")) as f:
        return f.read()


def declared(text: str, kind: str) -> list[tuple[str, str, tuple[int, ...], bool]]:
    """(name, datatype, dims, optional) of each tensor in the `input [...]` or `output [...]` block, in order."""
    block = re.search(rf"^{kind} \[\n(.*?)^\]", text, re.S | re.M).group(1)
    return [(name, datatype, tuple(int(d) for d in dims.split(",")), bool(optional))
            for name, datatype, dims, optional in TENSOR.findall(block)]


def expected(tensors, rename=lambda tensor: tensor.name, required=("text_input",)):
    return [(rename(t), t.datatype, t.dims, t.name not in required) for t in tensors]


@pytest.mark.parametrize("model, required", [("ensemble", ()), ("bls", ("text_input",))])
def test_the_ensemble_and_bls_declare_the_schema(model, required):
    """The ensemble declares text_input optional: Triton 2.51's ensemble answers a request without a required input
    with an empty response, so preprocessing checks it."""
    assert declared(config(model), "input") == expected(REQUEST_INPUTS, required=required)
    assert declared(config(model), "output") == expected(REQUEST_OUTPUTS, required=[t.name for t in REQUEST_OUTPUTS])


def test_glm_declares_the_schema_under_its_own_names():
    shared = [t for t in REQUEST_INPUTS if t.name != "text_input"]  # preprocessing turns it into input_ids
    inputs = expected(shared, rename=lambda t: t.glm_input) + expected(GLM_ONLY_INPUTS, required=())
    assert sorted(declared(config("glm"), "input")) == sorted(inputs)
    assert declared(config("glm"), "output") == expected(GLM_OUTPUTS, required=[t.name for t in GLM_OUTPUTS])


def test_the_ensemble_maps_each_input_to_its_glm_name():
    glm_step = config("ensemble").split('model_name: "glm"')[1].split("model_name:")[0]
    input_map = dict(re.findall(r'input_map \{ key: "(\w+)", value: "(\w+)" \}', glm_step))
    expected_map = {t.glm_input: t.name for t in REQUEST_INPUTS if t.name != "text_input"}
    assert {key: value for key, value in input_map.items() if not value.startswith("_")} == expected_map
    output_map = dict(re.findall(r'output_map \{ key: "(\w+)", value: "(\w+)" \}', glm_step))
    assert output_map == {t.name: t.name for t in REQUEST_OUTPUTS}  # glm is the last step: see the config


def test_the_client_sdk_sends_schema_inputs_with_their_types():
    schema = {t.name: t for t in REQUEST_INPUTS}
    for name, (datatype, _) in SAMPLING_INPUTS.items():
        assert name in schema, name
        assert datatype == schema[name].datatype.replace("STRING", "BYTES"), name
    # What the SDK does not take as a keyword: the prompt and streaming (its own arguments), vllm_backend's style,
    # and TensorRT-LLM's inputs that change nothing, older names and perf metrics.
    compatibility = {t.name for t in REQUEST_INPUTS if t.accepts is not None}
    assert set(schema) - set(SAMPLING_INPUTS) - compatibility == {
        "text_input", "stream", "sampling_parameters", "return_logprobs", "return_cumulative_logprob",
        "return_finish_reason", "return_num_input_tokens", "return_num_output_tokens", "pad_id", "min_length",
        "random_seed", "return_perf_metrics", "return_kv_cache_reuse_stats", "early_stopping"}


def test_every_input_has_a_meaning_a_default_and_a_known_type():
    for tensor in REQUEST_INPUTS:
        assert tensor.meaning and tensor.default_text(), tensor.name
        assert tensor.datatype in ("BOOL", "INT32", "UINT64", "FP32", "FP16", "STRING"), tensor.name


def test_the_docs_print_the_schema():
    with open(os.path.join(REPO, "docs", "requests.md")) as f:
        assert markdown_tables() in f.read(), "run `python -m triton_glm.request_schema` and paste its tables"
