#!/usr/bin/env bash
# Runs the CPU test suite. On a fresh clone it first builds .venv (CPU torch + the project with the
# extras the tests need). Extra arguments go to pytest, e.g. `bash scripts/test.sh tests/data -x`.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_env.sh
wnm_ensure_venv
export PYTHONHASHSEED=0 OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" MKL_NUM_THREADS="${MKL_NUM_THREADS:-1}"
echo "== ruff"
"$VENV/bin/ruff" check .
"$VENV/bin/ruff" format --check .
echo "== bash -n"
find scripts recipes -type f -name '*.sh' -print0 2>/dev/null | xargs -0 -r -n1 bash -n
echo "== pytest (CPU)"
if [ "$#" -gt 0 ]; then
  exec "$VENV/bin/python" -m pytest -q "$@"
fi
mapfile -t tests < <(find tests -type f -name '*_on_cpu.py' -print | sort)
if [ "${#tests[@]}" -eq 0 ]; then
  echo "no CPU tests found under tests/" >&2
  exit 1
fi
exec "$VENV/bin/python" -m pytest -q --timeout=900 "${tests[@]}"
