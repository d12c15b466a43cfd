"""torchrun worker of tests/integration/test_torchrun_data_parallel.py's 2-process weight-share test (gloo, CPU):

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/helpers/dp_weight_share_worker.py OUT.json

Every rank computes each objective's metrics on its rows of two mini-batches of `weight_batch`, reduces
them over ranks (`moe_rl.reduction.combine`, as the step pools a mini-batch) and mini-batches (`over_updates`, `extremes`) as the step
does; rank 0 writes the result per objective to OUT.json.
"""

from __future__ import annotations

import json
import sys

import torch

CLIP = {"clip_low": 0.2, "clip_high": 0.28}
ROWS_PER_RANK = 2  # of each mini-batch; mini-batch j is rows [4j, 4j + 4), rank r its rows 4j + 2r, 4j + 2r + 1


def weight_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """8 rows, 2 mini-batches of 4: token log-ratios spread over ±4 nats and some sequences shifted by ±3,
    so token and sequence ratios leave (0.1, 10); unequal lengths; and rank 0's rows of mini-batch 0 with positive advantages only (its neg_adv extremes NaN,
    first in rank order, where an unguarded max or min would return it)."""
    g = torch.Generator().manual_seed(23)
    B, T = 8, 6
    mask_BT = torch.rand(B, T, generator=g) < 0.8
    mask_BT[:, 0] = True
    mask_BT[2, 3:] = False
    old_BT = -3 * torch.rand(B, T, generator=g, dtype=torch.float64)
    shift_B = torch.tensor([0.0, -3.5, 0.0, 3.5, -3.0, 0.0, 2.5, 0.0], dtype=torch.float64)  # whole sequences
    logp_BT = old_BT + 2.0 * torch.randn(B, T, generator=g, dtype=torch.float64) + shift_B[:, None]
    adv_B = torch.tensor([1.2, 0.7, 0.4, -0.9, -1.5, 0.3, 1.1, -0.2], dtype=torch.float64)
    return logp_BT, old_BT, adv_B, mask_BT


def rows(minibatch: int, rank: int, world: int) -> slice:
    """This rank's rows of a mini-batch (all of them for a single process)."""
    per = 4 // world
    return slice(4 * minibatch + per * rank, 4 * minibatch + per * (rank + 1))


def step_metrics(name: str, rank: int, world: int, gather) -> dict[str, float]:
    """One objective's metrics as the step reduces them, with `gather` the all-gather of picklable objects."""
    from moe_rl import reduction as S
    from moe_rl.objectives import OBJECTIVES

    logp_BT, old_BT, adv_B, mask_BT = weight_batch()
    per_mb = []
    for j in range(2):
        sl = rows(j, rank, world)
        _, stats = OBJECTIVES[name].compute(OBJECTIVES[name].inputs(logp_BT[sl], old_BT[sl], adv_B[sl], mask_BT[sl], **CLIP))
        per_mb.append(S.combine(gather(S.to_floats(stats))))
    return {**S.values(S.over_updates(per_mb)), **S.values(S.extremes(per_mb))}


def main(out: str) -> None:
    import torch.distributed as dist

    from moe_rl.objectives import OBJECTIVES
    from moe_rl.trainer.distributed import Dist

    dist.init_process_group("gloo")
    d = Dist(dist.get_rank(), dist.get_world_size())
    result = {name: step_metrics(name, d.rank, d.world, d.gather) for name in sorted(OBJECTIVES) if not name.startswith("dppo_topk")}
    if d.main:
        with open(out, "w") as f:
            json.dump(result, f)  # NaN as the NaN literal, which json.load reads back
    d.close()


if __name__ == "__main__":
    main(sys.argv[1])
