"""The engine against transformers: prompts, transformers' own greedy decoding, and the checks that compare them.
The reference decodes each prompt alone with its own KV cache; the engine decodes them batched through the paged
cache."""

from __future__ import annotations

from collections import defaultdict

import torch

from glm_engine import EngineConfig, LLMEngine, SamplingParams

LOGITS_ATOL = 1e-4
GREEDY = SamplingParams(max_tokens=24, stop_token_ids=())  # no stop token: always run to max_tokens


def prompts(lengths, seed=1, vocab=512):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]


@torch.no_grad()
def reference(model, prompt: list[int], max_tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy decoding with its own KV cache: (tokens, logits [max_tokens, vocab])."""
    out = model(input_ids=torch.tensor([prompt]), use_cache=True)
    tokens, logits = [], []
    for _ in range(max_tokens):
        step_logits = out.logits[0, -1].float()
        logits.append(step_logits)
        tokens.append(int(step_logits.argmax()))
        out = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens, torch.stack(logits)


def make_engine(model_dir, **overrides) -> LLMEngine:
    settings = dict(model_dir=model_dir, block_size=8, num_kv_blocks=128)
    return LLMEngine(EngineConfig(**{**settings, **overrides}))


def record_logits(engine: LLMEngine) -> dict[str, list[torch.Tensor]]:
    """Wrap the runner so every sampled row's logits are kept, per request."""
    records = defaultdict(list)
    execute = engine.runner.execute

    def recording_execute(step):
        logits = execute(step)
        sampled = [seq.request_id for seq in step.sampling]
        for request_id, row in zip(sampled, logits):
            records[request_id].append(row.clone())
        return logits

    engine.runner.execute = recording_execute
    return records


def run_all(engine: LLMEngine, requests: dict[str, list[int]], params=GREEDY, join_after_steps=None):
    """Add requests (optionally half of them only after some steps) and run to the end."""
    outputs = {request_id: [] for request_id in requests}
    items = list(requests.items())
    late = items[len(items) // 2:] if join_after_steps else []
    for request_id, prompt in items[:len(items) - len(late)]:
        engine.add_request(request_id, prompt, params)
    steps = 0
    while engine.has_unfinished_requests() or late:
        if late and steps == join_after_steps:
            for request_id, prompt in late:
                engine.add_request(request_id, prompt, params)
            late = []
        for output in engine.step():
            outputs[output.request_id] += output.new_token_ids
        steps += 1
    return outputs


def assert_matches_reference(model, requests, outputs, records=None, max_tokens=GREEDY.max_tokens):
    for request_id, prompt in requests.items():
        tokens, logits = reference(model, prompt, max_tokens)
        assert outputs[request_id] == tokens, f"{request_id} (prompt of {len(prompt)} tokens)"
        if records is not None:
            engine_logits = torch.stack(records[request_id])
            torch.testing.assert_close(engine_logits, logits, atol=LOGITS_ATOL, rtol=0)
