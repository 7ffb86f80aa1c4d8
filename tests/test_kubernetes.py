"""deploy/kubernetes/, checked as far as a machine without a cluster can: each overlay renders with kustomize, every
object validates against the Kubernetes schemas offline, the objects agree with each other, with the image and with
the launcher, and the metrics the autoscaling rules read are published by the real server."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest
import yaml

from support import REPO
from support.server import published_metric_names

from glm_tools.launcher import EXIT_TIMEOUT_S

KUBERNETES = os.path.join(REPO, "deploy", "kubernetes")
OVERLAYS = ("cpu-demo", "gpu", "gpu-tensor-parallel")
# The oldest Kubernetes still commonly run, and the newest that kubernetes-validate knows.
KUBERNETES_VERSIONS = ("1.29", "latest")
CUSTOM_RESOURCES = {("monitoring.coreos.com/v1", "ServiceMonitor")}  # the Prometheus Operator's; no schema here
# What the launcher waits for on top of --drain-grace: the watchdog's poll, the last step, the metrics.
DRAIN_WAIT_S = 5


def render(overlay: str) -> dict[str, dict]:
    if not shutil.which("kubectl"):
        pytest.skip("kubectl is not installed (it renders kustomizations offline)")
    result = subprocess.run(["kubectl", "kustomize", os.path.join(KUBERNETES, "overlays", overlay)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return {obj["kind"]: obj for obj in yaml.safe_load_all(result.stdout)}


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request) -> dict[str, dict]:
    return render(request.param)


def server_container(objects: dict[str, dict]) -> dict:
    container, = objects["Deployment"]["spec"]["template"]["spec"]["containers"]
    return container


def adapter_rules() -> list[dict]:
    with open(os.path.join(KUBERNETES, "prometheus-adapter", "values.yaml")) as f:
        return yaml.safe_load(f)["rules"]["custom"]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_object_validates_against_the_kubernetes_schemas(rendered, version):
    import kubernetes_validate

    version = kubernetes_validate.latest_version() if version == "latest" else version
    for kind, obj in rendered.items():
        if (obj["apiVersion"], kind) in CUSTOM_RESOURCES:
            continue
        kubernetes_validate.validate(obj, version, strict=True)  # strict: unknown fields are errors too


def test_the_service_monitor_scrapes_the_services_metrics_port(rendered):
    monitor, service = rendered["ServiceMonitor"], rendered["Service"]
    labels = monitor["spec"]["selector"]["matchLabels"]
    assert labels.items() <= service["metadata"]["labels"].items()
    port, = monitor["spec"]["endpoints"]
    assert port["port"] in {p["name"] for p in service["spec"]["ports"]} and port["path"] == "/metrics"
    assert set(monitor["spec"]) == {"selector", "endpoints"} and set(port) <= {"port", "path", "interval"}


def test_the_selectors_reach_the_servers_pods(rendered):
    pod_labels = rendered["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert rendered["Service"]["spec"]["selector"].items() <= pod_labels.items()
    assert rendered["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    target = rendered["HorizontalPodAutoscaler"]["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", rendered["Deployment"]["metadata"]["name"])


def test_ports_and_probes_are_the_launchers(rendered):
    container = server_container(rendered)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": 8000, "grpc": 8001, "metrics": 8002, "openai": 9000}
    assert {p["targetPort"] for p in rendered["Service"]["spec"]["ports"]} == set(ports)
    assert container["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": "http"}
    startup = container["startupProbe"]
    assert startup["httpGet"]["path"] == "/v2/health/ready"
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # a 9B checkpoint from a network volume


def test_a_pod_being_deleted_has_time_to_drain_its_streams(rendered):
    """The grace period covers the pre-stop pause, the launcher's drain, its wait, the unloads and SIGTERM."""
    pod = rendered["Deployment"]["spec"]["template"]["spec"]
    container = server_container(rendered)
    pause = int(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    drain = float(container["args"][container["args"].index("--drain-grace") + 1])
    assert pod["terminationGracePeriodSeconds"] >= pause + drain + DRAIN_WAIT_S + EXIT_TIMEOUT_S + 1 + 10
    scale_down = rendered["HorizontalPodAutoscaler"]["spec"]["behavior"]["scaleDown"]
    assert scale_down["stabilizationWindowSeconds"] >= 300
    assert all(p["type"] == "Pods" and p["value"] == 1 for p in scale_down["policies"])
    assert rendered["Deployment"]["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


def test_it_runs_as_the_images_non_root_user_with_its_shared_memory(rendered):
    with open(os.path.join(REPO, "Dockerfile")) as f:
        image_user = int(re.search(r"^USER (\d+)$", f.read(), re.M).group(1))
    pod = rendered["Deployment"]["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] == image_user
    mounts = {m["mountPath"]: m["name"] for m in server_container(rendered)["volumeMounts"]}
    shm = next(v for v in pod["volumes"] if v["name"] == mounts["/dev/shm"])
    assert shm["emptyDir"]["medium"] == "Memory"


def test_the_keys_come_from_a_secret(rendered):
    env = {e["name"]: e for e in server_container(rendered)["env"]}
    for name in ("GLM_ADMIN_KEY", "GLM_OPENAI_API_KEY"):
        assert "value" not in env[name] and env[name]["valueFrom"]["secretKeyRef"]["name"] == "open-autoglm-keys"


def test_the_gpu_overlay_serves_a_checkpoint_volume_on_one_gpu():
    objects = render("gpu")
    container = server_container(objects)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    model_dir = {e["name"]: e.get("value") for e in container["env"]}["GLM_MODEL_DIR"]
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == model_dir)
    volume = next(v for v in objects["Deployment"]["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    claim = objects["PersistentVolumeClaim"]
    assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"] and mount["readOnly"]
    assert claim["spec"]["accessModes"] == ["ReadOnlyMany"]  # every pod, on any node, mounts it
    ingress = objects["Ingress"]
    assert ingress["metadata"]["annotations"]["nginx.ingress.kubernetes.io/upstream-hash-by"] == "$http_x_session_id"
    assert ingress["metadata"]["annotations"]["nginx.ingress.kubernetes.io/proxy-body-size"] == "8m"


def test_the_tensor_parallel_overlay_splits_the_model_over_the_gpus_it_asks_for():
    container = server_container(render("gpu-tensor-parallel"))
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert int(env["GLM_TENSOR_PARALLEL_SIZE"]) == container["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert env["GLM_MODEL_DIR"] == "/models/glm"  # the gpu overlay's checkpoint volume, kept


def test_the_cpu_demo_overlay_serves_the_baked_demo_model_without_a_gpu():
    container = server_container(render("cpu-demo"))
    assert "nvidia.com/gpu" not in str(container["resources"])
    assert "GLM_MODEL_DIR" not in {e["name"] for e in container["env"]}  # the image's trained demo checkpoint


def test_the_autoscaler_reads_the_metrics_the_adapter_defines(rendered):
    defined = {rule["name"]["as"] for rule in adapter_rules()}
    used = {m["pods"]["metric"]["name"] for m in rendered["HorizontalPodAutoscaler"]["spec"]["metrics"]}
    assert used == defined
    for rule in adapter_rules():  # per pod, as the HPA's Pods metrics ask
        assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}
        assert "<<.GroupBy>>" in rule["metricsQuery"] and "<<.LabelMatchers>>" in rule["metricsQuery"]


@pytest.mark.integration
def test_every_metric_the_adapter_rules_read_is_one_the_server_publishes(triton_server):
    published = published_metric_names(triton_server)
    read = set()
    for rule in adapter_rules():
        read |= set(re.findall(r"\b(glm_[a-z_]+)\{", rule["seriesQuery"] + rule["metricsQuery"]))
    assert read == {"glm_num_requests_waiting", "glm_kv_blocks_used", "glm_kv_blocks_total"}
    assert read <= published
