"""Train the demo GLM-4 on local text, so that it writes recognisable Python and some Chinese instead of noise.

    python scripts/train_demo_model.py [--out demo_checkpoint] [--steps 700] [--seed 0]

It builds the demo checkpoint's shape and tokenizer (glm_tools/demo_model.py), then trains it with transformers'
Glm4ForCausalLM (the reference implementation, so what is trained is exactly what the engine is tested against) on
the Python standard library's sources (their docstrings are its docs; more of them than the tokenizer was trained
on) and the Chinese sample. One file in HELD_OUT_EVERY, and the last tenth of the Chinese sample, are held out.
It prints the loss curve and the held-out perplexity and writes a Hugging Face checkpoint in float16 with
`training.json` (settings, loss curve, perplexity, time). The same seed, machine kind and thread count give the
same weights.
Needs transformers: `./scripts/setup_env.sh requirements-test.txt` installs it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer

from glm_tools.demo_model import TRAINED_CHECKPOINT, build_demo_model, corpus_files

HELD_OUT_EVERY = 20
# The model reads more of the standard library than the tokenizer was trained on (its first CORPUS_BYTES), so that
# a run of a few hundred steps sees most text once and the held-out files measure generalisation, not memory.
TRAINING_BYTES = 12_000_000
# The Chinese sample is small (about 700 bytes, which the tokenizer packs into about 40 tokens): repeated this often
# it is seen a few hundred times in a run, enough for a Chinese prompt to be continued in Chinese (mostly in the
# sample's own sentences: a 7M model learns it by heart).
CHINESE_TRAINING_WEIGHT = 400


def split_corpus(files: list[str]) -> tuple[list[str], list[str]]:
    """(training texts, held-out texts): whole stdlib files, one in HELD_OUT_EVERY held out; the Chinese sample
    (the first of `files`, and repeated there) split once: its first nine tenths for training, each line a text of
    its own (so that a prompt of one line's beginning is continued in Chinese), CHINESE_TRAINING_WEIGHT times."""
    chinese, sources = files[0], [f for f in files if f != files[0]]
    train, held_out = [], []
    for index, path in enumerate(sources):
        with open(path, encoding="utf-8", errors="replace") as f:
            (held_out if index % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 else train).append(f.read())
    with open(chinese, encoding="utf-8") as f:
        text = f.read()
    cut = text.rfind("。", 0, int(len(text) * 0.9)) + 1
    train += [line for line in text[:cut].splitlines() if line.strip()] * CHINESE_TRAINING_WEIGHT
    held_out.append(text[cut:])
    return train, held_out


def token_stream(tokenizer: Tokenizer, texts: list[str]) -> torch.Tensor:
    """All texts as one stream of token ids, each begun as the server begins a prompt (GLM-4's tokenizer puts
    [gMASK]<sop> first) and ended by <|endoftext|>: so the model learns what follows a prompt's start."""
    eos = tokenizer.token_to_id("<|endoftext|>")
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(texts):
        ids += encoding.ids + [eos]
    return torch.tensor(ids, dtype=torch.long)


@torch.no_grad()
def perplexity(model, stream: torch.Tensor, seq_len: int, batch_size: int = 16) -> float:
    """exp(mean next-token loss) over the stream cut into windows of seq_len + 1 tokens."""
    windows = stream[: (len(stream) - 1) // seq_len * seq_len + 1]
    inputs = windows[:-1].view(-1, seq_len)
    targets = windows[1:].view(-1, seq_len)
    total, count = 0.0, 0
    model.eval()
    for first in range(0, len(inputs), batch_size):
        logits = model(input_ids=inputs[first:first + batch_size]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets[first:first + batch_size].flatten(),
                                                 reduction="sum")
        total, count = total + loss.item(), count + targets[first:first + batch_size].numel()
    model.train()
    return math.exp(total / count)


def learning_rate(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def train(out_dir: str, steps: int, seed: int, seq_len: int, batch_size: int, peak_lr: float,
          training_bytes: int = TRAINING_BYTES) -> dict:
    from transformers import Glm4ForCausalLM

    started = time.time()
    torch.manual_seed(seed)
    build_demo_model(out_dir, seed=seed)  # config, tokenizer and the initial weights
    tokenizer = Tokenizer.from_file(os.path.join(out_dir, "tokenizer.json"))
    train_texts, held_out_texts = split_corpus(corpus_files(training_bytes))
    train_ids, held_out_ids = token_stream(tokenizer, train_texts), token_stream(tokenizer, held_out_texts)
    if len(held_out_ids) <= seq_len:
        raise SystemExit(f"[train] the held-out text ({len(held_out_ids)} tokens) is shorter than one window of "
                         f"{seq_len}: raise --training-bytes (one file in {HELD_OUT_EVERY} is held out)")
    print(f"[train] {len(train_ids):,} training tokens, {len(held_out_ids):,} held out; {steps} steps of "
          f"{batch_size} x {seq_len} tokens ({steps * batch_size * seq_len / len(train_ids):.1f} epochs), "
          f"{torch.get_num_threads()} threads", flush=True)

    model = Glm4ForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    model.train()
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    no_decay = [p for n, p in model.named_parameters() if p.dim() <= 1]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=peak_lr, betas=(0.9, 0.95))
    rng = np.random.default_rng(seed)
    initial = perplexity(model, held_out_ids, seq_len)
    print(f"[train] held-out perplexity before training: {initial:.1f}", flush=True)
    curve = []
    for step in range(steps):
        starts = torch.from_numpy(rng.integers(0, len(train_ids) - seq_len - 1, batch_size))
        batch = torch.stack([train_ids[s:s + seq_len + 1] for s in starts.tolist()])
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, steps, peak_lr, warmup=max(1, steps // 20))
        logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 25 == 0 or step == steps - 1:
            curve.append({"step": step, "loss": round(loss.item(), 4), "seconds": round(time.time() - started, 1)})
            print(f"[train] step {step:5d}  loss {loss.item():.3f}  {time.time() - started:6.0f}s", flush=True)
    held_out = perplexity(model, held_out_ids, seq_len)
    print(f"[train] held-out perplexity: {held_out:.2f} (before training {initial:.1f})", flush=True)

    weights = {name: tensor.detach().to(torch.float16).contiguous() for name, tensor in model.state_dict().items()}
    save_file(weights, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    config_path = os.path.join(out_dir, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    with open(config_path, "w") as f:
        json.dump({**config, "dtype": "float16"}, f, indent=2)
    report = {
        "seed": seed, "steps": steps, "batch_size": batch_size, "seq_len": seq_len, "peak_lr": peak_lr,
        "training_bytes": training_bytes,
        "threads": torch.get_num_threads(), "training_tokens": len(train_ids), "held_out_tokens": len(held_out_ids),
        "held_out_every": HELD_OUT_EVERY, "held_out_perplexity": round(held_out, 3),
        "held_out_perplexity_before": round(initial, 1), "seconds": round(time.time() - started, 1),
        "loss_curve": curve,
    }
    with open(os.path.join(out_dir, "training.json"), "w") as f:
        json.dump(report, f, indent=2)
    print(f"[train] {out_dir}: trained in {report['seconds']:.0f}s", flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=TRAINED_CHECKPOINT, help=f"output directory (default {TRAINED_CHECKPOINT})")
    parser.add_argument("--steps", type=int, default=700)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    parser.add_argument("--training-bytes", type=int, default=TRAINING_BYTES,
                        help="standard-library source to read, in bytes (the tests train on less)")
    args = parser.parse_args(argv)
    train(args.out, args.steps, args.seed, args.seq_len, args.batch_size, args.lr, args.training_bytes)
    return 0
