"""A glm request's sampling settings, from either request style clients already use:
TensorRT-LLM's (one tensor per setting) or vllm_backend's (a `sampling_parameters` JSON string whose values may be
strings, e.g. {"temperature": "0.1", "max_tokens": "100"}). A tensor wins over the same setting in the JSON."""

from __future__ import annotations

import json

import triton_python_backend_utils as pb_utils

from glm_engine import SamplingParams
from glm_engine.config import parse_bool

from .common import InputError, as_text, optional_scalar


def _vllm_top_k(value) -> int:
    top_k = int(value)
    return 0 if top_k == -1 else top_k  # vLLM disables top-k with -1, this engine with 0


# SamplingParams field -> (tensor input, sampling_parameters key, cast)
SETTINGS = {
    "max_tokens": ("request_output_len", "max_tokens", int),
    "temperature": ("temperature", "temperature", float),
    "top_k": ("runtime_top_k", "top_k", _vllm_top_k),
    "top_p": ("runtime_top_p", "top_p", float),
    "min_p": ("min_p", "min_p", float),
    "repetition_penalty": ("repetition_penalty", "repetition_penalty", float),
    "presence_penalty": ("presence_penalty", "presence_penalty", float),
    "frequency_penalty": ("frequency_penalty", "frequency_penalty", float),
    "min_tokens": ("min_tokens", "min_tokens", int),
    "seed": ("seed", "seed", int),
}
# sampling_parameters keys handled apart from SETTINGS.
OTHER_KEYS = ("ignore_eos", "stop_token_ids", "logprobs", "n", "stop", "bad_words")
JSON_KEYS = sorted({key for _, key, _ in SETTINGS.values()} | set(OTHER_KEYS))
# Tensor switches that turn on log-probabilities (ours, and vllm_backend's two).
LOGPROB_SWITCHES = ("return_log_probs", "return_logprobs", "return_cumulative_logprob")


def sampling_parameters_json(request) -> dict:
    text = optional_scalar(request, "sampling_parameters", None, as_text)
    if text is None:
        return {}
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"input 'sampling_parameters' is not valid JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise InputError("input 'sampling_parameters' must be a JSON object")
    unknown = sorted(set(parsed) - set(JSON_KEYS))
    if unknown:
        raise InputError(f"sampling_parameters: unsupported keys {unknown}; supported: {', '.join(JSON_KEYS)}")
    return parsed


def word_list(request, from_json: dict, name: str, key: str) -> list[str]:
    """Strings from a STRING [-1] input, else from the JSON (a string or a list of them)."""
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is not None:
        return [as_text(v) for v in tensor.as_numpy().reshape(-1)]
    value = from_json.get(key, [])
    words = [value] if isinstance(value, str) else value
    if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
        raise InputError(f"sampling_parameters: {key!r} must be a string or a list of strings")
    return words


def sampling_params(request, default_max_tokens: int, tokenizer=None) -> tuple[SamplingParams, list[str]]:
    """The request's SamplingParams and stop strings. Bad words are tokenized with `tokenizer`, with and without a
    leading space, as a word may be tokenized either way. Raises InputError naming the input (or JSON key) whose
    value cannot be read; ranges are checked later, by the engine."""
    from_json = sampling_parameters_json(request)

    def json_value(key, cast):
        try:
            return cast(from_json[key])
        except (TypeError, ValueError):
            raise InputError(f"sampling_parameters: {key!r} has an unusable value {from_json[key]!r}") from None

    values = {"max_tokens": default_max_tokens}
    for field, (tensor_name, key, cast) in SETTINGS.items():
        if key in from_json:
            values[field] = json_value(key, cast)
        tensor_value = optional_scalar(request, tensor_name, None, cast)
        if tensor_value is not None:
            values[field] = tensor_value

    if "n" in from_json and json_value("n", int) != 1:
        raise InputError("sampling_parameters: only n = 1 is supported")
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
    stop_strings = word_list(request, from_json, "stop_words", "stop")
    bad_words = [w for w in word_list(request, from_json, "bad_words", "bad_words") if w]
    bad_words_ids = tuple(dict.fromkeys(tuple(tokenizer.encode(variant, add_special_tokens=False))
                                        for word in bad_words for variant in (word, " " + word)))
    params = SamplingParams(**values, stop_token_ids=stop_token_ids, logprobs=logprobs, bad_words_ids=bad_words_ids)
    return params, stop_strings
