"""The version files and the routing rule (triton_glm/versions.py), and the engine's memory check
(glm_engine/memory.py), without a server."""

from __future__ import annotations

import os
import random

import pytest
import torch

from glm_engine import EngineConfig, LLMEngine
from glm_engine.memory import RESERVE_BYTES, InsufficientMemory, available_bytes, check_fits, weight_bytes
from glm_tools.launcher import MODEL_REPOSITORY
from triton_glm.versions import (Traffic, TrafficReader, VersionError, VersionSpec, policy_versions, read_traffic,
                                 read_version_spec, with_policy_versions, write_traffic, write_version_spec)


def test_the_split_sends_the_canary_its_share_and_the_rest_to_stable():
    traffic = Traffic(stable=1, canary=2, canary_percent=20)
    assert traffic.shares() == {1: 80.0, 2: 20.0}
    assert traffic.choose(0.0) == 2 and traffic.choose(0.1999) == 2 and traffic.choose(0.2) == 1
    rng = random.Random(0)
    draws = [traffic.choose(rng.random()) for _ in range(20000)]
    assert abs(draws.count(2) / len(draws) - 0.20) < 0.01
    assert Traffic(stable=3).shares() == {3: 100.0} and Traffic(stable=3).choose(0.0) == 3
    assert Traffic(stable=1, canary=2, canary_percent=0).choose(0.0) == 1
    with pytest.raises(VersionError, match="canary_percent"):
        Traffic(stable=1, canary=2, canary_percent=120)
    with pytest.raises(VersionError, match="stable must be a version number"):
        Traffic(stable="1")
    with pytest.raises(VersionError, match="canary must be a version number"):
        Traffic(stable=1, canary=0)


def test_a_version_routes_what_the_split_gives_another_and_follows_changes_of_the_file(tmp_path):
    model_path = str(tmp_path)
    reader = TrafficReader(model_path, rng=random.Random(0))
    assert reader.target(1) is None  # no traffic.json: each version serves what it gets
    write_traffic(model_path, Traffic(stable=1, canary=2, canary_percent=100))
    assert reader.target(1) == 2 and reader.target(2) is None
    write_traffic(model_path, Traffic(stable=2, previous=1))
    assert reader.target(1) == 2 and reader.target(2) is None and reader.current().previous == 1
    with open(os.path.join(model_path, "0", "traffic.json"), "w") as f:
        f.write("{not json")  # a hand edit gone wrong: the last good split goes on
    assert reader.target(1) == 2
    with pytest.raises(VersionError, match="traffic.json cannot be read"):
        read_traffic(model_path)


def test_a_version_names_its_checkpoint_and_parameters_relative_to_its_folder(tmp_path):
    model_path = str(tmp_path)
    assert read_version_spec(model_path, 1) == VersionSpec()  # the server's checkpoint
    write_version_spec(model_path, 2, VersionSpec("../../ckpt", {"kv_cache_memory_mb": "64"}))
    spec = read_version_spec(model_path, 2)
    assert spec.checkpoint == os.path.normpath(os.path.join(model_path, "..", "ckpt"))
    assert spec.parameters == {"kv_cache_memory_mb": "64"}
    with open(os.path.join(model_path, "2", "version.json"), "w") as f:
        f.write("[]")
    with pytest.raises(VersionError, match="version 2: version.json cannot be read"):
        read_version_spec(model_path, 2)


def test_the_version_policy_of_the_shipped_config_is_rewritten_in_place():
    with open(os.path.join(MODEL_REPOSITORY, "glm", "config.pbtxt")) as f:
        config = f.read()
    assert policy_versions(config) == [1]
    rewritten = with_policy_versions(config, [2, 1, 2])
    assert policy_versions(rewritten) == [1, 2]
    assert rewritten.replace("[ 1, 2 ]", "[ 1 ]") == config
    with pytest.raises(VersionError, match="version_policy"):
        policy_versions('name: "glm"')


def test_an_engine_that_cannot_fit_is_refused_before_it_loads_anything(tiny_model):
    model_dir, model = tiny_model
    assert weight_bytes(model_dir, torch.float32) == sum(p.numel() for p in model.state_dict().values()) * 4
    with pytest.raises(InsufficientMemory, match=r"needs .*weights .* \+ KV cache .* GiB is free"):
        check_fits("it", {"weights": 1, "KV cache": 2**40}, available_bytes(torch.device("cpu")))
    check_fits("it", {"weights": 1}, RESERVE_BYTES + 1)
    too_big = available_bytes(torch.device("cpu")) // 2**20 + 1024
    with pytest.raises(InsufficientMemory, match=model_dir):
        LLMEngine(EngineConfig(model_dir=model_dir, device="cpu", kv_cache_memory_mb=too_big))
