#!/usr/bin/env bash
# confirm_sort_long in sittings, as pre-registered (docs/preregistration/confirm_sort_long.md):
# calibrate every warm start first (two at a time; a warm start already calibrated is skipped, and its
# build is cached), then run the sweep, which resumes interrupted runs and leaves finished ones alone.
# Run the same command again in the next sitting. About 10 core-hours on 2 cores in all.
#
#   experiments/confirm_sort_long.sh            # calibrations to cal/confirm_sort_long/, runs to multirun/
set -euo pipefail
cd "$(dirname "$0")/.."
out=cal/confirm_sort_long
mkdir -p "$out"
# One driver at a time: a second one would calibrate and train the same runs twice.
exec 9> "$out/.driver.lock"
flock -n 9 || { echo "confirm_sort_long.sh: another driver is running (it holds $out/.driver.lock)" >&2; exit 1; }
calibrate() {
  local w=$1
  [[ -e $out/ws$w/calibration.json ]] && return 0
  moe-rl-calibrate task=sort_long objective=grpo trainer.lr=1e-4 trainer.grad_clip=null trainer.threads=1 \
    "warmstart.build_seed=$w" eval.size=128 --batches 3 --lrs 1e-4,3e-4,1e-3,3e-3 --drift "" --weight-noise "" \
    --logit-noise 0.1,0.2,0.3,0.4 --out "$out/ws$w" > "$out/ws$w.log" 2>&1
}
export -f calibrate
export out
printf '%s\n' 0 1 2 3 4 5 | xargs -P 2 -I{} bash -c 'calibrate {}'
moe-rl-calibrate --summarize "$out"/ws? --out "$out/summary"
experiments/reproduce.sh confirm_sort_long hydra/launcher=joblib_local trainer.threads=1 resume=true
