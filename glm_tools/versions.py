"""Rolling out numbered versions of the `glm` model on a running server: status, deploy, canary, promote, rollback.

The Python API behind scripts/glm_versions.py (docs/versions.md is the operator's guide):

    from clients.versions import VersionManager   # or glm_tools.versions
    manager = VersionManager("localhost:8000", "model_repository", admin_key=os.environ["GLM_ADMIN_KEY"])
    manager.deploy(2, "/srv/checkpoints/glm-v2")   # loaded beside version 1, warmed up, probed; no traffic yet
    manager.canary(2, 20)                          # 20% of requests, chosen per request
    manager.promote(2)                             # all of them; version 1 finishes its requests and is unloaded
    manager.rollback()                             # back to version 1

It works where the model repository is (the server's machine, or `docker compose exec triton`): a version is a folder
and the traffic split a file there (triton_glm/versions.py), and it drives Triton's model-control API with the
control-plane key. Every step prints what it did and how long it took; a failed deploy leaves the serving version
as it was and raises VersionError with the reason.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import time
from dataclasses import dataclass

import requests

from triton_glm.versions import (PINNED, STATE_FOLDER, TRAFFIC_FILE, Traffic, VersionError, VersionSpec,
                                 policy_versions, read_traffic, read_version_spec, state_path, with_policy_versions,
                                 write_json_atomically, write_traffic, write_version_spec)

from .launcher import ADMIN_KEY_ENV, ADMIN_KEY_HEADER

PROBE_FILE = "probe.json"  # a checkpoint's own probe; the tool keeps each version's in its state folder
PROBE_PROMPT = "The model repository holds numbered versions of the model"
PROBE_TOKENS = 8
# A version's engine parameters that change its greedy answer, which its computed probe is run with.
PROBE_PARAMETERS = ("quantization", "quantize_lm_head")
WARMUP_REQUESTS = 4


@dataclass
class VersionStatus:
    version: int
    state: str  # Triton's: READY, LOADING, UNLOADING, UNAVAILABLE
    share: float  # percent of requests it takes
    checkpoint: str  # its version.json's, or "(the server's)"
    kv_blocks_used: float | None = None
    kv_blocks_total: float | None = None
    requests_running: float | None = None
    requests_served: float | None = None


class VersionManager:
    def __init__(self, url: str = "localhost:8000", model_repository: str = "model_repository",
                 admin_key: str | None = None, metrics_url: str | None = None, model: str = "glm", out=print,
                 timeout: float = 600.0):
        """url: the server's HTTP endpoint; model_repository: the folder it serves; admin_key: the control plane's
        key (default GLM_ADMIN_KEY); metrics_url: host:port of its metrics (default: url's host, port 8002); out:
        where progress lines go; timeout: for one load or unload."""
        self.url = url if url.startswith("http") else f"http://{url}"
        self.model = model
        self.model_path = os.path.join(model_repository, model)
        if not os.path.isfile(os.path.join(self.model_path, "config.pbtxt")):
            raise VersionError(f"{self.model_path} has no config.pbtxt: give the model repository the server serves")
        self.admin_key = admin_key if admin_key is not None else os.environ.get(ADMIN_KEY_ENV, "")
        host = self.url.split("://", 1)[1].rsplit(":", 1)[0]
        self.metrics_url = f"http://{metrics_url or f'{host}:8002'}/metrics"
        self.out = out
        self.timeout = timeout
        self.timings: list[tuple[str, str, float]] = []  # (command, step, seconds) of every step done so far

    # --- reading the state ---------------------------------------------------------------------------------------
    def loaded_versions(self) -> dict[int, str]:
        """version -> Triton's state, for every version of the model the server knows."""
        index = self._control("repository/index", {})
        return {int(entry["version"]): entry.get("state", "") for entry in index
                if entry.get("name") == self.model and entry.get("version")}

    def traffic(self) -> Traffic:
        """The split in traffic.json; without one, all to the newest ready version (what Triton does)."""
        traffic = read_traffic(self.model_path)
        if traffic is None:
            ready = [v for v, state in self.loaded_versions().items() if state == "READY"]
            if not ready:
                raise VersionError(f"no version of {self.model} is ready")
            traffic = Traffic(stable=max(ready))
        return traffic

    def status(self) -> list[VersionStatus]:
        traffic, states, samples = self.traffic(), self.loaded_versions(), self._metrics()
        shares = traffic.shares()
        rows = []
        for version in sorted(set(states) | set(shares)):
            spec = read_version_spec(self.model_path, version)

            def sample(*names, version=version):
                values = [value for name in names for labels, value in samples.get(name, [])
                          if labels.get("model") == self.model and labels.get("version") == str(version)]
                return sum(values) if values else None

            rows.append(VersionStatus(
                version, states.get(version, "UNAVAILABLE"), shares.get(version, 0.0),
                spec.checkpoint or "(the server's)", sample("glm_kv_blocks_used"), sample("glm_kv_blocks_total"),
                sample("glm_num_requests_running", "glm_num_requests_waiting"), sample("glm_requests_finished_total")))
        return rows

    # --- changing it ---------------------------------------------------------------------------------------------
    def deploy(self, version: int, model_dir: str, parameters: dict[str, str] | None = None) -> None:
        """Create `version` from the checkpoint in model_dir (with these engine parameters over config.pbtxt's),
        load it beside the serving version, warm it up and check its greedy answer to a probe. It takes no traffic
        until canary() or promote(). On any failure the new version is unloaded and removed, and VersionError says
        why; the serving version is never touched."""
        with self._locked():
            step = self._steps(f"deploy {version}")
            with step("check") as note:
                traffic = self.traffic()
                loaded = self._serving_versions()
                if version in loaded:
                    raise VersionError(f"version {version} is loaded already; deploy a new number")
                if version < 1:  # 0 holds the rollout's state
                    raise VersionError(f"a version is a number from 1, got {version}")
                if traffic.canary is not None and traffic.canary in loaded:
                    raise VersionError(f"version {traffic.canary} is deployed beside version {traffic.stable}: "
                                       f"promote it or roll it back first")
                model_dir = os.path.abspath(model_dir)
                check_checkpoint(model_dir)
                folder = os.path.join(self.model_path, str(version))
                existing = read_version_spec(self.model_path, version).checkpoint or "the server's checkpoint"
                if os.path.isdir(folder) and existing != model_dir:  # a deploy that failed removed its folder
                    raise VersionError(f"version {version} exists already, for {existing}; deploy a new number")
                note(f"{model_dir}; serving: version {traffic.stable} (loaded: {loaded})")
            with step("probe answer") as note:
                probe, source = probe_for(model_dir, parameters)
                note(f"{len(probe['token_ids'])} greedy tokens for {probe['prompt']!r} ({source})")
            first_split = read_traffic(self.model_path) is None
            if first_split:  # else the new version, the newest, would take Triton's traffic
                write_traffic(self.model_path, traffic)
            created = not os.path.isdir(folder)
            write_version_spec(self.model_path, version, VersionSpec(model_dir, dict(parameters or {})))
            write_json_atomically(self._probe_path(version), probe)
            try:
                self._bring_up(version, loaded, step)
                with step("serving version's answer") as note:
                    note(self._record_probe(traffic.stable, probe["prompt"]))
            except BaseException:
                self._set_loaded(loaded)
                os.remove(self._probe_path(version))
                if first_split:
                    os.remove(state_path(self.model_path, TRAFFIC_FILE))
                if created:
                    shutil.rmtree(folder, ignore_errors=True)
                raise
            write_traffic(self.model_path, Traffic(traffic.stable, version, 0.0, traffic.previous))
            self.out(f"[deploy {version}] done: version {version} is loaded and takes no traffic yet; next: "
                     f"`glm_versions.py canary {version} --percent P` or `promote {version}`")

    def canary(self, version: int, percent: float) -> None:
        """Send `percent` of requests, chosen per request, to `version` (deployed already); the rest stay on the
        stable version."""
        with self._locked():
            traffic = self.traffic()
            if version == traffic.stable:
                raise VersionError(f"version {version} is the stable version; canary a deployed one")
            self._require_ready(version)
            write_traffic(self.model_path, Traffic(traffic.stable, version, float(percent), traffic.previous))
            self.out(f"[canary {version}] {percent:g}% of requests to version {version}, "
                     f"{100 - percent:g}% to version {traffic.stable}")

    def promote(self, version: int) -> None:
        """All traffic to `version`; the other versions finish the requests they have and are unloaded."""
        with self._locked():
            traffic = self.traffic()
            step = self._steps(f"promote {version}")
            with step("switch") as note:
                self._require_ready(version)
                previous = traffic.stable if traffic.stable != version else traffic.previous
                write_traffic(self.model_path, Traffic(version, None, 0.0, previous))
                note(f"all requests to version {version}; rollback returns to {previous}")
            self._retire(set(self._serving_versions()) - {version}, step)

    def rollback(self) -> None:
        """Back to the version before: during a canary, the stable one (the canary is unloaded); after a promote,
        the previous one (loaded again, warmed up and probed first, if it is not loaded)."""
        with self._locked():
            traffic = self.traffic()
            step = self._steps("rollback")
            if traffic.canary is not None:
                target = traffic.stable
                new_traffic = Traffic(traffic.stable, None, 0.0, traffic.previous)
            elif traffic.previous is not None:
                target = traffic.previous
                new_traffic = Traffic(traffic.previous, None, 0.0, traffic.stable)
            else:
                raise VersionError("nothing to roll back to: no canary and no previous version")
            loaded = self._serving_versions()
            if target not in loaded:
                try:
                    self._bring_up(target, loaded, step)
                except BaseException:
                    self._set_loaded(loaded)
                    raise
            with step("switch") as note:
                write_traffic(self.model_path, new_traffic)
                note(f"all requests to version {target}")
            self._retire(set(self._serving_versions()) - {target}, step)

    # --- the steps -----------------------------------------------------------------------------------------------
    def _bring_up(self, version: int, loaded: list[int], step) -> None:
        """Load `version` beside `loaded`, warm it up and probe it; raises VersionError if any of it fails."""
        with step("load") as note:
            self._set_loaded([*loaded, version])
            self._require_ready(version)
            note(f"version {version} ready beside {loaded}")
        with step("warm-up") as note:
            for _ in range(WARMUP_REQUESTS):
                self._generate(version, PROBE_PROMPT, PROBE_TOKENS)
            note(f"{WARMUP_REQUESTS} requests")
        with step("probe") as note:
            probe_path = self._probe_path(version)
            if not os.path.exists(probe_path):
                answer = self._generate(version, PROBE_PROMPT, PROBE_TOKENS)
                note(f"answers ({len(answer)} tokens; no {PROBE_FILE} to compare with)")
                return
            with open(probe_path) as f:
                probe = json.load(f)
            answer = self._generate(version, probe["prompt"], len(probe["token_ids"]))
            if answer != probe["token_ids"]:
                raise VersionError(f"version {version} answered the probe {probe['prompt']!r} with token ids {answer}, "
                                   f"not the checkpoint's greedy answer {probe['token_ids']}")
            note(f"greedy answer as expected ({len(answer)} tokens)")

    def _record_probe(self, version: int, prompt: str) -> str:
        """Keep the serving version's greedy answer in the state folder (if none is there), for a rollback to check."""
        path = self._probe_path(version)
        if os.path.exists(path):
            return f"version {version}'s answer is kept already"
        answer = self._generate(version, prompt, PROBE_TOKENS)
        write_json_atomically(path, {"prompt": prompt, "token_ids": answer})
        return f"version {version}'s greedy answer kept in {path}, for a rollback"

    def _retire(self, versions: set[int], step) -> None:
        """Unload `versions` (Triton lets their requests finish first) and wait until they are gone."""
        if not versions:
            return
        with step("unload") as note:
            self._set_loaded([v for v in self._serving_versions() if v not in versions])
            deadline = time.monotonic() + self.timeout
            while time.monotonic() < deadline:
                states = self.loaded_versions()
                if all(states.get(v, "UNAVAILABLE") == "UNAVAILABLE" for v in versions):
                    break
                time.sleep(0.5)
            else:
                raise VersionError(f"versions {sorted(versions)} still unloading after {self.timeout:.0f} s; "
                                   "`glm_versions.py status` shows their requests")
            note(f"versions {sorted(versions)} unloaded")

    def _probe_path(self, version: int) -> str:
        return state_path(self.model_path, f"probe-{version}.json")

    def _serving_versions(self) -> list[int]:
        with open(os.path.join(self.model_path, "config.pbtxt")) as f:
            return policy_versions(f.read())

    def _set_loaded(self, versions: list[int]) -> None:
        """Make config.pbtxt's version policy name `versions` and load the model: Triton loads the versions that are
        new and unloads those left out, and leaves the others running (their processes are kept)."""
        path = os.path.join(self.model_path, "config.pbtxt")
        with open(path) as f:
            config = f.read()
        temporary = f"{path}.tmp{os.getpid()}"
        with open(temporary, "w") as f:
            f.write(with_policy_versions(config, versions))
        os.replace(temporary, path)
        self._control(f"repository/models/{self.model}/load", {})

    def _require_ready(self, version: int) -> None:
        state = self.loaded_versions().get(version, "UNAVAILABLE")
        if state != "READY":
            raise VersionError(f"version {version} is not loaded (Triton says {state}); deploy it first")

    def _generate(self, version: int, prompt: str, max_tokens: int) -> list[int]:
        """Greedy token ids of `version` itself (pinned: the traffic split does not apply), for a text prompt."""
        ids = self._tokenize(prompt)
        body = {"input_ids": ids, "input_lengths": len(ids), "request_output_len": max_tokens, "temperature": 0.0,
                "exclude_input_in_output": True, PINNED: True}
        reply = requests.post(f"{self.url}/v2/models/{self.model}/versions/{version}/generate", json=body,
                              timeout=self.timeout)
        if reply.status_code != 200:
            raise VersionError(f"version {version} did not answer a request: HTTP {reply.status_code} {reply.text}")
        return reply.json().get("output_ids", [])  # left out when no token came

    def _tokenize(self, prompt: str) -> list[int]:
        """The prompt's ids by the server's own preprocessing model, which every version shares."""
        reply = requests.post(f"{self.url}/v2/models/preprocessing/infer", timeout=60, json={"inputs": [
            {"name": "QUERY", "datatype": "BYTES", "shape": [1, 1], "data": [prompt]}]})
        if reply.status_code != 200:
            raise VersionError(f"the preprocessing model did not answer: HTTP {reply.status_code} {reply.text}")
        outputs = {output["name"]: output["data"] for output in reply.json()["outputs"]}
        return outputs["INPUT_ID"][:outputs["REQUEST_INPUT_LEN"][0]]

    def _control(self, path: str, body: dict):
        """A call to Triton's model-repository API, with the key; VersionError with Triton's words if it fails."""
        try:
            reply = requests.post(f"{self.url}/v2/{path}", json=body, headers={ADMIN_KEY_HEADER: self.admin_key},
                                  timeout=self.timeout)
        except requests.RequestException as exc:
            raise VersionError(f"the server at {self.url} does not answer: {exc}") from None
        if reply.status_code in (401, 403):
            raise VersionError("the server refused the control-plane key: set GLM_ADMIN_KEY (or --admin-key) to the "
                               "key the server printed when it started")
        if reply.status_code != 200:
            message = reply.json().get("error", reply.text) if reply.text else f"HTTP {reply.status_code}"
            # A failed load carries the model's Python traceback ("At: <file>(<line>): ..."): the log has it.
            raise VersionError(f"{path}: " + re.sub(r"\s*At:\n.*?;", "", message, flags=re.S))
        return reply.json() if reply.text else None

    def _metrics(self) -> dict[str, list[tuple[dict[str, str], float]]]:
        try:
            text = requests.get(self.metrics_url, timeout=10).text
        except requests.RequestException:
            return {}
        samples: dict[str, list] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            series, value = line.rsplit(" ", 1)
            name, _, label_text = series.partition("{")
            labels = dict(part.split("=", 1) for part in label_text.rstrip("}").split(",") if "=" in part)
            samples.setdefault(name, []).append(({k: v.strip('"') for k, v in labels.items()}, float(value)))
        return samples

    @contextlib.contextmanager
    def _locked(self):
        """One change at a time, whoever runs it."""
        os.makedirs(os.path.join(self.model_path, STATE_FOLDER), exist_ok=True)
        with open(state_path(self.model_path, "lock"), "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise VersionError("another glm_versions command is changing versions; try again when it is done") \
                    from None
            yield

    def _steps(self, what: str):
        @contextlib.contextmanager
        def step(name: str):
            started = time.monotonic()
            notes: list[str] = []
            try:
                yield notes.append
            except BaseException as exc:
                self.out(f"[{what}] {name:<26} failed after {time.monotonic() - started:6.2f} s: {exc}")
                raise
            seconds = time.monotonic() - started
            self.timings.append((what, name, seconds))
            self.out(f"[{what}] {name:<26} {seconds:6.2f} s  {'; '.join(notes)}")
        return step


def check_checkpoint(model_dir: str) -> None:
    if not os.path.isdir(model_dir):
        raise VersionError(f"no checkpoint folder at {model_dir}")
    for name in ("config.json", "tokenizer.json"):
        if not os.path.isfile(os.path.join(model_dir, name)):
            raise VersionError(f"the checkpoint {model_dir} has no {name}")
    if not any(name.endswith(".safetensors") for name in os.listdir(model_dir)):
        raise VersionError(f"the checkpoint {model_dir} has no *.safetensors weights")


def probe_for(model_dir: str, parameters: dict[str, str] | None = None) -> tuple[dict, str]:
    """The probe and the greedy answer the checkpoint must give: its own probe.json ({"prompt", "token_ids"}), or
    computed here on the CPU with the engine (float32, with the version's parameters that change its numbers:
    PROBE_PARAMETERS) and the checkpoint's tokenizer."""
    path = os.path.join(model_dir, PROBE_FILE)
    if os.path.exists(path):
        with open(path) as f:
            probe = json.load(f)
        if not (isinstance(probe.get("prompt"), str) and isinstance(probe.get("token_ids"), list)):
            raise VersionError(f"{path} must hold {{\"prompt\": text, \"token_ids\": [ids]}}")
        return probe, f"from {path}"
    # Imported here: the rest of the client SDK needs no torch.
    from glm_engine import EngineConfig, LLMEngine, SamplingParams
    from glm_engine.tokenizer import GlmTokenizer

    numbers = {key: value for key, value in (parameters or {}).items() if key in PROBE_PARAMETERS}
    try:
        engine = LLMEngine(EngineConfig.from_parameters({
            "model_dir": model_dir, "device": "cpu", "dtype": "float32", "num_kv_blocks": "16", "max_num_seqs": "1",
            **numbers}))
        prompt_ids = GlmTokenizer(model_dir).encode(PROBE_PROMPT)
        answer = engine.generate([prompt_ids], SamplingParams(temperature=0.0, max_tokens=PROBE_TOKENS))[0]
    except (ValueError, OSError) as exc:
        raise VersionError(f"the checkpoint {model_dir} cannot be run: {exc}") from None
    return {"prompt": PROBE_PROMPT, "token_ids": answer}, f"computed on this machine's CPU; no {PROBE_FILE} in it"
