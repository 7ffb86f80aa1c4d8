"""Open-AutoGLM's engine: GLM / GLM-4 decoding with a paged KV cache and continuous batching, in plain torch."""

from .config import CheckpointError, EngineConfig, ModelConfig
from .engine import LLMEngine, Overloaded, RequestOutput, Unavailable
from .engine_thread import EngineThread
from .model_runner import FatalEngineError
from .sampling_params import SamplingParams
from .sequence import FinishReason

__all__ = [
    "CheckpointError", "EngineConfig", "ModelConfig", "LLMEngine", "Overloaded", "RequestOutput", "Unavailable",
    "EngineThread", "FatalEngineError", "FinishReason", "SamplingParams",
]
