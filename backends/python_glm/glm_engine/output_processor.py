"""What one request's responses carry, made from the engine's outputs: a server front turns each Response into its
own wire format and sends it, and this module knows nothing of any front.

Streaming, a response goes out whenever new tokens complete some text; otherwise one response carries everything at
the end, the prompt first when it is echoed. The last response is final. Every response counts what has been sent
so far: generated tokens, log-probabilities, and finish_reason (empty until the last).

Generated tokens pass two gates before they are sent: whole characters only (CompleteTextChunker), then nothing that
could be the start of a stop string (StopStringFilter). A stop string ends the request with finish_reason "stop";
its text and what follows are cut off by `text_length`, since it may begin inside a token.

It also times the request for the metrics: time to first token, the gaps between tokens, and the whole request.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from .engine import RequestOutput
from .sequence import FinishReason
from .stop_strings import StopStringFilter
from .tokenizer import CompleteTextChunker, GlmTokenizer


@dataclass(frozen=True)
class Response:
    """One response with outputs. The text of `token_ids` is cut to `text_length` characters when a stop string
    began inside them (None: all of it)."""

    token_ids: list[int]
    text_length: int | None
    finish_reason: str  # "" until the last response
    num_input_tokens: int
    num_output_tokens: int  # generated tokens sent so far, these included
    logprobs: list[float]  # of the generated tokens in this response (with SamplingParams.logprobs)
    cum_logprob: float  # of all generated tokens sent so far
    final: bool


@dataclass
class Update:
    """What to do after one engine output: send at most one of `response`, an error response (`error`, final; one
    the client may retry later when `unavailable`) or an empty final response (`close`: nobody listens any more);
    ask the engine to stop generating (`abort`); and record `latencies` and, when the request ended now,
    `finish_reason`."""

    response: Response | None = None
    error: str | None = None
    unavailable: bool = False
    close: bool = False
    abort: bool = False
    # ("ttft" | "itl" | "latency" | "itl_mean", seconds): "itl" since the previous output, "itl_mean" the request's
    # mean time between tokens, when it ended (with two tokens or more)
    latencies: list[tuple[str, float]] = field(default_factory=list)
    finish_reason: str | None = None


class OutputProcessor:
    def __init__(self, tokenizer: GlmTokenizer, prompt: list[int], streaming: bool, echo_prompt: bool,
                 stop_strings: list[str] = (), clock: Callable[[], float] = time.monotonic):
        self.tokenizer = tokenizer
        self.streaming = streaming
        self.num_input_tokens = len(prompt)
        self.echo = list(prompt) if echo_prompt else []
        self.chunker = CompleteTextChunker(tokenizer)
        self.stop_filter = StopStringFilter(list(stop_strings)) if stop_strings else None
        self.unsent_ids: list[int] = []  # streaming off: the whole answer, sent at the end
        self.unsent_logprobs: list[float] = []  # log-probs of generated tokens not sent yet
        self.num_sent = 0
        self.cum_logprob = 0.0
        self.closed = False  # the final response is out
        self.clock = clock
        self.arrival = self.last_token_time = clock()
        self.first_token_time = None
        self.num_tokens = 0

    def process(self, output: RequestOutput, client_gone: Callable[[], bool] = lambda: False) -> Update:
        """One engine output. `client_gone` says whether the client has gone away (asked only when it matters)."""
        if self.closed:  # a stop string ended it: what the engine still reports (the abort) is not news
            return Update(abort=True)
        if output.error:
            self.closed = True
            update = Update(error=output.error, unavailable=output.unavailable, abort=True)
            return self._timed(update, output.new_token_ids, "error")
        if output.finish_reason is FinishReason.CANCELLED or client_gone():
            # Close the stream now if this was its last output; otherwise the abort brings a CANCELLED one.
            if not output.finished:
                return Update(abort=True)
            self.closed = True
            if client_gone():
                update = Update(close=True, abort=True)
            else:  # stopped by a `stop` request: the client still gets what was generated, and why it ended
                update = Update(response=self._cancelled_response(), abort=True)
            return self._timed(update, output.new_token_ids, "cancelled")

        self.unsent_logprobs += output.new_logprobs or []
        ready, text = self.chunker.push(output.new_token_ids)
        if output.finished:
            rest, rest_text = self.chunker.flush()
            ready, text = ready + rest, text + rest_text
        keep_chars, stopped = None, False
        if self.stop_filter is not None:
            ready, keep_chars, stopped = self.stop_filter.push(ready, text)
            if output.finished and not stopped:
                ready += self.stop_filter.flush()
        finished = output.finished or stopped
        reason = "stop" if stopped else (output.finish_reason.value if output.finished else "")

        update = Update(abort=stopped)
        if self.streaming:
            if ready or finished:
                update.response = self._response(ready, len(ready), keep_chars, reason, finished)
        else:
            if keep_chars is not None:  # count from the start of the whole text, prompt echo included
                keep_chars += len(self.tokenizer.decode(self.echo + self.unsent_ids))
            self.unsent_ids += ready
            if finished:
                update.response = self._response(self.echo + self.unsent_ids, len(self.unsent_ids), keep_chars,
                                                 reason, True)
        self.closed = finished
        return self._timed(update, output.new_token_ids, reason if finished else None)

    def _cancelled_response(self) -> Response:
        held = self.chunker.flush()[0]
        if self.stop_filter is not None:  # what it holds back is no stop string, or the request would have ended
            held = self.stop_filter.flush() + held
        if self.streaming:
            return self._response(held, len(held), None, "cancelled", True)
        return self._response(self.echo + self.unsent_ids + held, len(self.unsent_ids) + len(held), None,
                              "cancelled", True)

    def _timed(self, update: Update, new_token_ids: list[int], finish_reason: str | None) -> Update:
        now = self.clock()
        if new_token_ids:
            update.latencies.append(("itl" if self.num_tokens else "ttft", now - self.last_token_time))
            if not self.num_tokens:
                self.first_token_time = now
            self.num_tokens += len(new_token_ids)
            self.last_token_time = now
        if finish_reason is not None:
            update.latencies.append(("latency", now - self.arrival))
            if self.num_tokens > 1:
                update.latencies.append(("itl_mean", (self.last_token_time - self.first_token_time)
                                         / (self.num_tokens - 1)))
            update.finish_reason = finish_reason
        return update

    def _response(self, token_ids: list[int], num_generated: int, keep_chars: int | None, reason: str,
                  final: bool) -> Response:
        """token_ids, whose last num_generated are generated tokens not sent before; keep_chars of their text."""
        logprobs = self.unsent_logprobs[:num_generated]
        del self.unsent_logprobs[:num_generated]
        self.num_sent += num_generated
        self.cum_logprob += sum(logprobs)
        return Response(token_ids, keep_chars, reason, self.num_input_tokens, self.num_sent, logprobs,
                        self.cum_logprob, final)
