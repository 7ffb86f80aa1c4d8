"""The glm adapter's request parsing and response stream, with a stand-in for Triton's pb_utils module."""

from __future__ import annotations

import sys

import pytest

import fake_pb_utils

fake_pb_utils.install(sys.modules)

from glm_engine import FinishReason, RequestOutput  # noqa: E402
from glm_engine.tokenizer import CompleteTextChunker, GlmTokenizer  # noqa: E402
from triton_glm.glm import ResponseStream  # noqa: E402

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


def output(tokens, finished=False, reason=None, error=None):
    return RequestOutput("r", tokens, finished=finished, finish_reason=reason, error=error)


def test_stream_sends_whole_character_chunks_then_a_final_flag(tokenizer):
    ids = tokenizer.encode("龘靐齉 ok")[2:]
    sender = Sender()
    stream = ResponseStream(sender, True, [], CompleteTextChunker(tokenizer))
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        assert stream.on_output(output([token], finished=last, reason=FinishReason.LENGTH if last else None))
    texts = [tokenizer.decode(r.outputs["output_ids"].reshape(-1).tolist()) for r, _ in sender.sent]
    assert "".join(texts) == "龘靐齉 ok" and not any("\ufffd" in t for t in texts)
    assert [flags for _, flags in sender.sent][-1] == FINAL and all(f == 0 for _, f in sender.sent[:-1])
    assert all(r.outputs["sequence_length"].item() == r.outputs["output_ids"].shape[-1] for r, _ in sender.sent)


def test_single_response_echoes_the_prompt_and_closes(tokenizer):
    sender = Sender()
    stream = ResponseStream(sender, False, [7, 8], CompleteTextChunker(tokenizer))
    stream.on_output(output([9]))
    assert sender.sent == []
    stream.on_output(output([10], finished=True, reason=FinishReason.STOP))
    (response, flags), = sender.sent
    assert response.outputs["output_ids"].tolist() == [[[7, 8, 9, 10]]] and flags == FINAL


def test_a_cancelled_client_aborts_and_its_stream_is_closed(tokenizer):
    sender = Sender()
    stream = ResponseStream(sender, True, [], CompleteTextChunker(tokenizer))
    sender.cancelled = True
    assert stream.on_output(output([5])) is False  # asks the engine to abort...
    assert sender.sent == []
    assert stream.on_output(output([], finished=True, reason=FinishReason.CANCELLED)) is False  # ...which closes it
    assert sender.sent == [(None, FINAL)]


def test_cancelled_on_the_last_output_still_closes_the_stream(tokenizer):
    sender = Sender()
    stream = ResponseStream(sender, True, [], CompleteTextChunker(tokenizer))
    sender.cancelled = True
    stream.on_output(output([5], finished=True, reason=FinishReason.LENGTH))
    assert sender.sent == [(None, FINAL)]


def test_engine_errors_become_internal_error_responses(tokenizer):
    sender = Sender()
    ResponseStream(sender, True, [], CompleteTextChunker(tokenizer)).on_output(
        output([], finished=True, reason=FinishReason.ERROR, error="engine step failed: boom"))
    (response, flags), = sender.sent
    assert flags == FINAL and response.error.code == "INTERNAL" and "boom" in response.error.message
    assert response.outputs == {}
