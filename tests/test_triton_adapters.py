"""The glm adapter's request parsing and response stream, with a stand-in for Triton's pb_utils module."""

from __future__ import annotations

import sys

import json

import numpy as np
import pytest

import fake_pb_utils

fake_pb_utils.install(sys.modules)

from glm_engine import FinishReason, RequestOutput  # noqa: E402
from glm_engine.tokenizer import GlmTokenizer  # noqa: E402
from triton_glm.common import InputError  # noqa: E402
from triton_glm.glm import ResponseStream  # noqa: E402
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


def test_stream_sends_whole_character_chunks_then_a_final_flag(tokenizer):
    ids = tokenizer.encode("龘靐齉 ok")[2:]
    sender = Sender()
    stream = ResponseStream(sender, True, [], False, tokenizer)
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        assert stream.on_output(output([token], finished=last, reason=FinishReason.LENGTH if last else None))
    texts = [tokenizer.decode(r.outputs["output_ids"].reshape(-1).tolist()) for r, _ in sender.sent]
    assert "".join(texts) == "龘靐齉 ok" and not any("\ufffd" in t for t in texts)
    assert [flags for _, flags in sender.sent][-1] == FINAL and all(f == 0 for _, f in sender.sent[:-1])
    assert all(r.outputs["sequence_length"].item() == r.outputs["output_ids"].shape[-1] for r, _ in sender.sent)


def test_only_the_outputs_the_client_asked_for_are_sent(tokenizer):
    everything, asked = Sender(), Sender()
    for sender, outputs in ((everything, None), (asked, {"output_ids", "finish_reason"})):
        stream = ResponseStream(sender, True, [], False, tokenizer, outputs=outputs)
        stream.on_output(output(tokenizer.encode("ok", add_special_tokens=False)))
        stream.on_output(output([], finished=True, reason=FinishReason.LENGTH))
    assert all(set(r.outputs) == {"output_ids", "finish_reason"} for r, _ in asked.sent)
    assert all(len(r.outputs) == 8 for r, _ in everything.sent)
    assert asked.sent[-1][0].outputs["finish_reason"].item() == b"length"


def test_single_response_echoes_the_prompt_and_closes(tokenizer):
    sender = Sender()
    stream = ResponseStream(sender, False, [7, 8], True, tokenizer)
    stream.on_output(output([9]))
    assert sender.sent == []
    stream.on_output(output([10], finished=True, reason=FinishReason.STOP))
    (response, flags), = sender.sent
    assert response.outputs["output_ids"].tolist() == [[[7, 8, 9, 10]]] and flags == FINAL
    assert response.outputs["num_input_tokens"].item() == 2 and response.outputs["num_output_tokens"].item() == 2
    assert response.outputs["finish_reason"].item() == b"stop"
    assert response.outputs["output_log_probs"].size == 0  # not asked for


def test_a_cancelled_client_aborts_and_its_stream_is_closed(tokenizer):
    sender = Sender()
    stream = ResponseStream(sender, True, [], False, tokenizer)
    sender.cancelled = True
    assert stream.on_output(output([5])) is False  # asks the engine to abort...
    assert sender.sent == []
    assert stream.on_output(output([], finished=True, reason=FinishReason.CANCELLED)) is False  # ...which closes it
    assert sender.sent == [(None, FINAL)]


@pytest.mark.parametrize("streaming", [True, False])
def test_a_stopped_request_still_gets_its_text_and_why_it_ended(tokenizer, streaming):
    """A `stop` request (not a gone client): the held-back tokens and finish_reason "cancelled" are sent."""
    ids = tokenizer.encode("龘", add_special_tokens=False)
    assert len(ids) > 1  # a character split across tokens, so the first is held back
    sender = Sender()
    stream = ResponseStream(sender, streaming, [7], False, tokenizer)
    assert stream.on_output(output(ids[:1]))
    assert sender.sent == []
    assert stream.on_output(output([], finished=True, reason=FinishReason.CANCELLED)) is False
    response, flags = sender.sent[-1]
    assert flags == FINAL and response.outputs["finish_reason"].item() == b"cancelled"
    sent = [int(t) for r, _ in sender.sent for t in r.outputs["output_ids"].reshape(-1)]
    assert sent == ids[:1] and response.outputs["num_output_tokens"].item() == 1


def test_cancelled_on_the_last_output_still_closes_the_stream(tokenizer):
    sender = Sender()
    stream = ResponseStream(sender, True, [], False, tokenizer)
    sender.cancelled = True
    stream.on_output(output([5], finished=True, reason=FinishReason.LENGTH))
    assert sender.sent == [(None, FINAL)]


def test_engine_errors_become_internal_error_responses(tokenizer):
    sender = Sender()
    ResponseStream(sender, True, [], False, tokenizer).on_output(
        output([], finished=True, reason=FinishReason.ERROR, error="engine step failed: boom"))
    (response, flags), = sender.sent
    assert flags == FINAL and response.error.code == "INTERNAL" and "boom" in response.error.message
    assert response.outputs == {}


def test_log_probs_follow_their_tokens_through_held_back_chunks(tokenizer):
    ids = tokenizer.encode("龘 ok")[2:]  # the character spans several tokens, which are held back together
    logprobs = [-0.5 * (i + 1) for i in range(len(ids))]
    sender = Sender()
    stream = ResponseStream(sender, True, [1, 2, 3], False, tokenizer)
    for i, (token, logprob) in enumerate(zip(ids, logprobs)):
        last = i == len(ids) - 1
        stream.on_output(output([token], finished=last, reason=FinishReason.LENGTH if last else None,
                                logprobs=[logprob]))
    responses = [r.outputs for r, _ in sender.sent]
    assert len(responses) < len(ids)
    for r in responses:
        assert r["output_log_probs"].shape == r["output_ids"].shape  # one log-prob per token sent
    assert [lp for r in responses for lp in r["output_log_probs"].reshape(-1).tolist()] == logprobs
    assert responses[-1]["cum_log_probs"].item() == pytest.approx(sum(logprobs))
    assert [r["num_output_tokens"].item() for r in responses][-1] == len(ids)
    assert [r["finish_reason"].item() for r in responses] == [b""] * (len(responses) - 1) + [b"length"]
    assert all(r["num_input_tokens"].item() == 3 for r in responses)


def request(sampling_parameters=None, **tensors):
    """A request as the stand-in pb_utils sees it: input name -> tensor of shape [1, 1]."""
    if sampling_parameters is not None:
        tensors["sampling_parameters"] = np.array([[json.dumps(sampling_parameters).encode()]], dtype=np.object_)
    return {name: fake_pb_utils.Tensor(name, np.array(value).reshape(1, 1)) for name, value in tensors.items()}


def test_vllm_style_sampling_parameters_with_string_values():
    params, stops = sampling_params(request({"temperature": "0.5", "max_tokens": "7", "top_k": "-1", "top_p": 0.9,
                                             "seed": "3", "ignore_eos": "true", "min_tokens": "2", "logprobs": 1,
                                             "stop": "END"}), 64)
    assert stops == ["END"]
    assert (params.temperature, params.max_tokens, params.top_k, params.top_p, params.seed) == (0.5, 7, 0, 0.9, 3)
    assert params.stop_token_ids == () and params.min_tokens == 2 and params.logprobs


def test_tensors_win_over_the_json_and_defaults_fill_the_rest():
    params, _ = sampling_params(request({"temperature": "0.5", "max_tokens": "7"}, temperature=np.float32(0.0)), 64)
    assert (params.temperature, params.max_tokens) == (0.0, 7)
    defaults, stops = sampling_params(request(), 64)
    assert stops == [] and defaults.bad_words_ids == ()
    assert (defaults.max_tokens, defaults.temperature, defaults.stop_token_ids, defaults.logprobs) == (64, 0.0, None, False)
    assert sampling_params(request(return_cumulative_logprob=True), 64)[0].logprobs
    assert sampling_params(request({"stop_token_ids": [5, "6"]}), 64)[0].stop_token_ids == (5, 6)


@pytest.mark.parametrize("sampling_parameters, message", [
    ({"temprature": 0.1}, r"unsupported keys \['temprature'\]"),
    ({"max_tokens": "many"}, r"'max_tokens' has an unusable value 'many'"),
    ({"n": 2}, "only n = 1"),
    ({"ignore_eos": "perhaps"}, "'ignore_eos' has an unusable value"),
    ({"stop": ["ok", 3]}, "'stop' must be a string or a list of strings"),
])
def test_bad_sampling_parameters_are_named(sampling_parameters, message):
    with pytest.raises(InputError, match=message):
        sampling_params(request(sampling_parameters), 64)


def test_sampling_parameters_must_be_a_json_object():
    bad = {"sampling_parameters": fake_pb_utils.Tensor("sampling_parameters", np.array([[b"{oops"]], dtype=np.object_))}
    with pytest.raises(InputError, match="not valid JSON"):
        sampling_params(bad, 64)


def send_tokens(stream, ids):
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        if stream.on_output(output([token], finished=last, reason=FinishReason.LENGTH if last else None)) is False:
            return False
    return True


def sent_text(tokenizer, sender):
    texts = []
    for response, _ in sender.sent:
        text = tokenizer.decode(response.outputs["output_ids"].reshape(-1).tolist())
        limit = response.outputs["text_length"].item()
        texts.append(text if limit < 0 else text[:limit])
    return "".join(texts)


@pytest.mark.parametrize("streaming", [True, False])
def test_a_stop_string_across_tokens_ends_the_answer_and_is_not_sent(tokenizer, streaming):
    text = "Some text, then 龘靐 STOP here and more after it"
    ids = tokenizer.encode(text, add_special_tokens=False)
    sender = Sender()
    stream = ResponseStream(sender, streaming, [], False, tokenizer, ["靐 ST"])
    assert send_tokens(stream, ids) is False  # it asks the engine to stop generating
    assert sent_text(tokenizer, sender) == "Some text, then 龘"
    assert sender.sent[-1][1] == FINAL and sender.sent[-1][0].outputs["finish_reason"].item() == b"stop"
    assert stream.on_output(output([], finished=True, reason=FinishReason.CANCELLED)) is False  # the abort: ignored
    assert sum(1 for _, flags in sender.sent if flags == FINAL) == 1


def test_a_stop_string_counts_from_the_echoed_prompt(tokenizer):
    prompt = tokenizer.encode("Prompt text. ")
    ids = tokenizer.encode("Answer END ignored", add_special_tokens=False)
    sender = Sender()
    stream = ResponseStream(sender, False, prompt, True, tokenizer, ["END"])
    send_tokens(stream, ids)
    assert sent_text(tokenizer, sender) == "Prompt text. Answer "


def test_without_a_stop_string_everything_held_back_is_sent(tokenizer):
    ids = tokenizer.encode("ends with EN", add_special_tokens=False)
    sender = Sender()
    send_tokens(ResponseStream(sender, True, [], False, tokenizer, ["END"]), ids)
    assert sent_text(tokenizer, sender) == "ends with EN"
    assert sender.sent[-1][0].outputs["finish_reason"].item() == b"length"


def test_bad_words_are_tokenized_with_and_without_a_leading_space(tokenizer):
    params, _ = sampling_params(request(bad_words=np.array([b"hello"], dtype=np.object_)), 64, tokenizer)
    assert params.bad_words_ids == (tuple(tokenizer.encode("hello", add_special_tokens=False)),
                                    tuple(tokenizer.encode(" hello", add_special_tokens=False)))


def test_the_outbox_sends_in_order_survives_a_failing_send_and_drains_on_close():
    from triton_glm.glm import ResponseOutbox

    class FailingSender(Sender):
        def send(self, response=None, flags=0):
            raise RuntimeError("the client went away")

    first, second, failing = Sender(), Sender(), FailingSender()
    outbox = ResponseOutbox()
    for i in range(50):
        outbox.send(first if i % 2 else second, f"response {i}", 0)
        if i == 10:
            outbox.send(failing, "lost", 0)
    outbox.send(first, None, FINAL)
    outbox.close()  # returns once everything queued before it was sent
    assert first.sent == [(f"response {i}", 0) for i in range(1, 50, 2)] + [(None, FINAL)]
    assert second.sent == [(f"response {i}", 0) for i in range(0, 50, 2)]
