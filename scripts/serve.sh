#!/usr/bin/env bash
# The main job: install, build the demo model if it is missing, run tritonserver on model_repository/.
#   ./scripts/serve.sh [--http-port 8000] [--grpc-port 8001] [--metrics-port 8002] [--model-dir DIR]
# With no --model-dir (or GLM_MODEL_DIR), the demo checkpoint in checkpoints/glm-demo is served.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$repo/scripts/setup_env.sh" requirements.txt
python="$repo/.venv/bin/python"
if [ -z "${GLM_MODEL_DIR:-}" ] && [[ " $* " != *" --model-dir"* ]] && [ ! -f "$repo/checkpoints/glm-demo/config.json" ]; then
  "$python" "$repo/scripts/make_demo_model.py" --out "$repo/checkpoints/glm-demo"
fi
exec "$python" "$repo/scripts/triton_server.py" "$@"
