#!/usr/bin/env bash
# Regenerates recipes/wnm_3d/stage3/generated/stage3_trainer.yaml, the flattened trainer config of the
# official recipe, from the Hydra sources in recipes/wnm_3d/stage3/config. Run it after changing them; a
# CPU test fails while the committed file is stale.
#
#   bash scripts/generate_trainer_config.sh [OUTPUT]      # default: the committed file
set -euo pipefail
cd "$(dirname "$0")/.."
py="${WNM_PYTHON:-.venv/bin/python}"
if ! command -v "$py" >/dev/null 2>&1; then
  py="$(command -v python3)" || { echo "error: no Python found; set WNM_PYTHON" >&2; exit 1; }
fi
out="${1:-recipes/wnm_3d/stage3/generated/stage3_trainer.yaml}"
mkdir -p "$(dirname "$out")"
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$py" -m verl_omni.trainer.contract_check \
  --config-dir recipes/wnm_3d/stage3/config --flatten-to "$out"
