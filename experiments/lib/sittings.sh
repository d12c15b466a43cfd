# Sourced by the drivers of pre-registered sweeps that run in sittings (experiments/confirm_sort_long.sh,
# experiments/router_lr_own_lr.sh): a sitting's machine keeps nothing, so each sitting unpacks the
# finished runs' records that earlier sittings committed, runs whole warm starts (resume=true leaves a
# finished run as it is), and packs its new finished runs into one more archive (moe_rl.archive).
#
#   sittings_begin NAME     sweep=multirun/NAME, keep=docs/results/NAME (committed), work=cal/NAME (not);
#                           takes the driver's lock and unpacks keep/records/*.tar.xz into the sweep
#   sittings_pack           packs the sweep's finished runs not yet archived into keep/records/<UTC>.tar.xz
#   sittings_finished       the number of finished runs in the sweep (summary.json outside .hydra/ and
#                           overwritten-*/: moe_rl.trainer.folder.set_aside)
sittings_begin() {
  name=$1
  sweep=multirun/$name
  keep=docs/results/$name
  work=cal/$name
  mkdir -p "$work" "$keep/records"
  # One driver at a time: a second one would train the same runs twice.
  exec 9> "$work/.driver.lock"
  flock -n 9 || { echo "$0: another driver is running (it holds $work/.driver.lock)" >&2; exit 1; }
  shopt -s nullglob
  local archives=("$keep"/records/*.tar.xz)
  if (( ${#archives[@]} )); then
    moe-rl-archive unpack "${archives[@]}" --into "$sweep"
  fi
}

sittings_pack() {
  moe-rl-archive pack "$sweep" "$keep/records/$(date -u +%Y%m%dT%H%M%SZ).tar.xz" --skip "$keep"/records/*.tar.xz
}

sittings_finished() {
  find "$sweep" -name summary.json -not -path '*/.hydra/*' -not -path '*/overwritten-*' 2>/dev/null | wc -l
}
