#!/usr/bin/env bash
# WNM-3D-RL quickstart: the whole Stage-III pipeline on the embedded synthetic world, with the same
# commands a user runs on real data. Needs no GPU, weights or downloads beyond the Python packages.
#
#   bash scripts/quickstart.sh              # workspace in ./workspace (refuses to overwrite it)
#   bash scripts/quickstart.sh --force      # delete ./workspace first
#   bash scripts/quickstart.sh --smallest   # CI-sized: fewer episodes, SFT steps, GRPO steps, eval episodes
#
# WNM_WORKSPACE=DIR picks another workspace directory. Steps:
#   1 synthesize a GN0 collection + InteriorGS-layout scenes      tools/data/synthesize_gn0_collection.py
#   2 Stage-II stand-in: tiny WNM checkpoint, flow-matching SFT   tools/checkpoint/make_tiny_wnm_checkpoint.py
#   3 convert -> sample -> event-balanced validation              tools/data/*.py
#   4 paths.env for this workspace, contract check                recipes/wnm_3d/stage3/validate.sh
#   5 Stage-III GRPO through Ray (CPU workers when no GPU)         recipes/wnm_3d/stage3/launch.sh
#   6 export the trained DiT into a complete checkpoint           tools/checkpoint/export_wnm_checkpoint.py
#   7 closed-loop evaluation, Stage-II vs Stage-III, held-out     tools/eval/closed_loop_eval.py
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"

force=0
smallest=0
for arg in "$@"; do
  case "$arg" in
    --force) force=1 ;;
    --smallest) smallest=1 ;;
    -h | --help)
      sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'
      exit 0
      ;;
    *)
      echo "error: unknown argument $arg (see --help)" >&2
      exit 2
      ;;
  esac
done

WS="${WNM_WORKSPACE:-$REPO/workspace}"
case "$WS" in /*) ;; *) WS="$REPO/$WS" ;; esac
if [ -e "$WS" ] && [ -n "$(ls -A "$WS" 2>/dev/null)" ]; then
  if [ "$force" -ne 1 ]; then
    echo "error: workspace $WS already exists and is not empty; pass --force to rebuild it or set WNM_WORKSPACE" >&2
    exit 2
  fi
  rm -rf "$WS"
fi

if [ "$smallest" -eq 1 ]; then
  SCENES=3 EPISODES=4 SFT_STEPS=10 SFT_BATCH=4 TRAIN_SIZE=2 GRPO_STEPS=1 EVAL_EPISODES=2 EVAL_SCENES=2 EVAL_MAX_STEPS=8
  IMAGE=64
else
  # Sized for two CPU cores: the recipe's prompt batch resolves to the training size (4 prompts x 16
  # rollouts per step), each GRPO step takes about a minute there. 300 SFT steps of 8 rows with the action
  # loss weighted 4x are what it takes for the tiny stand-in to drive instead of stopping at its first call.
  # The evaluation's 24 episodes (6 held-out scenes) are what it takes to show its progress above zero.
  SCENES=6 EPISODES=4 SFT_STEPS=300 SFT_BATCH=8 TRAIN_SIZE=4 GRPO_STEPS=2 EVAL_EPISODES=24 EVAL_SCENES=6 EVAL_MAX_STEPS=48
  IMAGE=64
fi

source scripts/_env.sh
wnm_ensure_venv
PY="$VENV/bin/python"
export PYTHONHASHSEED=0 OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

t_start=$(date +%s)
step() { printf '\n== [%s] %s (%ss)\n' "$1" "$2" "$(($(date +%s) - t_start))"; }

mkdir -p "$WS"
# The one-room task level: the goal object is in view after a turn in nearly every episode, which is what a
# policy trained for a few CPU minutes can hope to use (verl_omni/sim/levels.py).
LEVEL=one_room
step 1 "synthesize a GN0 collection: $SCENES scenes x $EPISODES episodes, ${IMAGE}px, level $LEVEL"
"$PY" tools/data/synthesize_gn0_collection.py --output-dir "$WS/collection" --occupancy-dir "$WS/scenes" \
  --num-scenes "$SCENES" --episodes-per-scene "$EPISODES" --image-size "$IMAGE" --seed 7 --workers 2 --level "$LEVEL"

step 2 "Stage-II stand-in: tiny WNM checkpoint with $SFT_STEPS flow-matching SFT steps"
"$PY" tools/checkpoint/make_tiny_wnm_checkpoint.py --output-dir "$WS/stage2" --collection "$WS/collection" \
  --sft-steps "$SFT_STEPS" --batch-size "$SFT_BATCH" --action-weight 4 --max-queries 400 --no-progress

step 3 "convert, sample $TRAIN_SIZE training rows, build event-balanced validation"
"$PY" tools/data/convert_interiorgs_dagger_to_rlhf.py --input-root "$WS/collection" --output-dir "$WS/converted" \
  --checkpoint "$WS/stage2" --occupancy-root "$WS/scenes" --shard-size 2048 --val-fraction 0 --split-seed 42 \
  --workers 2 --worker-prefetch 4
"$PY" tools/data/sample_stage3_train.py --source-manifest "$WS/converted/manifest.json" --output-dir "$WS/train" \
  --train-size "$TRAIN_SIZE" --shard-size 2048 --seed 42
"$PY" tools/data/build_vggt_stage3_event_val.py --input-root "$WS/collection" --output-dir "$WS/eventval" \
  --checkpoint "$WS/stage2" --exclude-parquet-dir "$WS/train" --occupancy-root "$WS/scenes" --per-event 1 \
  --workers 2
val_rows=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['counts']['rows'])" "$WS/eventval/manifest.json")

step 4 "paths.env for this workspace and the contract check"
cat >"$WS/paths.env" <<ENV
# Written by scripts/quickstart.sh for the synthetic workspace $WS
WNM3D_SOURCE_ROOT=
WNM3D_INITIAL_CHECKPOINT=$WS/stage2
WAM_DATA_CONTRACT_CHECKPOINT=$WS/stage2
WAM_DATA_ROOT=$WS/train
WAM_EVENT_VAL_FILE=$WS/eventval
WAM_EXPECTED_TRAIN_SIZE=$TRAIN_SIZE
WAM_VAL_MAX_SAMPLES=$val_rows
WAM_OUTPUT_DIR=$WS/stage3
WAM_TOTAL_STEPS=$GRPO_STEPS
WAM_SAVE_FREQ=$GRPO_STEPS
WAM_VAL_FREQ=$GRPO_STEPS
WAM_CPU_WORKERS=2
WAM_REWARD_WORKERS=1
ENV
export WAM_PATHS_ENV="$WS/paths.env"
bash recipes/wnm_3d/stage3/validate.sh

step 5 "Stage-III GRPO: $GRPO_STEPS step(s) through Ray"
bash recipes/wnm_3d/stage3/launch.sh
latest=$(cat "$WS/stage3/latest_checkpointed_iteration.txt")

step 6 "export global_step_$latest into a complete checkpoint"
"$PY" tools/checkpoint/export_wnm_checkpoint.py --base-vln "$WS/stage2" \
  --actor-checkpoint "$WS/stage3/global_step_$latest/actor" --output-dir "$WS/stage3_export" --dry-run | tail -n 5
"$PY" tools/checkpoint/export_wnm_checkpoint.py --base-vln "$WS/stage2" \
  --actor-checkpoint "$WS/stage3/global_step_$latest/actor" --output-dir "$WS/stage3_export"

step 7 "closed-loop evaluation on held-out scenes: Stage-II vs Stage-III, beside the goal-bearing reference"
# The checkpoints replan every 3 action steps, as the Stage-II evaluations do. 24 episodes in 6 scenes, so that
# the report can tell the stand-in's mean progress from zero (docs/results.md: +0.47 m [+0.08, +0.86]; 8 episodes
# gave +0.79 m [-0.40, +1.98]); about 200 s of the quickstart's 10 minutes on 2 cores.
"$PY" tools/eval/closed_loop_eval.py --checkpoint "$WS/stage2" --compare "$WS/stage3_export" --policy goal_bearing \
  --level "$LEVEL" --synthesize "$EVAL_SCENES" --seed 1 --episodes "$EVAL_EPISODES" --max-steps "$EVAL_MAX_STEPS" --num-steps 4 \
  --execute-steps 3 --output-dir "$WS/eval" --no-progress
progress=$("$PY" -c "
import json, sys
runs = json.load(open(sys.argv[1]))['runs']
print(', '.join(f\"{r['label']} {r['aggregate']['progress']['mean']:+.2f} m\" for r in runs.values()))
" "$WS/eval/report.json")

step done "quickstart finished"
cat <<SUMMARY

Workspace:            $WS
  collection/ scenes/ GN0 collection and occupancy scenes (synthetic)
  stage2/             Stage-II stand-in checkpoint (tiny, flow-matching SFT)
  train/ eventval/    converted training subset and event-balanced validation (Parquet + manifest.json)
  paths.env           the recipe's machine-local settings for this workspace
  stage3/             run directory: checkpoints global_step_N/, metrics.jsonl, timing.txt, tensorboard/
  stage3_export/      complete Stage-III checkpoint (exported)
  eval/               closed-loop report.json and trajectories.png
TensorBoard:          $VENV/bin/tensorboard --logdir "$WS/stage3"
Closed-loop report:   $WS/eval/report.json
Geodesic progress:    $progress (mean per episode toward the goal)
Trajectory plot:      $WS/eval/trajectories.png
Total time:           $(($(date +%s) - t_start)) s
SUMMARY
