"""Tiny seeded GLM and GLM-4 checkpoints written by transformers, with the reference model that wrote them."""

from __future__ import annotations

import torch

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, pad_token_id=0, eos_token_id=[2], bos_token_id=1,
            # Random checkpoints have nearly flat logits at the default 0.02; at 0.25 the top-1/top-2 margins are
            # large enough that greedy choices cannot flip on float32 rounding.
            initializer_range=0.25, max_position_embeddings=512)


def make_tiny_checkpoint(directory: str, model_type: str, seed: int = 0) -> tuple[str, torch.nn.Module]:
    """Save a seeded random GLM or GLM-4 with transformers; return its directory and the reference model."""
    from transformers import Glm4Config, Glm4ForCausalLM, GlmConfig, GlmForCausalLM

    config_class, model_class = {"glm": (GlmConfig, GlmForCausalLM), "glm4": (Glm4Config, Glm4ForCausalLM)}[model_type]
    torch.manual_seed(seed)
    model = model_class(config_class(**TINY)).eval()
    model.save_pretrained(directory)
    return directory, model
