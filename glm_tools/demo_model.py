"""The demo GLM-4 checkpoint in Hugging Face format: the trained one this repository ships, or random weights.

By default, copies the trained demo model (demo_checkpoint/, made by scripts/train_demo_model.py) to --out.
With --random, builds one deterministically from a seed: config.json, generation_config.json, model.safetensors
(random weights), and a byte-level BPE tokenizer.json / tokenizer_config.json trained with `tokenizers` on text
found on this machine (the Python standard library's sources) plus a little Chinese text in glm_tools/demo_corpus/.
The tests build random ones (build_demo_model) for their own checks. Needs torch, tokenizers and safetensors, and
the clients package for GLM-4's chat template: what scripts/setup_env.sh installs.

    python scripts/make_demo_model.py [--out checkpoints/glm-demo] [--random [--seed 0] [--tokenizer-from DIR]]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sysconfig
import time

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from clients.chat import GLM4_CHAT_TEMPLATE
from glm_tools.launcher import DEMO_CHECKPOINT

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = DEMO_CHECKPOINT
# The trained demo model, shipped in the repository (its weights in float16: 14 MB).
TRAINED_CHECKPOINT = os.path.join(os.path.dirname(HERE), "demo_checkpoint")
CHECKPOINT_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                    "model.safetensors", "training.json")
SPECIAL_TOKENS = ["<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>",
                  "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]
# Small enough to run quickly on two CPU cores, shaped like GLM-4 (grouped-query attention, partial rotary).
ARCHITECTURE = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                    num_key_value_heads=2, head_dim=32, max_position_embeddings=4096)
CORPUS_BYTES = 3_000_000
# The Chinese sample is small; it is repeated so that Chinese characters and their UTF-8 byte pieces earn a share of
# the vocabulary, and a random model's answers contain characters split across tokens (what streaming must handle).
CHINESE_WEIGHT = 40

# The benchmarks' bigger model (scripts/bench_engine.py, scripts/bench_rollout.py): about 30M parameters.
BENCH_ARCHITECTURE = dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8,
                          num_key_value_heads=2, head_dim=64)


def corpus_files(max_bytes: int = CORPUS_BYTES) -> list[str]:
    """Deterministic list of local text: the stdlib's .py files in sorted order, up to max_bytes, plus ours (the
    Chinese sample first, CHINESE_WEIGHT times)."""
    stdlib = sysconfig.get_paths()["stdlib"]
    files, total = [os.path.join(HERE, "demo_corpus", "zh.txt")] * CHINESE_WEIGHT, 0
    for root, dirs, names in os.walk(stdlib):
        dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "test", "tests", "__pycache__"))
        for name in sorted(names):
            if name.endswith(".py") and total < max_bytes:
                path = os.path.join(root, name)
                files.append(path)
                total += os.path.getsize(path)
    return files


def train_tokenizer(vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train(corpus_files(), trainer)
    ids = {token: tokenizer.token_to_id(token) for token in ("[gMASK]", "<sop>")}
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[gMASK] <sop> $A", pair="[gMASK] <sop> $A $B", special_tokens=list(ids.items()))
    return tokenizer


def random_weights(config: dict, seed: int, std: float) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    h, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q_dim = config["num_attention_heads"] * config["head_dim"]
    kv_dim = config["num_key_value_heads"] * config["head_dim"]

    def normal(*shape):
        return torch.randn(*shape, generator=generator) * std

    weights = {"model.embed_tokens.weight": normal(vocab, h), "model.norm.weight": torch.ones(h),
               "lm_head.weight": normal(vocab, h)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights |= {
            p + "self_attn.q_proj.weight": normal(q_dim, h), p + "self_attn.q_proj.bias": normal(q_dim),
            p + "self_attn.k_proj.weight": normal(kv_dim, h), p + "self_attn.k_proj.bias": normal(kv_dim),
            p + "self_attn.v_proj.weight": normal(kv_dim, h), p + "self_attn.v_proj.bias": normal(kv_dim),
            p + "self_attn.o_proj.weight": normal(h, q_dim),
            p + "mlp.gate_up_proj.weight": normal(2 * inter, h), p + "mlp.down_proj.weight": normal(h, inter),
        }
        for norm in ("input_layernorm", "post_attention_layernorm", "post_self_attn_layernorm", "post_mlp_layernorm"):
            weights[p + norm + ".weight"] = torch.ones(h)
    return weights


def build_demo_model(out_dir: str, seed: int = 0, vocab_size: int = 8192, init_std: float = 0.05,
                     architecture: dict | None = None, tokenizer_from: str | None = None) -> str:
    """Write the checkpoint to `out_dir`; `architecture` overrides ARCHITECTURE's sizes (the benchmark's model);
    `tokenizer_from`: a checkpoint whose tokenizer.json to take instead of training one (a new version of a served
    model keeps its tokenizer: docs/versions.md)."""
    started = time.time()
    os.makedirs(out_dir, exist_ok=True)
    if tokenizer_from:
        print(f"[demo model] tokenizer from {tokenizer_from}", flush=True)
        shutil.copyfile(os.path.join(tokenizer_from, "tokenizer.json"), os.path.join(out_dir, "tokenizer.json"))
        tokenizer = Tokenizer.from_file(os.path.join(out_dir, "tokenizer.json"))
    else:
        print(f"[demo model] training a {vocab_size}-token byte-level BPE tokenizer on local text...", flush=True)
        tokenizer = train_tokenizer(vocab_size)
        tokenizer.save(os.path.join(out_dir, "tokenizer.json"))
    tid = tokenizer.token_to_id
    eos_ids = [tid("<|endoftext|>"), tid("<|user|>"), tid("<|observation|>")]

    config = {
        "architectures": ["Glm4ForCausalLM"], "model_type": "glm4", "vocab_size": tokenizer.get_vocab_size(),
        **ARCHITECTURE, **(architecture or {}), "hidden_act": "silu", "attention_bias": True, "attention_dropout": 0.0,
        "rms_norm_eps": 1.5625e-07, "initializer_range": init_std, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        "pad_token_id": tid("<|endoftext|>"), "eos_token_id": eos_ids, "dtype": "float32",
    }
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": eos_ids, "pad_token_id": config["pad_token_id"]}, f, indent=2)
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": GLM4_CHAT_TEMPLATE,
                   "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
                   "additional_special_tokens": SPECIAL_TOKENS[1:]}, f, indent=2)

    print(f"[demo model] writing random weights (seed {seed})...", flush=True)
    weights = random_weights(config, seed, init_std)
    save_file(weights, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    params = sum(t.numel() for t in weights.values())
    print(f"[demo model] {out_dir}: GLM-4, {params / 1e6:.1f}M parameters, built in {time.time() - started:.1f}s",
          flush=True)
    return out_dir


def copy_trained_demo_model(out_dir: str) -> str:
    """Copy the shipped trained demo model to out_dir (the checkpoint serve.sh serves)."""
    os.makedirs(out_dir, exist_ok=True)
    for name in CHECKPOINT_FILES:
        shutil.copyfile(os.path.join(TRAINED_CHECKPOINT, name), os.path.join(out_dir, name))
    with open(os.path.join(TRAINED_CHECKPOINT, "training.json")) as f:
        training = json.load(f)
    print(f"[demo model] {out_dir}: the trained demo GLM-4 ({training['steps']} steps, held-out perplexity "
          f"{training['held_out_perplexity']:.1f}; scripts/train_demo_model.py reproduces it)", flush=True)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})")
    parser.add_argument("--random", action="store_true", help="random weights from --seed instead of the trained "
                                                              "model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer-from", metavar="DIR",
                        help="with --random: take this checkpoint's tokenizer instead of training one (another "
                             "version of it)")
    args = parser.parse_args(argv)
    if not args.random and (args.seed or args.tokenizer_from):
        parser.error("--seed and --tokenizer-from build random weights: add --random")
    if args.random:
        build_demo_model(args.out, args.seed, tokenizer_from=args.tokenizer_from)
    else:
        copy_trained_demo_model(args.out)
    return 0
