"""The engine's Prometheus metrics, published on Triton's metrics port through the Python backend's metrics API.

Gauges and counters follow the engine's own numbers (EngineStats) after every step; latency histograms and finish
reasons are recorded per request from what its OutputProcessor reports: the gauges and counters on the engine
thread, the rest on glm's response outbox. Each set, increment or observation is a round trip to Triton's process:
the inter-token histogram makes one a token, unless inter_token_latency_metric is per_request.
"""

from __future__ import annotations

import ctypes

import triton_python_backend_utils as pb_utils

from glm_engine.engine import EngineStats

LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
GAUGES = {
    "kv_blocks_used": ("glm_kv_blocks_used", "KV cache blocks held by requests"),
    "kv_blocks_total": ("glm_kv_blocks_total", "KV cache blocks in the pool"),
    "running": ("glm_num_requests_running", "Requests in the running batch"),
    "waiting": ("glm_num_requests_waiting", "Requests waiting to join the batch"),
}
COUNTERS = {
    "preemptions": ("glm_preemptions_total", "Sequences preempted for lack of KV blocks (recomputed later)"),
    "prefix_queried_tokens": ("glm_prefix_cache_queried_tokens_total", "Prompt tokens looked up in the prefix cache"),
    "prefix_hit_tokens": ("glm_prefix_cache_hit_tokens_total", "Prompt tokens found in the prefix cache"),
    "prompt_tokens": ("glm_prompt_tokens_total", "Prompt tokens of accepted requests"),
    "generated_tokens": ("glm_generation_tokens_total", "Tokens generated"),
    "refused": ("glm_requests_refused_total", "Requests refused as overloaded, at admission or after waiting"),
}
HISTOGRAMS = {
    "ttft": ("glm_time_to_first_token_seconds", "From request arrival to its first generated token"),
    "itl": ("glm_inter_token_latency_seconds", "Between consecutive generated tokens of a request, or a request's "
            "mean time between them (the glm model's inter_token_latency_metric: per_token, per_request)"),
    "latency": ("glm_request_latency_seconds", "From request arrival to its last response"),
}
FINISH_REASONS = ("stop", "length", "cancelled", "error")


class EngineMetrics:
    def __init__(self, model_name: str, model_version: str, inter_token_latency_metric: str = "per_token"):
        """inter_token_latency_metric: what the "itl" histogram observes (EngineConfig's parameter)."""
        # The OutputProcessor reports both; the one not asked for is left out.
        self._unobserved = "itl" if inter_token_latency_metric == "per_request" else "itl_mean"
        labels = {"model": model_name, "version": model_version}
        M = pb_utils.MetricFamily
        # Families must outlive their metrics: keep both.
        self._families = []

        def family(name, description, kind):
            self._families.append(M(name=name, description=description, kind=kind))
            return self._families[-1]

        self.gauges = {key: family(name, text, M.GAUGE).Metric(labels=labels) for key, (name, text) in GAUGES.items()}
        self.counters = {key: family(name, text, M.COUNTER).Metric(labels=labels)
                         for key, (name, text) in COUNTERS.items()}
        self.hit_rate = family("glm_prefix_cache_hit_rate", "Prefix-cache hit tokens over queried tokens",
                               M.GAUGE).Metric(labels=labels)
        finished = family("glm_requests_finished_total", "Requests ended, by finish reason", M.COUNTER)
        self.finished = {reason: finished.Metric(labels={**labels, "finish_reason": reason})
                         for reason in FINISH_REASONS}
        self.histograms = {key: family(name, text, M.HISTOGRAM).Metric(labels=labels, buckets=LATENCY_BUCKETS)
                           for key, (name, text) in HISTOGRAMS.items()}
        self._last = {key: 0 for key in COUNTERS}
        self._last_set: dict[str, float] = {}  # gauges' values as last set

    def update(self, stats: EngineStats) -> None:
        """Publish the engine's figures after a step. Each set or increment is a round trip to the server's process,
        made on the engine thread between steps: only the figures that changed are sent (two or so a decode step,
        of eleven)."""
        for key, metric in self.gauges.items():
            self._set(key, metric, getattr(stats, key))
        for key, metric in self.counters.items():
            value = getattr(stats, key)
            if value != self._last[key]:
                metric.increment(value - self._last[key])
                self._last[key] = value
        if stats.prefix_queried_tokens:
            self._set("hit_rate", self.hit_rate, stats.prefix_hit_tokens / stats.prefix_queried_tokens)

    def _set(self, key: str, gauge, value: float) -> None:
        if self._last_set.get(key) != value:
            gauge.set(value)
            self._last_set[key] = value

    def close(self) -> None:
        """Let go of the metrics and their families without deleting them, now or at the stub's exit: in Triton 2.51
        either way crashes a process.

        Deleted, a metric takes its Prometheus series with it even when a newer instance of this model and version
        has made the same one: on a reload the new instance loads before the old one finalizes, Triton's core counts
        a series' users per family object and each instance has its own, and tritonserver itself segfaults at the new
        instance's next update. Left to the interpreter's exit, their destructors run after the stub has let go of
        its shared memory, and the stub segfaults on its way out. So each gets a reference that is never returned:
        its series stays, with its last values, and a newer instance of the same version carries on with it."""
        for kept in (*self.gauges.values(), *self.counters.values(), self.hit_rate, *self.finished.values(),
                     *self.histograms.values(), *self._families):
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(kept))

    def record(self, latencies: list[tuple[str, float]], finish_reason: str | None) -> None:
        """A request's latencies observed now (Update.latencies), and its finish reason if it just ended."""
        for name, seconds in latencies:
            if name != self._unobserved:
                self.histograms["itl" if name == "itl_mean" else name].observe(seconds)
        if finish_reason is not None:
            self.finished[finish_reason].increment(1)
