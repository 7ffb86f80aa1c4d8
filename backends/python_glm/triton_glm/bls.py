"""`bls`: the whole pipeline in one non-decoupled model, for clients that cannot talk to a decoupled one
(Triton's HTTP /infer, so `tritonclient.http`, and perf tools over HTTP). It tokenizes and detokenizes with the
same tokenizer module as the ensemble and calls the `glm` model through BLS, so both paths give the same text.
Streaming goes through the `ensemble`."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import triton_python_backend_utils as pb_utils

from .bls_calls import exec_latest, release_kept
from .common import CODE_IN_MESSAGE, InputError, check_prompt, cut_to_text_length, error_from_callee, \
    error_response, internal_error, only_requested, optional_scalar, output_or_empty, required_array, \
    text_of, tokenizer_and_limit, without_empty
from .request_params import answers_asked
from .request_schema import INPUTS_BY_NAME, REQUEST_OUTPUTS

log = logging.getLogger(__name__)

# Every input but text_input and stream goes to glm, under its glm name (the ensemble's mapping), so what bls
# accepts is what its config.pbtxt declares.
NOT_FOR_GLM = ("text_input", "stream")
# The glm outputs that bls returns as they are, from the last response (those glm sends: the perf metrics only when
# asked for); text_output and output_log_probs it makes from all responses.
PASSED_THROUGH = tuple(tensor.name for tensor in REQUEST_OUTPUTS if tensor.name not in ("text_output",
                                                                                        "output_log_probs"))


class Bls:
    def __init__(self, args: dict, parameters: dict[str, str]):
        self.tokenizer, self.max_prompt_tokens = tokenizer_and_limit(parameters, args)
        self.engine_model = parameters.pop("engine_model", "glm")
        # execute() gets a dynamic batch; each request waits on the engine in a thread of its own, so they wait side
        # by side. Enough threads that the engine's admission limit, not this pool, decides who waits.
        self.pool = ThreadPoolExecutor(max_workers=256, thread_name_prefix="bls")

    def execute(self, requests):
        # Each request answers through its own response sender as soon as it is done (Triton 2.51 allows this in a
        # non-decoupled model), so that a short request, or a refused one, never waits for the longest of its batch.
        for request in requests:
            self.pool.submit(self._answer_alone, request, request.get_response_sender())
        return None

    def _answer_alone(self, request, sender) -> None:
        try:
            sender.send(self._one(request), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception:  # the client went away
            log.exception("sending a bls response failed")

    def _one(self, request):
        try:
            return self._answer(request)
        except InputError as exc:
            return error_response(str(exc))
        except Exception:
            return internal_error("answering a bls request")

    def _answer(self, request):
        texts = [text_of(v, "text_input") for v in required_array(request, "text_input").reshape(-1)]
        if len(texts) != 1:
            raise InputError(f"one prompt per request, got {len(texts)}")
        check_prompt(texts[0], self.tokenizer, self.max_prompt_tokens)
        if optional_scalar(request, "stream", False, bool):
            raise InputError("the bls model answers in one response; stream through the 'ensemble' model")
        if answers_asked(request) != 1:
            raise InputError("the bls model gives one answer per request: for num_return_sequences (n) above 1, "
                             "use the 'ensemble' model, whose responses carry sequence_index")

        prompt = np.array([self.tokenizer.encode(texts[0])], dtype=np.int32)
        inputs = [pb_utils.Tensor("input_ids", prompt),
                  pb_utils.Tensor("input_lengths", np.array([[prompt.shape[1]]], dtype=np.int32))]
        for tensor in request.inputs():
            if tensor.name() not in NOT_FOR_GLM:
                inputs.append(pb_utils.Tensor(INPUTS_BY_NAME[tensor.name()].glm_input, tensor.as_numpy()))
        # The same request id, so that a `stop` request naming it reaches the engine's request.
        engine_request = pb_utils.InferenceRequest(
            model_name=self.engine_model, inputs=inputs, request_id=request.request_id(),
            requested_output_names=["output_ids", "output_log_probs", "text_length", *PASSED_THROUGH],
            parameters={CODE_IN_MESSAGE: True})
        token_ids: list[int] = []
        logprobs: list[float] = []
        text_length = -1
        last = {}
        for response, _ in exec_latest(engine_request, request):
            if response.has_error():
                return pb_utils.InferenceResponse(output_tensors=[], error=error_from_callee(response.error()))
            if not response.output_tensors():  # the empty final flag
                continue
            token_ids += output_or_empty(response, "output_ids").tolist()
            logprobs += output_or_empty(response, "output_log_probs").tolist()
            text_length = int(output_or_empty(response, "text_length")[0])
            last = {name: tensor.as_numpy() for name in PASSED_THROUGH
                    if (tensor := pb_utils.get_output_tensor_by_name(response, name)) is not None}
        # glm answers once (streaming is off), so its text_length, if any, counts over all of token_ids.
        text = self.tokenizer.decode(token_ids)
        text = np.array([[cut_to_text_length(text, text_length).encode("utf-8")]], dtype=np.object_)
        return pb_utils.InferenceResponse(output_tensors=without_empty(only_requested(request, [
            pb_utils.Tensor("text_output", text),
            pb_utils.Tensor("output_log_probs", np.array(logprobs, dtype=np.float32).reshape(1, 1, -1)),
            *(pb_utils.Tensor(name, value) for name, value in last.items())])))

    def finalize(self):
        self.pool.shutdown(wait=False, cancel_futures=True)
        release_kept()

