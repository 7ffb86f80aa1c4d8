"""Tiny seeded GLM and GLM-4 checkpoints written by transformers, with the reference model that wrote them."""

from __future__ import annotations

import torch

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, pad_token_id=0, eos_token_id=[2], bos_token_id=1,
            # Random checkpoints have nearly flat logits at the default 0.02; at 0.25 the top-1/top-2 margins are
            # large enough that greedy choices cannot flip on float32 rounding.
            initializer_range=0.25, max_position_embeddings=512)


def make_tiny_checkpoint(directory: str, model_type: str, seed: int = 0, **overrides) -> tuple[str, torch.nn.Module]:
    """Save a seeded random GLM or GLM-4 with transformers (TINY's settings, with `overrides`); return its directory
    and the reference model."""
    from transformers import Glm4Config, Glm4ForCausalLM, GlmConfig, GlmForCausalLM

    config_class, model_class = {"glm": (GlmConfig, GlmForCausalLM), "glm4": (Glm4Config, Glm4ForCausalLM)}[model_type]
    torch.manual_seed(seed)
    model = model_class(config_class(**{**TINY, **overrides})).eval()
    model.save_pretrained(directory)
    return directory, model


def make_tool_calling_checkpoint(directory: str, demo_dir: str, call: str = 'get_weather\n{"days": 3}') -> str:
    """A stub of a model that calls a tool, for the OpenAI front's tests: the demo checkpoint's tokenizer and shape,
    with weights that make it a bigram model answering every `<|assistant|>` turn with `call` (GLM-4's form of a
    function call: name, newline, JSON arguments) and then `<|observation|>`, one of its end tokens.

    Every layer's output projections (o_proj, down_proj) are zero, so the last hidden state is the current token's
    embedding; each token of the chain gets a direction of its own, and the LM head row of its successor that
    direction, so greedy decoding follows the chain with a logit margin of about 30."""
    import json
    import os
    import shutil

    from safetensors.torch import load_file, save_file
    from tokenizers import Tokenizer

    os.makedirs(directory, exist_ok=True)
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(os.path.join(demo_dir, name), os.path.join(directory, name))
    tokenizer = Tokenizer.from_file(os.path.join(demo_dir, "tokenizer.json"))
    chain = [tokenizer.token_to_id("<|assistant|>"), *tokenizer.encode(call, add_special_tokens=False).ids,
             tokenizer.token_to_id("<|observation|>")]
    if len(set(chain[:-1])) != len(chain) - 1:
        raise ValueError(f"a bigram model needs each token of {call!r} once: {chain}")
    with open(os.path.join(demo_dir, "config.json")) as f:
        hidden = json.load(f)["hidden_size"]
    weights = load_file(os.path.join(demo_dir, "model.safetensors"))
    for name, tensor in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor.zero_()
    generator = torch.Generator().manual_seed(0)
    directions = torch.randn(len(chain) - 1, hidden, generator=generator)
    directions *= hidden ** 0.5 / directions.norm(dim=1, keepdim=True)  # RMS 1: the final norm leaves them as they are
    weights["lm_head.weight"] *= 0.01
    for direction, token, successor in zip(directions, chain, chain[1:]):
        weights["model.embed_tokens.weight"][token] = direction
        weights["lm_head.weight"][successor] += direction * (30.0 / hidden)
    save_file(weights, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    return directory
