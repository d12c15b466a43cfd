# Sourced by the drivers of pre-registered sweeps that run in sittings (experiments/confirm_sort_long.sh,
# experiments/router_lr_own_lr.sh, experiments/stale_rivals.sh): a sitting's machine keeps nothing, so each
# sitting fetches and unpacks the finished runs' records that earlier sittings published, runs whole warm
# starts (resume=true leaves a finished run as it is), and packs its new finished runs into one more archive
# (moe_rl.archive), published to the record store (moe_rl.records): the archive goes to W&B, and only its
# manifest entry (file, sha256, source) is committed.
#
#   sittings_begin NAME     sweep=multirun/NAME, keep=docs/results/NAME (committed), work=cal/NAME and
#                           records=records/NAME (not); takes the driver's lock, fetches every archive that
#                           keep/records.json lists into records/NAME (verified) and unpacks them into the sweep
#   sittings_pack           packs the sweep's finished runs not yet archived into records/NAME/<UTC>.tar.xz
#                           and publishes it into keep/records.json, as a W&B artifact of project
#                           $MOE_RL_RECORDS_PROJECT (default moe-rl-records; offline until `wandb sync`) and,
#                           with $MOE_RL_RECORDS_URL, as the release asset $MOE_RL_RECORDS_URL/<file>
#   sittings_finished       the number of finished runs in the sweep (summary.json outside .hydra/ and
#                           overwritten-*/: moe_rl.trainer.folder.set_aside)
#   sittings_prune          removes the finished runs' checkpoints, checkpoint.pt and checkpoint.prev.pt
#                           (sittings_pack calls it once they are archived): they only served resumption, and
#                           resume=true leaves a finished run as it is without them; 152 MB per stale_rivals
#                           run, 117 GB over that study
sittings_begin() {
  name=$1
  sweep=multirun/$name
  keep=docs/results/$name
  work=cal/$name
  records=records/$name
  mkdir -p "$work" "$records"
  # One driver at a time: a second one would train the same runs twice.
  exec 9> "$work/.driver.lock"
  flock -n 9 || { echo "$0: another driver is running (it holds $work/.driver.lock)" >&2; exit 1; }
  shopt -s nullglob
  if [[ -e $keep/records.json ]]; then
    moe-rl-archive fetch "$keep/records.json" --out "$records" --into "$sweep"
  fi
}

sittings_pack() {
  local out
  out=$records/$(date -u +%Y%m%dT%H%M%SZ).tar.xz
  moe-rl-archive pack "$sweep" "$out" --skip "$records"/*.tar.xz
  if [[ -e $out ]]; then
    moe-rl-archive publish "$keep/records.json" "$out" --wandb-project "${MOE_RL_RECORDS_PROJECT:-moe-rl-records}" \
      ${MOE_RL_RECORDS_URL:+--url-prefix "$MOE_RL_RECORDS_URL"}
  fi
  sittings_prune
}

sittings_prune() {
  local summary
  while IFS= read -r -d '' summary; do
    rm -f "$(dirname "$summary")/checkpoint.pt" "$(dirname "$summary")/checkpoint.prev.pt"
  done < <(find "$sweep" -name summary.json -not -path '*/.hydra/*' -not -path '*/overwritten-*' -print0 2>/dev/null)
}

sittings_finished() {
  find "$sweep" -name summary.json -not -path '*/.hydra/*' -not -path '*/overwritten-*' 2>/dev/null | wc -l
}
