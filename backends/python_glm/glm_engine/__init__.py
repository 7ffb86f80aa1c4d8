"""Open-AutoGLM's engine: GLM / GLM-4 decoding with a paged KV cache and continuous batching, in plain torch.

The names below are imported on first use (PEP 562), so that a process that only reads a checkpoint's config and
tokenizer (the Triton models that tokenize, the OpenAI front) never imports torch: about a second of start-up and
200 MB of memory a process (docs/operations.md#start-up).
"""

import importlib

_MODULE_OF = {
    "CheckpointError": "config", "EngineConfig": "config", "ModelConfig": "config",
    "LLMEngine": "engine", "Overloaded": "engine", "RequestOutput": "engine", "Unavailable": "engine",
    "EngineThread": "engine_thread", "FatalEngineError": "model_runner", "SamplingParams": "sampling_params",
    "FinishReason": "sequence",
}

__all__ = list(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_MODULE_OF[name]}", __name__), name)
    globals()[name] = value  # the next lookup does not come here
    return value
