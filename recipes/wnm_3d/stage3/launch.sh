#!/usr/bin/env bash
# Launches the official Stage-III recipe (wnm-3d-stage3-navigation-grpo-r1) on one or more nodes.
#
#   bash recipes/wnm_3d/stage3/launch.sh                                   # one node: all local GPUs, or CPU
#   NNODES=N NODE_RANK=r MASTER_ADDR=<head IPv4> bash recipes/wnm_3d/stage3/launch.sh   # on every node
#
# Every node first runs the same contract check as validate.sh. Node 0 starts the Ray head, waits until
# NNODES nodes joined, runs the trainer driver and stops its head when the driver ends; other nodes join
# the head and stay until it is gone. Arguments are refused: the recipe is locked, and the per-run knobs
# (WAM_TOTAL_STEPS, WAM_SAVE_FREQ, WAM_VAL_FREQ, WAM_ROLLOUT_BACKEND, ...) are environment variables
# documented in paths.env.example. A running Ray runtime is never stopped unless
# WAM_REPLACE_EXISTING_RAY=true. Outputs (config snapshot, logs, TensorBoard, checkpoints) go to
# WAM_OUTPUT_DIR; a relaunch with the same WAM_OUTPUT_DIR resumes from its latest checkpoint.
set -euo pipefail
# shellcheck source=recipes/wnm_3d/stage3/_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"

case "${1-}" in
  -h | --help)
    sed -n '2,13p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
    exit 0
    ;;
esac
if [ "$#" -gt 0 ]; then
  cat >&2 <<MSG
error: launch.sh takes no arguments, got: $*
Positional Hydra overrides are refused so that a run cannot bypass the verified recipe contract
(algorithm constants are locked in recipes/wnm_3d/stage3/config/locked.yaml). Per-run settings are
environment variables documented in recipes/wnm_3d/stage3/paths.env.example, e.g.
  WAM_TOTAL_STEPS=500 WAM_SAVE_FREQ=25 bash recipes/wnm_3d/stage3/launch.sh
MSG
  exit 2
fi

wam_load_paths_env
export NNODES="${NNODES:-1}" NODE_RANK="${NODE_RANK:-0}" RAY_PORT="${RAY_PORT:-6379}"
export WAM_NODE_WAIT_TIMEOUT="${WAM_NODE_WAIT_TIMEOUT:-600}"
if [ -n "${WAM_NETWORK_INTERFACE:-}" ]; then
  # One bootstrap interface for Ray, Gloo and NCCL unless paths.env sets the NCCL/Gloo ones explicitly.
  export NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-$WAM_NETWORK_INTERFACE}"
  export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-$WAM_NETWORK_INTERFACE}"
fi
if [ -z "${WAM_GPUS_PER_NODE:-}" ]; then
  WAM_GPUS_PER_NODE="$("$WAM_PY" -m verl_omni.trainer.launch_env gpus)"
fi
export WAM_GPUS_PER_NODE

stamp="$(date -u +%Y%m%dT%H%M%SZ)"
work="$(mktemp -d "${TMPDIR:-/tmp}/wam_launch.XXXXXX")"
cleanup_work() { rm -rf "$work"; }
trap cleanup_work EXIT

# 1. The contract check (same as validate.sh); its plan stays outside WAM_OUTPUT_DIR until Ray is cleared.
if ! "$WAM_PY" -m verl_omni.trainer.contract_check --config-dir "$WAM_RECIPE_DIR/config" \
  --paths-env "$WAM_PATHS_ENV_FILE" --write-plan "$work/plan"; then
  echo "error: the contract check failed (see above); nothing was started" >&2
  exit 1
fi

# 2. Ray: never reuse or stop someone else's runtime silently.
if [ -n "${RAY_ADDRESS:-}" ]; then
  wam_die "RAY_ADDRESS=$RAY_ADDRESS is set: launch.sh starts and owns its Ray runtime; unset RAY_ADDRESS"
fi
run_key="$(printf '%s' "$WAM_OUTPUT_DIR" | sha256sum | cut -c1-10)"
# Short, per-run, per-rank Ray temp dirs: Ray's socket paths must fit in 107 bytes.
ray_tmp() { echo "/tmp/wam_ray_$(id -u)_${run_key}_n$1"; }
my_ray_tmp="$(ray_tmp "$NODE_RANK")"
check_args=()
if [ "$NODE_RANK" -gt 0 ]; then
  # On one machine (loopback tests) the head of this very run is not "someone else's" runtime.
  check_args+=(--ignore-dir "$(ray_tmp 0)")
fi
if [ "${WAM_REPLACE_EXISTING_RAY:-false}" = "true" ]; then
  check_args+=(--replace)
fi
"$WAM_PY" -m verl_omni.trainer.launch_env ray-check "${check_args[@]}" || exit 1

if [ -z "${RAY_AUTH_MODE:-}" ]; then
  # Ray enables token authentication when a token exists; make every process we start agree on it.
  if [ -n "${RAY_AUTH_TOKEN:-}" ] || [ -f "${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/auth_token}" ]; then
    export RAY_AUTH_MODE=token
  else
    export RAY_AUTH_MODE=disabled
  fi
fi
export RAY_USAGE_STATS_ENABLED="${RAY_USAGE_STATS_ENABLED:-0}"

# 3. Outputs exist only from here on.
logs="$WAM_OUTPUT_DIR/logs"
mkdir -p "$logs"
driver_cmd=("$WAM_PY" -m verl_omni.trainer.main_stage3 --config-path "$WAM_RECIPE_DIR/config" --config-name stage3)
if [ "$NODE_RANK" -eq 0 ]; then
  mkdir -p "$WAM_OUTPUT_DIR/launch"
  snapshot="$WAM_OUTPUT_DIR/launch/$stamp"
  mv "$work/plan" "$snapshot"
  # A record of what the check verified; the driver resolves the same topology itself and prints it.
  echo "config snapshot: $snapshot/resolved_config.yaml"
fi

node_ip="${WAM_NODE_IP:-}"
if [ -z "$node_ip" ] && [ -n "${WAM_NETWORK_INTERFACE:-}" ]; then
  node_ip="$("$WAM_PY" -m verl_omni.trainer.launch_env node-ip --interface "$WAM_NETWORK_INTERFACE")"
fi
ray_start=("$WAM_PY" -m ray.scripts.scripts start --temp-dir "$my_ray_tmp" --disable-usage-stats)
if [ -n "$node_ip" ]; then
  ray_start+=(--node-ip-address "$node_ip")
fi
if [ "$WAM_GPUS_PER_NODE" -gt 0 ]; then
  ray_start+=(--num-gpus "$WAM_GPUS_PER_NODE")
fi
stop_own_ray() { "$WAM_PY" -m verl_omni.trainer.launch_env stop-ray --temp-dir "$my_ray_tmp" || true; }

# A scheduler's preemption (Kubernetes, Slurm's scancel) signals this script, not the driver. The driver runs in
# the background so that the signal is passed on at once (bash runs a trap only after a foreground command ends):
# the first SIGTERM or Ctrl-C asks the driver to finish its step, save it and exit 143; a second stops it at once.
# Ctrl-C is passed on as SIGTERM because a background job starts with SIGINT ignored.
driver_pid=""
forward_stop() {
  if [ -n "$driver_pid" ] && kill -0 "$driver_pid" 2>/dev/null; then
    echo "launch.sh: $1 received; passing SIGTERM to the driver (pid $driver_pid): it finishes the step, saves it" \
      "and exits 143; signal again to stop it at once" >&2
    kill -TERM "$driver_pid" 2>/dev/null || true
  fi
}

run_driver() {
  local log="$logs/driver_$stamp.log" rc
  echo "driver log: $log; TensorBoard: tensorboard --logdir $WAM_OUTPUT_DIR"
  set +e
  "${driver_cmd[@]}" > >(tee -a "$log") 2>&1 &
  driver_pid=$!
  trap 'forward_stop SIGTERM' TERM
  trap 'forward_stop SIGINT' INT
  # wait returns early (> 128) when a trapped signal arrives while the driver still runs; bash keeps the exit
  # status of a reaped background job, so the last wait returns the driver's own code.
  while kill -0 "$driver_pid" 2>/dev/null; do
    wait "$driver_pid"
  done
  wait "$driver_pid"
  rc=$?
  trap 'exit 130' INT TERM
  set -e
  echo "driver exited with code $rc"
  return "$rc"
}

if [ "$NNODES" -eq 1 ]; then
  # Single node: the driver starts a private local Ray runtime itself.
  unset RAY_ADDRESS
  run_driver
  exit $?
fi

head_address="$MASTER_ADDR:$RAY_PORT"
if [ "$NODE_RANK" -eq 0 ]; then
  trap 'stop_own_ray; cleanup_work' EXIT
  trap 'exit 130' INT TERM
  echo "starting the Ray head on port $RAY_PORT (temp dir $my_ray_tmp)"
  "${ray_start[@]}" --head --port "$RAY_PORT" "--include-dashboard=${WAM_RAY_DASHBOARD:-true}" >"$logs/ray_head_$stamp.log" 2>&1 ||
    wam_die "ray start --head failed, see $logs/ray_head_$stamp.log (is RAY_PORT=$RAY_PORT free?)"
  "$WAM_PY" -m verl_omni.trainer.launch_env wait-nodes --address "$head_address" --expected "$NNODES" \
    --timeout "$WAM_NODE_WAIT_TIMEOUT" || exit 1
  export RAY_ADDRESS="$head_address"
  run_driver
  exit $?
fi

# Worker node: join the head and stay until it is gone.
"$WAM_PY" -m verl_omni.trainer.launch_env wait-port --address "$head_address" --timeout "$WAM_NODE_WAIT_TIMEOUT" ||
  exit 1
trap 'stop_own_ray; cleanup_work' EXIT
trap 'exit 130' INT TERM
echo "node $NODE_RANK joining the Ray head at $head_address (temp dir $my_ray_tmp)"
"${ray_start[@]}" --address "$head_address" >"$logs/ray_node${NODE_RANK}_$stamp.log" 2>&1 ||
  wam_die "ray start --address $head_address failed, see $logs/ray_node${NODE_RANK}_$stamp.log"
"$WAM_PY" -m verl_omni.trainer.launch_env follow-head --address "$head_address" --temp-dir "$my_ray_tmp"
