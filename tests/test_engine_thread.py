"""The engine on its own thread: callbacks, requests joining mid-flight, cancellation and broken callbacks."""

from __future__ import annotations

import threading

import pytest

from glm_engine import EngineConfig, EngineThread, FinishReason, LLMEngine, SamplingParams


@pytest.fixture(scope="module")
def engine_thread(tmp_path_factory):
    from support.checkpoints import make_tiny_checkpoint

    model_dir = make_tiny_checkpoint(str(tmp_path_factory.mktemp("glm4-thread")), "glm4")[0]
    thread = EngineThread(lambda: LLMEngine(EngineConfig(model_dir=model_dir, block_size=4, num_kv_blocks=64)))
    yield thread
    thread.shutdown()


class Collector:
    def __init__(self, stop_after=None):
        self.tokens, self.outputs, self.done = [], [], threading.Event()
        self.stop_after = stop_after

    def __call__(self, output):
        self.outputs.append(output)
        self.tokens += output.new_token_ids
        if output.finished:
            self.done.set()
        return self.stop_after is None or len(self.tokens) < self.stop_after


def test_the_engine_is_built_on_its_own_thread_and_a_build_error_is_raised_to_the_caller():
    built_on = []

    def build_engine():
        built_on.append(threading.current_thread().name)
        raise ValueError("no checkpoint here")

    with pytest.raises(ValueError, match="no checkpoint here"):
        EngineThread(build_engine)
    assert built_on == ["glm-engine"]


def test_results_match_the_synchronous_engine(engine_thread):
    params = SamplingParams(max_tokens=12, stop_token_ids=())
    prompts = [[5, 6, 7], [8] * 11, [9, 10]]
    collectors = [Collector() for _ in prompts]
    for i, (prompt, collector) in enumerate(zip(prompts, collectors)):
        engine_thread.submit(f"t{i}", prompt, params, collector)
    assert all(c.done.wait(30) for c in collectors)
    expected = [engine_thread.engine.generate([p], params)[0] for p in prompts]  # thread idle again: safe
    assert [c.tokens for c in collectors] == expected
    assert all(c.outputs[-1].finish_reason is FinishReason.LENGTH for c in collectors)


def test_a_client_that_goes_away_is_aborted_and_its_blocks_freed(engine_thread):
    leaving = Collector(stop_after=3)
    engine_thread.submit("leaving", [5, 6, 7], SamplingParams(max_tokens=50, stop_token_ids=()), leaving)
    assert leaving.done.wait(30)
    assert leaving.outputs[-1].finish_reason is FinishReason.CANCELLED
    assert len(leaving.tokens) == 3
    pool = engine_thread.engine.pool
    assert pool.num_free_blocks == pool.num_blocks


def test_abort_and_a_raising_callback_leave_others_running(engine_thread):
    def broken(output):
        raise RuntimeError("client bug")

    survivor = Collector()
    engine_thread.submit("broken", [5, 6], SamplingParams(max_tokens=30, stop_token_ids=()), broken)
    engine_thread.submit("survivor", [7, 8], SamplingParams(max_tokens=20, stop_token_ids=()), survivor)
    aborted = Collector()
    engine_thread.submit("aborted", [9, 9], SamplingParams(max_tokens=200, stop_token_ids=()), aborted)
    engine_thread.abort("aborted")
    assert survivor.done.wait(30) and aborted.done.wait(30)
    assert len(survivor.tokens) == 20
    assert aborted.outputs[-1].finish_reason is FinishReason.CANCELLED


def test_invalid_requests_raise_on_the_callers_thread(engine_thread):
    with pytest.raises(ValueError, match="top_p"):
        engine_thread.submit("bad", [5], SamplingParams(top_p=2.0), Collector())


def test_an_engine_fault_fails_the_requests_in_flight_and_the_loop_goes_on(engine_thread):
    engine = engine_thread.engine
    schedule = engine.scheduler.schedule

    def broken_schedule():
        engine.scheduler.schedule = schedule  # fails once
        raise RuntimeError("scheduler bug")

    engine.scheduler.schedule = broken_schedule
    victim = Collector()
    engine_thread.submit("victim", [5, 6], SamplingParams(max_tokens=5, stop_token_ids=()), victim)
    assert victim.done.wait(30)
    assert victim.outputs[-1].finish_reason is FinishReason.ERROR and "scheduler bug" in victim.outputs[-1].error
    assert engine.pool.num_free_blocks == engine.pool.num_blocks

    after = Collector()
    engine_thread.submit("after", [5, 6], SamplingParams(max_tokens=5, stop_token_ids=()), after)
    assert after.done.wait(30) and len(after.tokens) == 5
