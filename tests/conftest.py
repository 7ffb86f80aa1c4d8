"""Shared fixtures: tiny checkpoints made by transformers, the demo checkpoint, and a real tritonserver."""

from __future__ import annotations

import os
import socket
import sys
import time

# Triton-language kernels run on the CPU through Triton's interpreter in tests. Triton reads this when it is
# imported and when a kernel runs, so it is set for the whole session, before anything imports triton.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import requests  # noqa: E402
import torch  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # clients/
sys.path.insert(0, os.path.join(REPO, "backends", "python_glm"))
sys.path.insert(0, os.path.join(REPO, "scripts"))

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


@pytest.fixture(scope="session", params=["glm", "glm4"])
def tiny_model(request, tmp_path_factory):
    """(checkpoint directory, transformers reference model) for GLM and for GLM-4."""
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp(request.param)), request.param)


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory) -> str:
    from make_demo_model import build_demo_model

    return build_demo_model(str(tmp_path_factory.mktemp("glm-demo")))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def triton_server(demo_model_dir, tmp_path_factory):
    """The real tritonserver on free ports, serving the demo checkpoint, for the whole session."""
    from triton_server import TritonServer

    log_path = str(tmp_path_factory.mktemp("triton") / "tritonserver.log")
    server = TritonServer(free_port(), free_port(), free_port(), model_dir=demo_model_dir, log_path=log_path,
                          extra_env={"OMP_NUM_THREADS": "2"})
    server.start()
    try:
        server.wait_ready()
    except Exception:
        server.stop()
        with open(log_path) as f:
            sys.stderr.write(f.read()[-5000:])
        raise
    yield server
    server.stop()


# -- reading the server's metrics ----------------------------------------------------------------------------
def metrics(server) -> dict[str, float]:
    """The server's Prometheus samples, e.g. 'glm_kv_blocks_used{model="glm",version="1"}' -> value."""
    text = requests.get(f"http://localhost:{server.metrics_port}/metrics", timeout=10).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def metric(samples: dict[str, float], name: str, **labels) -> float:
    label_text = ",".join(f'{k}="{v}"' for k, v in {"finish_reason": labels.get("finish_reason")}.items() if v)
    matches = [value for key, value in samples.items()
               if key.split("{")[0] == name and label_text in key and 'model="glm"' in key]
    assert len(matches) == 1, (name, labels, matches)
    return matches[0]


def wait_for(condition, timeout=15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.2)
    return False
