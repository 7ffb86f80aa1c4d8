"""A glm request's SamplingParams, read through the request schema from either request style clients already use:
TensorRT-LLM's (one tensor per setting) or vllm_backend's (a `sampling_parameters` JSON string whose values may be
strings, e.g. {"temperature": "0.1", "max_tokens": "100"}). A tensor wins over the same setting in the JSON. Values
are read here; their rules are checked by SamplingParams.validate, and those of stop and bad words here."""

from __future__ import annotations

import json

import triton_python_backend_utils as pb_utils

from glm_engine import SamplingParams
from glm_engine.config import parse_bool
from glm_engine.sampling_params import RULES

from .common import InputError, optional_scalar, text_of
from .request_schema import INPUTS_BY_NAME, JSON_ONLY_KEYS, REQUEST_INPUTS

TENSOR_CASTS = {"BOOL": bool, "INT32": int, "UINT64": int, "FP32": float}
# The numeric settings: schema inputs that set a SamplingParams field of a number.
NUMERIC_SETTINGS = [tensor for tensor in REQUEST_INPUTS if tensor.setting and tensor.datatype in TENSOR_CASTS]
JSON_KEYS = sorted({tensor.json_key for tensor in REQUEST_INPUTS if tensor.json_key} | set(JSON_ONLY_KEYS))
# The longest sampling_parameters JSON read: room for every key, with the most and longest stop and bad words
# written as \\u escapes.
MAX_JSON_CHARS = 262144
# TensorRT-LLM's inputs for what this engine does not do, accepted with values that change nothing.
COMPATIBILITY_INPUTS = [tensor for tensor in REQUEST_INPUTS if tensor.accepts is not None]
# Tensor switches that turn on log-probabilities (ours, and vllm_backend's two).
LOGPROB_SWITCHES = ("return_log_probs", "return_logprobs", "return_cumulative_logprob")


def _vllm_top_k(value) -> int:
    top_k = int(value)
    return 0 if top_k == -1 else top_k  # vLLM disables top-k with -1, this engine with 0


def _json_cast(tensor):
    """How a JSON value for this input is read (int("7") and float("0.5") take JSON strings too)."""
    return _vllm_top_k if tensor.name == "top_k" else TENSOR_CASTS[tensor.datatype]


def sampling_parameters_json(request) -> dict:
    text = optional_scalar(request, "sampling_parameters", None, lambda value: text_of(value, "sampling_parameters"))
    if text is None:
        return {}
    if len(text) > MAX_JSON_CHARS:
        raise InputError(f"input 'sampling_parameters' must be at most {MAX_JSON_CHARS} characters, got {len(text)}")
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"input 'sampling_parameters' is not valid JSON: {exc}") from None
    except (ValueError, RecursionError):  # an integer of over 4,300 digits; nesting deeper than Python recurses
        raise InputError("input 'sampling_parameters' holds a number too long or nesting too deep to read") from None
    if not isinstance(parsed, dict):
        raise InputError("input 'sampling_parameters' must be a JSON object")
    unknown = sorted(set(parsed) - set(JSON_KEYS))
    if unknown:
        raise InputError(f"sampling_parameters: unsupported keys {unknown}; supported: {', '.join(JSON_KEYS)}")
    return parsed


def answers_asked(request) -> int:
    """num_return_sequences, else sampling_parameters' n, else 1 (an unreadable value: glm names the problem)."""
    value = optional_scalar(request, "num_return_sequences", None, int)
    if value is None:
        value = sampling_parameters_json(request).get("n", 1)
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError):
        return 1


def word_list(request, from_json: dict, name: str) -> list[str]:
    """Strings from a STRING [-1] input, else from its JSON key (a string or a list of them), within their rule."""
    tensor = pb_utils.get_input_tensor_by_name(request, INPUTS_BY_NAME[name].glm_input)
    key = INPUTS_BY_NAME[name].json_key
    if tensor is not None:
        words = [text_of(v, name) for v in tensor.as_numpy().reshape(-1)]
    else:
        value = from_json.get(key, [])
        words = [value] if isinstance(value, str) else value
        if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
            raise InputError(f"sampling_parameters: {key!r} must be a string or a list of strings")
    try:
        RULES[INPUTS_BY_NAME[name].setting].check(name, words)
    except ValueError as exc:
        raise InputError(str(exc)) from None
    return words


def check_compatibility_inputs(request) -> None:
    """Refuse a value of COMPATIBILITY_INPUTS that would ask for something this engine does not do."""
    for tensor in COMPATIBILITY_INPUTS:
        value = pb_utils.get_input_tensor_by_name(request, tensor.glm_input)
        if value is not None and not tensor.accepts(value.as_numpy()):
            raise InputError(f"input '{tensor.name}' {tensor.rule} ({tensor.meaning})")


def sampling_params(request, default_max_tokens: int, tokenizer=None) -> SamplingParams:
    """The request's SamplingParams. Bad words are tokenized with `tokenizer`, with and without a leading space, as
    a word may be tokenized either way. Raises InputError naming the input (or JSON key) whose value cannot be
    read; the ranges of the values are checked later, by the engine."""
    check_compatibility_inputs(request)
    from_json = sampling_parameters_json(request)

    def json_value(key, cast):
        try:
            return cast(from_json[key])
        except (TypeError, ValueError, OverflowError):  # OverflowError: int() of an infinite float
            raise InputError(f"sampling_parameters: {key!r} has an unusable value {from_json[key]!r}") from None

    values = {"max_tokens": default_max_tokens}
    for tensor in NUMERIC_SETTINGS:
        if tensor.json_key in from_json:
            values[tensor.setting] = json_value(tensor.json_key, _json_cast(tensor))
        tensor_value = optional_scalar(request, tensor.glm_input, None, TENSOR_CASTS[tensor.datatype])
        if tensor.name == "top_p" and tensor_value == 0:
            tensor_value = 1.0  # TensorRT-LLM's clients send 0 for no nucleus filter
        if tensor_value is not None:
            values[tensor.setting] = tensor_value

    stop_token_ids = None
    if "stop_token_ids" in from_json:
        stop_token_ids = tuple(json_value("stop_token_ids", lambda ids: [int(i) for i in ids]))
    end_id = optional_scalar(request, "end_id", None, int)
    if end_id is not None:
        stop_token_ids = (end_id,)
    ignore_eos = optional_scalar(request, "ignore_eos", None, bool)
    if ignore_eos is None and "ignore_eos" in from_json:
        ignore_eos = json_value("ignore_eos", parse_bool)
    if ignore_eos:
        stop_token_ids = ()
    logprobs = any(optional_scalar(request, name, False, bool) for name in LOGPROB_SWITCHES)
    if "logprobs" in from_json:
        logprobs = logprobs or json_value("logprobs", int) > 0
    stop = tuple(word_list(request, from_json, "stop_words"))
    bad_words = [w for w in word_list(request, from_json, "bad_words") if w]
    bad_words_ids = tuple(dict.fromkeys(tuple(tokenizer.encode(variant, add_special_tokens=False))
                                        for word in bad_words for variant in (word, " " + word)))
    return SamplingParams(**values, stop_token_ids=stop_token_ids, logprobs=logprobs, bad_words_ids=bad_words_ids,
                          stop=stop)
