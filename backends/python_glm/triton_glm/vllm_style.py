"""`vllm_model`: vllm_backend's interface over the same engine, for its clients unchanged.

vllm_backend's models have `max_batch_size: 0`, so their clients send tensors without a batch dimension (`text_input`
of shape [1]); settings travel as the `sampling_parameters` JSON string (or, where that is absent, as the request's
parameters), and its outputs are `text_output`, and, when switched on (or named by the client: perf_analyzer names
every output, and reads garbage for one that is missing), `finish_reason`, `cumulative_logprob`, `logprobs`,
`num_input_tokens` and `num_output_tokens`. This model tokenizes, calls `glm` through BLS (so the traffic
split and every engine rule apply, and no second copy of the weights is loaded), and turns each glm response into
vllm_backend's, one by one, so a stream stays a stream.
"""

from __future__ import annotations

import json
import logging
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import triton_python_backend_utils as pb_utils

from .bls_calls import exec_latest, release_kept
from .common import (CODE_IN_MESSAGE, InputError, callee_error, check_prompt, error_response, internal_error,
                     optional_scalar, output_or_empty, request_parameters, required_array, send_now, text_of,
                     tokenizer_and_limit, without_empty)

log = logging.getLogger(__name__)

# vllm_backend's switches for its optional outputs, and the output each turns on.
SWITCHES = {"return_finish_reason": "finish_reason", "return_cumulative_logprob": "cumulative_logprob",
            "return_logprobs": "logprobs", "return_num_input_tokens": "num_input_tokens",
            "return_num_output_tokens": "num_output_tokens"}
GLM_OUTPUTS = ["text_output", "output_ids", "finish_reason", "num_input_tokens", "num_output_tokens",
               "output_log_probs", "cum_log_probs", "sequence_index"]


class VllmStyleModel:
    def __init__(self, args: dict, parameters: dict[str, str]):
        self.tokenizer, self.max_prompt_tokens = tokenizer_and_limit(parameters, args)
        self.engine_model = parameters.pop("engine_model", "glm")
        # Each request waits on its glm stream in a thread of its own; the engine's admission limit decides who waits.
        self.pool = ThreadPoolExecutor(max_workers=256, thread_name_prefix="vllm-style")

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                glm_request, wanted, request_id = self._glm_request(request)
            except InputError as exc:
                sender.send(error_response(str(exc)), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            except Exception:
                sender.send(internal_error("reading a vllm_model request"),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            self.pool.submit(self._relay, glm_request, sender, wanted, request_id)
        return None

    def _glm_request(self, request):
        text = text_of(required_array(request, "text_input").reshape(-1)[0], "text_input")
        check_prompt(text, self.tokenizer, self.max_prompt_tokens)
        stream = optional_scalar(request, "stream", False, bool)
        switched_on = {output for switch, output in SWITCHES.items() if optional_scalar(request, switch, False, bool)}
        # Only the outputs the client asked for (all when it named none): Triton would drop the others, and its stub
        # frees what it drops without the GIL (see common.only_requested).
        wanted = set(request.requested_output_names())
        settings = pb_utils.get_input_tensor_by_name(request, "sampling_parameters")
        if settings is not None:
            settings = settings.as_numpy().reshape(-1)[:1]
        else:  # vllm_backend also reads the settings from the request's parameters
            parameters = {key: value for key, value in request_parameters(request).items()
                          if not key.startswith(("glm_", "triton_"))}
            settings = np.array([json.dumps(parameters).encode()], dtype=np.object_) if parameters else None
        prompt = np.array([self.tokenizer.encode(text)], dtype=np.int32)
        inputs = [pb_utils.Tensor("input_ids", prompt),
                  pb_utils.Tensor("input_lengths", np.array([[prompt.shape[1]]], dtype=np.int32)),
                  pb_utils.Tensor("streaming", np.array([[stream]])),
                  pb_utils.Tensor("exclude_input_in_output",
                                  np.array([[optional_scalar(request, "exclude_input_in_output", False, bool)]])),
                  # Log-probs cost the engine a little: computed when switched on, else sent as vllm_backend does
                  # when they were not asked for (0 and "null").
                  pb_utils.Tensor("return_log_probs",
                                  np.array([[bool(switched_on & {"cumulative_logprob", "logprobs"})]]))]
        if settings is not None:
            inputs.append(pb_utils.Tensor("sampling_parameters", settings.reshape(1, 1)))
        ignore_eos = optional_scalar(request, "ignore_eos", None, bool)  # genai-perf's extra input
        if ignore_eos is not None:
            inputs.append(pb_utils.Tensor("ignore_eos", np.array([[ignore_eos]])))
        # glm's request always has an id, the client's or one of its own, so that a `stop` can end it (_relay).
        request_id = request.request_id() or f"vllm_model-{uuid.uuid4().hex}"
        glm_request = pb_utils.InferenceRequest(
            model_name=self.engine_model, inputs=inputs, request_id=request_id,
            requested_output_names=GLM_OUTPUTS, parameters={CODE_IN_MESSAGE: True})
        return glm_request, wanted, request_id

    def _relay(self, glm_request, sender, wanted: set[str], request_id: str) -> None:
        """glm's responses to the client as vllm_backend's. When the client goes away, or a send or this relay fails,
        glm's request is stopped before its call is closed: closing waits for glm's last response, which would
        otherwise come only at max_tokens."""
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        sent_tokens: dict[int, int] = {}  # per answer: output tokens reported so far (vllm reports each response's)
        finished = cancelled = False
        glm_responses = exec_latest(glm_request, sender)
        try:
            for response, cancelled in glm_responses:
                if cancelled:  # the client went away: end the request in the engine
                    self._stop(request_id)
                    break
                if response.has_error():
                    code, message = callee_error(response.error(), untagged="UNAVAILABLE")
                    sender.send(error_response(message, code), flags=final)
                    finished = True
                    break
                if not response.output_tensors():  # glm's empty final response
                    sender.send(flags=final)
                    finished = True
                    break
                sender.send(self._vllm_response(response, wanted, sent_tokens))
            if not finished:  # every request gets its final flag
                sender.send(flags=final)
        except Exception:
            if not finished:
                if not cancelled:
                    self._stop(request_id)
                try:
                    send_now(sender, None if cancelled else internal_error("answering a vllm_model request"), final)
                except Exception:  # the client went away
                    log.exception("closing a vllm_model request failed")
        finally:
            glm_responses.close()

    def _vllm_response(self, response, wanted: set[str], sent_tokens: dict[int, int]):
        def output(name):
            return output_or_empty(response, name)

        index = int(output("sequence_index")[0])
        total = int(output("num_output_tokens")[0])
        tensors = [pb_utils.Tensor("text_output", output("text_output").astype(np.object_))]
        if "finish_reason" in wanted:  # vllm_backend sends str(None) until the answer is over
            reason = output("finish_reason")[0].decode() or "None"
            tensors.append(pb_utils.Tensor("finish_reason", np.array([reason.encode()], dtype=np.object_)))
        if "cumulative_logprob" in wanted:
            tensors.append(pb_utils.Tensor("cumulative_logprob", output("cum_log_probs").astype(np.float32)))
        if "logprobs" in wanted:
            ids, logprobs = output("output_ids").tolist(), output("output_log_probs").tolist()
            generated = ids[len(ids) - len(logprobs):]  # a response that echoes the prompt has its ids first
            entries = [{str(token): {"logprob": logprob, "rank": None, "decoded_token": self.tokenizer.decode([token])}}
                       for token, logprob in zip(generated, logprobs)]
            text = json.dumps(entries) if logprobs else "null"
            tensors.append(pb_utils.Tensor("logprobs", np.array([text.encode()], dtype=np.object_)))
        if "num_input_tokens" in wanted:
            tensors.append(pb_utils.Tensor("num_input_tokens", output("num_input_tokens").astype(np.uint32)))
        if "num_output_tokens" in wanted:
            new = total - sent_tokens.get(index, 0)
            tensors.append(pb_utils.Tensor("num_output_tokens", np.array([new], dtype=np.uint32)))
        sent_tokens[index] = total
        return pb_utils.InferenceResponse(output_tensors=without_empty(tensors))

    def _stop(self, request_id: str) -> None:
        """TensorRT-LLM's `stop` on glm for this request id (glm passes it on to another version it forwarded to)."""
        stop = pb_utils.InferenceRequest(model_name=self.engine_model, request_id=request_id,
                                         inputs=[pb_utils.Tensor("stop", np.array([[True]]))],
                                         requested_output_names=[])
        try:
            for _ in stop.exec(decoupled=True):
                pass
        except Exception:
            log.info("stop for %r not delivered", request_id, exc_info=True)

    def finalize(self):
        self.pool.shutdown(wait=False, cancel_futures=True)
        release_kept()
