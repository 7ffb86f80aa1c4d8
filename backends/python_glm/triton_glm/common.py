"""What the adapters share: reading parameters and inputs, finding the checkpoint, error responses."""

from __future__ import annotations

import os

import numpy as np
import triton_python_backend_utils as pb_utils

MODEL_DIR_ENV = "GLM_MODEL_DIR"


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


def check_prompt(text: str) -> None:
    if not text.strip():
        raise InputError("input 'text_input' is empty: give a prompt of at least one non-blank character")


def error_response(message: str, internal: bool = False):
    """An error response: the client's fault (INVALID_ARG, HTTP 400) unless `internal` (the server's)."""
    # pb_utils' attributes are read here, not at import: the stub imports model.py before it fills them in.
    code = pb_utils.TritonError.INTERNAL if internal else pb_utils.TritonError.INVALID_ARG
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message, code))


def as_text(value) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def cut_to_text_length(text: str, text_length: int) -> str:
    """Apply glm's `text_length` output: a stop string began at that character; -1 keeps the whole text."""
    return text if text_length < 0 else text[:text_length]
