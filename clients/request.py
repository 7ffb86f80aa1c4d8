"""What a request carries: the prompt and the optional sampling inputs of the ensemble (and bls), with their
Triton types, and what comes back. Shared by the HTTP and gRPC clients so both send the same request."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# keyword -> (Triton datatype, numpy dtype): inputs of the ensemble (triton_glm/request_schema.py defines them,
# and a test holds this table against it; docs/requests.md lists their defaults and rules).
SAMPLING_INPUTS = {
    "max_tokens": ("INT32", np.int32), "temperature": ("FP32", np.float32), "top_k": ("INT32", np.int32),
    "top_p": ("FP32", np.float32), "min_p": ("FP32", np.float32), "seed": ("UINT64", np.uint64),
    "repetition_penalty": ("FP32", np.float32), "presence_penalty": ("FP32", np.float32),
    "frequency_penalty": ("FP32", np.float32), "min_tokens": ("INT32", np.int32), "end_id": ("INT32", np.int32),
    "ignore_eos": ("BOOL", bool), "return_log_probs": ("BOOL", bool), "exclude_input_in_output": ("BOOL", bool),
    "stop_words": ("BYTES", np.object_), "bad_words": ("BYTES", np.object_),
    "num_return_sequences": ("INT32", np.int32),
}
# A client wants the answer, not the prompt echoed back (the server's TensorRT-LLM default).
CLIENT_DEFAULTS = {"exclude_input_in_output": True}
# The model that runs the engine: `stop` requests go to it (see GrpcClient.cancel).
ENGINE_MODEL = "glm"


def answers_asked(values: dict) -> int:
    """How many answers a request's values ask for: each ends with a piece that has a finish_reason."""
    return int(values.get("num_return_sequences") or 1)


def request_values(sampling: dict) -> dict:
    """The sampling keywords checked and completed with the client's defaults; None values are left out."""
    unknown = sorted(set(sampling) - set(SAMPLING_INPUTS))
    if unknown:
        raise TypeError(f"unknown sampling option(s) {', '.join(unknown)}; known: {', '.join(SAMPLING_INPUTS)}")
    values = {**CLIENT_DEFAULTS, **{k: v for k, v in sampling.items() if v is not None}}
    for name in ("stop_words", "bad_words"):
        if isinstance(values.get(name), str):
            values[name] = [values[name]]
    return values


def triton_inputs(module, prompt: str, stream: bool, sampling: dict) -> list:
    """tritonclient InferInputs (of `module`, tritonclient.grpc or .http) for one ensemble request."""
    def tensor(name: str, array: np.ndarray, datatype: str):
        infer_input = module.InferInput(name, list(array.shape), datatype)
        infer_input.set_data_from_numpy(array)
        return infer_input

    inputs = [tensor("text_input", np.array([[prompt.encode()]], dtype=np.object_), "BYTES"),
              tensor("stream", np.array([[stream]], dtype=bool), "BOOL")]
    for name, value in request_values(sampling).items():
        datatype, dtype = SAMPLING_INPUTS[name]
        if datatype == "BYTES":
            array = np.array([[word.encode() for word in value]], dtype=np.object_)
        else:
            array = np.array([[value]], dtype=dtype)
        inputs.append(tensor(name, array, datatype))
    return inputs


def model_url(server: str, model: str, endpoint: str, version: str = "") -> str:
    """A model's HTTP endpoint (generate, generate_stream, ready), of one version or of the server's choice."""
    versioned = f"/versions/{version}" if version else ""
    return f"http://{server}/v2/models/{model}{versioned}/{endpoint}"


def generate_body(prompt: str, stream: bool, sampling: dict, request_id: str) -> dict:
    """The JSON body of the generate / generate_stream endpoints."""
    return {"id": request_id, "text_input": prompt, "stream": stream, **request_values(sampling)}


def stop_inputs(module) -> list:
    """The inputs of a `stop` request to ENGINE_MODEL; the request id names the request to stop."""
    stop = module.InferInput("stop", [1, 1], "BOOL")
    stop.set_data_from_numpy(np.array([[True]]))
    return [stop]


def stop_body(request_id: str) -> dict:
    """A `stop` request as the JSON body of ENGINE_MODEL's generate endpoint."""
    return {"id": request_id, "stop": True}


@dataclass
class Generation:
    """A finished answer. finish_reason: "stop" (end token or stop word), "length" (max_tokens) or
    "cancelled"; cum_log_prob is set when return_log_probs was asked for."""
    text: str
    finish_reason: str
    num_input_tokens: int
    num_output_tokens: int
    cum_log_prob: float | None = None
    glm_version: int | None = None  # the version of the glm model that answered (docs/versions.md)


@dataclass
class Piece:
    """One streamed response: its text and the request's figures so far (finish_reason only on the last)."""
    text: str
    finish_reason: str = ""
    num_input_tokens: int = 0
    num_output_tokens: int = 0
    cum_log_prob: float | None = None
    glm_version: int | None = None
    sequence_index: int = 0  # which answer (of num_return_sequences) the piece belongs to
    log_probs: list[float] = field(default_factory=list)  # of the piece's tokens, with return_log_probs

    @classmethod
    def from_outputs(cls, get) -> "Piece":
        """From a getter of output values by name (None when the response lacks that output)."""
        def scalar(name):
            value = get(name)
            if value is None:
                return None
            value = np.asarray(value, dtype=object if name in ("text_output", "finish_reason") else None)
            value = value.reshape(-1)[0] if value.size else None
            return value.decode() if isinstance(value, bytes) else value

        cum, version, index = scalar("cum_log_probs"), scalar("glm_version"), scalar("sequence_index")
        return cls(text=scalar("text_output") or "", finish_reason=scalar("finish_reason") or "",
                   num_input_tokens=int(scalar("num_input_tokens") or 0),
                   num_output_tokens=int(scalar("num_output_tokens") or 0),
                   cum_log_prob=None if cum is None else float(cum),
                   glm_version=None if version is None else int(version),
                   sequence_index=0 if index is None else int(index),
                   log_probs=[] if get("output_log_probs") is None else
                   np.asarray(get("output_log_probs"), dtype=np.float32).reshape(-1).tolist())
