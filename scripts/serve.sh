#!/usr/bin/env bash
# The main job: install, put the demo model in place if it is missing, run tritonserver on model_repository/.
#   ./scripts/serve.sh [--http-port 8000] [--grpc-port 8001] [--metrics-port 8002] [--model-dir DIR]
# With no --model-dir (or GLM_MODEL_DIR), the demo checkpoint in checkpoints/glm-demo is served: a copy of the
# trained demo model in demo_checkpoint/ (renewed when that one changes).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$repo/scripts/setup_env.sh" requirements.txt
python="$repo/.venv/bin/python"
if [ -z "${GLM_MODEL_DIR:-}" ] && [[ " $* " != *" --model-dir"* ]] \
   && ! cmp -s "$repo/demo_checkpoint/model.safetensors" "$repo/checkpoints/glm-demo/model.safetensors"; then
  "$python" "$repo/scripts/make_demo_model.py" --out "$repo/checkpoints/glm-demo"
fi
exec "$python" "$repo/scripts/triton_server.py" "$@"
