#!/usr/bin/env bash
# genai-perf and perf_analyzer in a virtual environment of their own (.venv-genai): genai-perf 0.0.16 pins packages
# that the server's .venv does not want. perf_analyzer is not in PyPI's `perf-analyzer` package (a placeholder) but
# in the tritonclient 2.51 wheel (as bin/perf_analyzer); it needs libb64 (Debian's libb64-0d) and the CUDA runtime
# library (PyPI's nvidia-cuda-runtime-cu12, used here without a GPU) on its library path.
#   ./scripts/setup_genai_perf.sh          then   source .venv-genai/env   (PATH and LD_LIBRARY_PATH)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$repo/.venv-genai"
if ! ldconfig -p | grep -q libb64.so.0d; then
  echo "[genai-perf] installing Debian's libb64-0d (perf_analyzer needs it)..."
  apt-get install -y -q libb64-0d >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q libb64-0d >/dev/null; }
fi
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
echo "[genai-perf] installing genai-perf, tritonclient (with perf_analyzer) and the CUDA runtime into $venv..."
"$venv/bin/pip" install --quiet genai-perf==0.0.16 "tritonclient[all]==2.51.0" nvidia-cuda-runtime-cu12==12.9.79
cudart="$("$venv/bin/python" -c 'import nvidia.cuda_runtime, os; print(os.path.join(nvidia.cuda_runtime.__path__[0], "lib"))')"
cat > "$venv/env" <<ENV
export PATH="$venv/bin:\$PATH"
export LD_LIBRARY_PATH="$cudart\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
ENV
# shellcheck disable=SC1091
source "$venv/env"
perf_analyzer --version | head -1
genai-perf --version
