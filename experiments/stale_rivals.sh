#!/usr/bin/env bash
# stale_rivals in sittings, as pre-registered (docs/preregistration/stale_rivals.md). Stages, in order:
#   experiments/stale_rivals.sh lr          # the step-size rule: 96 runs of 40 steps on warm starts 100, 101,
#                                           # then docs/results/stale_rivals/step_size.json (commit it)
#   experiments/stale_rivals.sh primary     # GRPO, R2 and GSPO at its own lr, k = 0 and 8, warm starts 0-19
#   experiments/stale_rivals.sh secondary   # every other cell on warm starts 0-7
#   WARM_STARTS="3 4" experiments/stale_rivals.sh primary
# Each stage refuses to start unless the pre-registration was committed before the sweep's first record
# (experiments/lib/preregistration.py), runs whole warm starts (resume=true: a finished run is left as it
# is), packs the finished runs' records and publishes them to the record store (commit
# docs/results/stale_rivals/records.json at the end of every sitting, and `wandb sync` the artifact) and
# prints counts only. Once every primary run is done (360), the primary family is analysed as
# pre-registered, and only then read:
#   experiments/stale_rivals.sh analyze     # experiments/stale_rivals_primary.py: D_a and D_b, t over warm
#                                           # starts, Holm over the two (blind, exit 1, until all 360 are in;
#                                           # FAILED_OK=1 once the driver has finished names the failed ones)
# (moe-rl-analyze's dose-interaction section pairs arms at a shared lr only, so it cannot form D_b, GSPO at
# its own lr against R2 at 1e-4: the script is the registered test.)
set -euo pipefail
cd "$(dirname "$0")/.."
source experiments/lib/sittings.sh
stage=${1:?usage: experiments/stale_rivals.sh lr|primary|secondary|analyze}
sittings_begin stale_rivals
python experiments/lib/preregistration.py check docs/preregistration/stale_rivals.md "$sweep" "$keep/records.json"
common=(hydra/launcher=joblib_local trainer.threads=1 resume=true logger.progress=false)
[[ $stage == lr ]] || common+=(logger.wandb=false)  # amendment 1: the profile's cut, which changes no number
lr_of() { python -c "import json,sys; print(json.load(open('$keep/step_size.json'))['arms'][sys.argv[1]]['lr'])" "$1"; }
case $stage in
  lr)
    moe-rl-train -m +experiment=stale_rivals__lr "hydra.sweep.dir=$sweep/lr" "${common[@]}"
    python experiments/stale_rivals_lr.py "$sweep/lr" --out "$keep/step_size.json"
    sittings_pack ;;
  primary)
    [[ -e $keep/step_size.json ]] || { echo "$0: run the lr stage first (no $keep/step_size.json)" >&2; exit 1; }
    for w in ${WARM_STARTS:-$(seq 0 19)}; do
      moe-rl-train -m +experiment=stale_rivals "warmstart.build_seed=$w" "hydra.sweep.dir=$sweep/ws$w/grpo" "${common[@]}"
      moe-rl-train -m +experiment=stale_rivals objective=gspo "trainer.lr=$(lr_of gspo)" "warmstart.build_seed=$w" \
        "hydra.sweep.dir=$sweep/ws$w/gspo" "${common[@]}"
      sittings_pack
      echo "$0: primary cells of warm start $w done; $(sittings_finished) runs finished in all"
    done ;;
  secondary)
    [[ -e $keep/step_size.json ]] || { echo "$0: run the lr stage first (no $keep/step_size.json)" >&2; exit 1; }
    for w in ${WARM_STARTS:-$(seq 0 7)}; do
      at=("warmstart.build_seed=$w" "${common[@]}")
      moe-rl-train -m +experiment=stale_rivals objective=grpo_r3,grpo_tis rollout.staleness=0,8,16 \
        "hydra.sweep.dir=$sweep/ws$w/replay_tis" "${at[@]}"
      moe-rl-train -m +experiment=stale_rivals objective=grpo,grpo_rr rollout.staleness=16 "hydra.sweep.dir=$sweep/ws$w/grpo16" "${at[@]}"
      for arm in gspo vespo_stale dppo_tv_sampler; do
        ks=$([[ $arm == gspo ]] && echo 16 || echo 0,8,16)
        moe-rl-train -m +experiment=stale_rivals "objective=$arm" "trainer.lr=$(lr_of $arm)" "rollout.staleness=$ks" \
          "hydra.sweep.dir=$sweep/ws$w/$arm" "${at[@]}"
      done
      if [[ $(lr_of gspo) != 0.0001 ]]; then  # GSPO at the shared lr too (else its primary cell is that)
        moe-rl-train -m +experiment=stale_rivals objective=gspo trainer.lr=1e-4 "hydra.sweep.dir=$sweep/ws$w/gspo_shared" "${at[@]}"
      fi
      sittings_pack
      echo "$0: secondary cells of warm start $w done; $(sittings_finished) runs finished in all"
    done ;;
  analyze)
    python experiments/stale_rivals_primary.py "$sweep" --out "$keep/primary" ${FAILED_OK:+--failed-ok} ;;
  *) echo "$0: unknown stage $stage (lr, primary, secondary or analyze)" >&2; exit 2 ;;
esac
