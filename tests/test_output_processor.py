"""A request's responses from the engine's outputs (glm_engine/output_processor.py), with no server: whole-character
chunks, final flags, prompt echo, cancellation, stop strings and log-probs; and the stop-string matcher."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from glm_engine import FinishReason, RequestOutput
from glm_engine.output_processor import OutputProcessor
from glm_engine.stop_strings import StopStringFilter, StopStringMatcher
from glm_engine.tokenizer import GlmTokenizer


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir):
    return GlmTokenizer(demo_model_dir)


def output(tokens, finished=False, reason=None, error=None, logprobs=None):
    return RequestOutput("r", tokens, finished=finished, finish_reason=reason, error=error, new_logprobs=logprobs)


class Client:
    """Collects the updates of one request, as a front would send them."""

    def __init__(self, processor: OutputProcessor):
        self.processor, self.gone, self.updates = processor, False, []

    def push(self, out: RequestOutput) -> bool:
        """Returns whether the engine should go on generating."""
        update = self.processor.process(out, client_gone=lambda: self.gone)
        self.updates.append(update)
        return not update.abort

    @property
    def responses(self):
        return [u.response for u in self.updates if u.response is not None]

    def text(self, tokenizer) -> str:
        texts = []
        for response in self.responses:
            text = tokenizer.decode(response.token_ids)
            texts.append(text if response.text_length is None else text[:response.text_length])
        return "".join(texts)


def client(tokenizer, streaming=True, prompt=(), echo=False, stop_strings=()):
    return Client(OutputProcessor(tokenizer, list(prompt), streaming, echo, list(stop_strings)))


def send_tokens(receiver: Client, ids) -> bool:
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        if not receiver.push(output([token], finished=last, reason=FinishReason.LENGTH if last else None)):
            return False
    return True


def test_stream_sends_whole_character_chunks_then_a_final_flag(tokenizer):
    ids = tokenizer.encode("龘靐齉 ok")[2:]
    receiver = client(tokenizer)
    assert send_tokens(receiver, ids)
    texts = [tokenizer.decode(r.token_ids) for r in receiver.responses]
    assert "".join(texts) == "龘靐齉 ok" and not any("\ufffd" in t for t in texts)
    assert [r.final for r in receiver.responses] == [False] * (len(texts) - 1) + [True]


def test_single_response_echoes_the_prompt_and_closes(tokenizer):
    receiver = client(tokenizer, streaming=False, prompt=[7, 8], echo=True)
    receiver.push(output([9]))
    assert receiver.responses == []
    receiver.push(output([10], finished=True, reason=FinishReason.STOP))
    (response,) = receiver.responses
    assert response.token_ids == [7, 8, 9, 10] and response.final
    assert response.num_input_tokens == 2 and response.num_output_tokens == 2
    assert response.finish_reason == "stop"
    assert response.logprobs == []  # not asked for


def test_a_cancelled_client_aborts_and_its_stream_is_closed(tokenizer):
    receiver = client(tokenizer)
    receiver.gone = True
    assert receiver.push(output([5])) is False  # asks the engine to abort...
    assert receiver.responses == [] and not receiver.updates[-1].close
    assert receiver.push(output([], finished=True, reason=FinishReason.CANCELLED)) is False  # ...which closes it
    assert receiver.updates[-1].close and receiver.responses == []


@pytest.mark.parametrize("streaming", [True, False])
def test_a_stopped_request_still_gets_its_text_and_why_it_ended(tokenizer, streaming):
    """A `stop` request (not a gone client): the held-back tokens and finish_reason "cancelled" are sent."""
    ids = tokenizer.encode("龘", add_special_tokens=False)
    assert len(ids) > 1  # a character split across tokens, so the first is held back
    receiver = client(tokenizer, streaming, prompt=[7])
    assert receiver.push(output(ids[:1]))
    assert receiver.responses == []
    assert receiver.push(output([], finished=True, reason=FinishReason.CANCELLED)) is False
    response = receiver.responses[-1]
    assert response.final and response.finish_reason == "cancelled"
    assert [t for r in receiver.responses for t in r.token_ids] == ids[:1] and response.num_output_tokens == 1


def test_cancelled_on_the_last_output_still_closes_the_stream(tokenizer):
    receiver = client(tokenizer)
    receiver.gone = True
    receiver.push(output([5], finished=True, reason=FinishReason.LENGTH))
    assert receiver.updates[-1].close and receiver.responses == []


def test_engine_errors_become_error_responses(tokenizer):
    receiver = client(tokenizer)
    assert receiver.push(output([], finished=True, reason=FinishReason.ERROR, error="engine step failed: boom")) \
        is False
    (update,) = receiver.updates
    assert "boom" in update.error and update.response is None and update.finish_reason == "error"


def test_log_probs_follow_their_tokens_through_held_back_chunks(tokenizer):
    ids = tokenizer.encode("龘 ok")[2:]  # the character spans several tokens, which are held back together
    logprobs = [-0.5 * (i + 1) for i in range(len(ids))]
    receiver = client(tokenizer, prompt=[1, 2, 3])
    for i, (token, logprob) in enumerate(zip(ids, logprobs)):
        last = i == len(ids) - 1
        receiver.push(output([token], finished=last, reason=FinishReason.LENGTH if last else None,
                             logprobs=[logprob]))
    responses = receiver.responses
    assert len(responses) < len(ids)
    for r in responses:
        assert len(r.logprobs) == len(r.token_ids)  # one log-prob per token sent
    assert [lp for r in responses for lp in r.logprobs] == logprobs
    assert responses[-1].cum_logprob == pytest.approx(sum(logprobs))
    assert responses[-1].num_output_tokens == len(ids)
    assert [r.finish_reason for r in responses] == [""] * (len(responses) - 1) + ["length"]
    assert all(r.num_input_tokens == 3 for r in responses)


@pytest.mark.parametrize("streaming", [True, False])
def test_a_stop_string_across_tokens_ends_the_answer_and_is_not_sent(tokenizer, streaming):
    text = "Some text, then 龘靐 STOP here and more after it"
    ids = tokenizer.encode(text, add_special_tokens=False)
    receiver = client(tokenizer, streaming, stop_strings=["靐 ST"])
    assert send_tokens(receiver, ids) is False  # it asks the engine to stop generating
    assert receiver.text(tokenizer) == "Some text, then 龘"
    assert receiver.responses[-1].final and receiver.responses[-1].finish_reason == "stop"
    assert receiver.push(output([], finished=True, reason=FinishReason.CANCELLED)) is False  # the abort: ignored
    assert sum(1 for r in receiver.responses if r.final) == 1


def test_a_stop_string_counts_from_the_echoed_prompt(tokenizer):
    prompt = tokenizer.encode("Prompt text. ")
    ids = tokenizer.encode("Answer END ignored", add_special_tokens=False)
    receiver = client(tokenizer, streaming=False, prompt=prompt, echo=True, stop_strings=["END"])
    send_tokens(receiver, ids)
    assert receiver.text(tokenizer) == "Prompt text. Answer "


def test_without_a_stop_string_everything_held_back_is_sent(tokenizer):
    ids = tokenizer.encode("ends with EN", add_special_tokens=False)
    receiver = client(tokenizer, stop_strings=["END"])
    send_tokens(receiver, ids)
    assert receiver.text(tokenizer) == "ends with EN"
    assert receiver.responses[-1].finish_reason == "length"


@pytest.mark.parametrize("streaming", [True, False])
def test_the_first_stop_string_completed_ends_the_answer_however_the_tokens_split_it(tokenizer, streaming):
    """"b c d" is completed before "a b c d e" can be: the answer ends before "b c d", even when one token carries
    both; and the text sent never depends on how the tokens split it."""
    text = "x a b c d e y"
    whole = tokenizer.encode(text, add_special_tokens=False)
    one_char_tokens = [t for char in text for t in tokenizer.encode(char, add_special_tokens=False)]
    for ids in (whole, one_char_tokens):
        receiver = client(tokenizer, streaming, stop_strings=["a b c d e", "b c d"])
        send_tokens(receiver, ids)
        assert receiver.text(tokenizer) == "x a " and receiver.responses[-1].finish_reason == "stop"


def test_latencies_and_the_finish_reason_are_reported(tokenizer):
    now = [10.0]
    processor = OutputProcessor(tokenizer, [1], True, False, clock=lambda: now[0])
    now[0] = 10.5
    first = processor.process(output([40]))
    now[0] = 10.75
    last = processor.process(output([41], finished=True, reason=FinishReason.LENGTH))
    assert first.latencies == [("ttft", 0.5)] and first.finish_reason is None
    assert last.latencies == [("itl", 0.25), ("latency", 0.75), ("itl_mean", 0.25)]
    assert last.finish_reason == "length"


def test_the_mean_time_between_tokens_counts_tokens_not_outputs(tokenizer):
    now = [0.0]
    processor = OutputProcessor(tokenizer, [1], True, False, clock=lambda: now[0])
    for at, ids in ((1.0, [40]), (1.3, [41, 42, 43]), (1.9, [44])):  # an output may carry several tokens
        now[0] = at
        update = processor.process(output(ids))
    now[0] = 2.0
    last = processor.process(output([], finished=True, reason=FinishReason.STOP))
    assert dict(update.latencies) == {"itl": pytest.approx(0.6)}
    assert dict(last.latencies) == {"latency": 2.0, "itl_mean": pytest.approx(0.9 / 4)}
    one_token = OutputProcessor(tokenizer, [1], True, False, clock=lambda: now[0])
    assert [name for name, _ in one_token.process(output([40], finished=True, reason=FinishReason.LENGTH)).latencies
            ] == ["ttft", "latency"]


def test_stop_string_filter_holds_back_what_could_start_one():
    stops = StopStringFilter(["END", "。"])
    assert stops.push([1], "hello E") == ([], None, False)  # "E" may begin "END": the chunk waits
    assert stops.push([2], "N") == ([], None, False)
    assert stops.push([3], "Dxx") == ([1], 6, True)  # "hello " of chunk 1's text, then the stop string
    stops = StopStringFilter(["END"])
    assert stops.push([1], "abc") == ([1], None, False)
    assert stops.push([2], "E") == ([], None, False)
    assert stops.push([3], "x") == ([2, 3], None, False)  # "Ex" cannot begin "END" any more
    assert stops.push([4], "好。") == ([4], None, False)
    assert StopStringFilter(["。"]).push([4], "好。") == ([4], 1, True)


def first_stop(stop_strings: list[str], text: str) -> tuple[int, int] | None:
    """The plain definition: the first end position where some stop string ends, and the longest one ending there."""
    for end in range(1, len(text) + 1):
        lengths = [len(s) for s in stop_strings if s and text[:end].endswith(s)]
        if lengths:
            return end, max(lengths)
    return None


@settings(max_examples=300, deadline=None)
@given(stop_strings=st.lists(st.text("ab c龘", max_size=6), min_size=1, max_size=6),
       text=st.text("ab c龘", max_size=40))
def test_the_matcher_finds_what_the_plain_definition_finds(stop_strings, text):
    matcher = StopStringMatcher(stop_strings)
    found = None
    for end, char in enumerate(text, 1):
        length = matcher.feed(char)
        if length:
            found = (end, length)
            break
        # What is held back: the longest end of the text that begins some stop string.
        assert matcher.partial == max((n for s in stop_strings for n in range(1, len(s))
                                       if text[:end].endswith(s[:n])), default=0)
    assert found == first_stop(stop_strings, text)


class CountingList(list):
    """A list that counts how often it is read by index."""

    def __init__(self, values):
        super().__init__(values)
        self.reads = 0

    def __getitem__(self, index):
        self.reads += 1
        return super().__getitem__(index)


@pytest.mark.parametrize("num_strings", [2, 2000])
def test_matching_work_per_character_does_not_grow_with_the_stop_strings(num_strings):
    """The automaton follows at most one fallback link per character read, amortized, however many stop strings
    there are (here up to 2,000 of 186 characters, each sharing 180 with the text, so links are followed)."""
    sentence = "the quick brown fox jumps over the lazy dog "
    text = sentence * 50
    matcher = StopStringMatcher([sentence * 4 + "#" + f"{i:05d}" for i in range(num_strings)])
    matcher._fallback = CountingList(matcher._fallback)
    for char in text:
        assert not matcher.feed(char)
    assert 0 < matcher._fallback.reads <= len(text)
