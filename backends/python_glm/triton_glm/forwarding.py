"""Forwarding a glm request to another version of glm (triton_glm/versions.py has the routing rule): the request goes
there through BLS, pinned, and its responses come back through the original request's response sender, one by one
as they arrive, so a stream stays a stream."""

from __future__ import annotations

import itertools
import logging
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import triton_python_backend_utils as pb_utils

from .bls_calls import bls_responses, release_kept
from .common import CODE_IN_MESSAGE, callee_error, error_response, internal_error, send_now
from .request_params import answers_asked
from .versions import PINNED

log = logging.getLogger(__name__)


class Forwarder:
    def __init__(self, model_name: str):
        self.model_name = model_name
        # Each forwarded request waits on its stream in a thread of its own; the target's admission limit, not this
        # pool, decides who waits.
        self.pool = ThreadPoolExecutor(max_workers=256, thread_name_prefix="glm-forward")
        self._ids = itertools.count()

    def forward(self, request, sender, version: int, code_in_message: bool) -> None:
        """Send `request` to `version`, its responses to `sender`; returns at once."""
        # The client's id, so that a `stop` naming it (also forwarded) reaches the request; else one of ours, so that
        # a client that goes away can be stopped there.
        forward_id = request.request_id() or f"glm-forward-{next(self._ids)}"
        wanted = list(request.requested_output_names())
        inputs = [pb_utils.Tensor(tensor.name(), tensor.as_numpy()) for tensor in request.inputs()]
        # finish_reason, empty until an answer's last response, is how the end of each answer is told.
        callee_request = pb_utils.InferenceRequest(
            model_name=self.model_name, model_version=version, inputs=inputs, request_id=forward_id,
            requested_output_names=sorted({*wanted, "finish_reason"}),
            parameters={PINNED: True, CODE_IN_MESSAGE: True})
        self.pool.submit(self._relay, callee_request, sender, set(wanted), answers_asked(request), forward_id,
                         version, code_in_message)

    def stop(self, request_id: str, version: int) -> None:
        """TensorRT-LLM's `stop` for the requests with this id on `version`."""
        stop_request = pb_utils.InferenceRequest(
            model_name=self.model_name, model_version=version, request_id=request_id,
            inputs=[pb_utils.Tensor("stop", np.array([[True]]))],
            requested_output_names=[], parameters={PINNED: True})
        try:
            for _ in stop_request.exec(decoupled=True):
                pass
        except Exception:  # that version is gone: nothing runs there to stop
            log.info("stop for %r on version %d not delivered", request_id, version, exc_info=True)

    def _relay(self, callee_request, sender, wanted: set[str], answers: int, forward_id: str, version: int,
               code_in_message: bool) -> None:
        """`answers`: how many the request asked for (num_return_sequences); the final flag goes with the last."""
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        finished = stopped = False
        try:
            for response, cancelled in bls_responses(callee_request, sender):
                if cancelled:  # the client went away: stop the request there, close this one at the end
                    self.stop(forward_id, version)
                    stopped = True
                    break
                if response.has_error():
                    # Untagged: Triton's own refusal (that version is not loaded), which a retry can get past.
                    code, message = callee_error(response.error(), untagged="UNAVAILABLE")
                    sender.send(error_response(message, code, code_in_message), flags=final)
                    finished = True
                    break
                tensors = response.output_tensors()
                if not tensors:  # the callee's empty final response
                    sender.send(flags=final)
                    finished = True
                    break
                reason = pb_utils.get_output_tensor_by_name(response, "finish_reason").as_numpy().reshape(-1)[0]
                answers -= bool(reason)
                finished = answers <= 0
                sender.send(pb_utils.InferenceResponse(output_tensors=[t for t in tensors if t.name() in wanted]),
                            flags=final if finished else 0)
                if finished:
                    break
            if not finished:  # every request gets its final flag, or Triton holds it (and this version) for ever
                sender.send(flags=final)
        except Exception:
            if not finished:
                try:
                    error = None if stopped else internal_error(f"forwarding a request to version {version}",
                                                                code_in_message)
                    send_now(sender, error, final)
                except Exception:  # the client went away
                    log.exception("closing a forwarded request failed")

    def close(self) -> None:
        self.pool.shutdown(wait=False)
        release_kept()

