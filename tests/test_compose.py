"""docker-compose.yml, checked as far as a machine without a Docker engine can: no container is started."""

from __future__ import annotations

import json
import os
import re

import pytest
import yaml

from support import REPO
from support.server import published_metric_names

from glm_tools.launcher import DRAIN_GRACE_S, EXIT_TIMEOUT_S


@pytest.fixture(scope="module")
def services():
    with open(os.path.join(REPO, "docker-compose.yml")) as f:
        return yaml.safe_load(f)["services"]


@pytest.fixture(scope="module")
def service(services):
    return services["tritonserver"]


def dockerfile_instruction(name: str) -> list[str]:
    """The exec-form (JSON) arguments of the Dockerfile's instruction `name`."""
    with open(os.path.join(REPO, "Dockerfile")) as f:
        lines = [line for line in f if line.startswith(name + " ")]
    assert len(lines) == 1, name
    return json.loads(lines[0][len(name) + 1:])


def split_volume(volume: str) -> tuple[str, str]:
    """source:target[:mode] -> (source, target), where the source may be "${VARIABLE:-default}" (with a colon)."""
    split_at = volume.index("}") + 1 if volume.startswith("${") else volume.index(":")
    return volume[:split_at], volume[split_at + 1:].split(":")[0]


def load(path: str):
    with open(os.path.join(REPO, path)) as f:
        return json.load(f) if path.endswith(".json") else yaml.safe_load(f)


def test_the_server_runs_the_image_the_dockerfile_builds_on_a_gpu(service):
    assert service["build"] == "." and service["image"].startswith("open-autoglm:")
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    published = {mapping.rsplit(":", 1)[1] for mapping in service["ports"]}
    assert published == {"8000", "8001", "8002"}


def test_mounted_paths_exist_and_the_checkpoint_comes_from_the_environment(services, service):
    from glm_tools.demo_model import DEFAULT_OUT, TRAINED_CHECKPOINT

    targets = {}
    for volume in service["volumes"]:
        source, target = split_volume(volume)
        targets[target] = source
        if source.startswith("${"):
            # Without GLM_MODEL_DIR the shipped trained demo checkpoint is served; without GLM_CHECKPOINTS, new
            # versions' checkpoints are looked for where serve.sh and make_demo_model.py put them.
            variable, default = source[2:].rstrip("}").split(":-", 1)
            expected = {"GLM_MODEL_DIR": TRAINED_CHECKPOINT, "GLM_CHECKPOINTS": os.path.dirname(DEFAULT_OUT)}[variable]
            assert os.path.normpath(os.path.join(REPO, default)) == expected
    assert service["environment"]["GLM_MODEL_DIR"] in targets
    # The model repository is a named volume (filled from the image, writable by its user), at the image's path.
    assert targets["/opt/open-autoglm/model_repository"] == "model-repository"
    assert "model-repository" in load("docker-compose.yml")["volumes"]


def test_nothing_is_installed_when_a_container_starts(services, service):
    """The server and the OpenAI front run the image as built: no pip at start, no source mounted over it."""
    for name in ("tritonserver", "openai"):
        definition = services[name]
        assert definition["image"] == service["image"], name
        started = " ".join(definition.get("entrypoint", []) + definition.get("command", []))
        assert "pip" not in started, name
        assert not any(split_volume(v)[1].startswith(("/opt/tritonserver/backends", "/opt/open-autoglm/scripts"))
                       for v in definition.get("volumes", [])), name


def test_the_server_starts_through_the_shared_launcher(service):
    """The flags live in scripts/triton_server.py (server_args), used by serve.sh, the tests and compose alike: the
    image's entry point is the launcher, and compose's command adds launcher flags only."""
    entrypoint = dockerfile_instruction("ENTRYPOINT")
    assert entrypoint[:2] == ["python3", "scripts/triton_server.py"]
    assert entrypoint[entrypoint.index("--installed-triton") + 1] == "/opt/tritonserver"
    assert entrypoint[entrypoint.index("--host") + 1] == "0.0.0.0"  # it listens on 127.0.0.1 unless told otherwise
    assert "entrypoint" not in service and all(a.startswith("--") or a.isdigit() for a in service["command"])


def test_health_check_asks_for_readiness(service):
    assert "/v2/health/ready" in " ".join(service["healthcheck"]["test"])


def test_the_launcher_gets_sigterm_and_time_to_drain_and_compose_restarts_it(service):
    """The exec-form entry point makes the launcher, not a shell, the container's main process, so that
    `docker compose stop` reaches it."""
    assert dockerfile_instruction("ENTRYPOINT")[0] == "python3"
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
            if not source.startswith("${") and source not in load("docker-compose.yml")["volumes"]:
                assert os.path.exists(os.path.join(REPO, source)), (name, source)


def test_the_openai_front_is_a_service_of_its_own_in_front_of_the_server(services, service):
    front = services["openai"]
    assert front["entrypoint"] == ["python3", "-m", "openai_front"]
    command = front["command"]
    assert command[command.index("--triton") + 1] == "tritonserver:8001"
    assert command[command.index("--host") + 1] == "0.0.0.0"
    mounts = dict(reversed(split_volume(v)) for v in front["volumes"])
    # The same checkpoint as the server's, for the chat template.
    assert split_volume(next(v for v in service["volumes"] if v.endswith(":/models/glm:ro")))[0] == \
        mounts[command[command.index("--model-dir") + 1]]
    assert [port.rsplit(":", 1)[1] for port in front["ports"]] == ["9000"]
    assert front["depends_on"]["tritonserver"]["condition"] == "service_healthy"
    assert service["command"][service["command"].index("--openai-port") + 1] == "0"  # one front: this one


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
    published = published_metric_names(triton_server)
    dashboard = load("monitoring/grafana/dashboards/glm.json")
    queried = {name for panel in dashboard["panels"] for target in panel["targets"]
               for name in re.findall(r"\b((?:glm|nv)_[a-z_]+)", target["expr"])}
    assert len(queried) >= 12
    for name in queried:
        assert re.sub(r"_bucket$", "", name) in published, name
