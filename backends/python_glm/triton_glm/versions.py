"""Numbered versions of the `glm` model and the traffic split between them, as files in the model repository.

scripts/glm_versions.py (clients/versions.py) writes these files; the glm model reads them. Nothing here imports
Triton, so both sides use this one module:

    model_repository/glm/
      config.pbtxt      version_policy { specific { versions: [1, 2] } }: the versions Triton loads
      1/                a version with no version.json serves the server's checkpoint (GLM_MODEL_DIR, else the
                        model_dir parameter), with the engine parameters of config.pbtxt
      2/version.json    {"checkpoint": "/srv/ckpt/glm-v2", "parameters": {"kv_cache_memory_mb": "1024"}}: its own
                        checkpoint (absolute, or relative to this folder) and engine parameters that override
                        config.pbtxt's
      0/                the rollout's state, never loaded as a version: traffic.json
                        ({"stable": 1, "canary": 2, "canary_percent": 20.0, "previous": null}), the probes' answers
                        (probe-N.json) and the tool's lock

Why a folder 0: on a load, Triton reloads every serving version when a file beside config.pbtxt changed, and a version
whose own folder changed; a version folder that is not loaded is the one place it does not look.

The routing rule: a glm request that is not pinned (request parameter PINNED) goes to `canary` with probability
canary_percent / 100 and otherwise to `stable`, whichever version Triton gave it to; a version that is not the one
chosen forwards it there, pinned. Every front (the ensemble, bls, direct calls) reaches glm, so every front follows
the split. Without traffic.json, each version serves what it gets.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
from dataclasses import asdict, dataclass, field

log = logging.getLogger(__name__)

VERSION_FILE = "version.json"
STATE_FOLDER = "0"
TRAFFIC_FILE = "traffic.json"
# A request parameter: true makes the version that receives the request serve it (forwarded requests, probes, and
# clients that pick a version on purpose).
PINNED = "glm_pinned"
POLICY_PATTERN = re.compile(r"version_policy\s*\{\s*specific\s*\{\s*versions:\s*\[([0-9,\s]*)\]\s*\}\s*\}")


class VersionError(ValueError):
    """A version file or traffic split that cannot be used; the message says which and why."""


@dataclass
class VersionSpec:
    checkpoint: str | None = None  # absolute; None: the server's checkpoint
    parameters: dict[str, str] = field(default_factory=dict)


def read_version_spec(model_path: str, version: int | str) -> VersionSpec:
    """The checkpoint and engine parameters of `version` of the model in `model_path` (model_repository/glm)."""
    folder = os.path.join(model_path, str(version))
    path = os.path.join(folder, VERSION_FILE)
    if not os.path.exists(path):
        return VersionSpec()
    try:
        with open(path) as f:
            raw = json.load(f)
        checkpoint = raw.get("checkpoint")
        parameters = {str(key): str(value) for key, value in raw.get("parameters", {}).items()}
    except (OSError, ValueError, AttributeError) as exc:
        raise VersionError(f"version {version}: {VERSION_FILE} cannot be read: {exc}") from None
    if checkpoint is not None:
        checkpoint = os.path.normpath(os.path.join(folder, str(checkpoint)))
    return VersionSpec(checkpoint, parameters)


def write_version_spec(model_path: str, version: int, spec: VersionSpec) -> None:
    folder = os.path.join(model_path, str(version))
    os.makedirs(folder, exist_ok=True)
    write_json_atomically(os.path.join(folder, VERSION_FILE), asdict(spec))


@dataclass
class Traffic:
    stable: int
    canary: int | None = None
    canary_percent: float = 0.0
    previous: int | None = None  # the version that rollback returns to

    def __post_init__(self):
        for name in ("stable", "canary", "previous"):
            value, optional = getattr(self, name), name != "stable"
            if (value is None and optional) or (type(value) is int and value >= 1):
                continue
            raise VersionError(f"{name} must be a version number (1 or more){' or null' if optional else ''}, "
                               f"got {value!r}")
        if not isinstance(self.canary_percent, (int, float)) or not 0.0 <= self.canary_percent <= 100.0:
            raise VersionError(f"canary_percent must lie in [0, 100], got {self.canary_percent}")

    def shares(self) -> dict[int, float]:
        """Percent of unpinned requests each version gets."""
        if self.canary is None or self.canary == self.stable:
            return {self.stable: 100.0}
        return {self.stable: 100.0 - self.canary_percent, self.canary: self.canary_percent}

    def choose(self, draw: float) -> int:
        """The version for a request, from a uniform draw in [0, 1)."""
        if self.canary is not None and draw * 100.0 < self.canary_percent:
            return self.canary
        return self.stable

    def versions(self) -> set[int]:
        return {v for v in (self.stable, self.canary, self.previous) if v is not None}


def state_path(model_path: str, name: str) -> str:
    return os.path.join(model_path, STATE_FOLDER, name)


def read_traffic(model_path: str) -> Traffic | None:
    path = state_path(model_path, TRAFFIC_FILE)
    try:
        with open(path) as f:
            raw = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise VersionError(f"{TRAFFIC_FILE} cannot be read: {exc}") from None
    try:
        return Traffic(**raw)
    except TypeError as exc:
        raise VersionError(f"{TRAFFIC_FILE} is not a traffic split: {exc}") from None


def write_traffic(model_path: str, traffic: Traffic) -> None:
    os.makedirs(os.path.join(model_path, STATE_FOLDER), exist_ok=True)
    write_json_atomically(state_path(model_path, TRAFFIC_FILE), asdict(traffic))


def write_json_atomically(path: str, value) -> None:
    """Readers see the old file or the new one, never half of one."""
    temporary = f"{path}.tmp{os.getpid()}"
    with open(temporary, "w") as f:
        json.dump(value, f, indent=1)
        f.write("\n")
    os.replace(temporary, path)


class TrafficReader:
    """traffic.json as the glm model sees it: read again whenever the file changes (a stat per request)."""

    def __init__(self, model_path: str, rng: random.Random | None = None):
        self.path = state_path(model_path, TRAFFIC_FILE)
        self.model_path = model_path
        self.rng = rng or random.Random()
        self._stamp = None
        self._traffic: Traffic | None = None

    def current(self) -> Traffic | None:
        try:
            stat = os.stat(self.path)
            stamp = (stat.st_mtime_ns, stat.st_ino, stat.st_size)
        except FileNotFoundError:
            stamp = None
        if stamp != self._stamp:
            try:
                self._traffic = read_traffic(self.model_path) if stamp else None
            except VersionError:  # written by hand and wrong: the last good split goes on
                log.exception("keeping the previous traffic split")
            self._stamp = stamp
        return self._traffic

    def target(self, own_version: int) -> int | None:
        """Where an unpinned request that reached `own_version` is served: None here, else the version to forward it
        to."""
        traffic = self.current()
        if traffic is None:
            return None
        chosen = traffic.choose(self.rng.random())
        return None if chosen == own_version else chosen


def policy_versions(config_text: str) -> list[int]:
    """The versions a config.pbtxt's `version_policy { specific { ... } }` names."""
    match = POLICY_PATTERN.search(config_text)
    if not match:
        raise VersionError("config.pbtxt has no `version_policy { specific { versions: [...] } }`")
    return sorted(int(v) for v in re.findall(r"\d+", match[1]))


def with_policy_versions(config_text: str, versions: list[int]) -> str:
    policy_versions(config_text)  # it must have one
    listed = ", ".join(str(v) for v in sorted(set(versions)))
    return POLICY_PATTERN.sub(f"version_policy {{ specific {{ versions: [ {listed} ] }} }}", config_text, count=1)
