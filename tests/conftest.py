"""Fixtures: tiny checkpoints made by transformers, the demo checkpoint, and a real tritonserver.
The helpers behind them live in tests/support/."""

from __future__ import annotations

import os

# Triton-language kernels run on the CPU through Triton's interpreter in tests. Triton reads this when it is
# imported and when a kernel runs, so it is set for the whole session, before anything imports triton. It stays
# in this process: the launcher keeps it from the servers the tests start.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
from support.checkpoints import make_tiny_checkpoint  # noqa: E402
from support.server import running_openai_front, running_server  # noqa: E402

from glm_tools.demo_model import build_demo_model  # noqa: E402


@pytest.fixture(scope="session", params=["glm", "glm4"])
def tiny_model(request, tmp_path_factory):
    """(checkpoint directory, transformers reference model) for GLM and for GLM-4."""
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp(request.param)), request.param)


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory) -> str:
    return build_demo_model(str(tmp_path_factory.mktemp("glm-demo")))


@pytest.fixture(scope="session")
def triton_server(demo_model_dir, tmp_path_factory):
    """The real tritonserver on free ports, serving the demo checkpoint, for the whole session. After its stop, no
    model's process may have aborted on its way out (vllm_model's did after every session: bls_calls.release_kept)."""
    with running_server(demo_model_dir, str(tmp_path_factory.mktemp("triton"))) as server:
        yield server
    with open(server.log_path) as f:
        log = f.read()
    assert "terminate called" not in log, log[-3000:]


@pytest.fixture(scope="session")
def openai_front(triton_server, demo_model_dir):
    """The OpenAI-compatible front in front of triton_server (its key: support.server.OPENAI_API_KEY)."""
    with running_openai_front(triton_server, demo_model_dir) as url:
        yield url
