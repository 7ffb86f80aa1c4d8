"""Talking to a running tritonserver from the tests: its Prometheus samples, waiting on a condition."""

from __future__ import annotations

import time

import requests


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
