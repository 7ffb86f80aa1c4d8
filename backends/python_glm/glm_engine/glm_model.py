"""The GLM / GLM-4 forward pass over a flat batch of tokens, reading and writing the paged KV cache.

Parameter names match Hugging Face's, so a checkpoint loads with `load_state_dict`; load_weights() then fuses
each layer's q/k/v projections and, on the CPU, hands float Linear weights to oneDNN in its own layout. With
quantization (int8, fp8) the projections of every layer are QuantizedLinear layers, whose 8-bit weights and scales
the checkpoint reader makes (glm_engine/checkpoint.py); embeddings, norms and the LM head stay in the model's dtype.
With tensor parallelism each rank builds its part of the model (glm_engine/tensor_parallel.py: its heads, MLP
channels and vocabulary slice) and adds the parts up where the Shard's collectives say.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import cpu_elementwise_kernel, cpu_linear_kernel
from .attention import AttentionMetadata, paged_attention, write_kv
from .config import CheckpointError, ModelConfig
from .quantization import QuantizedLinear, quantize_weight
from .tensor_parallel import Shard


class RMSNorm(nn.Module):
    """RMSNorm, optionally with the residual addition before it: norm(x), or with `residual` the pair
    (norm(x + residual), x + residual), the sum being the residual stream's next value (one pass in the C kernel)."""

    c_kernel = False  # set at load where the layers run the CPU's C kernels (cpu_elementwise_kernel.py)

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.c_kernel:
            out, total = cpu_elementwise_kernel.rms_norm(x, self.weight, self.eps, residual)
            return out if residual is None else (out, total)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Computed in float32 whatever the weights' dtype, as the reference does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Linear(nn.Linear):
    """nn.Linear, with its parameter names (so checkpoints load), whose weight may be packed for a CPU kernel.

    pack_for_cpu() reorders the weight once into the layout of the kernel that will run it: this package's C kernel
    (cpu_linear_kernel.py: panels read front to back) or oneDNN's blocked layout (the prepacking that
    torch.compile's CPU backend does). Both beat MKL's sgemm on nn.Linear's layout at every row count, and the C
    kernel beats oneDNN at decode sizes (docs/performance.md). cuBLAS needs no such help."""

    packed_weight: torch.Tensor | None = None
    kernel: str | None = None  # "cpu" or "onednn" once packed

    def pack_for_cpu(self, kernel: str) -> None:
        if kernel == "cpu":
            self.packed_weight = cpu_linear_kernel.pack_weight(self.weight)
        else:
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach())
        self.kernel = kernel
        self.weight = None  # the packed copy replaces it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [tokens, in_features], as everywhere in this model."""
        if self.kernel == "cpu":
            return cpu_linear_kernel.linear(x, self.packed_weight, self.bias, self.out_features)
        if self.kernel == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        return super().forward(x)


def make_linear(in_features: int, out_features: int, bias: bool, quantization: str) -> nn.Module:
    """A projection of a decoder layer: float (Linear) or 8-bit (QuantizedLinear)."""
    if quantization == "none":
        return Linear(in_features, out_features, bias=bias)
    return QuantizedLinear(in_features, out_features, bias, quantization)


def concatenate_linears(parts: list[nn.Module]) -> nn.Module:
    """One layer computing the parts' outputs side by side: their tensors stacked along the output dimension.
    Per-channel scales stack with their rows, so quantizing before or after fusing gives the same layer."""
    first = parts[0]
    quantization = first.method if isinstance(first, QuantizedLinear) else "none"
    with torch.device("meta"):  # no memory for initial tensors: they are replaced at once
        fused = make_linear(first.in_features, sum(p.out_features for p in parts), first.bias is not None,
                            quantization)
    for name, _ in first.named_parameters(recurse=False):
        setattr(fused, name, nn.Parameter(torch.cat([getattr(p, name) for p in parts]), requires_grad=False))
    for name, _ in first.named_buffers(recurse=False):
        setattr(fused, name, torch.cat([getattr(p, name) for p in parts]))
    return fused


def can_pack_for_cpu(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs weights of this dtype on this CPU: float32 wherever torch has oneDNN; bfloat16 and
    float16 only with the instructions for them (oneDNN raises otherwise), else nn.Linear's path is kept."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype))
    except (RuntimeError, AttributeError):
        return False
    return True


class RotaryEmbedding:
    """Rotary embedding over the first `rotary_dim` channels of each head, on interleaved pairs (GPT-J style)."""

    def __init__(self, config: ModelConfig):
        dim = config.rotary_dim
        # Explicitly on the CPU: the model may be built on the meta device; moved on first use.
        arange = torch.arange(0, dim, 2, dtype=torch.float, device="cpu")
        self.inv_freq = 1.0 / (config.rope_theta ** (arange / dim))
        self.rotary_dim = dim

    def angles(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of positions [tokens], as [tokens, 1, rotary_dim / 2]: once a step, for every layer."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        return freqs.cos().to(dtype)[:, None, :], freqs.sin().to(dtype)[:, None, :]

    def rotate(self, x: torch.Tensor, angles: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x: [tokens, heads, head_dim]."""
        cos, sin = angles
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim:]
        even, odd = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
        return torch.cat((rotated, rest), dim=-1)


class Attention(nn.Module):
    c_kernel = False  # set at load where the layers run the CPU's C kernels: rotary and the KV store in one pass

    def __init__(self, config: ModelConfig, quantization: str, shard: Shard):
        super().__init__()
        self.num_heads, self.num_kv_heads = shard.num_heads(config), shard.num_kv_heads(config)
        self.head_dim, self.shard = config.head_dim, shard
        hidden, bias = config.hidden_size, config.attention_bias
        # Loaded under Hugging Face's names, then fused by fuse_qkv().
        self.q_proj = make_linear(hidden, self.num_heads * self.head_dim, bias, quantization)
        self.k_proj = make_linear(hidden, self.num_kv_heads * self.head_dim, bias, quantization)
        self.v_proj = make_linear(hidden, self.num_kv_heads * self.head_dim, bias, quantization)
        self.o_proj = make_linear(self.num_heads * self.head_dim, hidden, False, quantization)
        self.scale = self.head_dim ** -0.5

    def fuse_qkv(self) -> None:
        """Stack the q, k and v projections: one matmul a layer instead of three, and queries and keys rotated
        together."""
        self.qkv_proj = concatenate_linears([self.q_proj, self.k_proj, self.v_proj])
        del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x, rotary: RotaryEmbedding, angles, kv_cache, meta: AttentionMetadata):
        tokens, heads, kv_heads = x.shape[0], self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(tokens, heads + 2 * kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        if self.c_kernel:  # qkv is this call's own: rotated in place
            cpu_elementwise_kernel.rotary_and_store_kv(qkv, heads, rotary.rotary_dim, angles, meta.slot_mapping,
                                                       k_cache, v_cache)
            q = qkv[:, :heads]
        else:
            q, k = rotary.rotate(qkv[:, :heads + kv_heads], angles).split([heads, kv_heads], dim=1)
            write_kv(k_cache, v_cache, k, qkv[:, heads + kv_heads:], meta.slot_mapping)
        out = paged_attention(q, k_cache, v_cache, meta, self.scale)
        return self.shard.all_reduce(self.o_proj(out.reshape(tokens, heads * self.head_dim)))


class MLP(nn.Module):
    c_kernel = False  # set at load where the layers run the CPU's C kernels: SiLU * up in one pass

    def __init__(self, config: ModelConfig, quantization: str, shard: Shard):
        super().__init__()
        intermediate = shard.intermediate_size(config)
        self.gate_up_proj = make_linear(config.hidden_size, 2 * intermediate, False, quantization)
        self.down_proj = make_linear(intermediate, config.hidden_size, False, quantization)
        self.shard = shard

    def forward(self, x):
        gate_up = self.gate_up_proj(x)
        if self.c_kernel:
            activated = cpu_elementwise_kernel.silu_and_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            activated = up * F.silu(gate)
        return self.shard.all_reduce(self.down_proj(activated))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, quantization: str, shard: Shard):
        super().__init__()
        self.self_attn = Attention(config, quantization, shard)
        self.mlp = MLP(config, quantization, shard)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.sandwich = config.has_sandwich_norms
        if self.sandwich:
            self.post_self_attn_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.post_mlp_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h, residual, rotary, angles, kv_cache, meta):
        """h: what the layer before added to the residual stream (the first layer: the embeddings, residual None).
        Returns this layer's (h, residual): each addition to the stream is made by the norm that follows it."""
        if residual is None:
            x, residual = self.input_layernorm(h), h
        else:
            x, residual = self.input_layernorm(h, residual)
        h = self.self_attn(x, rotary, angles, kv_cache, meta)
        if self.sandwich:
            h = self.post_self_attn_layernorm(h)
        x, residual = self.post_attention_layernorm(h, residual)
        h = self.mlp(x)
        if self.sandwich:
            h = self.post_mlp_layernorm(h)
        return h, residual


class VocabEmbedding(nn.Embedding):
    """nn.Embedding over this rank's slice of the vocabulary: rows first_token ..; a token outside it gives zeros,
    and the all-reduce adds the row of the rank that holds it."""

    def __init__(self, config: ModelConfig, shard: Shard):
        super().__init__(shard.vocab_rows(config), config.hidden_size)
        self.shard, self.first_token = shard, shard.first_token(config)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.shard.world_size == 1:
            return super().forward(input_ids)
        local = input_ids - self.first_token
        outside = (local < 0) | (local >= self.num_embeddings)
        x = super().forward(local.masked_fill(outside, 0)).masked_fill_(outside[:, None], 0)
        return self.shard.all_reduce(x)


class Backbone(nn.Module):
    def __init__(self, config: ModelConfig, quantization: str, shard: Shard):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config, shard)
        self.layers = nn.ModuleList(DecoderLayer(config, quantization, shard) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class GlmForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, quantization: str = "none", shard: Shard = Shard(),
                 quantize_lm_head: bool = False):
        """quantization: none, int8 or fp8 (glm_engine/quantization.py) for the decoder layers' projections, and for
        the LM head too with quantize_lm_head. shard: the part of the model this rank holds (tensor parallelism); by
        default the whole."""
        super().__init__()
        self.config, self.shard = config, shard
        self.model = Backbone(config, quantization, shard)
        self.rotary = RotaryEmbedding(config)
        self.lm_head = make_linear(config.hidden_size, shard.vocab_rows(config), False,
                                   quantization if quantize_lm_head else "none")

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [tokens]; kv_caches: one (k, v) pair per layer. Returns hidden states [tokens, hidden]."""
        h, residual = self.model.embed_tokens(input_ids), None
        angles = self.rotary.angles(positions, h.dtype)
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            h, residual = layer(h, residual, self.rotary, angles, kv_cache, meta)
        return self.model.norm(h, residual)[0]  # every model has a layer: residual is set

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """float32 logits [rows, vocab]; with tensor parallelism on rank 0 only (None on the others)."""
        return self.shard.gather_vocab(self.lm_head(hidden).float(), self.config.vocab_size)

    def quantized_weight_names(self) -> set[str]:
        """The checkpoint tensors to store in 8 bits: the weights of the QuantizedLinear layers, by their Hugging
        Face names (before q/k/v are fused)."""
        return {f"{name}.weight" for name, module in self.named_modules() if isinstance(module, QuantizedLinear)}

    def load_weights(self, state: dict[str, torch.Tensor], cpu_kernels: str | None = None) -> None:
        """Load a checkpoint's tensors; on the CPU, `cpu_kernels` says what runs the layers: "cpu" (this package's C
        kernels: float Linear weights packed for cpu_linear_kernel; norms, SiLU * up, rotary and the KV store in
        cpu_elementwise_kernel) or "torch" (float Linear weights packed for oneDNN where it packs the dtype, else
        nn.Linear's path; torch operators). int8 weights are packed for the kernel that runs them with those
        (QuantizedLinear.pack_for_cpu)."""
        tied = self.config.tie_word_embeddings and "lm_head.weight" not in state
        if tied and isinstance(self.lm_head, QuantizedLinear):  # an 8-bit copy of the shared weight
            values, scales = quantize_weight(state["model.embed_tokens.weight"], self.lm_head.method)
            state = {**state, "lm_head.weight": values, "lm_head.weight_scale": scales}
        elif tied:
            state = {**state, "lm_head.weight": state["model.embed_tokens.weight"]}
        # Some exporters store the rotary frequencies; they are recomputed here.
        state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
        result = self.load_state_dict(state, strict=False, assign=True)
        if result.missing_keys or result.unexpected_keys:
            raise CheckpointError(
                f"weights do not match a {self.config.model_type} model: "
                f"missing {result.missing_keys[:8]}, unexpected {result.unexpected_keys[:8]}"
            )
        for layer in self.model.layers:
            layer.self_attn.fuse_qkv()
        if cpu_kernels:
            c_kernels = cpu_kernels == "cpu"
            floats = c_kernels or can_pack_for_cpu(self.model.embed_tokens.weight.dtype)
            for module in self.modules():
                tied_head = tied and module is self.lm_head  # shares the embedding's weight: packing would copy it
                if isinstance(module, QuantizedLinear):
                    module.pack_for_cpu(cpu_kernels)
                elif isinstance(module, Linear) and floats and not tied_head:
                    module.pack_for_cpu("cpu" if c_kernels else "onednn")
                elif isinstance(module, (RMSNorm, MLP, Attention)):
                    module.c_kernel = c_kernels
