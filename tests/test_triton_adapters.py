"""The glm adapter's request parsing and its response tensors, with a stand-in for Triton's pb_utils module. What
the responses carry is tested without Triton in test_output_processor.py."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import threading

import numpy as np
import pytest

from support import fake_pb_utils

fake_pb_utils.install(sys.modules)

from glm_engine import FinishReason, RequestOutput  # noqa: E402
from glm_engine.engine import EngineStats  # noqa: E402
from glm_engine.output_processor import OutputProcessor  # noqa: E402
from glm_engine.tokenizer import GlmTokenizer  # noqa: E402
from triton_glm.common import InputError  # noqa: E402
from triton_glm.glm import OpenAnswers, Outputs, ResponseStream  # noqa: E402
from triton_glm.metrics import EngineMetrics  # noqa: E402
from triton_glm.request_params import sampling_params  # noqa: E402

FINAL = fake_pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class Sender:
    def __init__(self):
        self.sent, self.cancelled = [], False

    def send(self, response=None, flags=0):
        self.sent.append((response, flags))

    def is_cancelled(self):
        return self.cancelled


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir):
    return GlmTokenizer(demo_model_dir)


def output(tokens, finished=False, reason=None, error=None, logprobs=None):
    return RequestOutput("r", tokens, finished=finished, finish_reason=reason, error=error, new_logprobs=logprobs)


def stream(sender, tokenizer, streaming=True, prompt=(), echo=False, outputs=None):
    return ResponseStream(sender, OutputProcessor(tokenizer, list(prompt), streaming, echo), outputs=outputs)


def test_responses_become_tensors_with_a_final_flag_on_the_last(tokenizer):
    ids = tokenizer.encode("龘靐齉 ok")[2:]
    sender = Sender()
    responses = stream(sender, tokenizer, prompt=[3, 4])
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        assert responses.on_output(output([token], finished=last, reason=FinishReason.LENGTH if last else None,
                                          logprobs=[-1.0]))
    texts = [tokenizer.decode(r.outputs["output_ids"].reshape(-1).tolist()) for r, _ in sender.sent]
    assert "".join(texts) == "龘靐齉 ok"
    assert [flags for _, flags in sender.sent][-1] == FINAL and all(f == 0 for _, f in sender.sent[:-1])
    for r, _ in sender.sent:
        assert r.outputs["sequence_length"].item() == r.outputs["output_ids"].shape[-1]
        assert r.outputs["output_log_probs"].shape == r.outputs["output_ids"].shape
        assert r.outputs["text_length"].item() == -1 and r.outputs["num_input_tokens"].item() == 2
    last = sender.sent[-1][0].outputs
    assert last["finish_reason"].item() == b"length" and last["num_output_tokens"].item() == len(ids)
    assert last["cum_log_probs"].item() == -len(ids)


def test_a_gone_client_gets_an_empty_final_response(tokenizer):
    sender = Sender()
    sender.cancelled = True
    assert stream(sender, tokenizer).on_output(output([5], finished=True, reason=FinishReason.LENGTH)) is False
    assert sender.sent == [(None, FINAL)]


def test_cancellation_is_asked_for_once_a_period_and_at_the_end(tokenizer):
    """Each is_cancelled() is a round trip to the server: a stream asks at most every cancellation_check_s, and always
    at its last output, so that a final response never goes to a client that has gone."""
    class CountingSender(Sender):
        asked = 0

        def is_cancelled(self):
            self.asked += 1
            return self.cancelled

    sender, now = CountingSender(), [0.0]
    responses = ResponseStream(sender, OutputProcessor(tokenizer, [3], True, False), cancellation_check_s=0.1,
                               clock=lambda: now[0])
    for step in range(10):  # 10 tokens 30 ms apart: asked at 0, 120 and 240 ms
        now[0] = 0.03 * step
        assert responses.on_output(output([5]))
    assert sender.asked == 3 and len(sender.sent) == 10
    sender.cancelled = True
    now[0] = 0.3
    assert responses.on_output(output([5]))  # not asked yet: 60 ms since the last time
    now[0] = 0.36
    assert responses.on_output(output([5])) is False  # asked: the engine aborts the request
    assert responses.on_output(output([], finished=True, reason=FinishReason.CANCELLED)) is False
    assert sender.sent[-1] == (None, FINAL) and len(sender.sent) == 12

    ended = CountingSender()
    responses = ResponseStream(ended, OutputProcessor(tokenizer, [3], True, False), cancellation_check_s=10.0,
                               clock=lambda: 0.0)
    assert responses.on_output(output([5]))
    ended.cancelled = True
    assert responses.on_output(output([6], finished=True, reason=FinishReason.LENGTH)) is False
    assert ended.asked == 2 and ended.sent[-1] == (None, FINAL)


def test_only_the_outputs_the_client_asked_for_are_sent(tokenizer):
    everything, asked = Sender(), Sender()
    for sender, outputs in ((everything, None), (asked, {"output_ids", "finish_reason"})):
        responses = stream(sender, tokenizer, outputs=outputs)
        responses.on_output(output(tokenizer.encode("ok", add_special_tokens=False)))
        responses.on_output(output([], finished=True, reason=FinishReason.LENGTH))
    assert [set(r.outputs) for r, _ in asked.sent] == [{"output_ids", "finish_reason"}, {"finish_reason"}]
    # The perf metrics only when asked for; no log probs without log-probs on, no ids in a response without tokens.
    assert [len(r.outputs) for r, _ in everything.sent] == [11, 10]
    assert all(r.outputs["glm_version"].item() == 1 for r, _ in everything.sent)
    assert asked.sent[-1][0].outputs["finish_reason"].item() == b"length"


def test_no_response_carries_an_empty_output(tokenizer):
    """Triton 2.51's HTTP front end leaks a record for each empty output it passes on (common.without_empty): an
    output with nothing in it is left out, and whoever reads the response takes it as empty."""
    from triton_glm.common import output_or_empty
    sender = Sender()
    responses = stream(sender, tokenizer)
    responses.on_output(output(tokenizer.encode("ok", add_special_tokens=False)))  # log-probs off
    responses.on_output(output([], finished=True, reason=FinishReason.LENGTH))  # the last response has no token
    assert all(array.size for r, _ in sender.sent for array in r.outputs.values())
    (first, _), (last, _) = sender.sent
    assert "output_log_probs" not in first.outputs and "output_ids" in first.outputs
    assert "output_ids" not in last.outputs and last.outputs["sequence_length"].item() == 0

    with_logprobs = Sender()
    stream(with_logprobs, tokenizer).on_output(output([40, 41], logprobs=[-0.5, -1.5]))
    assert with_logprobs.sent[0][0].outputs["output_log_probs"].tolist() == [[[-0.5, -1.5]]]

    # What bls and vllm_model read of glm's responses.
    assert output_or_empty(last, "output_ids").tolist() == []
    assert output_or_empty(first, "output_ids").tolist() == first.outputs["output_ids"].ravel().tolist()


def test_outputs_not_asked_for_are_not_even_made(tokenizer):
    """They would be made on the outbox's thread every token, holding the GIL the engine thread needs."""
    from glm_engine.output_processor import Response
    responses = stream(Sender(), tokenizer, outputs={"output_ids", "sequence_length"})
    unreadable = Response(token_ids=[40, 41], text_length=None, finish_reason=None, num_input_tokens=3,
                          num_output_tokens=2, logprobs=["not a number"], cum_logprob=None, final=False)
    made = responses._triton_response([Outputs(unreadable, {})])
    assert made.outputs["output_ids"].tolist() == [[[40, 41]]] and made.outputs["sequence_length"].item() == 2
    assert set(made.outputs) == {"output_ids", "sequence_length"}


class Deferred:
    """A `later` that holds the calls until run(): the outbox, busy with other sends."""

    def __init__(self):
        self.calls = []

    def __call__(self, function, *args):
        self.calls.append((function, args))

    def run(self, count: int | None = None):
        """Make the first `count` calls queued (None: all, including those they queue)."""
        while self.calls and count != 0:
            function, args = self.calls.pop(0)
            function(*args)
            count = None if count is None else count - 1


def streamed(tokenizer, text, coalesce, run_every, stop_strings=()):
    """`text`'s tokens streamed one an output into a ResponseStream, its outbox running after every `run_every`
    outputs: (the sender, the calls that were queued on the outbox)."""
    sender, later = Sender(), Deferred()
    responses = ResponseStream(sender, OutputProcessor(tokenizer, [3], True, False, list(stop_strings)), later=later,
                               coalesce=coalesce)
    ids, queued = tokenizer.encode(text, add_special_tokens=False), 0
    for index, token in enumerate(ids):
        last = index == len(ids) - 1
        if not responses.on_output(output([token], finished=last, reason=FinishReason.LENGTH if last else None,
                                          logprobs=[-0.5 * index])):
            break
        if (index + 1) % run_every == 0:
            queued += len(later.calls)
            later.run()
    queued += len(later.calls)
    later.run()
    return sender, queued


def joined(sender, name):
    return [value for response, _ in sender.sent for value in response.outputs[name].reshape(-1).tolist()]


@pytest.mark.parametrize("run_every", [1, 3, 1000])
def test_responses_waiting_for_the_outbox_go_as_one_with_the_same_tokens_text_and_log_probs(tokenizer, run_every):
    """coalesce_stream_responses: what the engine makes while a stream's send waits joins it. The client gets the same
    tokens, text, log-probs and last figures as one response a token would give it, in fewer responses."""
    text = "Some text, then 龘靐 and more: def main():\n    return 0"
    alone, alone_queued = streamed(tokenizer, text, coalesce=False, run_every=run_every)
    merged, merged_queued = streamed(tokenizer, text, coalesce=True, run_every=run_every)
    tokens = len(tokenizer.encode(text, add_special_tokens=False))
    assert alone_queued == len(alone.sent) == len([1 for r, _ in alone.sent if r.outputs["output_ids"].size]) > 10
    assert len(merged.sent) == merged_queued == (len(alone.sent) if run_every == 1 else -(-tokens // run_every))
    for name in ("output_ids", "output_log_probs"):
        assert joined(merged, name) == joined(alone, name)
    assert b"".join(joined(merged, "text_output")).decode() == text
    assert [r.outputs["sequence_length"].item() for r, _ in merged.sent] == [
        r.outputs["output_ids"].size for r, _ in merged.sent]
    assert [flags for _, flags in merged.sent] == [0] * (len(merged.sent) - 1) + [FINAL]
    last, last_alone = merged.sent[-1][0].outputs, alone.sent[-1][0].outputs
    for name in ("finish_reason", "num_output_tokens", "cum_log_probs", "num_input_tokens", "text_length"):
        assert last[name].tolist() == last_alone[name].tolist(), name


def test_a_coalesced_response_cut_by_a_stop_string_says_where_in_its_own_text(tokenizer):
    """text_length counts from the start of the response's text: what postprocessing cuts output_ids' text to."""
    text = "Some text, then 龘靐 STOP here and more after it"
    merged, _ = streamed(tokenizer, text, coalesce=True, run_every=1000, stop_strings=["靐 ST"])
    (response, flags), = merged.sent
    outputs = response.outputs
    assert flags == FINAL and outputs["finish_reason"].item() == b"stop"
    assert outputs["text_output"][0].decode() == "Some text, then 龘"
    assert tokenizer.decode(outputs["output_ids"].ravel().tolist())[:outputs["text_length"].item()] == (
        "Some text, then 龘")


def test_an_error_after_waiting_responses_follows_them_and_a_failed_send_does_not_lose_the_final_flag(tokenizer):
    class FailingFirst(Sender):
        failed = False

        def send(self, response=None, flags=0):
            if not self.failed:
                self.failed = True
                raise RuntimeError("the client went away")
            super().send(response, flags)

    for sender in (Sender(), FailingFirst()):
        later = Deferred()
        responses = ResponseStream(sender, OutputProcessor(tokenizer, [3], True, False), later=later, coalesce=True)
        for token in tokenizer.encode("abc def", add_special_tokens=False):
            responses.on_output(output([token]))
        responses.on_output(output([], finished=True, reason=FinishReason.ERROR, error="engine step failed: boom"))
        assert len(later.calls) == 1
        later.run()
        if isinstance(sender, FailingFirst):  # the joined response was lost; the error still came, and was final
            assert [(r.error.message, flags) for r, flags in sender.sent] == [
                ("engine step failed: boom", FINAL)]
        else:
            assert [flags for _, flags in sender.sent] == [0, FINAL]
            assert tokenizer.decode(sender.sent[0][0].outputs["output_ids"].ravel().tolist()) == "abc def"
            assert sender.sent[1][0].error.message == "engine step failed: boom"


def test_the_final_flag_goes_last_when_the_answer_that_ended_last_is_sent_first(tokenizer):
    """Two answers of one request share its sender and coalesce each on its own: B's queued send takes B's last
    token while A's last one waits behind it. Triton's final flag must still be the request's last send."""
    sender, later, answers = Sender(), Deferred(), OpenAnswers(2)
    a, b = (ResponseStream(sender, OutputProcessor(tokenizer, [3], True, False), later=later, sequence_index=index,
                           answers=answers, coalesce=True) for index in range(2))
    a.on_output(output([40]))
    b.on_output(output([41]))
    later.run(1)  # A's send; B's still waits
    a.on_output(output([42], finished=True, reason=FinishReason.LENGTH))  # queued behind B's
    b.on_output(output([43], finished=True, reason=FinishReason.LENGTH))  # joins B's waiting send
    later.run()
    assert [(r.outputs["sequence_index"].item(), r.outputs["output_ids"].ravel().tolist(), flags)
            for r, flags in sender.sent] == [(0, [40], 0), (1, [41, 43], 0), (0, [42], FINAL)]


def test_several_answers_share_one_final_flag_and_say_which_they_are(tokenizer):
    """num_return_sequences: each answer's responses carry its sequence_index; only the last answer to end sends
    Triton's final flag, whatever order they end in."""
    sender = Sender()
    answers = OpenAnswers(3)
    streams = [ResponseStream(sender, OutputProcessor(tokenizer, [3], False, False), sequence_index=index,
                              answers=answers) for index in range(3)]
    for index in (2, 0, 1):
        streams[index].on_output(output([5, 6], finished=True, reason=FinishReason.LENGTH))
    assert [r.outputs["sequence_index"].item() for r, _ in sender.sent] == [2, 0, 1]
    assert [flags for _, flags in sender.sent] == [0, 0, FINAL]


def test_perf_metrics_are_sent_when_asked_for(tokenizer):
    sender = Sender()
    responses = ResponseStream(sender, OutputProcessor(tokenizer, [3], False, False), perf_metrics=True)
    running = RequestOutput("r", [5], num_cached_blocks=1, num_blocks=3, first_scheduled_ns=7)
    responses.on_output(running)
    responses.on_output(RequestOutput("r", [6], finished=True, finish_reason=FinishReason.LENGTH, num_cached_blocks=1,
                                      first_scheduled_ns=7))  # a finished request holds no blocks
    (response, _), = sender.sent
    figures = {name: response.outputs[name].item() for name in ("kv_cache_reused_blocks", "kv_cache_alloc_new_blocks",
                                                                "kv_cache_alloc_total_blocks")}
    assert figures == {"kv_cache_reused_blocks": 1, "kv_cache_alloc_new_blocks": 2, "kv_cache_alloc_total_blocks": 3}
    times = [response.outputs[name].item() for name in ("arrival_time_ns", "first_token_time_ns",
                                                         "last_token_time_ns")]
    assert times == sorted(times) and times[0] > 0


def test_vllm_model_stops_glms_request_when_a_send_fails(tokenizer, monkeypatch):
    """A send to vllm_model's client that raises (the client went away) ends glm's request with a `stop` before the
    glm call is closed: closing waits for glm's last response, which would otherwise come only at max_tokens."""
    from triton_glm import vllm_style
    events = []

    def glm_call(request, caller):  # glm generating until it is stopped
        try:
            while ("stop", "r-1") not in events:
                yield fake_pb_utils.InferenceResponse([fake_pb_utils.Tensor(name, np.array(value)) for name, value in (
                    ("text_output", [b"a"]), ("sequence_index", [0]), ("num_output_tokens", [1]))]), False
        finally:
            events.append("closed")

    class GoneAfterOne(Sender):
        def send(self, response=None, flags=0):
            if self.sent:
                raise RuntimeError("the client went away")
            super().send(response, flags)

    monkeypatch.setattr(vllm_style, "exec_latest", glm_call)
    model = vllm_style.VllmStyleModel.__new__(vllm_style.VllmStyleModel)
    model.tokenizer, model.engine_model = tokenizer, "glm"
    monkeypatch.setattr(model, "_stop", lambda request_id: events.append(("stop", request_id)))
    sender = GoneAfterOne()
    model._relay("glm request", sender, {"text_output"}, "r-1")
    assert events == [("stop", "r-1"), "closed"]
    assert len(sender.sent) == 1


def test_engine_errors_become_internal_error_responses(tokenizer):
    sender = Sender()
    stream(sender, tokenizer).on_output(
        output([], finished=True, reason=FinishReason.ERROR, error="engine step failed: boom"))
    (response, flags), = sender.sent
    assert flags == FINAL and response.error.code == "INTERNAL" and "boom" in response.error.message
    assert response.outputs == {}


def request(sampling_parameters=None, **tensors):
    """A request as the stand-in pb_utils sees it: input name -> tensor of shape [1, 1] (an array of two dimensions
    or more as it is)."""
    if sampling_parameters is not None:
        tensors["sampling_parameters"] = np.array([[json.dumps(sampling_parameters).encode()]], dtype=np.object_)
    return {name: fake_pb_utils.Tensor(name, np.array(value) if np.ndim(value) >= 2 else np.array(value).reshape(1, 1))
            for name, value in tensors.items()}


def test_vllm_style_sampling_parameters_with_string_values():
    params = sampling_params(request({"temperature": "0.5", "max_tokens": "7", "top_k": "-1", "top_p": 0.9,
                                      "seed": "3", "ignore_eos": "true", "min_tokens": "2", "logprobs": 1,
                                      "stop": "END"}), 64)
    assert params.stop == ("END",)
    assert (params.temperature, params.max_tokens, params.top_k, params.top_p, params.seed) == (0.5, 7, 0, 0.9, 3)
    assert params.stop_token_ids == () and params.min_tokens == 2 and params.logprobs


def test_tensors_win_over_the_json_and_defaults_fill_the_rest():
    params = sampling_params(request({"temperature": "0.5", "max_tokens": "7"}, temperature=np.float32(0.0)), 64)
    assert (params.temperature, params.max_tokens) == (0.0, 7)
    defaults = sampling_params(request(), 64)
    assert defaults.stop == () and defaults.bad_words_ids == ()
    assert (defaults.max_tokens, defaults.temperature, defaults.stop_token_ids, defaults.logprobs) == (64, 0.0, None, False)
    assert sampling_params(request(return_cumulative_logprob=True), 64).logprobs
    assert sampling_params(request({"stop_token_ids": [5, "6"]}), 64).stop_token_ids == (5, 6)


@pytest.mark.parametrize("sampling_parameters, message", [
    ({"temprature": 0.1}, r"unsupported keys \['temprature'\]"),
    ({"max_tokens": "many"}, r"'max_tokens' has an unusable value 'many'"),
    ({"n": "two"}, "'n' has an unusable value 'two'"),
    ({"ignore_eos": "perhaps"}, "'ignore_eos' has an unusable value"),
    ({"stop": ["ok", 3]}, "'stop' must be a string or a list of strings"),
    ({"stop": ["x"] * 65}, "stop_words must hold at most 64 strings of at most 128 characters, got 65"),
    ({"bad_words": "y" * 129}, r"bad_words must hold at most 64 strings of at most 128 characters, got 1 \(the "
                               r"longest of 129 characters\)"),
])
def test_bad_sampling_parameters_are_named(sampling_parameters, message):
    with pytest.raises(InputError, match=message):
        sampling_params(request(sampling_parameters), 64)


def test_tensorrt_llm_inputs_that_change_nothing_are_accepted_and_others_named():
    accepted = dict(beam_width=np.int32(1), length_penalty=np.float32(1.3), early_stopping=True,
                    return_context_logits=False, num_draft_tokens=np.int32(0), lora_task_id=np.uint64(0),
                    guided_decoding_guide=np.array([[b""]], dtype=np.object_))
    params = sampling_params(request(**accepted, min_length=np.int32(2), random_seed=np.uint64(9),
                                     num_return_sequences=np.int32(3)), 64)
    assert (params.min_tokens, params.seed, params.n) == (2, 9, 3)
    assert [p.seed for p in params.samples()] == [9, 10, 11] and all(p.n == 1 for p in params.samples())
    for name, value, rule in (("beam_width", np.int32(4), "must be 1 (not supported: beam search)"),
                              ("return_generation_logits", True, "must be false"),
                              ("lora_weights", np.ones((1, 2, 2), dtype=np.float16), "must be empty"),
                              ("guided_decoding_guide", np.array([[b"{}"]], dtype=np.object_), "must be empty")):
        with pytest.raises(InputError, match=rf"input '{name}' {re.escape(rule)}"):
            sampling_params(request(**{name: value}), 64)


def test_sampling_parameters_must_be_a_json_object():
    bad = {"sampling_parameters": fake_pb_utils.Tensor("sampling_parameters", np.array([[b"{oops"]], dtype=np.object_))}
    with pytest.raises(InputError, match="not valid JSON"):
        sampling_params(bad, 64)


def test_bad_words_are_tokenized_with_and_without_a_leading_space(tokenizer):
    params = sampling_params(request(bad_words=np.array([b"hello"], dtype=np.object_)), 64, tokenizer)
    assert params.bad_words_ids == (tuple(tokenizer.encode("hello", add_special_tokens=False)),
                                    tuple(tokenizer.encode(" hello", add_special_tokens=False)))


def test_the_outbox_sends_in_order_survives_a_failing_send_and_drains_on_close():
    from triton_glm.common import send_now
    from triton_glm.glm import ResponseOutbox

    class FailingSender(Sender):
        def send(self, response=None, flags=0):
            raise RuntimeError("the client went away")

    first, second, failing = Sender(), Sender(), FailingSender()
    outbox = ResponseOutbox()
    for i in range(50):
        outbox.later(send_now, first if i % 2 else second, f"response {i}", 0)
        if i == 10:
            outbox.later(send_now, failing, "lost", 0)
    outbox.later(send_now, first, None, FINAL)
    outbox.close()  # returns once everything queued before it was sent
    assert first.sent == [(f"response {i}", 0) for i in range(1, 50, 2)] + [(None, FINAL)]
    assert second.sent == [(f"response {i}", 0) for i in range(0, 50, 2)]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="nice values of threads are Linux's")
@pytest.mark.parametrize("nice", [0, 5, 30])
def test_the_outbox_thread_alone_stands_back_by_its_nice_increment(nice):
    """response_thread_nice: the outbox's thread runs at its creator's nice value plus the increment (at most 19);
    the creating thread keeps its own."""
    from triton_glm.glm import ResponseOutbox

    def own_nice():
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    before, seen = own_nice(), []
    outbox = ResponseOutbox(nice)
    outbox.later(lambda: seen.append(own_nice()))
    outbox.close()
    assert seen == [min(19, before + nice)] and own_nice() == before


def test_engine_metrics_send_only_the_figures_that_changed():
    """Each set or increment is a round trip to the server's process, made between steps: a step that changes two
    figures sends two, and the published values stay those of the engine."""
    metrics = EngineMetrics("glm", "1")
    calls = fake_pb_utils.metric_calls
    stats = EngineStats(kv_blocks_used=0, kv_blocks_total=64, running=0, waiting=0, preemptions=0,
                        prefix_queried_tokens=0, prefix_hit_tokens=0, prompt_tokens=0, generated_tokens=0, refused=0)
    calls.clear()
    metrics.update(stats)  # the first update publishes every gauge; counters at zero have nothing to add
    assert sorted(name for name, _, op, _ in calls) == ["glm_kv_blocks_total", "glm_kv_blocks_used",
                                                        "glm_num_requests_running", "glm_num_requests_waiting"]
    calls.clear()
    metrics.update(stats)
    assert calls == []
    step = dataclasses.replace(stats, kv_blocks_used=3, running=2, prompt_tokens=40, generated_tokens=2,
                               prefix_queried_tokens=40, prefix_hit_tokens=10)
    metrics.update(step)
    assert {(name, op, value) for name, _, op, value in calls} == {
        ("glm_kv_blocks_used", "set", 3), ("glm_num_requests_running", "set", 2),
        ("glm_prompt_tokens_total", "increment", 40), ("glm_generation_tokens_total", "increment", 2),
        ("glm_prefix_cache_queried_tokens_total", "increment", 40),
        ("glm_prefix_cache_hit_tokens_total", "increment", 10), ("glm_prefix_cache_hit_rate", "set", 0.25)}
    calls.clear()
    metrics.update(dataclasses.replace(step, generated_tokens=4))  # a decode step: one token more each
    assert [(name, op, value) for name, _, op, value in calls] == [("glm_generation_tokens_total", "increment", 2)]


@pytest.mark.parametrize("mode, observed", [("per_request", [0.02]), ("per_token", [0.01, 0.03])])
def test_the_inter_token_histogram_observes_once_a_request_unless_asked_per_token(mode, observed):
    """Each observation is a round trip to the server's process: by default none is made per token."""
    metrics = EngineMetrics("glm", "1", mode)
    calls = fake_pb_utils.metric_calls
    calls.clear()
    metrics.record([("ttft", 0.5)], None)
    metrics.record([("itl", 0.01)], None)
    metrics.record([("itl", 0.03), ("latency", 0.54), ("itl_mean", 0.02)], "length")
    assert [value for name, _, op, value in calls if name == "glm_inter_token_latency_seconds"] == observed
    assert [(name, value) for name, _, op, value in calls if name != "glm_inter_token_latency_seconds"] == [
        ("glm_time_to_first_token_seconds", 0.5), ("glm_request_latency_seconds", 0.54),
        ("glm_requests_finished_total", 1)]
