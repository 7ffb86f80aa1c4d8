"""docker-compose.yml, checked as far as a machine without a Docker engine can: no container is started."""

from __future__ import annotations

import json
import os
import re
import shlex

import pytest
import yaml

from support import REPO

from glm_tools.launcher import DRAIN_GRACE_S, EXIT_TIMEOUT_S

NGC_IMAGE = "nvcr.io/nvidia/tritonserver:24.10-py3"  # Triton 2.51, the release inside nvidia-pytriton 0.7.0


@pytest.fixture(scope="module")
def services():
    with open(os.path.join(REPO, "docker-compose.yml")) as f:
        return yaml.safe_load(f)["services"]


@pytest.fixture(scope="module")
def service(services):
    return services["tritonserver"]


def split_volume(volume: str) -> tuple[str, str]:
    """source:target[:mode] -> (source, target), where the source may be "${VARIABLE:-default}" (with a colon)."""
    split_at = volume.index("}") + 1 if volume.startswith("${") else volume.index(":")
    return volume[:split_at], volume[split_at + 1:].split(":")[0]


def load(path: str):
    with open(os.path.join(REPO, path)) as f:
        return json.load(f) if path.endswith(".json") else yaml.safe_load(f)


def test_image_gpu_and_ports(service):
    assert service["image"] == NGC_IMAGE
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    published = {mapping.rsplit(":", 1)[1] for mapping in service["ports"]}
    assert published == {"8000", "8001", "8002"}


def test_mounted_paths_exist_and_the_checkpoint_comes_from_the_environment(service):
    targets = {}
    for volume in service["volumes"]:
        source, target = split_volume(volume)
        targets[target] = source
        if source.startswith("${"):
            # Without GLM_MODEL_DIR the demo checkpoint that serve.sh / make_demo_model.py build is served; without
            # GLM_CHECKPOINTS, new versions' checkpoints are looked for beside it.
            from glm_tools.demo_model import DEFAULT_OUT

            variable, default = source[2:].rstrip("}").split(":-", 1)
            expected = {"GLM_MODEL_DIR": DEFAULT_OUT, "GLM_CHECKPOINTS": os.path.dirname(DEFAULT_OUT)}[variable]
            assert os.path.normpath(os.path.join(REPO, default)) == expected
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
    assert any(v.endswith(":" + repository) for v in service["volumes"])  # writable, for glm_versions.py
    requirements = [v for v in service["volumes"] if "requirements-gpu.txt" in v]
    assert requirements and "pip install" in service["command"]


def test_health_check_asks_for_readiness(service):
    assert "/v2/health/ready" in " ".join(service["healthcheck"]["test"])


def test_the_launcher_gets_sigterm_and_time_to_drain_and_compose_restarts_it(service):
    """`exec`: the launcher, not bash, is the container's main process, so `docker compose stop` reaches it."""
    assert "exec python3 /workspace/scripts/triton_server.py" in " ".join(service["command"].split())
    assert "--host 0.0.0.0" in service["command"]  # the launcher listens on 127.0.0.1 unless told otherwise
    grace = int(service["stop_grace_period"].rstrip("s"))
    assert grace > DRAIN_GRACE_S + EXIT_TIMEOUT_S + 5
    assert service["restart"] in ("always", "unless-stopped", "on-failure")


def test_every_other_service_is_in_a_profile_and_mounts_existing_paths(services):
    assert set(services) == {"tritonserver", "openai", "locust-master", "locust-worker", "prometheus", "grafana"}
    for name, definition in services.items():
        if name not in ("tritonserver", "openai"):  # `docker compose up` alone starts the server and its OpenAI API
            assert definition["profiles"] in (["loadtest"], ["monitoring"]), name
        for volume in definition.get("volumes", []):
            source = split_volume(volume)[0]
            if not source.startswith("${"):
                assert os.path.exists(os.path.join(REPO, source)), (name, source)


def test_the_openai_front_is_a_service_of_its_own_in_front_of_the_server(services, service):
    front = services["openai"]
    command = " ".join(front["command"].split())
    assert "pip install --quiet -r /app/clients/requirements.txt" in command
    assert "exec python -m openai_front --triton tritonserver:8001 --model-dir /models/glm --host 0.0.0.0" in command
    mounts = dict(reversed(split_volume(v)) for v in front["volumes"])
    assert mounts["/app/openai_front"] == "./openai_front" and mounts["/app/clients"] == "./clients"
    # The same checkpoint as the server's, for the chat template.
    assert split_volume(next(v for v in service["volumes"] if v.endswith(":/models/glm:ro")))[0] == \
        mounts["/models/glm"]
    assert [port.rsplit(":", 1)[1] for port in front["ports"]] == ["9000"]
    assert front["depends_on"]["tritonserver"]["condition"] == "service_healthy"
    assert "--openai-port 0" in service["command"]  # the launcher's own front is off: one front, this one


def test_locust_runs_the_repositorys_locustfile_against_the_server(services):
    with open(os.path.join(REPO, "requirements-loadtest.txt")) as f:
        locust_pin = re.search(r"^locust==(\S+)", f.read(), re.M).group(1)
    master, worker = services["locust-master"], services["locust-worker"]
    for definition in (master, worker):
        assert definition["image"] == f"locustio/locust:{locust_pin}"  # the Locust the tests use
        command = definition["command"].split()
        locustfile = command[command.index("-f") + 1]
        mounts = dict(reversed(split_volume(v)) for v in definition["volumes"])
        mounted_dir = os.path.dirname(locustfile)
        assert os.path.isfile(os.path.join(REPO, mounts[mounted_dir], os.path.basename(locustfile)))
        assert "clients/requirements.txt" in " ".join(definition["entrypoint"])  # for GrpcStreamUser
    command = master["command"].split()
    assert command[command.index("--host") + 1] == "http://tritonserver:8000"
    assert command[command.index("--grpc-url") + 1] == "tritonserver:8001"
    assert master["depends_on"]["tritonserver"]["condition"] == "service_healthy"
    assert "--worker" in worker["command"] and "locust-master" in worker["command"]


def test_prometheus_scrapes_the_metrics_port_and_grafana_reads_prometheus(services, service):
    metrics_port = next(m.rsplit(":", 1)[1] for m in service["ports"] if "METRICS_PORT" in m)
    mounts = dict(reversed(split_volume(v)) for v in services["prometheus"]["volumes"])
    config = load(mounts["/etc/prometheus/prometheus.yml"])
    targets = [t for job in config["scrape_configs"] for c in job["static_configs"] for t in c["targets"]]
    assert targets == [f"tritonserver:{metrics_port}"]
    datasource, = load("monitoring/grafana/provisioning/datasources/prometheus.yml")["datasources"]
    assert datasource["url"] == "http://prometheus:9090" and datasource["uid"] == "prometheus"
    provider, = load("monitoring/grafana/provisioning/dashboards/glm.yml")["providers"]
    grafana_mounts = dict(reversed(split_volume(v)) for v in services["grafana"]["volumes"])
    assert os.path.isfile(os.path.join(REPO, grafana_mounts[provider["options"]["path"]], "glm.json"))


@pytest.mark.integration
def test_every_dashboard_metric_is_one_the_server_publishes(triton_server):
    """Each metric the Grafana dashboard queries is in the real server's /metrics (after one request)."""
    import requests

    requests.post(f"http://{triton_server.http_url}/v2/models/ensemble/generate",
                  json={"text_input": "dashboard", "max_tokens": 4}, timeout=60)
    published = set(re.findall(r"^# TYPE (\S+)", requests.get(
        f"http://localhost:{triton_server.metrics_port}/metrics", timeout=10).text, re.M))
    dashboard = load("monitoring/grafana/dashboards/glm.json")
    queried = {name for panel in dashboard["panels"] for target in panel["targets"]
               for name in re.findall(r"\b((?:glm|nv)_[a-z_]+)", target["expr"])}
    assert len(queried) >= 12
    for name in queried:
        assert re.sub(r"_bucket$", "", name) in published, name
