#!/usr/bin/env bash
# Fail-closed contract check of the official Stage-III recipe (wnm-3d-stage3-navigation-grpo-r1).
#
#   bash recipes/wnm_3d/stage3/validate.sh
#
# Loads paths.env (or the file named by WAM_PATHS_ENV), then checks paths, dataset manifests, checkpoint
# contracts, referenced videos and scenes, topology divisibility and the locked algorithm constants.
# Prints STAGE3_CONFIG_CONTRACT_OK and exits 0 only when everything holds. Starts nothing, writes nothing.
set -euo pipefail
# shellcheck source=recipes/wnm_3d/stage3/_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"

if [ "$#" -gt 0 ]; then
  wam_die "validate.sh takes no arguments (got: $*); settings come from paths.env, see paths.env.example"
fi
wam_load_paths_env
exec "$WAM_PY" -m verl_omni.trainer.contract_check --config-dir "$WAM_RECIPE_DIR/config" \
  --paths-env "$WAM_PATHS_ENV_FILE"
