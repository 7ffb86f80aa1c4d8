#!/usr/bin/env bash
# All the tests: install (with the test-only packages, and genai-perf in .venv-genai), then pytest. The integration
# tests build their own demo checkpoint and start their own tritonserver on free ports. Extra arguments go to pytest.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$repo/scripts/setup_env.sh" requirements-test.txt
# genai-perf and perf_analyzer, which tests/test_genai_perf.py runs (it is skipped, saying so, where they cannot be
# installed: perf_analyzer needs Debian's libb64-0d, so apt-get as root).
if ! "$repo/scripts/setup_genai_perf.sh"; then
  echo "[test] genai-perf could not be installed: tests/test_genai_perf.py will be skipped" >&2
fi
# nginx for tests/test_bench_scripts.py's run of scripts/bench_affinity.py (skipped, saying so, without it).
if ! command -v nginx >/dev/null && [ ! -x /usr/sbin/nginx ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "[test] installing Debian's nginx-light (the session-affinity benchmark's load balancer)"
  (apt-get install -y -qq nginx-light || (apt-get update -qq && apt-get install -y -qq nginx-light)) >/dev/null 2>&1 \
    || echo "[test] could not install nginx-light: the session-affinity benchmark's test will be skipped" >&2
fi
cd "$repo"
exec "$repo/.venv/bin/python" -m pytest tests "$@"
