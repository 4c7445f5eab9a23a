# Shared by scripts/test.sh and scripts/quickstart.sh: build or reuse the project's virtual environment.
# Source it; it defines VENV and wnm_ensure_venv. WNM_VENV overrides the location (default .venv).
VENV="${WNM_VENV:-$PWD/.venv}"
WNM_EXTRAS="${WNM_EXTRAS:-train,dev}"

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
