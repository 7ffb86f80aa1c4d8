"""`glm`: the engine as a decoupled Triton model. execute() only validates and submits; the engine thread sends
each request's responses through its response sender as tokens come."""

from __future__ import annotations

import itertools
import logging
import math
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass

import numpy as np
import triton_python_backend_utils as pb_utils

from glm_engine import EngineConfig, EngineThread, LLMEngine, RequestOutput, SamplingParams, Unavailable
from glm_engine.output_processor import OutputProcessor, Response
from glm_engine.tokenizer import GlmTokenizer, same_tokenizer
from glm_engine.watchdog import Watchdog

from .common import (CODE_IN_MESSAGE, TENSOR_PARALLEL_ENV, InputError, cut_to_text_length, error_response,
                     internal_error, optional_scalar, request_parameters, required_array, resolve_model_dir, send_now,
                     without_empty)
from .forwarding import Forwarder
from .metrics import EngineMetrics
from .request_params import sampling_params
from .versions import PINNED, TrafficReader, VersionError, read_version_spec

log = logging.getLogger(__name__)

# Switches of TensorRT-LLM's that ask for its perf-metric outputs (PerfMetrics).
PERF_METRICS_SWITCHES = ("return_perf_metrics", "return_kv_cache_reuse_stats")
ZERO_INT32 = np.zeros((1, 1), dtype=np.int32)


class GlmEngineModel:
    def __init__(self, args: dict, parameters: dict[str, str]):
        self.version = int(args["model_version"])
        model_path = args["model_repository"]  # model_repository/glm
        if os.environ.get(TENSOR_PARALLEL_ENV):
            parameters["tensor_parallel_size"] = os.environ[TENSOR_PARALLEL_ENV]
        model_dir = version_checkpoint(model_path, self.version, parameters, resolve_model_dir(parameters, args))
        self.config = EngineConfig.from_parameters({**parameters, "model_dir": model_dir})
        self.tokenizer = GlmTokenizer(model_dir)
        self.metrics = EngineMetrics(args["model_name"], args["model_version"], self.config.inter_token_latency_metric)
        self.traffic = TrafficReader(model_path)
        self.forwarder = Forwarder(args["model_name"])
        self.outbox = ResponseOutbox(self.config.response_thread_nice)
        self.engine_thread = EngineThread(lambda: LLMEngine(self.config),
                                          on_step=lambda engine: self.metrics.update(engine.stats()))
        self.metrics.update(self.engine_thread.engine.stats())  # the pool's size, before the first step
        self.watchdog = Watchdog(self.engine_thread, self.config.stall_timeout_s)
        self._request_ids = itertools.count()
        # Engine ids of the running requests, by the id the client gave them (Triton's request id), for `stop`.
        self._running: dict[str, set[str]] = {}
        self._running_lock = threading.Lock()
        log.info("glm version %d ready: %s, max_model_len %d", self.version, model_dir,
                 self.engine_thread.engine.max_model_len)

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            parameters = request_parameters(request)
            code_in_message, pinned = bool(parameters.get(CODE_IN_MESSAGE)), bool(parameters.get(PINNED))
            try:
                if optional_scalar(request, "stop", False, bool):
                    self._stop(request.request_id(), forward=not pinned)
                    # One empty response, as the generate endpoint expects exactly one.
                    sender.send(pb_utils.InferenceResponse(output_tensors=[]),
                                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                    continue
                target = None if pinned else self.traffic.target(self.version)
                if target is not None:
                    self.forwarder.forward(request, sender, target, code_in_message)
                    continue
                prompt, params, streaming, echo_prompt = self._parse(request)
                perf_metrics = any(optional_scalar(request, name, False, bool) for name in PERF_METRICS_SWITCHES)
                answers = OpenAnswers(params.n)
                streams = [ResponseStream(sender, OutputProcessor(self.tokenizer, prompt, streaming, echo_prompt,
                                                                  params.stop),
                                          self.metrics, outputs=set(request.requested_output_names()),
                                          later=self.outbox.later, code_in_message=code_in_message,
                                          version=self.version, sequence_index=index, answers=answers,
                                          perf_metrics=perf_metrics,
                                          cancellation_check_s=self.config.cancellation_check_period_ms / 1000,
                                          coalesce=self.config.coalesce_stream_responses)
                           for index in range(params.n)]
                self._submit(request.request_id(), prompt, params.samples(), streams)
            except ValueError as exc:  # InputError, VersionError, or the engine's own checks
                sender.send(error_response(str(exc), code_in_message=code_in_message),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            except Unavailable as exc:  # overloaded or draining, refused in no time: HTTP 503, gRPC UNAVAILABLE
                sender.send(error_response(str(exc), "UNAVAILABLE", code_in_message),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            except Exception:
                sender.send(internal_error("reading a glm request", code_in_message),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None

    def _submit(self, client_id: str, prompt: list[int], samples: list[SamplingParams],
                streams: list[ResponseStream]) -> None:
        """Submit each answer of a request (one engine request each; the first leads the others, which share its
        prompt's KV blocks). If the engine refuses one, those already submitted are aborted without a word: the
        caller answers the request with the refusal."""
        engine_ids = [f"r{next(self._request_ids)}" for _ in samples]
        submitted = []
        try:
            for engine_id, params, stream in zip(engine_ids, samples, streams):
                self._submit_one(client_id, engine_id, prompt, params, stream, leader_id=submitted[0] if submitted
                                 else None)
                submitted.append(engine_id)
        except Exception:
            streams[0].answers.abandon()
            for engine_id in submitted:
                self.engine_thread.abort(engine_id)
            raise

    def _submit_one(self, client_id: str, engine_id: str, prompt: list[int], params: SamplingParams,
                    stream: ResponseStream, leader_id: str | None) -> None:
        if not client_id:
            self.engine_thread.submit(engine_id, prompt, params, stream.on_output, leader_id)
            return

        def on_output(output: RequestOutput) -> bool:
            keep_going = stream.on_output(output)
            if output.finished:
                self._forget(client_id, engine_id)
            return keep_going

        with self._running_lock:
            self._running.setdefault(client_id, set()).add(engine_id)
        try:
            self.engine_thread.submit(engine_id, prompt, params, on_output, leader_id)
        except Exception:  # refused: it will never run
            self._forget(client_id, engine_id)
            raise

    def _forget(self, client_id: str, engine_id: str) -> None:
        with self._running_lock:
            self._running[client_id].discard(engine_id)
            if not self._running[client_id]:
                del self._running[client_id]

    def _stop(self, client_id: str, forward: bool) -> None:
        """TensorRT-LLM's `stop` input: end the running requests that carry this request id. They finish with
        finish_reason "cancelled" and free their blocks within one step. It is how a client stops a request sent
        through the ensemble, whose cancellation Triton 2.51 does not pass on to this model. `forward`: also on the
        other versions that traffic.json names, where this version may have forwarded the request."""
        if not client_id:
            raise InputError("input 'stop' needs the request id of the request to stop (the request's 'id')")
        with self._running_lock:
            engine_ids = list(self._running.get(client_id, ()))
        for engine_id in engine_ids:  # none: it has finished already, which is not an error
            self.engine_thread.abort(engine_id)
        traffic = self.traffic.current() if forward else None
        for version in sorted(traffic.versions() - {self.version}) if traffic else ():
            self.forwarder.stop(client_id, version)

    def _parse(self, request) -> tuple[list[int], SamplingParams, bool, bool]:
        ids = required_array(request, "input_ids")
        lengths = required_array(request, "input_lengths")
        if ids.ndim == 2 and ids.shape[0] > 1:
            raise InputError(f"one prompt per request, got {ids.shape[0]}: send each prompt as a request of its own "
                             "(the engine batches them)")
        if ids.ndim != 2 or ids.shape[0] != 1 or lengths.size != 1:
            raise InputError(f"one prompt per request: input_ids must be [1, tokens], got {list(ids.shape)}")
        if ids.shape[1] == 0:
            raise InputError("input_ids is empty: a prompt needs at least one token")
        length = int(lengths.reshape(-1)[0])
        if not 0 < length <= ids.shape[1]:
            raise InputError(f"input_lengths must lie in [1, {ids.shape[1]}], got {length}: the prompt is empty "
                             "or shorter than stated")
        params = sampling_params(request, self.config.default_max_tokens, self.tokenizer)
        # pad_id is accepted for TensorRT-LLM clients; outputs are never padded, so it changes nothing.
        optional_scalar(request, "pad_id", None, int)
        streaming = optional_scalar(request, "streaming", False, bool)
        exclude_input = optional_scalar(request, "exclude_input_in_output", False, bool)
        # As in TensorRT-LLM, a stream carries only new tokens; a single response echoes the prompt unless excluded.
        return ids[0, :length].tolist(), params, streaming, not (exclude_input or streaming)

    def finalize(self):
        self.watchdog.stop()
        # Requests still running when Triton unloads the model (a reload under load) get unload_grace_s to finish
        # before the engine stops; after the launcher's drain there are none.
        self.engine_thread.shutdown(grace_s=self.config.unload_grace_s)
        self.outbox.close()
        # Triton finalizes a model once every response of its requests is sent, so no forwarded stream is left.
        self.forwarder.close()
        self.metrics.close()
        log.info("glm engine stopped")


def version_checkpoint(model_path: str, version: int, parameters: dict[str, str], server_checkpoint: str) -> str:
    """The checkpoint `version` serves (its version.json, else the server's), adding the engine parameters the
    version sets to `parameters`. A checkpoint whose tokenizer is not the server's is refused: preprocessing,
    postprocessing, bls and vllm_model tokenize for every version with the server's."""
    spec = read_version_spec(model_path, version)
    parameters.update(spec.parameters)
    if spec.checkpoint is None:
        return server_checkpoint
    if not same_tokenizer(spec.checkpoint, server_checkpoint):
        raise VersionError(f"version {version}: the checkpoint {spec.checkpoint} has another tokenizer.json than the "
                           f"server's checkpoint {server_checkpoint}, which preprocessing, postprocessing, bls and "
                           "vllm_model use for every version; serve it from a model repository of its own")
    return spec.checkpoint


class ResponseOutbox:
    """Runs the engine thread's round trips to Triton's process (sending responses, recording metrics) on a thread of
    its own, in the order they were queued.

    Each is mostly spent waiting for the server's side. Made on the engine thread, those waits came once per token
    and held up the next step; from here, they overlap the steps (docs/performance.md has the measurements). `nice`:
    how much lower than its creator's this thread's priority is (EngineConfig.response_thread_nice)."""

    def __init__(self, nice: int = 0):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._nice = nice
        self._thread = threading.Thread(target=self._run, name="glm-outbox", daemon=True)
        self._thread.start()

    def later(self, function, *args) -> None:
        """Call function(*args) on the outbox's thread, after everything queued before."""
        self._queue.put((function, args))

    def close(self) -> None:
        """Run what is queued, then stop."""
        self._queue.put(None)
        self._thread.join(timeout=30)

    def _run(self) -> None:
        if self._nice:
            lower_this_threads_priority(self._nice)
        while (item := self._queue.get()) is not None:
            function, args = item
            try:
                function(*args)
            except Exception:  # e.g. the client went away; the engine notices through is_cancelled()
                log.exception("a response or metric failed")


def lower_this_threads_priority(increment: int) -> None:
    """Add `increment` to the calling thread's nice value (at most 19). On Linux a nice value belongs to a thread,
    and raising it needs no privilege."""
    if not sys.platform.startswith("linux"):  # elsewhere the id would name a process
        return
    thread = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, thread, min(19, os.getpriority(os.PRIO_PROCESS, thread) + increment))
    except OSError as exc:
        log.warning("glm's response thread keeps the engine's priority: %s", exc)


def call_now(function, *args) -> None:
    function(*args)


class OpenAnswers:
    """The answers of one request (num_return_sequences) that have not ended: Triton's final flag goes with the last
    send of the last one whose last send is made (ResponseStream._send)."""

    def __init__(self, count: int):
        self._count = count
        self._lock = threading.Lock()
        self.abandoned = False  # the request was refused after some answers were submitted: they send nothing

    def close_one(self) -> bool:
        """One answer's last send is being made; True if it is the request's last."""
        with self._lock:
            self._count -= 1
            return self._count == 0

    def abandon(self) -> None:
        self.abandoned = True


@dataclass
class Outputs:
    """A response the output processor made, and TensorRT-LLM's perf outputs as they were then: one Triton response's
    worth, or part of one (ResponseStream._send_later)."""

    response: Response
    perf: dict[str, np.ndarray]


class ResponseStream:
    """The responses of one answer to a request, on Triton: the engine's outputs go through the answer's
    OutputProcessor, and what it says to send is turned into tensors and sent (through a ResponseOutbox); latencies
    go to the metrics."""

    def __init__(self, sender, processor: OutputProcessor, metrics: EngineMetrics | None = None,
                 outputs: set[str] | None = None, later=call_now, code_in_message: bool = False, version: int = 1,
                 sequence_index: int = 0, answers: OpenAnswers | None = None, perf_metrics: bool = False,
                 cancellation_check_s: float = 0.0, coalesce: bool = False, clock=time.monotonic):
        """`outputs`: the output names the client asked for (Triton asks for all when the client names none); only
        those are sent. Each tensor costs a copy through shared memory and gRPC or JSON encoding, every token.
        `later(function, *args)`: where the responses are built and sent and the latencies recorded (at once, or
        ResponseOutbox.later). `code_in_message`: the request came through BLS (see common.CODE_IN_MESSAGE).
        `version`: glm's version, sent as the output glm_version. `sequence_index`: which answer of the request this
        is, of `answers`. `perf_metrics`: send TensorRT-LLM's KV-cache and timing outputs. `cancellation_check_s`:
        the client's cancellation is asked for at most this often, and at the answer's end. `coalesce`: responses
        made while this answer's earlier ones still wait for `later` go out with them, as one (_send_later)."""
        self.sender = sender
        self.code_in_message = code_in_message
        self.processor = processor
        self.metrics = metrics
        self.outputs = outputs
        self.later = later
        self.cancellation_check_s, self.clock = cancellation_check_s, clock
        self._next_check, self._cancelled = -math.inf, False
        self.version = np.array([[version]], dtype=np.int32)
        self.sequence_index = np.array([[sequence_index]], dtype=np.int32)
        self.answers = answers or OpenAnswers(1)
        self.perf = PerfMetrics() if perf_metrics else None
        self.coalesce = coalesce
        self._waiting: list[tuple[object, bool]] = []  # sends queued and not yet made (coalesce): (item, ends)
        self._waiting_lock = threading.Lock()

    def on_output(self, output: RequestOutput) -> bool:
        """Called on the engine thread; returning False asks the engine to abort the request."""
        if self.answers.abandoned:
            return False
        update = self.processor.process(output, client_gone=lambda: self._client_gone(output.finished))
        if self.metrics is not None and (update.latencies or update.finish_reason):
            self.later(self.metrics.record, update.latencies, update.finish_reason)
        if self.perf is not None:
            self.perf.update(output)
        ends = update.error is not None or update.close or (update.response is not None and update.response.final)
        if update.error is not None:
            code = "UNAVAILABLE" if update.unavailable else "INTERNAL"
            self._send_later(error_response(update.error, code, self.code_in_message), ends)
        elif update.close:  # nobody listens: only the request's final flag may still be owed
            self._send_later(None, ends)
        elif update.response is not None:
            perf = self.perf.outputs() if self.perf is not None else {}  # as they are now, not when sent
            self._send_later(Outputs(update.response, perf), ends)
        return not update.abort

    def _send_later(self, item, ends: bool) -> None:
        """Have `later` send `item`: Outputs to make into a Triton response, or one ready (an error; None: only the
        request's final flag, if this answer is its last). `ends`: the answer's last. Coalescing, an answer has at
        most one send queued on the outbox, and what the engine makes while it waits goes with it, consecutive
        Outputs as one response: when Triton takes responses more slowly than the engine makes tokens (each send is
        a round trip to its process, which waits for a core beside the engine's), their number adapts instead of the
        queue growing; when it keeps up, every token goes alone (vLLM's output collector merges a request's outputs
        the same way)."""
        if not self.coalesce:
            self.later(self._send, [(item, ends)])
            return
        with self._waiting_lock:
            self._waiting.append((item, ends))
            queued = len(self._waiting) > 1
        if not queued:
            self.later(self._send_waiting)

    def _send_waiting(self) -> None:
        with self._waiting_lock:
            waiting, self._waiting = self._waiting, []
        self._send(waiting)

    def _send(self, items: list[tuple[object, bool]]) -> None:
        """Send these (item, ends) in order, each run of Outputs as one response. The request's final flag goes with
        the last answer's last send, decided as it is made: the answers of one request (num_return_sequences) share
        its sender and coalesce each on its own, so the answer that ended last may be sent before another's last
        tokens. One failed send (the client went away) does not keep the final flag from Triton."""
        for are_outputs, run in itertools.groupby(items, key=lambda item: isinstance(item[0], Outputs)):
            run = list(run)
            if are_outputs:
                run = [([outputs for outputs, _ in run], run[-1][1])]
            for item, ends in run:
                flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if ends and self.answers.close_one() else 0
                if item is None and not flags:
                    continue
                try:
                    send_now(self.sender, self._triton_response(item) if are_outputs else item, flags)
                except Exception:  # e.g. the client went away; the engine notices through is_cancelled()
                    log.exception("a glm response could not be made or sent")

    def _client_gone(self, ending: bool) -> bool:
        """Whether the client has cancelled: asked of the server every cancellation_check_s and when the answer ends
        (so that its last response goes to nobody only when nobody listens)."""
        now = self.clock()
        if not self._cancelled and (ending or now >= self._next_check):
            self._cancelled, self._next_check = self.sender.is_cancelled(), now + self.cancellation_check_s
        return self._cancelled

    def _triton_response(self, parts: list[Outputs]):
        """One Triton response for an answer's consecutive Outputs (one, unless coalesced): their tokens, text and
        log-probs joined; the counts, finish reason and perf figures of the last."""
        last, perf = parts[-1].response, parts[-1].perf
        token_ids = [token for part in parts for token in part.response.token_ids]
        # Each part's ids decode to whole characters (the output processor's chunking): its text is what it would
        # have sent alone. Only an answer's last response can be cut (a stop string ends it).
        def texts() -> list[str]:
            return [self.processor.tokenizer.decode(part.response.token_ids) for part in parts]

        text_length = -1 if last.text_length is None else sum(map(len, texts()[:-1])) + last.text_length
        # Each output is made only if asked for: on the outbox's thread, every token, holding the GIL that the engine
        # thread needs between its kernels.
        makers = {
            "output_ids": lambda: np.array(token_ids, dtype=np.int32).reshape(1, 1, -1),
            "sequence_length": lambda: np.array([[len(token_ids)]], dtype=np.int32),
            "text_length": lambda: np.array([[text_length]], dtype=np.int32),
            "finish_reason": lambda: np.array([[last.finish_reason.encode()]], dtype=np.object_),
            "num_input_tokens": lambda: np.array([[last.num_input_tokens]], dtype=np.int32),
            "num_output_tokens": lambda: np.array([[last.num_output_tokens]], dtype=np.int32),
            "output_log_probs": lambda: np.array([logprob for part in parts for logprob in part.response.logprobs],
                                                 dtype=np.float32).reshape(1, 1, -1),
            "cum_log_probs": lambda: np.array([[last.cum_logprob]], dtype=np.float32),
            "glm_version": lambda: self.version,
            "sequence_index": lambda: self.sequence_index,
            "batch_index": lambda: ZERO_INT32,
            # The text postprocessing would make, made here: the ensemble has no step after glm (its config.pbtxt).
            # Shape [1], not [1, 1]: TensorRT-LLM's and vllm_backend's clients read `text_output[0]` as the text.
            "text_output": lambda: np.array([cut_to_text_length("".join(texts()), text_length).encode("utf-8")],
                                            dtype=np.object_),
            **{name: (lambda value=value: value) for name, value in perf.items()},
        }
        return pb_utils.InferenceResponse(output_tensors=without_empty([
            pb_utils.Tensor(name, make()) for name, make in makers.items()
            if self.outputs is None or name in self.outputs]))


class PerfMetrics:
    """TensorRT-LLM's per-request figures (return_perf_metrics), as one answer's responses report them."""

    def __init__(self):
        self.arrival_ns = time.time_ns()
        self.first_token_ns = self.last_token_ns = 0
        self.first_scheduled_ns = self.reused_blocks = self.most_blocks = 0

    def update(self, output: RequestOutput) -> None:
        self.first_scheduled_ns = output.first_scheduled_ns
        self.reused_blocks = output.num_cached_blocks
        self.most_blocks = max(self.most_blocks, output.num_blocks)
        if output.new_token_ids:
            self.last_token_ns = time.time_ns()
            self.first_token_ns = self.first_token_ns or self.last_token_ns

    def outputs(self) -> dict[str, np.ndarray]:
        def int32(value):
            return np.array([[value]], dtype=np.int32)

        def int64(value):
            return np.array([[value]], dtype=np.int64)

        return {
            "kv_cache_alloc_new_blocks": int32(max(0, self.most_blocks - self.reused_blocks)),
            "kv_cache_reused_blocks": int32(self.reused_blocks),
            "kv_cache_alloc_total_blocks": int32(self.most_blocks),
            "arrival_time_ns": int64(self.arrival_ns),
            "first_scheduled_time_ns": int64(self.first_scheduled_ns),
            "first_token_time_ns": int64(self.first_token_ns),
            "last_token_time_ns": int64(self.last_token_ns),
            "acceptance_rate": np.zeros((1, 1), dtype=np.float32),
            "total_accepted_draft_tokens": ZERO_INT32,
            "total_draft_tokens": ZERO_INT32,
        }
