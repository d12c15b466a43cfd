#!/usr/bin/env bash
# router_lr_own_lr in sittings, as pre-registered (docs/preregistration/router_lr_own_lr.md): warm start
# slowest, one whole warm start (96 runs: 4 arms x 2 router-lr doses x 4 lrs x 3 seeds, about 2
# core-hours, and its build) per sitting that can finish it. Each sitting fetches and unpacks what earlier
# sittings published, runs its warm starts (resume=true), packs the new finished runs' records and
# publishes them (commit docs/results/router_lr_own_lr/records.json at the end of the sitting), and prints
# counts only; the report is written once all 384 runs are done.
#
#   experiments/router_lr_own_lr.sh            # warm starts 0-3, in order
#   WARM_STARTS=1 experiments/router_lr_own_lr.sh
set -euo pipefail
cd "$(dirname "$0")/.."
source experiments/lib/sittings.sh
sittings_begin router_lr_own_lr
for w in ${WARM_STARTS:-0 1 2 3}; do
  moe-rl-train -m +experiment=$name "hydra.sweep.dir=$sweep/ws$w" "warmstart.build_seed=$w" \
    hydra/launcher=joblib_local trainer.threads=1 resume=true logger.progress=false
  sittings_pack
  echo "$0: warm start $w done; $(sittings_finished) of 384 runs finished"
done
if (( $(sittings_finished) == 384 )); then
  moe-rl-analyze "$sweep" --out "results/$name" --title "moe-rl: $name (pre-registered)"
fi
