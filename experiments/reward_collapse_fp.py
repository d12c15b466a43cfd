"""False-positive rate of the `reward_collapse` detector on a policy whose true reward never moves.

    python experiments/reward_collapse_fp.py                # the table in moe_rl/trainer/collapse.py, ~1 min
    python experiments/reward_collapse_fp.py --seeds 500    # quicker, noisier

For each reward level p, run length and intra-group correlation (icc: 0 = every reward an independent
Bernoulli(p); 0.3 = prompts that differ in difficulty, see `reward_collapse_false_positive_rate`), it
prints the fraction of seeds on which the detector with the default `CollapseConfig` (warm-up 5, window
5, fraction 0.5) fires at least once, at the default batch of 8 prompts x 8 completions. It measures
whatever detector is on sys.path: run it on an older checkout to measure that one.
"""

from __future__ import annotations

import argparse
import math

from moe_rl.config import CollapseConfig
from moe_rl.trainer.collapse import reward_collapse_false_positive_rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=2000)
    args = parser.parse_args()
    print("| icc | p | steps | false-positive rate (± 1 s.e.) |")
    print("|---|---|---|---|")
    for icc in (0.0, 0.3):
        for p in (0.2, 0.5):
            for steps in (30, 150):
                rate = reward_collapse_false_positive_rate(CollapseConfig(), p, steps, icc=icc, seeds=args.seeds)
                se = math.sqrt(rate * (1 - rate) / args.seeds)
                print(f"| {icc:g} | {p:g} | {steps} | {rate:.4f} ± {se:.4f} |", flush=True)


if __name__ == "__main__":
    main()
