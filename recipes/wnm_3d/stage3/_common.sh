# shellcheck shell=bash
# Shared by validate.sh and launch.sh (sourced, not run): locations, the Python to use, and loading of
# paths.env. Defines WAM_RECIPE_DIR, WAM_REPO_ROOT, WAM_PY, wam_die, wam_load_paths_env.

WAM_RECIPE_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
WAM_REPO_ROOT="$(cd "$WAM_RECIPE_DIR/../../.." && pwd)"

wam_die() {
  echo "error: $*" >&2
  exit 1
}

# The project's virtual environment; WNM_PYTHON overrides it (relative paths are relative to the repo root).
WAM_PY="${WNM_PYTHON:-.venv/bin/python}"
case "$WAM_PY" in
  /*) ;;
  */*) WAM_PY="$WAM_REPO_ROOT/$WAM_PY" ;;
esac
if ! command -v "$WAM_PY" >/dev/null 2>&1; then
  if [ -n "${WNM_PYTHON:-}" ]; then
    wam_die "WNM_PYTHON=$WNM_PYTHON is not an executable Python"
  fi
  WAM_PY="$(command -v python3 || true)"
  [ -n "$WAM_PY" ] || wam_die "no Python found: create .venv (bash scripts/test.sh does) or set WNM_PYTHON"
fi
export PYTHONPATH="$WAM_REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}"

# Optional variables: an empty value means "unset" so that the recipe's defaults apply.
WAM_OPTIONAL_VARS=(WNM3D_SOURCE_ROOT WNM_TOKENIZER_SOURCE WNM_TEXT_ENCODER_SOURCE WNM_IMAGE_ENCODER_SOURCE
  WNM_VAE_SOURCE WNM_VGGT_SOURCE WAM_TOTAL_STEPS WAM_SAVE_FREQ WAM_VAL_FREQ WAM_ROLLOUT_BACKEND WAM_COMPILE WAM_ATTENTION_BACKEND WAM_CPU_WORKERS
  WAM_REWARD_WORKERS WAM_GPUS_PER_NODE WAM_NETWORK_INTERFACE NCCL_SOCKET_IFNAME GLOO_SOCKET_IFNAME NCCL_IB_HCA
  WAM_NODE_IP NNODES NODE_RANK MASTER_ADDR RAY_PORT WAM_NODE_WAIT_TIMEOUT WAM_REPLACE_EXISTING_RAY
  WAM_RAY_DASHBOARD WAM_RESUME_OVERRIDE)

# Loads paths.env (WAM_PATHS_ENV overrides its location) with every variable exported. A variable that
# is already exported in the calling environment keeps its value (so `WAM_TOTAL_STEPS=5 bash launch.sh`
# works); those names are listed in WAM_ENV_OVERRIDES for the contract check's summary.
wam_load_paths_env() {
  local __wam_file="${WAM_PATHS_ENV:-$WAM_RECIPE_DIR/paths.env}"
  if [ ! -f "$__wam_file" ]; then
    if [ -n "${WAM_PATHS_ENV:-}" ]; then
      wam_die "WAM_PATHS_ENV=$WAM_PATHS_ENV does not exist: point it at your paths.env"
    fi
    wam_die "$__wam_file not found: cp $WAM_RECIPE_DIR/paths.env.example $__wam_file and fill in your paths (or set WAM_PATHS_ENV)"
  fi
  local -A __wam_keep=()
  local __wam_name
  while IFS= read -r __wam_name; do
    __wam_keep[$__wam_name]="${!__wam_name-}"
  done < <(compgen -e)
  set -a
  # shellcheck disable=SC1090
  source "$__wam_file" || { set +a; wam_die "$__wam_file: shell error while loading it"; }
  set +a
  WAM_ENV_OVERRIDES=""
  for __wam_name in "${!__wam_keep[@]}"; do
    if [ "${!__wam_name-}" != "${__wam_keep[$__wam_name]}" ]; then
      export "$__wam_name=${__wam_keep[$__wam_name]}"
      WAM_ENV_OVERRIDES="$WAM_ENV_OVERRIDES $__wam_name"
    fi
  done
  export WAM_ENV_OVERRIDES
  for __wam_name in "${WAM_OPTIONAL_VARS[@]}"; do
    if [ -z "${!__wam_name-}" ]; then
      unset "$__wam_name"
    fi
  done
  WAM_PATHS_ENV_FILE="$(cd "$(dirname "$__wam_file")" && pwd)/$(basename "$__wam_file")"
  export WAM_PATHS_ENV_FILE
}
