#!/usr/bin/env bash
# Stage II on `two_rooms` from one command: a one_room round 0, then two_rooms rounds that start from it.
#
#   bash scripts/stage2_curriculum.sh RUN_DIR [extra train_stage2.py flags for every step]
#
# Steps (each one reuses what an earlier call finished, so the command resumes where it was cut off, e.g. on a GPU
# machine that gives 10 minutes a call; a round cut off during SFT keeps its encoded rows):
#   1. the one_room round-0 collection;
#   2. the two_rooms round-0 collection, in the background on SYN_WORKERS cores, while
#   3. the one_room round 0 trains on the GPU and is evaluated;
#   4. two_rooms rounds 0..ROUNDS-1 from the one_room checkpoint (--init-checkpoint), DAgger from round 1,
#      each evaluated with and without the STOP gate on the held-out episodes. Each DAgger round trains on the
#      whole 800-scene round-0 collection plus its own rows (about 10% of the states): from scratch with
#      ROUNDS=2 and --sft-autocast bfloat16 this gave SR 0.193 on the held-out two_rooms episodes in session 19
#      (1,619 s on one H200), from a round 0 at 0.237 (evaluated in session 21), against 0.318 for the
#      TWO_ROOMS_FROM round below in session 15 (docs/results.md).
#
# DAgger rounds from a carried checkpoint: with TWO_ROOMS_FROM=CKPT (a two_rooms round of an earlier run, e.g. one
# brought back from a GPU machine that has since gone), steps 1-4 are replaced by one train_stage2.py run in
# RUN_DIR/two_rooms_dagger whose round 0 is CKPT unchanged (--sft-steps 0) over a fresh REPLAY_SCENES-scene round-0
# collection (400), and whose rounds 1..ROUNDS-1 are DAgger rounds driven from it that aggregate that collection
# with their own (ROUNDS=2: one DAgger round, 739 s on one H200 in session 15, where it raised the two_rooms SR from
# 0.220 to 0.318; from session 19's round 0 in session 21 it lowered it from 0.237 to 0.158, so one DAgger round
# spreads from -0.08 to +0.10 SR; docs/results.md).
# All those rounds were collected before the expert could label a robot pressed against a wall (session 23): the
# learner's contacts were dropped from its DAgger rows. Rounds run now label them: session 24 ran the session-21
# round from the same round 0 again with them (768 s on one H200) and got 0.233 instead of 0.158 (round 0: 0.237),
# with collisions per episode halved (4.31 -> 2.26).
#
# Chained DAgger rounds: with CHAINED_ROUNDS=N, round 0 is followed by N DAgger rounds, each one train_stage2.py run
# in RUN_DIR/two_rooms_chain_<k> whose round 0 is the previous round's checkpoint unchanged and whose round 1 is a
# DAgger round driven from it over the REPLAY_SCENES replay collection (made once, hard-linked into the later
# rounds) plus its own rows; round 0 is TWO_ROOMS_FROM if given, else the two_rooms round 0 trained by steps 1-4
# (which then train round 0 only). Every chained round drives the same DAGGER_SCENES scenes with the newer policy.
# From round 2 on, a round takes over the replay rows the round before it encoded (train_stage2.py --reuse-encoded:
# the trained encoders' features are recomputed; nothing is decoded or run through the VAE again, about 170 s of
# an H100 a round at session 25's rates). CHAINED_EVAL=last evaluates only the last chained round (default all).
# From scratch (or ONE_ROOM_FROM), the replay collection is synthesized in the background beside the two_rooms round 0.
# Issue 17's Stage-II checkpoint came from this (docs/results.md, session 25): session 19's round 0 (from scratch,
# ROUND0_SFT_AUTOCAST=bfloat16) -> 0.237, chained round 1 -> 0.233 (session 24), chained round 2 -> 0.297-0.300
# (session 25, one H100, 1,109 s beside a Stage-III run), all float32 rounds, seed 0:
#
#   ROUND0_SFT_AUTOCAST=bfloat16 CHAINED_ROUNDS=2 bash scripts/stage2_curriculum.sh RUN
#
# Session 29 ran this command on one H100 as far as a session's device time went: steps 1-4 took 1,128 s (compiled
# SFT, 348 s for both rounds 0; loads bound by decoding, 478 s waiting) and gave a two_rooms round 0 at SR 0.180
# against session 19's 0.237, open-loop the same model. The chained rounds then go on from a carried round 0 with
# TWO_ROOMS_FROM=CKPT CHAINED_ROUNDS=2 (below; about 900-1,000 s at that run's rates).
# Session 30 ran those chained rounds from that round 0 on one H100 (TWO_ROOMS_EVAL_PLAIN=0): 1,276 s, R1 and R2
# both at SR 0.263 [0.222, 0.308], +0.083 over the round 0 (docs/results.md, "Session 30").
#
# From a carried one_room checkpoint: with ONE_ROOM_FROM=CKPT (a one_room round 0 of an earlier run), steps 1 and 3
# are skipped and the two_rooms collection is synthesized on all WORKERS before its rounds start from CKPT.
#
# Settings (environment): DEVICE (cuda), WORKERS (all cores), SYN_WORKERS (WORKERS - 4), ONE_ROOM_SCENES (200),
# TWO_ROOMS_SCENES (800), ROUNDS (2), DAGGER_SCENES (200), ONE_ROOM_STEPS (2000), TWO_ROOMS_STEPS (2000),
# ROUND_STEPS (1000), EVAL_SEED (2000), SEED (0), ONE_ROOM_EVAL (1; 0 skips the one_room evaluation),
# EVAL_EXECUTE_STEPS (3: the checkpoints replan every 3 action steps in the closed-loop evaluations, measured
# against 8, one chunk, in docs/results.md; reports of other values than 8 are labelled <name>_x<steps>),
# DAGGER_EXECUTE_STEPS (3: steps the DAgger behaviour policy executes per call, as the evaluation replans; 8 drives
# whole chunks), TWO_ROOMS_EVAL_ROUNDS (the two_rooms rounds to evaluate, e.g. "1", or none; default all; with
# CHAINED_ROUNDS only 0 or none, and none with CHAINED_EVAL=last leaves the last chained round the only closed-loop
# pass),
# TWO_ROOMS_EVAL_PLAIN (1; 0 evaluates the two_rooms rounds with their STOP gate only, one closed-loop pass a round
# less), TWO_ROOMS_FROM, REPLAY_SCENES, CHAINED_ROUNDS and CHAINED_EVAL (above), ROUND0_SFT_AUTOCAST
# (--sft-autocast of the two round-0 trainings of steps 3-4 only, e.g. bfloat16; default float32), SFT_COMPILE
# (auto: compiled DiT blocks in every SFT on a GPU; below), STAGE2_MODEL (the model's --set flags; default the
# 8-layer x 256 model below). Extra flags go to every train_stage2.py call after the recipe's own, so they override it (e.g.
# --eval-episodes 100, or --dagger-share 0.05 to draw that share of every DAgger-round batch from the round's own
# rows instead of their share of the aggregate, about 10% here; not yet measured on the GPU). The recipe is the one docs/results.md reports (session 11: one H200, 8-layer x 256 model,
# goal point `nearest`, batch 128 on one_room and 256 on two_rooms).
set -euo pipefail
if [ $# -lt 1 ]; then
  echo "usage: bash scripts/stage2_curriculum.sh RUN_DIR [extra train_stage2.py flags]" >&2
  exit 2
fi
RUN=$(realpath -m "$1") # before the cd below, so that a relative RUN_DIR means the caller's folder
shift
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
DEVICE=${DEVICE:-cuda}
WORKERS=${WORKERS:-$(nproc)}
SYN_WORKERS=${SYN_WORKERS:-$((WORKERS > 5 ? WORKERS - 4 : 1))}
ONE_ROOM_SCENES=${ONE_ROOM_SCENES:-200}
TWO_ROOMS_SCENES=${TWO_ROOMS_SCENES:-800}
ROUNDS=${ROUNDS:-2}
DAGGER_SCENES=${DAGGER_SCENES:-200}
EVAL_SEED=${EVAL_SEED:-2000}
SEED=${SEED:-0}
ONE_ROOM_STEPS=${ONE_ROOM_STEPS:-2000}
TWO_ROOMS_STEPS=${TWO_ROOMS_STEPS:-2000}
ROUND_STEPS=${ROUND_STEPS:-1000}
CHAINED_ROUNDS=${CHAINED_ROUNDS:-0}
CHAINED_EVAL=${CHAINED_EVAL:-all}
if [ "$CHAINED_EVAL" != all ] && [ "$CHAINED_EVAL" != last ]; then
  echo "CHAINED_EVAL=$CHAINED_EVAL: expected 'all' (every chained round evaluated) or 'last' (only the last one)" >&2
  exit 2
fi
if ! [[ "$CHAINED_ROUNDS" =~ ^[0-9]+$ ]]; then
  echo "CHAINED_ROUNDS=$CHAINED_ROUNDS: expected a whole number of chained DAgger rounds (0 = none)" >&2
  exit 2
fi
if [ "$CHAINED_ROUNDS" -gt 0 ] && [ -n "${TWO_ROOMS_EVAL_ROUNDS:-}" ] && [ "$TWO_ROOMS_EVAL_ROUNDS" != 0 ] \
  && [ "$TWO_ROOMS_EVAL_ROUNDS" != none ]; then
  # Refused here, not after the one_room round has trained: the two_rooms run then holds round 0 only, and every
  # chained round evaluates itself.
  echo "TWO_ROOMS_EVAL_ROUNDS=$TWO_ROOMS_EVAL_ROUNDS with CHAINED_ROUNDS=$CHAINED_ROUNDS: the two_rooms run has round 0" \
    "only (each chained round is evaluated by its own run); use TWO_ROOMS_EVAL_ROUNDS=0, none or leave it unset" >&2
  exit 2
fi
# Compiled DiT blocks (train_stage2.py --compile-blocks) for every SFT of the command: on by default on a GPU, where
# the eager SFT step is bound by launching ~5,000 small operators a step (session 28, one H100, bf16, batch 256,
# in situ: 52.8 ms a step compiled against 109-112 ms eager, after about 25 s of compiling once per round's
# process). SFT_COMPILE=1 compiles on any device, 0 trains eagerly.
SFT_COMPILE=${SFT_COMPILE:-auto}
case "$SFT_COMPILE" in
  1) COMPILE=(--compile-blocks) ;;
  0) COMPILE=() ;;
  auto) if [[ "$DEVICE" == cuda* ]]; then COMPILE=(--compile-blocks); else COMPILE=(); fi ;;
  *)
    echo "SFT_COMPILE=$SFT_COMPILE: expected auto (compiled blocks on a GPU), 1 (always) or 0 (never)" >&2
    exit 2
    ;;
esac
ROUND0_AUTOCAST=()
if [ -n "${ROUND0_SFT_AUTOCAST:-}" ]; then ROUND0_AUTOCAST=(--sft-autocast "$ROUND0_SFT_AUTOCAST"); fi
ONE_EVAL=()
if [ "${ONE_ROOM_EVAL:-1}" = 0 ]; then ONE_EVAL=(--eval-rounds); fi
TWO_EVAL=()
if [ "${TWO_ROOMS_EVAL_ROUNDS:-}" = none ]; then
  TWO_EVAL=(--eval-rounds) # no two_rooms round of that run is evaluated
elif [ -n "${TWO_ROOMS_EVAL_ROUNDS:-}" ]; then
  # shellcheck disable=SC2206  # word splitting of TWO_ROOMS_EVAL_ROUNDS is intended
  TWO_EVAL=(--eval-rounds $TWO_ROOMS_EVAL_ROUNDS)
fi
if [ "${TWO_ROOMS_EVAL_PLAIN:-1}" = 0 ]; then TWO_EVAL+=(--no-eval-plain); fi

TASK=(--episodes-per-scene 4 --goal-variants 3 --face-goal-object --goal-point nearest --seed "$SEED")
COMMON=("${TASK[@]}" --device "$DEVICE" --lr 5e-4 --eval-scenes 40 --eval-episodes 400 --eval-seed "$EVAL_SEED"
  --probe-states 256 --eval-execute-steps "${EVAL_EXECUTE_STEPS:-3}"
  --dagger-execute-steps "${DAGGER_EXECUTE_STEPS:-3}" --skip-baselines --view-aux-weight 1
  --independent-action-noise 0.5 --no-progress "${COMPILE[@]}")
# shellcheck disable=SC2206  # word splitting of STAGE2_MODEL is intended
MODEL=(${STAGE2_MODEL:---set num_layers=8 --set num_heads=8 --set ffn_dim=1024 --set text_max_length=64})
ONE=(--workdir "$RUN/one_room" --level one_room --scenes "$ONE_ROOM_SCENES")
TWO=(--workdir "$RUN/two_rooms" --level two_rooms --scenes "$TWO_ROOMS_SCENES")

stamp() { echo "[curriculum $(date +%H:%M:%S)] $*"; }

# chain_rounds FROM [extra flags]: CHAINED_ROUNDS DAgger rounds, round k one train_stage2.py run from round k-1.
chain_rounds() {
  local from=$1 k dir prev=""
  shift
  local eval_flags reuse
  for k in $(seq 1 "$CHAINED_ROUNDS"); do
    dir="$RUN/two_rooms_chain_$k"
    eval_flags=(--eval-rounds 1)
    if [ "$CHAINED_EVAL" = last ] && [ "$k" -lt "$CHAINED_ROUNDS" ]; then eval_flags=(--eval-rounds); fi
    if [ "${TWO_ROOMS_EVAL_PLAIN:-1}" = 0 ]; then eval_flags+=(--no-eval-plain); fi
    reuse=()
    # The replay collection depends only on the task flags, the same in every round: synthesize it once, and take
    # over its rows from the round before (train_stage2.py --reuse-encoded checks that they fit this round's model).
    if [ -n "$prev" ]; then
      if [ ! -e "$dir/data/r0" ] && [ -f "$prev/data/r0/collection.json" ]; then
        mkdir -p "$dir/data"
        cp -al "$prev/data/r0" "$dir/data/r0"
        cp -al "$prev/data/r0_occ" "$dir/data/r0_occ"
      fi
      reuse=(--reuse-encoded "$prev")
    fi
    stamp "chained DAgger round $k of $CHAINED_ROUNDS from $from ($REPLAY_SCENES replay scenes)"
    "$PY" scripts/train_stage2.py --workdir "$dir" --level two_rooms --scenes "$REPLAY_SCENES" "${COMMON[@]}" \
      --workers "$WORKERS" --rounds 2 --sft-steps 0 --round-steps "$ROUND_STEPS" --batch-size 256 \
      --dagger-scenes "$DAGGER_SCENES" --eval-stop-gate "${eval_flags[@]}" --init-checkpoint "$from" "${reuse[@]}" \
      "$@"
    from="$dir/ckpt/stage2_r1"
    prev=$dir
  done
  stamp "done: the last chained round is $from ($prev/summary.md)"
}

if [ -n "${TWO_ROOMS_FROM:-}" ]; then
  FROM=$(realpath -m "$TWO_ROOMS_FROM")
  if [ ! -f "$FROM/checkpoint_manifest.json" ]; then
    echo "TWO_ROOMS_FROM=$TWO_ROOMS_FROM: not a complete WNM checkpoint (no checkpoint_manifest.json)" >&2
    exit 2
  fi
  REPLAY_SCENES=${REPLAY_SCENES:-400}
  if [ "$CHAINED_ROUNDS" -gt 0 ]; then
    chain_rounds "$FROM" "$@"
    exit 0
  fi
  if [ "$ROUNDS" -lt 2 ]; then
    echo "TWO_ROOMS_FROM needs ROUNDS >= 2 (round 0 is the carried checkpoint; round 1 is the first DAgger round)" >&2
    exit 2
  fi
  stamp "two_rooms DAgger rounds 1..$((ROUNDS - 1)) from $FROM (round 0 unchanged, $REPLAY_SCENES replay scenes)"
  # shellcheck disable=SC2046  # word splitting of seq's output is intended
  "$PY" scripts/train_stage2.py --workdir "$RUN/two_rooms_dagger" --level two_rooms --scenes "$REPLAY_SCENES" \
    "${COMMON[@]}" --workers "$WORKERS" --rounds "$ROUNDS" --sft-steps 0 --round-steps "$ROUND_STEPS" \
    --batch-size 256 --dagger-scenes "$DAGGER_SCENES" --eval-stop-gate --eval-rounds $(seq 1 $((ROUNDS - 1))) \
    "${TWO_EVAL[@]}" --init-checkpoint "$FROM" "$@"
  stamp "done: $RUN/two_rooms_dagger/summary.md"
  exit 0
fi

ONE_CKPT="$RUN/one_room/ckpt/stage2_r0"
if [ -n "${ONE_ROOM_FROM:-}" ]; then
  ONE_CKPT=$(realpath -m "$ONE_ROOM_FROM")
  if [ ! -f "$ONE_CKPT/checkpoint_manifest.json" ]; then
    echo "ONE_ROOM_FROM=$ONE_ROOM_FROM: not a complete WNM checkpoint (no checkpoint_manifest.json)" >&2
    exit 2
  fi
  stamp "1-3/4 skipped: the one_room round 0 is $ONE_CKPT; two_rooms collection ($TWO_ROOMS_SCENES scenes)"
  "$PY" scripts/train_stage2.py "${TWO[@]}" "${MODEL[@]}" "${COMMON[@]}" --workers "$WORKERS" --synthesize-only "$@"
else
  stamp "1/4 one_room collection ($ONE_ROOM_SCENES scenes)"
  "$PY" scripts/train_stage2.py "${ONE[@]}" "${MODEL[@]}" "${COMMON[@]}" --workers "$WORKERS" --synthesize-only "$@"

  stamp "2/4 two_rooms collection ($TWO_ROOMS_SCENES scenes) in the background on $SYN_WORKERS cores"
  "$PY" scripts/train_stage2.py "${TWO[@]}" "${MODEL[@]}" "${COMMON[@]}" --workers "$SYN_WORKERS" --synthesize-only \
    "$@" > "$RUN/two_rooms_synthesis.log" 2>&1 &
  SYN=$!
  trap 'kill $SYN 2>/dev/null || true' EXIT

  stamp "3/4 one_room round 0 ($ONE_ROOM_STEPS SFT steps of 128 rows)"
  "$PY" scripts/train_stage2.py "${ONE[@]}" "${MODEL[@]}" "${COMMON[@]}" --workers "$WORKERS" --rounds 1 \
    --sft-steps "$ONE_ROOM_STEPS" --batch-size 128 "${ONE_EVAL[@]}" "${ROUND0_AUTOCAST[@]}" "$@"
  if ! wait $SYN; then
    echo "two_rooms synthesis failed; its log: $RUN/two_rooms_synthesis.log" >&2
    tail -20 "$RUN/two_rooms_synthesis.log" >&2
    exit 1
  fi
  trap - EXIT
fi

TWO_ROUNDS=$ROUNDS
REPLAY_SYN=""
if [ "$CHAINED_ROUNDS" -gt 0 ]; then
  TWO_ROUNDS=1 # the DAgger rounds are the chained ones below
  REPLAY_SCENES=${REPLAY_SCENES:-400}
  if [ ! -f "$RUN/two_rooms_chain_1/data/r0/collection.json" ]; then
    # The chained rounds' replay collection needs only the CPU: synthesize it while the GPU trains round 0 (each
    # scene's randomness comes from the seed and its index, so the data are those the first round would make).
    stamp "replay collection ($REPLAY_SCENES scenes) in the background on $SYN_WORKERS cores"
    "$PY" scripts/train_stage2.py --workdir "$RUN/two_rooms_chain_1" --level two_rooms --scenes "$REPLAY_SCENES" \
      "${MODEL[@]}" "${COMMON[@]}" --workers "$SYN_WORKERS" --synthesize-only "$@" > "$RUN/replay_synthesis.log" 2>&1 &
    REPLAY_SYN=$!
    trap 'kill $REPLAY_SYN 2>/dev/null || true' EXIT
  fi
fi
stamp "4/4 two_rooms rounds 0..$((TWO_ROUNDS - 1)) from the one_room checkpoint"
"$PY" scripts/train_stage2.py "${TWO[@]}" "${COMMON[@]}" --workers "$WORKERS" --rounds "$TWO_ROUNDS" \
  --sft-steps "$TWO_ROOMS_STEPS" --round-steps "$ROUND_STEPS" --batch-size 256 --dagger-scenes "$DAGGER_SCENES" \
  --eval-stop-gate "${TWO_EVAL[@]}" --init-checkpoint "$ONE_CKPT" "${ROUND0_AUTOCAST[@]}" "$@"
stamp "done: $RUN/two_rooms/summary.md"
if [ "$CHAINED_ROUNDS" -gt 0 ]; then
  if [ -n "$REPLAY_SYN" ]; then
    if ! wait "$REPLAY_SYN"; then
      echo "replay synthesis failed; its log: $RUN/replay_synthesis.log" >&2
      tail -20 "$RUN/replay_synthesis.log" >&2
      exit 1
    fi
    trap - EXIT
  fi
  chain_rounds "$RUN/two_rooms/ckpt/stage2_r0" "$@"
fi
