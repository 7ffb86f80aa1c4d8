"""What the adapters share: reading parameters and inputs, finding the checkpoint, error responses."""

from __future__ import annotations

import json
import logging
import os
import re

import numpy as np
import triton_python_backend_utils as pb_utils

from glm_engine.config import ModelConfig
from glm_engine.tokenizer import GlmTokenizer

log = logging.getLogger(__name__)

MODEL_DIR_ENV = "GLM_MODEL_DIR"
# Overrides glm's tensor_parallel_size parameter (a version's version.json still sets its own): the launcher's
# --tensor-parallel-size, a container's environment.
TENSOR_PARALLEL_ENV = "GLM_TENSOR_PARALLEL_SIZE"
# Triton 2.51 sets the code of every error that a BLS call receives to INTERNAL (triton-inference-server/server
# issue #7804), so a client error of glm would reach a bls client as HTTP 500. A request that carries this parameter
# gets each error's code at the start of its message instead ("[INVALID_ARG] ..."), and bls restores it.
CODE_IN_MESSAGE = "glm_error_code_in_message"


class InputError(ValueError):
    """A request input that is missing, of the wrong shape, or out of range; the message names it."""


def model_parameters(model_config: dict) -> dict[str, str]:
    return {key: value["string_value"] for key, value in model_config.get("parameters", {}).items()}


def resolve_model_dir(parameters: dict[str, str], args: dict) -> str:
    """GLM_MODEL_DIR if set, else the `model_dir` parameter; relative paths start at the model repository."""
    configured = parameters.pop("model_dir", "")
    path = os.environ.get(MODEL_DIR_ENV) or configured
    if not path:
        raise ValueError(f"no checkpoint: set the model_dir parameter or {MODEL_DIR_ENV}")
    repository = os.path.dirname(os.path.normpath(args["model_repository"]))
    return os.path.normpath(os.path.join(repository, path))


def optional_scalar(request, name: str, default, cast):
    """One value per request from an optional [1, 1] input, or `default` when the client did not send it."""
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return default
    array = tensor.as_numpy()
    if array.size != 1:
        raise InputError(f"input '{name}' must hold one value per request, got shape {list(array.shape)}")
    return cast(array.reshape(-1)[0])


def required_array(request, name: str) -> np.ndarray:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        raise InputError(f"input '{name}' is required")
    return tensor.as_numpy()


def check_prompt(text: str, tokenizer: GlmTokenizer, max_tokens: int) -> None:
    """A blank prompt, or one certainly longer than max_tokens (the checkpoint's positions), is refused before it is
    tokenized: tokenizing takes about a second a megabyte, and the instance's other requests wait meanwhile."""
    if not text.strip():
        raise InputError("input 'text_input' is empty: give a prompt of at least one non-blank character")
    if (fewest := tokenizer.fewest_tokens(text)) > max_tokens:
        raise InputError(f"input 'text_input' is {len(text.encode()):,} bytes, so at least {fewest:,} tokens: over "
                         f"the model's limit of {max_tokens:,} (refused before tokenizing)")


def tokenizer_and_limit(parameters: dict[str, str], args: dict) -> tuple[GlmTokenizer, int]:
    """The served checkpoint's tokenizer, and its positions: the longest prompt check_prompt lets through."""
    model_dir = resolve_model_dir(parameters, args)
    tokenizer = GlmTokenizer(model_dir)
    tokenizer.longest_token_bytes  # parsed now, at load, rather than in the first request
    return tokenizer, ModelConfig.from_checkpoint(model_dir).max_position_embeddings


def error_response(message: str, code: str = "INVALID_ARG", code_in_message: bool = False):
    """An error response. `code`: INVALID_ARG (the client's fault, HTTP 400), INTERNAL (the server's, HTTP 500) or
    another pb_utils.TritonError code; `code_in_message`: for a BLS caller (see CODE_IN_MESSAGE)."""
    # pb_utils' attributes are read here, not at import: the stub imports model.py before it fills them in.
    if code_in_message:
        message = f"[{code}] {message}"
    return pb_utils.InferenceResponse(output_tensors=[],
                                      error=pb_utils.TritonError(message, getattr(pb_utils.TritonError, code)))


def only_requested(request, tensors: list) -> list:
    """The tensors that the request asked for (Triton's requested outputs: all of the model's when it named none).
    Build a response for a response sender from these only: Triton 2.51's stub drops the others in sender.send()
    without holding the GIL, and frees their numpy arrays there (python_backend#390; see bls_calls.py)."""
    names = set(request.requested_output_names())
    return [tensor for tensor in tensors if tensor.name() in names]


def without_empty(tensors: list) -> list:
    """The tensors that hold at least one element: no response of these models carries an empty output.

    Triton 2.51's HTTP front end leaks a small record for every empty output it is given: its output allocator makes
    one per output, and Triton's core hands it back only with a buffer, which an empty output has not. Through the
    ensemble's generate_stream, an empty output_log_probs (log-probs off) leaked one every response: tritonserver
    grew about 8 KB a 128-token request, without end
    (docs/operations.md#fixed-tritonserver-grew-with-every-streamed-response).
    Whoever reads these responses takes a missing output as an empty one (`output_or_empty`)."""
    return [tensor for tensor in tensors if tensor.as_numpy().size]


def output_or_empty(response, name: str) -> np.ndarray:
    """A response's output `name`, flattened; empty when the response leaves it out (see without_empty)."""
    tensor = pb_utils.get_output_tensor_by_name(response, name)
    return np.zeros(0) if tensor is None else tensor.as_numpy().reshape(-1)


def send_now(sender, response, flags: int) -> None:
    """Send a response (None: only the flags, e.g. an empty final response) through a response sender."""
    if response is None:
        sender.send(flags=flags)
    else:
        sender.send(response, flags=flags)


def internal_error(what: str, code_in_message: bool = False):
    """The response to an exception no check foresaw: logged with its traceback, and reported to the client without
    one (nor any server path)."""
    log.exception("internal error while %s", what)
    return error_response(f"internal error while {what}; the server's log has the details", "INTERNAL",
                          code_in_message)


def request_parameters(request) -> dict:
    """A request's parameters ({} when it has none or they cannot be read)."""
    try:
        parameters = json.loads(request.parameters() or "{}")
    except (ValueError, AttributeError):
        return {}
    return parameters if isinstance(parameters, dict) else {}


def wants_code_in_message(request) -> bool:
    return bool(request_parameters(request).get(CODE_IN_MESSAGE))


def callee_error(error, untagged: str = "INTERNAL") -> tuple[str, str]:
    """(code, message) of a TritonError that a BLS call received, the code from its message (see CODE_IN_MESSAGE);
    `untagged`: the code of an error without one (Triton's own, e.g. the model is not loaded)."""
    message = error.message()
    tagged = re.fullmatch(r"\[([A-Z_]+)\] (.*)", message, re.S)
    if tagged and hasattr(pb_utils.TritonError, tagged[1]):
        return tagged[1], tagged[2]
    return untagged, message


def error_from_callee(error):
    """A TritonError that a BLS call received, with the code its message carries (see CODE_IN_MESSAGE)."""
    code, message = callee_error(error)
    return pb_utils.TritonError(message, getattr(pb_utils.TritonError, code))


def text_of(value, name: str) -> str:
    """One element of a STRING input as text; bytes that are not UTF-8 are an InputError naming the input."""
    if not isinstance(value, bytes):
        return str(value)
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"input '{name}' is not valid UTF-8 (byte 0x{value[exc.start]:02x} at position "
                         f"{exc.start})") from None


def cut_to_text_length(text: str, text_length: int) -> str:
    """Apply glm's `text_length` output: a stop string began at that character; -1 keeps the whole text."""
    return text if text_length < 0 else text[:text_length]
