#!/usr/bin/env bash
# Create .venv (Python 3.11: the Triton Python stub embeds the system's libpython3.11), install the pinned
# requirements file given as $1, then this repository's packages (pyproject.toml), editable and without
# dependencies. Does nothing when neither the requirements nor pyproject.toml changed since the last install.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
requirements="$repo/${1:-requirements.txt}"
venv="${VENV:-$repo/.venv}"
python="${PYTHON:-python3.11}"

if ! command -v "$python" >/dev/null; then
  echo "[setup] $python not found: Triton's Python backend stub here is built for Python 3.11" >&2
  exit 1
fi
if [ ! -x "$venv/bin/python" ]; then
  echo "[setup] creating $venv"
  "$python" -m venv "$venv"
fi
stamp="$venv/.installed-$(basename "$requirements").sha256"
wanted="$(cat "$repo"/requirements*.txt "$repo"/clients/requirements.txt "$repo"/pyproject.toml | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$wanted" ]; then
  echo "[setup] installing $(basename "$requirements") into $venv (about a minute on a fresh machine)"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$requirements"
  echo "[setup] installing glm_engine, triton_glm, clients, glm_tools and loadtests (editable)"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps --editable "$repo"
  echo "$wanted" > "$stamp"
fi
# jemalloc for the server (docs/operations.md, "Memory over time"): best effort, as root with apt only; without it
# the launcher uses the system's malloc.
if ! compgen -G "/usr/lib/*/libjemalloc.so.2" >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "[setup] installing Debian's libjemalloc2 (the server's memory allocator)"
  (apt-get install -y -qq libjemalloc2 || (apt-get update -qq && apt-get install -y -qq libjemalloc2)) >/dev/null 2>&1 \
    || echo "[setup] could not install libjemalloc2: the server will use the system's malloc" >&2
fi
