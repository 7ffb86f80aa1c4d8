"""Locust users for Open-AutoGLM on Triton. Each records, as its own Locust entry (so that Locust's percentiles
apply to each): the whole request, the time to first token (TTFT) and every inter-token gap (ITL). The output
tokens of a request are its entry's "content size", so Locust's CSV carries them too.

    locust -f loadtests/locustfile.py --host http://localhost:8000 --grpc-url localhost:8001 HttpStreamUser
    python loadtests/run.py --help      # headless runs, summaries and plots

User classes: HttpGenerateUser (generate, the whole answer), HttpStreamUser (generate_stream, server-sent
events), GrpcStreamUser (gRPC bidirectional streaming through tritonclient.grpc), OpenAiChatUser (the OpenAI front's
streaming /v1/chat/completions, at --openai-url).
"""

from __future__ import annotations

import csv
import itertools
import json
import time

import grpc.experimental.gevent
import requests
from locust import HttpUser, User, between, events, task
from locust.stats import PERCENTILES_TO_REPORT, StatsCSV

# Locust runs users as gevent greenlets; gRPC must cooperate with them (before any channel is made).
grpc.experimental.gevent.init_gevent()

from clients.client import event_piece  # noqa: E402
from clients.errors import OverloadedError  # noqa: E402
from loadtests.prompts import FINAL_STATS, OVERLOADED, REQUEST_NAMES, RequestMix, parse_range  # noqa: E402

MODEL = "ensemble"
_user_numbers = itertools.count()


@events.init_command_line_parser.add_listener
def _options(parser):
    parser.add_argument("--grpc-url", default="localhost:8001", help="gRPC address for GrpcStreamUser")
    parser.add_argument("--openai-url", default="http://localhost:9000", help="the OpenAI front, for OpenAiChatUser")
    parser.add_argument("--openai-api-key", default="", help="its API key, if it wants one")
    parser.add_argument("--prompt-words", default="16-512", help="prompt length range, in words (about tokens)")
    parser.add_argument("--output-tokens", default="16-256", help="max_tokens range")
    parser.add_argument("--scenario", default="mixed", choices=("mixed", "shared-prefix"))
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy, the server's default")
    parser.add_argument("--top-p", type=float, default=1.0, help="1: no top-p filter, the server's default")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-requests", type=int, default=0, help="stop after this many requests (0: no bound)")


@events.init.add_listener
def _stop_after_max_requests(environment, **kwargs):
    """--max-requests: end the run once that many whole requests (not TTFT / ITL samples) have been recorded."""
    limit = environment.parsed_options.max_requests if environment.parsed_options else 0
    if not limit:
        return

    @environment.events.request.add_listener
    def count(name, **kwargs):
        done = sum(entry.num_requests for (entry_name, _), entry in environment.stats.entries.items()
                   if entry_name in REQUEST_NAMES)
        if name in REQUEST_NAMES and done >= limit:
            environment.runner.quit()


@events.init.add_listener
def _write_final_stats_at_exit(environment, **kwargs):
    """With --csv: the run's totals in <csv prefix> + FINAL_STATS, once Locust has stopped every user (before its
    HTML report). Its own _stats.csv is rewritten only once a second, so a run shorter than that left it empty (a
    fast server answers --max-requests 24 in under a second) and any run lost its last second; run.py reads this
    file instead."""
    prefix = environment.parsed_options.csv_prefix if environment.parsed_options else None
    if not prefix:
        return

    @environment.events.test_stop.add_listener
    def write(**kwargs):
        with open(prefix + FINAL_STATS, "w", newline="") as f:
            StatsCSV(environment, PERCENTILES_TO_REPORT).requests_csv(csv.writer(f))


def is_overloaded(error) -> bool:
    """Whether an error (an exception, or an HTTP error body) is the server refusing a request as overloaded."""
    return isinstance(error, OverloadedError) or (error is not None and "the server is overloaded" in str(error))


class GlmUser(User):
    abstract = True
    wait_time = between(0, 0.05)

    def on_start(self):
        options = self.environment.parsed_options
        # Each user draws from its own seeded mix: reproducible, yet users do not send the same requests.
        self.mix = RequestMix(options.seed * 1000 + next(_user_numbers), parse_range(options.prompt_words),
                              parse_range(options.output_tokens), options.scenario)
        # Sampling settings go with every request, but only those that differ from the server's defaults.
        self.sampling = {key: value for key, value, default in (("temperature", options.temperature, 0.0),
                                                                ("top_p", options.top_p, 1.0)) if value != default}

    def record(self, request_type: str, name: str, started: float, output_tokens: int, error: Exception | None):
        if is_overloaded(error):
            name, error = name + OVERLOADED, None
        self.environment.events.request.fire(
            request_type=request_type, name=name, response_time=(time.perf_counter() - started) * 1000,
            response_length=output_tokens, exception=error, context={})

    def record_timings(self, request_type: str, name: str, started: float, token_times: list[float]):
        """TTFT and the ITL gaps of one stream, each its own Locust sample."""
        fire = self.environment.events.request.fire
        if token_times:
            fire(request_type=request_type, name=f"{name} TTFT", response_time=(token_times[0] - started) * 1000,
                 response_length=0, exception=None, context={})
        for before, after in zip(token_times, token_times[1:]):
            fire(request_type=request_type, name=f"{name} ITL", response_time=(after - before) * 1000,
                 response_length=0, exception=None, context={})


class HttpGenerateUser(HttpUser, GlmUser):
    """The generate endpoint: one response with the whole answer."""

    @task
    def generate(self):
        request = self.mix.next()
        with self.client.post(f"/v2/models/{MODEL}/generate", name="generate", catch_response=True,
                              json={"text_input": request.prompt, "max_tokens": request.max_tokens,
                                    "exclude_input_in_output": True, **self.sampling}) as response:
            if response.status_code != 200:
                if is_overloaded(response.text):
                    response.request_meta["name"] += OVERLOADED
                    response.success()
                else:
                    response.failure(f"HTTP {response.status_code}: {response.text[:200]}")
                return
            response.request_meta["response_length"] = response.json().get("num_output_tokens", 0)


class HttpStreamUser(GlmUser):
    """generate_stream: server-sent events, a piece of text each. Locust's HttpSession would time only the
    response headers of a stream, so this user reads the events with requests and records its own timings."""

    def on_start(self):
        super().on_start()
        self.http = requests.Session()

    @task
    def generate_stream(self):
        request = self.mix.next()
        started, token_times, output_tokens, error = time.perf_counter(), [], 0, None
        body = {"text_input": request.prompt, "max_tokens": request.max_tokens, "stream": True, **self.sampling}
        try:
            with self.http.post(f"{self.host}/v2/models/{MODEL}/generate_stream", json=body, stream=True,
                                timeout=600) as response:
                if response.status_code != 200:
                    raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")
                for line in response.iter_lines(decode_unicode=True):
                    piece = event_piece(line)  # the SDK's reading of an event; raises the server's error
                    if piece is None:
                        continue
                    if piece.text:
                        token_times.append(time.perf_counter())
                    output_tokens = piece.num_output_tokens or output_tokens
        except Exception as exc:  # recorded as a Locust failure, with its message
            error = exc
        self.record("HTTP", "generate_stream", started, output_tokens, error)
        if error is None:
            self.record_timings("HTTP", "generate_stream", started, token_times)


class GrpcStreamUser(GlmUser):
    """gRPC bidirectional streaming (tritonclient.grpc, through clients.GrpcClient); grpc runs on gevent here
    (init_gevent above), so the client's stream thread is a greenlet like the users."""

    @task
    def grpc_stream(self):
        from clients import GrpcClient

        request = self.mix.next()
        started, token_times, output_tokens, error = time.perf_counter(), [], 0, None
        try:
            with GrpcClient(self.environment.parsed_options.grpc_url) as client, \
                    client.stream(request.prompt, max_tokens=request.max_tokens, **self.sampling) as stream:
                for _ in stream:
                    token_times.append(time.perf_counter())
                output_tokens = stream.generation.num_output_tokens
        except Exception as exc:  # recorded as a Locust failure, with its message
            error = exc
        self.record("gRPC", "grpc_stream", started, output_tokens, error)
        if error is None:
            self.record_timings("gRPC", "grpc_stream", started, token_times)


class OpenAiChatUser(GlmUser):
    """The OpenAI front (openai_front/): streaming chat completions, one user message per request, read as
    server-sent events with requests (as HttpStreamUser reads Triton's)."""

    def on_start(self):
        super().on_start()
        options = self.environment.parsed_options
        self.http = requests.Session()
        if options.openai_api_key:
            self.http.headers["Authorization"] = f"Bearer {options.openai_api_key}"
        self.url = options.openai_url.rstrip("/") + "/v1/chat/completions"

    @task
    def chat_stream(self):
        request = self.mix.next()
        started, token_times, output_tokens, error = time.perf_counter(), [], 0, None
        # OpenAI's default temperature is 1; the other users get the server's (greedy) unless told otherwise.
        body = {"model": "glm", "messages": [{"role": "user", "content": request.prompt}], "stream": True,
                "max_tokens": request.max_tokens, "stream_options": {"include_usage": True},
                "temperature": self.sampling.get("temperature", 0.0), **self.sampling}
        try:
            with self.http.post(self.url, json=body, stream=True, timeout=600) as response:
                if response.status_code != 200:
                    raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")
                for line in response.iter_lines(decode_unicode=True):
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[len("data: "):])
                    if "error" in chunk:
                        raise RuntimeError(chunk["error"]["message"])
                    if any(choice["delta"].get("content") for choice in chunk["choices"]):
                        token_times.append(time.perf_counter())
                    if chunk.get("usage"):
                        output_tokens = chunk["usage"]["completion_tokens"]
        except Exception as exc:  # recorded as a Locust failure, with its message
            error = exc
        self.record("OpenAI", "chat_stream", started, output_tokens, error)
        if error is None:
            self.record_timings("OpenAI", "chat_stream", started, token_times)
