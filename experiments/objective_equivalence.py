"""Before/after equality of the objectives: loss, gradient and every metric on a grid of options.

    git archive <base-commit> | tar -x -C /tmp/base                   # the code before a refactor
    python experiments/objective_equivalence.py snapshot /tmp/base /tmp/before.pt
    python experiments/objective_equivalence.py snapshot .         /tmp/after.pt
    python experiments/objective_equivalence.py compare /tmp/before.pt /tmp/after.pt

The grid: every objective of issue 16 x float32/float64 x [B]/[B, T] advantages x beta 0/0.3 (k3, k1,
low_var_kl) x dual-clip off/3 x every rollout_is mode of issue 16 x every loss_agg the objective defines,
on one ragged batch with NaN/inf padding and a token beyond the log-ratio clamp. It uses only the keyword
form, which both sides have. Issue 25's refactor: 1000 cases; loss, gradient and metrics bitwise equal.
"""

from __future__ import annotations

import itertools
import math
import sys

import torch

CLIPS = {"grpo": (0.2, 0.27), "gspo": (0.03, 0.04), "gspo_token": (0.03, 0.04), "cispo": (1.0, 4.0),
         "gmpo": (0.4, 0.4)}
MODES = ["none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
AGGS = ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"]


def batch(seed: int, dtype: torch.dtype, per_token: bool):
    g = torch.Generator().manual_seed(seed)
    B, T = 12, 9
    mask = torch.rand(B, T, generator=g) < 0.7
    mask[0], mask[1], mask[2] = False, False, True
    mask[1, 3] = True
    old = -3 * torch.rand(B, T, generator=g, dtype=torch.float64)
    logp = old + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)
    logp[3, :2] += 25.0  # beyond the clamp
    ref = old + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)
    sampler = old + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn((B, T) if per_token else (B,), generator=g, dtype=torch.float64)
    logp[~mask], old[~mask], sampler[~mask] = float("nan"), -float("inf"), float("nan")
    return [t.to(dtype) for t in (logp, old, adv)] + [mask, ref.to(dtype), sampler.to(dtype)]


def snapshot(root: str, out: str) -> None:
    sys.path.insert(0, root)
    from moe_rl.objectives import OBJECTIVES

    results = {}
    grid = itertools.product(sorted(CLIPS), [torch.float32, torch.float64], [False, True], [0.0, 0.3],
                             ["k3", "k1", "low_var_kl"], [None, 3.0], MODES, AGGS)
    for name, dtype, per_token, beta, kl, c, mode, agg in grid:
        if ((beta == 0.0 and kl != "k3") or (c is not None and name in ("cispo", "gmpo"))
                or (agg != AGGS[0] and name not in ("grpo", "cispo")) or (per_token and name in ("gspo", "gmpo"))):
            continue
        logp, old, adv, mask, ref, sampler = batch(7, dtype, per_token)
        logp.requires_grad_()
        lo, hi = CLIPS[name]
        loss, metrics = OBJECTIVES[name](
            logp, old, adv, mask, clip_low=lo, clip_high=hi, loss_agg=agg, max_len=12, beta=beta,
            ref_logp=ref if beta else None, kl_estimator=kl, clip_ratio_c=c, sampler_logp=sampler,
            rollout_is=mode, rollout_is_cap=1.5,
        )
        (grad,) = torch.autograd.grad(loss, logp)
        results[(name, str(dtype), per_token, beta, kl, c, mode, agg)] = (loss.detach(), grad, metrics)
    torch.save(results, out)
    print(f"{len(results)} cases -> {out}")


def compare(before: str, after: str) -> int:
    a, b = torch.load(before, weights_only=False), torch.load(after, weights_only=False)
    assert a.keys() == b.keys(), "the two snapshots hold different grids"
    loss_eq = grad_eq = 0
    d_loss = d_grad = worst = 0.0
    keys_differ = []
    for k in a:
        (la, ga, ma), (lb, gb, mb) = a[k], b[k]
        loss_eq, grad_eq = loss_eq + torch.equal(la, lb), grad_eq + torch.equal(ga, gb)
        d_loss, d_grad = max(d_loss, (la - lb).abs().max().item()), max(d_grad, (ga - gb).abs().max().item())
        if set(ma) != set(mb):
            keys_differ.append(k)
            continue
        for key, x in ma.items():
            y = mb[key]
            if x != y and not (math.isnan(x) and math.isnan(y)):
                worst = max(worst, abs(x - y) / max(abs(x), 1e-300))
    print(f"{len(a)} cases: loss bitwise equal in {loss_eq}, gradient in {grad_eq}; max |Δloss| {d_loss:.3g}, "
          f"max |Δgrad| {d_grad:.3g}; metric key sets differ in {len(keys_differ)}; max metric rel. diff {worst:.3g}")
    return 0 if loss_eq == grad_eq == len(a) and not keys_differ and worst <= 1e-12 else 1


if __name__ == "__main__":
    if sys.argv[1] == "snapshot":
        snapshot(sys.argv[2], sys.argv[3])
    else:
        sys.exit(compare(sys.argv[2], sys.argv[3]))
