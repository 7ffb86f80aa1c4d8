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
cd "$repo"
exec "$repo/.venv/bin/python" -m pytest tests "$@"
