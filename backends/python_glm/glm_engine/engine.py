"""The engine: requests in, token ids out, one scheduling step at a time. It knows nothing of Triton."""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass

from .block_pool import BlockPool
from .config import EngineConfig, ModelConfig
from .model_runner import FatalEngineError, ModelRunner
from .sampler import draw_uniforms, sample
from .sampling_params import SamplingParams
from .scheduler import ScheduledSequence, Scheduler, SchedulerOutput
from .sequence import FinishReason, Sequence
from .tensor_parallel import Shard, check_divisible
from .tp_workers import WorkerGroup

log = logging.getLogger(__name__)


class Unavailable(Exception):
    """The engine cannot serve a request now, through no fault of the request: retrying later, or on another replica,
    may succeed (HTTP 503, gRPC UNAVAILABLE through Triton)."""


class Overloaded(Unavailable):
    """A request refused, or ended, because the engine has more waiting than its admission limits allow."""


SHUTTING_DOWN = "the server is shutting down; retry on another replica"


@dataclass
class RequestOutput:
    """What one step produced for one request: the tokens it added, and whether it is over."""

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None
    # With SamplingParams.logprobs: the log-probability of each new token, and of the whole output so far.
    new_logprobs: list[float] | None = None
    cumulative_logprob: float | None = None
    # With `error`: the request failed because the engine was overloaded or shutting down, not because of the request
    # or a fault (see Unavailable).
    unavailable: bool = False
    # KV blocks of the prompt the request found in the prefix cache when it started, those it holds (0 once over),
    # and when it first joined the batch (time.time_ns(); 0 before): for TensorRT-LLM's perf-metric outputs.
    num_cached_blocks: int = 0
    num_blocks: int = 0
    first_scheduled_ns: int = 0


@dataclass
class EngineStats:
    """A snapshot for metrics: gauges as they are now, counters since the engine started."""

    kv_blocks_used: int
    kv_blocks_total: int
    running: int
    waiting: int
    preemptions: int
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    prompt_tokens: int
    generated_tokens: int
    refused: int  # requests refused at admission or ended by the queue time limit


class LLMEngine:
    def __init__(self, config: EngineConfig):
        config.validate()
        self.config = config
        self.model_config = ModelConfig.from_checkpoint(config.model_dir)
        self.max_model_len = config.model_len_limit(self.model_config)
        # With tensor_parallel_size N, the other N - 1 ranks' processes (glm_engine/tp_workers.py).
        self.workers: WorkerGroup | None = None
        if config.tensor_parallel_size > 1:
            check_divisible(self.model_config, config.tensor_parallel_size)
            self.workers = WorkerGroup.start(config)
        try:
            self.runner = ModelRunner(self.model_config, config, self.max_model_len,
                                      self.workers.shard if self.workers else Shard())
        except BaseException as exc:
            fault = self.workers.fault() if self.workers else None
            self.close(kill=True)
            if fault:  # the cause, rather than rank 0's broken connection to it
                raise RuntimeError(f"{fault} while loading the model (its error is in the server's log)") from exc
            raise
        self.pool = BlockPool(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.pool, config.max_num_seqs, config.max_num_batched_tokens)
        self.sequences: dict[str, Sequence] = {}
        self._seed_source = random.Random(config.seed)
        self.num_prompt_tokens = 0
        self.num_generated_tokens = 0
        self.num_refused = 0

    # -- requests -------------------------------------------------------------------------------------------
    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError if the request can never be served. Reads only fixed state: safe from any thread."""
        params.validate()
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must lie in [0, {vocab}), got {bad[:5]}")
        if params.stop_token_ids and any(not 0 <= t < vocab for t in params.stop_token_ids):
            raise ValueError(f"end_id must lie in [0, {vocab}), got {list(params.stop_token_ids)}")
        if any(not word or not all(0 <= t < vocab for t in word) for word in params.bad_words_ids):
            raise ValueError(f"bad words must be non-empty token sequences in [0, {vocab})")
        total = len(prompt_token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(f"the prompt ({len(prompt_token_ids)} tokens) plus max_tokens ({params.max_tokens}) "
                             f"is {total} tokens, over the model's limit of {self.max_model_len}")
        if self.pool.blocks_for(total) > self.pool.num_blocks:
            raise ValueError(f"the prompt plus max_tokens needs {self.pool.blocks_for(total)} KV blocks, "
                             f"more than the whole cache ({self.pool.num_blocks})")

    def check_admission(self, num_prompt_tokens: int, queued_requests: int = 0, queued_tokens: int = 0) -> None:
        """Raise Overloaded if one more request of num_prompt_tokens would pass max_waiting_requests or
        max_waiting_tokens. queued_*: requests on their way to add_request (the engine thread's inbox). Reads
        counters only: safe from any thread. (The token limit counts every waiting prompt: it bounds prefill work.)"""
        config = self.config
        # Those that will take the batch's free places at the next step do not wait.
        free_places = max(0, config.max_num_seqs - len(self.scheduler.running))
        waiting = max(0, len(self.scheduler.waiting) + queued_requests - free_places)
        tokens = self.scheduler.waiting_tokens + queued_tokens
        if config.max_waiting_requests and waiting >= config.max_waiting_requests:
            reason = f"{waiting} requests are waiting to start (max_waiting_requests {config.max_waiting_requests})"
        elif config.max_waiting_tokens and tokens and tokens + num_prompt_tokens > config.max_waiting_tokens:
            reason = (f"{tokens} prompt tokens are waiting to be computed (max_waiting_tokens "
                      f"{config.max_waiting_tokens})")
        else:
            return
        self.num_refused += 1
        raise Overloaded(f"the server is overloaded: {reason}; retry later")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    leader_id: str | None = None) -> None:
        """`leader_id`: another answer to the same prompt, added just before; this one then shares its prompt's KV
        blocks (Sequence.leader). Each of a request's n answers is added on its own (SamplingParams.samples)."""
        if request_id in self.sequences:
            raise ValueError(f"request id {request_id!r} is already running")
        self.check_request(prompt_token_ids, params)
        stop_ids = params.stop_token_ids if params.stop_token_ids is not None else self.model_config.eos_token_ids
        seq = Sequence(
            request_id=request_id,
            token_ids=list(prompt_token_ids),
            num_prompt_tokens=len(prompt_token_ids),
            params=params,
            stop_token_ids=frozenset(stop_ids),
            seed=params.seed if params.seed is not None else self._seed_source.getrandbits(63),
            leader=self.sequences.get(leader_id) if leader_id is not None else None,
        )
        self.sequences[request_id] = seq
        self.scheduler.add(seq)
        self.num_prompt_tokens += seq.num_prompt_tokens

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; None if it is unknown or already over."""
        seq = self.sequences.pop(request_id, None)
        if seq is None:
            return None
        self.scheduler.finish(seq, FinishReason.CANCELLED)
        return self._output(seq, [])

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def fault(self) -> str | None:
        """Why this engine can no longer run (a tensor-parallel worker has died), or None. Safe from any thread."""
        return self.workers.fault() if self.workers else None

    def close(self, kill: bool = False) -> None:
        """Stop the tensor-parallel workers, if any (kill: at once, after a FatalEngineError). The engine cannot step
        afterwards."""
        if self.workers is not None:
            self.workers.close(kill=kill)

    # -- the loop -------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and run one step. Raises FatalEngineError when the engine can no longer run (fault())."""
        if fault := self.fault():
            raise FatalEngineError(fault)
        expired = self._expire_waiting()
        step = self.scheduler.schedule()
        if not step.scheduled:
            return expired
        uniforms = dict(zip(step.sampling, draw_uniforms(step.sampling)))
        try:
            sampled, failed = self._execute(step.scheduled, uniforms)
        except FatalEngineError as exc:  # a rank that died is the cause to name, not the broken connection to it
            raise FatalEngineError(self.fault() or str(exc)) from exc
        outputs = [self._fail(seq, message) for seq, message in failed.items()]
        return expired + outputs + self._apply(step, sampled)

    def _expire_waiting(self) -> list[RequestOutput]:
        """End the requests that have waited max_queue_time_s without joining the batch (a preempted one has)."""
        limit = self.config.max_queue_time_s
        if not limit:
            return []
        now = time.monotonic()
        expired = [seq for seq in self.scheduler.waiting if not seq.started and now - seq.arrival_time > limit]
        outputs = []
        for seq in expired:
            self.num_refused += 1
            output = self._fail(seq, f"the server is overloaded: the request waited {now - seq.arrival_time:.1f} s "
                                     f"without starting (max_queue_time_s {limit:g}); retry later")
            output.unavailable = True
            outputs.append(output)
        return outputs

    def _execute(self, items: list[ScheduledSequence], uniforms: dict[Sequence, float | None]
                 ) -> tuple[dict[Sequence, tuple[int, float | None]], dict[Sequence, str]]:
        """Run these scheduled sequences as one step: (token and log-prob of each that sampled, error of each that
        failed). If the step raises, each half runs on its own, and so on down to single sequences, so that only a
        request that fails alone fails: one request must not end the others. Nothing changes the sequences here;
        rerunning rewrites the same keys and values, and draws with the same numbers."""
        part = SchedulerOutput(items)
        try:
            logits = self.runner.execute(part)
            tokens, logprobs = sample(logits, part.sampling, [uniforms[seq] for seq in part.sampling])
        except FatalEngineError:
            raise
        except Exception as exc:
            if len(items) == 1:
                log.exception("engine step failed for request %s", items[0].seq.request_id)
                return {}, {items[0].seq: f"engine step failed: {exc}"}
            log.warning("a step of %d sequences failed (%s); running each half on its own", len(items), exc)
            half = len(items) // 2
            (first, first_failed), (second, second_failed) = (self._execute(items[:half], uniforms),
                                                              self._execute(items[half:], uniforms))
            return {**first, **second}, {**first_failed, **second_failed}
        sampled, failed = {}, {}
        for seq, token, logprob in zip(part.sampling, tokens, logprobs):
            if token < 0:
                failed[seq] = ("no token could be sampled: the model's logits for this request were not finite, or "
                               "its bans (bad words, min_tokens) left no token")
            else:
                sampled[seq] = (token, logprob)
        return sampled, failed

    def _apply(self, step: SchedulerOutput, sampled: dict[Sequence, tuple[int, float | None]]
               ) -> list[RequestOutput]:
        """The one place a step's results change the sequences that did not fail: the computed tokens are in the KV
        cache (and full blocks in the prefix cache), then each sampling sequence takes its token, which may end it."""
        for item in step.scheduled:
            if not item.seq.is_finished:
                item.seq.num_computed_tokens = item.start + item.num_new_tokens
                self.pool.cache_full_blocks(item.seq)
        return [self._append_token(seq, *sampled[seq]) for seq in step.sampling if seq in sampled]

    def fail_all(self, message: str, unavailable: bool = False) -> list[RequestOutput]:
        """End every live request with an error and free its blocks: after an unexpected engine fault, or (with
        `unavailable`) when the server shuts down."""
        outputs = [self._fail(seq, message) for seq in list(self.sequences.values())]
        for output in outputs:
            output.unavailable = unavailable
        return outputs

    def _append_token(self, seq: Sequence, token: int, logprob: float | None) -> RequestOutput:
        self.num_generated_tokens += 1
        if token in seq.stop_token_ids:
            output = self._finish(seq, FinishReason.STOP, [])
        else:
            seq.token_ids.append(token)
            if logprob is not None:
                seq.cumulative_logprob += logprob
            if seq.num_output_tokens >= seq.params.max_tokens:
                output = self._finish(seq, FinishReason.LENGTH, [token])
            else:
                output = self._output(seq, [token])
        if seq.params.logprobs:
            output.new_logprobs = [logprob] if output.new_token_ids else []
            output.cumulative_logprob = seq.cumulative_logprob
        return output

    def _finish(self, seq: Sequence, reason: FinishReason, new_tokens: list[int]) -> RequestOutput:
        self.scheduler.finish(seq, reason)
        del self.sequences[seq.request_id]
        return self._output(seq, new_tokens)

    def _fail(self, seq: Sequence, message: str) -> RequestOutput:
        output = self._finish(seq, FinishReason.ERROR, [])
        output.error = message
        return output

    @staticmethod
    def _output(seq: Sequence, new_tokens: list[int]) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=new_tokens,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_cached_blocks=seq.num_cached_blocks,
            num_blocks=len(seq.block_table),
            first_scheduled_ns=seq.first_scheduled_ns,
        )

    def stats(self) -> EngineStats:
        return EngineStats(
            kv_blocks_used=self.pool.num_used_blocks,
            kv_blocks_total=self.pool.num_blocks,
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            preemptions=self.scheduler.num_preemptions,
            prefix_queried_tokens=self.scheduler.prefix_queried_tokens,
            prefix_hit_tokens=self.scheduler.prefix_hit_tokens,
            prompt_tokens=self.num_prompt_tokens,
            generated_tokens=self.num_generated_tokens,
            refused=self.num_refused,
        )

    # -- offline use ----------------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Run prompts to completion together; returns each one's output token ids."""
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"generate-{i}" for i in range(len(prompts))]
        for request_id, prompt, p in zip(ids, prompts, per_prompt):
            self.add_request(request_id, prompt, p)
        results: dict[str, list[int]] = {request_id: [] for request_id in ids}
        while self.has_unfinished_requests():
            for output in self.step():
                if output.error:
                    raise RuntimeError(output.error)
                results[output.request_id] += output.new_token_ids
        return [results[request_id] for request_id in ids]
