#!/usr/bin/env bash
# Builds a SEPARATE environment with the vllm-omni version set (requirements/vllm-omni.txt), imports the
# WNM vLLM-Omni pipeline and runs the backend's tests there, including those that need vllm/vllm_omni.
# Not part of scripts/test.sh (CI): the install takes about 7 GB on disk (vLLM's wheel alone is ~315 MB).
#   usage: bash scripts/check_vllm_omni.sh [pytest args]      (default: tests/pipelines/wnm_vllm_omni)
#   env:   VLLM_OMNI_VENV (default /tmp/vllmomni-venv), PYTHON (default python3),
#          WNM_TORCH_VERSION (default 2.13.0; install your CUDA build of it first on a GPU machine)
# On a machine without a GPU the PyPI vLLM wheel (a CUDA build) installs next to a CPU torch; what needs
# CUDA kernels cannot run there and the tests that need it skip with the reason (docs/vllm_omni.md).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VLLM_OMNI_VENV:-/tmp/vllmomni-venv}"
py="${PYTHON:-python3}"
t0=$SECONDS
stamp="$VENV/.wnm-vllm-omni-installed"
want="$(cat pyproject.toml requirements/vllm-omni.txt | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  [ -x "$VENV/bin/python" ] || "$py" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  if ! "$VENV/bin/python" -c 'import torch' 2>/dev/null; then
    echo "== installing torch ${WNM_TORCH_VERSION:-2.13.0}"
    "$VENV/bin/python" -m pip install -q "torch==${WNM_TORCH_VERSION:-2.13.0}"
  fi
  echo "== installing verl-omni[train,vllm-omni,dev] with requirements/vllm-omni.txt"
  "$VENV/bin/python" -m pip install -q -e ".[train,vllm-omni,dev]" -c requirements/vllm-omni.txt
  if ! "$VENV/bin/python" -c 'import sys, torch; sys.exit(0 if torch.version.cuda else 1)'; then
    # PyPI's torchvision and torchcodec are CUDA builds (they link libtorch_cuda.so): next to a CPU torch they
    # fail at import, and transformers/vLLM import them when present. Both are optional for our pipeline.
    echo "== CPU torch: removing the CUDA-only torchvision and torchcodec wheels"
    "$VENV/bin/python" -m pip uninstall -q -y torchvision torchcodec
  fi
  echo "$want" > "$stamp"
fi
echo "== install done after $((SECONDS - t0)) s"
"$VENV/bin/python" -m pip check 2>/dev/null || echo "note: pip check reported the problems above (on CPU: the removed torchvision/torchcodec)"
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
for name in ("torch", "vllm", "vllm-omni", "verl", "ray", "transformers", "diffusers", "accelerate"):
    print(f"  {name:14s} {md.version(name)}")
from verl_omni.pipelines.wnm_vllm_omni import extra
diff = extra.check_pinned_versions()
print("  pinned version set:", "OK" if not diff else f"differs {diff}")
PY
echo "== import vllm / vllm_omni / our pipeline and its registration"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" PYTHONHASHSEED=0
"$VENV/bin/python" -m verl_omni.pipelines.wnm_vllm_omni.registration --check || echo "(see above: import check failed)"
echo "== pytest"
if [ "$#" -eq 0 ]; then set -- tests/pipelines/wnm_vllm_omni; fi
"$VENV/bin/python" -m pytest -q -rs "$@"
echo "== check_vllm_omni.sh done after $((SECONDS - t0)) s"
