#!/usr/bin/env bash
# confirm_sort_long in sittings, as pre-registered (docs/preregistration/confirm_sort_long.md, amendment 1):
# warm start slowest. For each warm start: calibrate it (which builds and caches it), run its 16 runs
# (resume=true: a finished run is left as it is), and pack the finished runs' records into one archive,
# published to the record store (docs/results/confirm_sort_long/records.json, moe_rl/records.py). A sitting
# starts by fetching and unpacking what earlier sittings published. Commit docs/results/confirm_sort_long/
# (and `wandb sync` the published artifact) at the end of every sitting, then run the
# same command in the next one. It prints counts only; the report is written once all 96 runs are done.
#
#   experiments/confirm_sort_long.sh              # warm starts 0-5, in order
#   WARM_STARTS="2 3" experiments/confirm_sort_long.sh
# Give a sitting only the warm starts it can finish (amendment 2): a build on another machine's CPU model is
# another policy. One warm start is about 2 core-hours: 16 runs of about 4.5 core-minutes, and its build and
# calibration (43 min on a machine shared with other work).
set -euo pipefail
cd "$(dirname "$0")/.."
source experiments/lib/sittings.sh
sittings_begin confirm_sort_long   # sweep, keep (committed: calibrations, records.json), work (not: full output, logs)
mkdir -p "$keep/calibration"
for w in ${WARM_STARTS:-0 1 2 3 4 5}; do
  if [[ ! -e $keep/calibration/ws$w/calibration.json ]]; then
    moe-rl-calibrate task=sort_long objective=grpo trainer.lr=1e-4 trainer.grad_clip=null trainer.threads=1 \
      "warmstart.build_seed=$w" eval.size=128 --batches 3 --lrs 1e-4,3e-4,1e-3,3e-3 --drift "" --weight-noise "" \
      --logit-noise 0.1,0.2,0.3,0.4 --out "$work/ws$w" > "$work/ws$w.log" 2>&1
    mkdir -p "$keep/calibration/ws$w"
    cp "$work/ws$w"/calibration.{json,md} "$keep/calibration/ws$w/"
  fi
  common=("warmstart.build_seed=$w" hydra/launcher=joblib_local trainer.threads=1 resume=true logger.progress=false)
  moe-rl-train -m "+experiment=$name" "hydra.sweep.dir=$sweep/ws$w" "${common[@]}"
  moe-rl-train -m "+experiment=${name}__gspo_lr2e4" "hydra.sweep.dir=$sweep/ws$w/gspo_lr2e4" "${common[@]}"
  sittings_pack
  echo "$0: warm start $w done; $(sittings_finished) of 96 runs finished"
done
if (( $(sittings_finished) == 96 )); then
  moe-rl-calibrate --summarize "$keep"/calibration/ws? --out "$keep/calibration/summary"
  # The pre-registered secondary pairs at GSPO's own step size (2e-4, twice GRPO's): across lr, so named.
  grpo="grpo (replay=off) lr=0.0001" r2="grpo_rr (replay=old) lr=0.0001" gspo2="gspo (replay=off) lr=0.0002"
  moe-rl-analyze "$sweep" --out "results/$name" --title "moe-rl: $name (pre-registered)" \
    --pair "$gspo2" "$grpo" --pair "$gspo2" "$r2"
fi
