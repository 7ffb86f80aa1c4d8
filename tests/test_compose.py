"""docker-compose.yml, checked as far as a machine without a Docker engine can: no container is started."""

from __future__ import annotations

import os
import shlex

import pytest
import yaml

from conftest import REPO

NGC_IMAGE = "nvcr.io/nvidia/tritonserver:24.10-py3"  # Triton 2.51, the release inside nvidia-pytriton 0.7.0


@pytest.fixture(scope="module")
def service():
    with open(os.path.join(REPO, "docker-compose.yml")) as f:
        return yaml.safe_load(f)["services"]["tritonserver"]


def test_image_gpu_and_ports(service):
    assert service["image"] == NGC_IMAGE
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    published = {mapping.rsplit(":", 1)[1] for mapping in service["ports"]}
    assert published == {"8000", "8001", "8002"}


def test_mounted_paths_exist_and_the_checkpoint_comes_from_the_environment(service):
    targets = {}
    for volume in service["volumes"]:
        # source:target[:mode], where the source may be "${VARIABLE:-default}", itself holding a colon.
        split_at = volume.index("}") + 1 if volume.startswith("${") else volume.index(":")
        source, target = volume[:split_at], volume[split_at + 1:].split(":")[0]
        targets[target] = source
        if source.startswith("${GLM_MODEL_DIR"):
            # Without GLM_MODEL_DIR the demo checkpoint that serve.sh / make_demo_model.py build is served.
            from make_demo_model import DEFAULT_OUT

            default = source.split(":-", 1)[1].rstrip("}")
            assert os.path.normpath(os.path.join(REPO, default)) == DEFAULT_OUT
        else:
            assert os.path.exists(os.path.join(REPO, source)), source
    assert targets["/opt/tritonserver/backends/python_glm"] == "./backends/python_glm"
    assert service["environment"]["GLM_MODEL_DIR"] in targets


def test_the_server_starts_through_the_shared_launcher(service):
    """The flags live in scripts/triton_server.py (server_args), used by serve.sh, the tests and compose alike."""
    command = shlex.split(service["command"][service["command"].index("python3"):].strip().rstrip('"'))
    assert command[1].endswith("scripts/triton_server.py")
    assert command[command.index("--installed-triton") + 1] == "/opt/tritonserver"
    repository = command[command.index("--model-repository") + 1]
    assert any(v.endswith(":" + repository + ":ro") for v in service["volumes"])
    requirements = [v for v in service["volumes"] if "requirements-gpu.txt" in v]
    assert requirements and "pip install" in service["command"]


def test_health_check_asks_for_readiness(service):
    assert "/v2/health/ready" in " ".join(service["healthcheck"]["test"])
