#!/usr/bin/env bash
# Reproduce one of the GSPO paper's ablations: run its sweep, then draw its figures and tables.
#
#   experiments/reproduce.sh stability        # or clipping, volatility, length, replay_source, collapse_stress
#   experiments/reproduce.sh stability trainer.steps=200 model=deep   # scale up with any Hydra overrides
#
# The sweep goes to multirun/<name>/, the report (report.md, PNGs, tables) to results/<name>/.
# An ablation may have parts that a single Hydra sweep cannot express (a cross product would repeat runs):
# each conf/experiment/<name>__<part>.yaml is swept too, into multirun/<name>/<part>/, and analysed with it.
set -euo pipefail
conf=$(dirname "$0")/../conf/experiment
usage() {
  echo "usage: experiments/reproduce.sh NAME [HYDRA OVERRIDES...]"
  echo "ablations (conf/experiment/NAME.yaml; pre-registered studies run by their own drivers in experiments/):"
  for f in "$conf"/*.yaml; do
    n=$(basename "$f" .yaml)
    [[ $n == *__* ]] && continue
    printf '  %-24s %s\n' "$n" "$(grep -v '^# @package' "$f" | grep -m1 '^# ' | sed 's/^# //' | cut -c1-90)"
  done
}
case ${1:-} in
  ""|-h|--help) usage; [[ -n ${1:-} ]] && exit 0 || exit 2 ;;
esac
name=$1
[[ -e $conf/$name.yaml ]] || { echo "experiments/reproduce.sh: no ablation '$name' (no conf/experiment/$name.yaml)" >&2; usage >&2; exit 2; }
shift
sweep_dir=multirun/$name
moe-rl-train -m "+experiment=$name" "hydra.sweep.dir=$sweep_dir" "$@"
for part_file in "$(dirname "$0")"/../conf/experiment/"$name"__*.yaml; do
  [[ -e $part_file ]] || continue
  part=$(basename "$part_file" .yaml)
  moe-rl-train -m "+experiment=$part" "hydra.sweep.dir=$sweep_dir/${part#"$name"__}" "$@"
done
moe-rl-analyze "$sweep_dir" --out "results/$name" --title "moe-rl: $name"
