"""The two configuration objects: what the checkpoint says (ModelConfig) and how to run it (EngineConfig)."""

from __future__ import annotations

import json
import os
import typing
from dataclasses import dataclass

SUPPORTED_MODEL_TYPES = ("glm", "glm4")
QUANTIZATION_METHODS = ("auto", "none", "int8", "fp8")
INTER_TOKEN_LATENCY_METRICS = ("per_token", "per_request")


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be served: missing files, unknown architecture, bad weights."""


@dataclass(frozen=True)
class ModelConfig:
    """The architecture facts the forward pass needs, read from a Hugging Face `config.json`."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    attention_bias: bool
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]

    @property
    def has_sandwich_norms(self) -> bool:
        """GLM-4 normalises each sub-block's output before the residual add; GLM does not."""
        return self.model_type == "glm4"

    @classmethod
    def from_dict(cls, raw: dict, generation: dict | None = None) -> "ModelConfig":
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise CheckpointError(
                f"unsupported model_type {model_type!r} (architectures {raw.get('architectures')}); "
                f"this engine serves {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in raw]
        if missing:
            raise CheckpointError(f"config.json lacks {', '.join(missing)}")
        num_heads = raw["num_attention_heads"]
        head_dim = raw.get("head_dim") or raw["hidden_size"] // num_heads
        # transformers 5 nests rotary settings in rope_parameters; 4.x checkpoints keep them at the top.
        rope = raw.get("rope_parameters") or {}
        rope_type = rope.get("rope_type", "default")
        if rope_type != "default":
            raise CheckpointError(f"unsupported rope_type {rope_type!r}; only 'default' rotary embedding is implemented")
        partial = rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.5))
        rope_theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
        eos = (generation or {}).get("eos_token_id", raw.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads", num_heads),
            head_dim=head_dim,
            rotary_dim=int(head_dim * partial),
            rope_theta=float(rope_theta),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
            max_position_embeddings=raw.get("max_position_embeddings", 8192),
            attention_bias=raw.get("attention_bias", True),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_checkpoint(cls, model_dir: str) -> "ModelConfig":
        config_path = os.path.join(model_dir, "config.json")
        if not os.path.isdir(model_dir):
            raise CheckpointError(f"checkpoint directory {model_dir!r} does not exist")
        if not os.path.isfile(config_path):
            raise CheckpointError(f"{model_dir!r} has no config.json: not a Hugging Face checkpoint")
        with open(config_path) as f:
            raw = json.load(f)
        generation = None
        generation_path = os.path.join(model_dir, "generation_config.json")
        if os.path.isfile(generation_path):
            with open(generation_path) as f:
                generation = json.load(f)
        return cls.from_dict(raw, generation)


@dataclass
class EngineConfig:
    """How the engine runs a checkpoint. Every field is a `parameters` key of the `glm` model's config.pbtxt."""

    model_dir: str = ""
    # "auto" picks CUDA when it is available, else the CPU.
    device: str = "auto"
    # "auto": float32 on the CPU, bfloat16 on CUDA (float16 on GPUs without bf16).
    dtype: str = "auto"
    # Weights of the decoder layers' projections (glm_engine/quantization.py): "none" (the dtype above), "int8"
    # (per output channel, activations per token, integer matmuls), "fp8" (float8_e4m3fn likewise; FP8 tensor cores
    # on CUDA 8.9+, emulated elsewhere). "auto": an FP8 checkpoint stays FP8 where the GPU runs it, else none.
    quantization: str = "auto"
    # The LM head in the projections' 8 bits too (int8 or fp8, as quantization resolves; an error with none): faster
    # and smaller, but it changes more greedy answers than it does perplexity (docs/quantization.md). Off by default,
    # as TensorRT-LLM's quantize_lm_head and GLM's own FP8 releases leave the head in float.
    quantize_lm_head: bool = False
    # Tokens per KV block.
    block_size: int = 16
    # Size of the KV pool in blocks; 0 sizes it from kv_cache_memory_mb (CPU) or gpu_memory_utilization (CUDA).
    num_kv_blocks: int = 0
    kv_cache_memory_mb: int = 512
    gpu_memory_utilization: float = 0.85
    # Most sequences in one batch, and most tokens (prefill and decode together) in one step.
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # Decode attention: "auto" (the Triton-language kernel on CUDA when `triton` is installed; the C kernel on the
    # CPU in float32 when a C compiler builds it; else torch), "torch", "triton" (the kernel on any device: on the
    # CPU only under TRITON_INTERPRET=1, for tests) or "cpu" (the C kernel, or an error saying why it cannot run).
    attention_backend: str = "auto"
    # The decoder layers' work on the CPU: "auto" (the C kernels, when a C compiler builds them, in float32: linear
    # products, cpu_linear_kernel.c; RMSNorm with the residual addition and SiLU * up, cpu_elementwise_kernel.c;
    # int8 products, cpu_int8_kernel.c; else torch), "torch" (oneDNN's products, torch's operators, int8 through
    # torch._int_mm), or "cpu" (the C kernels, or an error saying why they cannot run). Ignored on CUDA; fp8 products
    # keep their own path.
    layer_backend: str = "auto"
    # Decode-only steps of up to this many sequences (at most max_num_seqs) replay CUDA graphs, recorded at start-up;
    # 0 turns them off. Only on CUDA with the decode kernel; ignored on the CPU.
    cuda_graph_max_batch: int = 64
    # Reuse the KV blocks of prompt prefixes seen before (shared system prompts cost one prefill).
    enable_prefix_caching: bool = True
    # Longest prompt plus output; 0 means the checkpoint's max_position_embeddings.
    max_model_len: int = 0
    # max_tokens of a request that does not say.
    default_max_tokens: int = 64
    # Threads torch may use on the CPU; 0 leaves torch's default.
    cpu_threads: int = 0
    # Seeds requests that give no seed of their own.
    seed: int = 0
    # Admission: a request that would make more than this many requests wait to join the batch (beyond those about to
    # take its free places) is refused at once as overloaded (HTTP 503); 0: no limit. Continuous batching takes every
    # request off Triton's queue at once, so Triton's own queue policy never sees a backlog: this is where it is bounded.
    max_waiting_requests: int = 128
    # Likewise for the tokens of the waiting requests' prompts (what they will cost to prefill); 0: no limit.
    max_waiting_tokens: int = 0
    # A request that has waited this long without joining the batch fails as overloaded; 0: no limit.
    max_queue_time_s: float = 0.0
    # The watchdog ends the model's process when the engine thread has been busy this long without finishing a step,
    # or has died, so that the launcher restarts the server instead of requests hanging; 0: never. Above the
    # longest step the checkpoint and device can take (a full max_num_batched_tokens prefill).
    stall_timeout_s: float = 300.0
    # When the model is unloaded (a reload, a new version, a shutdown), requests still running get this long to finish;
    # those left then end with a retryable "shutting down" error.
    unload_grace_s: float = 60.0
    # A running request asks the server whether its client has cancelled at most this often (TensorRT-LLM's parameter
    # of the same name): each asking is a round trip to Triton's process, which, asked at every token, took as long
    # as the rest of the engine thread's work on the outputs; 0: at every output.
    cancellation_check_period_ms: int = 100
    # What the inter-token latency histogram observes: per_token, every gap between a request's outputs (a round trip
    # to Triton's process each); per_request, each request's mean time between its tokens, once, when it ends (as
    # genai-perf's and TGI's figure).
    inter_token_latency_metric: str = "per_token"
    # A streamed answer's responses made while its earlier ones still wait to be sent to Triton's process go with them,
    # as one (their tokens together); off: one response per token, however far behind the sending falls.
    coalesce_stream_responses: bool = True
    # How far the thread that sends the responses (glm's outbox: sends and metric observations, each a round trip to
    # Triton's process) stands back for the engine's threads: a nice increment for that thread alone, 0-19. With a
    # core to spare it runs at once; when the engine's threads keep every core busy, it waits its turn and its
    # sends go out coalesced, where at the engine's priority it took a core in the middle of a step, whose other
    # threads then waited for it (docs/performance.md). 0: the engine's priority.
    response_thread_nice: int = 10
    # Split the model over this many devices (glm_engine/tensor_parallel.py): one worker process per extra rank, GPUs
    # device, device + 1, ... over NCCL on CUDA; on the CPU over gloo, the cores shared out between the ranks.
    tensor_parallel_size: int = 1

    @classmethod
    def from_parameters(cls, parameters: dict[str, str]) -> "EngineConfig":
        """Build from string key/values (config.pbtxt parameters); unknown keys are an error, not ignored."""
        types = typing.get_type_hints(cls)
        values = {}
        for key, text in parameters.items():
            if key not in types:
                raise ValueError(f"unknown engine parameter {key!r}; known: {', '.join(sorted(types))}")
            kind = types[key]
            try:
                values[key] = parse_bool(text) if kind is bool else kind(text)
            except ValueError:
                raise ValueError(f"engine parameter {key!r} must be {kind.__name__}, got {text!r}") from None
        config = cls(**values)
        config.validate()
        return config

    def model_len_limit(self, model: ModelConfig) -> int:
        """The longest prompt plus output: max_model_len, within the checkpoint's max_position_embeddings."""
        return min(self.max_model_len or model.max_position_embeddings, model.max_position_embeddings)

    def validate(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "default_max_tokens", "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("num_kv_blocks", "max_model_len", "cuda_graph_max_batch", "max_waiting_requests",
                     "max_waiting_tokens", "max_queue_time_s", "cancellation_check_period_ms"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative, got {getattr(self, name)}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must lie in (0, 1], got {self.gpu_memory_utilization}")
        if self.attention_backend not in ("auto", "torch", "triton", "cpu"):
            raise ValueError(f"attention_backend must be auto, torch, triton or cpu, got {self.attention_backend!r}")
        if self.layer_backend not in ("auto", "torch", "cpu"):
            raise ValueError(f"layer_backend must be auto, torch or cpu, got {self.layer_backend!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if not 0 <= self.response_thread_nice <= 19:
            raise ValueError(f"response_thread_nice must lie in [0, 19], got {self.response_thread_nice}")
        if self.inter_token_latency_metric not in INTER_TOKEN_LATENCY_METRICS:
            raise ValueError(f"inter_token_latency_metric must be {' or '.join(INTER_TOKEN_LATENCY_METRICS)}, got "
                             f"{self.inter_token_latency_metric!r}")
        if self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization must be {', '.join(QUANTIZATION_METHODS)}, got {self.quantization!r}")


def parse_bool(value) -> bool:
    """true/false, 1/0, yes/no or on/off in any case; a value that is not a string (JSON's true, 1) as Python sees it.
    Engine parameters and request values (vLLM-style JSON) both go through here."""
    if not isinstance(value, str):
        return bool(value)
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(value)
