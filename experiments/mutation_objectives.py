"""Mutation check of the objectives (issues 16 and 25): plant one bug at a time, see the tests catch it.

    python experiments/mutation_objectives.py            # all 39 mutants: 10.5 min on 2 idle cores (all caught)
    python experiments/mutation_objectives.py gmpo dual  # only mutants whose name contains a word

Each mutant is one textual edit of moe_rl/ (a wrong sign, a missing stop-gradient, a mean for a sum, a
dropped check) applied to a throw-away copy of the tracked files; the objective tests then run in that
copy (`pytest -x`), which puts the copy's moe_rl first on sys.path. A mutant is caught when the tests
fail. The script exits 1 if any mutant survives, naming it, and never edits the working tree.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ["tests/unit/objectives/test_grpo_gspo_references.py", "tests/unit/objectives/test_cispo_gmpo_rollout_is_kl.py",
         "tests/unit/objectives/test_stabilisers_masking_kl_ess.py", "tests/unit/trainer/test_exact_metric_reduction.py",
         "tests/unit/objectives/test_rspo_router_shift.py", "tests/unit/rollout/test_keep_sampling_mask.py"]
OBJ = "moe_rl/objectives/"

# (name, file, original text, mutated text); the original must occur exactly once.
MUTANTS = [
    # issue 25, the rest: RSPO's router-shift ratio, the keep sampling mask
    ("rspo: floor not applied", OBJ + "router_shift.py", "floored_BT = gamma_BT.clamp(min=floor)", "floored_BT = gamma_BT"),
    ("rspo: abs of the mean shift", OBJ + "router_shift.py", "(new_BTLK - old_BTLK).abs().mean(dim=(-2, -1))",
     "(new_BTLK - old_BTLK).mean(dim=(-2, -1)).abs()"),
    ("rspo: ratio not rescaled", OBJ + "surrogate.py",
     "p_rho = p if x.router_shift is None else router_shifted(p, x.router_shift)", "p_rho = p"),
    ("rspo: rescaling reaches the IS weight's π_old", OBJ + "surrogate.py",
     "omega_BT, is_stats = rollout_is_weight(p.old_logp_BT,", "omega_BT, is_stats = rollout_is_weight(p_rho.old_logp_BT,"),
    ("keep mask: not renormalised", "moe_rl/rollout/support.py",
     'logits = logits.masked_fill(~mask_BRV.to(logits.device), float("-inf"))', "logits = logits"),
    ("keep mask: padding gets no support", "moe_rl/rollout/support.py", "mask_BRV[(size_N == 0).to(device)] = True", "pass"),
    # issue 25: SAPO, OPSM, the unbiased KL, geometric IS, IcePop, ESS/χ²
    ("sapo: temperatures swapped", OBJ + "sapo.py", "torch.where(adv > 0, rho.new_tensor(x.tau_pos), rho.new_tensor(x.tau_neg))",
     "torch.where(adv > 0, rho.new_tensor(x.tau_neg), rho.new_tensor(x.tau_pos))"),
    ("sapo: gate without 4/τ", OBJ + "sapo.py", "loss = -(gate * 4.0 / tau) * adv", "loss = -gate * adv"),
    ("opsm: sign of the log-ratio", OBJ + "surrogate.py", "mu_BT - p.logp_BT.detach()", "p.logp_BT.detach() - mu_BT"),
    ("opsm: drops positive advantages", OBJ + "surrogate.py", "(p.adv_BT >= 0) | (kl_B <= delta)", "(kl_B <= delta)"),
    ("opsm: mask not applied", OBJ + "surrogate.py", "omega_BT = omega_BT * keep_BT", "omega_BT = omega_BT"),
    ("kl: unbiased ratio detached", OBJ + "common.py",
     "r_BT = torch.exp((logp_BT - old_logp_BT).clamp(", "r_BT = torch.exp((logp_BT.detach() - old_logp_BT).clamp("),
    ("geo IS: product instead of mean", OBJ + "common.py", "(diff_BT.sum(-1) / mask_BT.sum(-1).clamp(min=1))[:, None]",
     "(diff_BT.sum(-1))[:, None]"),
    ("icepop: symmetric 1/C band", OBJ + "common.py", 'lo, hi = band if mode == "icepop" else (1.0 / cap, cap)',
     "lo, hi = (1.0 / cap, cap)"),
    ("ess: square of the mean", "moe_rl/reduction.py", "return p[1] ** 2 / (p[0] * p[2])", "return p[1] / (p[0] * p[2]) ** 0.5"),
    ("stats: variance combine drops the between term", "moe_rl/reduction.py",
     "qa + qb + delta * delta * na * nb / n", "qa + qb"),
    ("cispo: ratio not stop-gradient", OBJ + "cispo.py", "r_BT = ratio.value.detach()", "r_BT = ratio.value"),
    (
        "cispo: clip bounds swapped",
        OBJ + "cispo.py",
        "r_BT.clamp(1.0 - x.clip_low, 1.0 + x.clip_high)",
        "r_BT.clamp(1.0 - x.clip_high, 1.0 + x.clip_low)",
    ),
    (
        "cispo: clip metric counts advantage sign",
        OBJ + "cispo.py",
        "p.mask_BT & (r_BT > 1.0 + x.clip_high)",
        "p.mask_BT & (r_BT > 1.0 + x.clip_high) & (p.adv_BT > 0)",
    ),
    (
        "gmpo: advantage sign ignored in the clip",
        OBJ + "gmpo.py",
        "sign_BT * torch.minimum(sign_BT * d_BT, sign_BT * d_BT.clamp(-x.clip_low, x.clip_high))",
        "torch.minimum(d_BT, d_BT.clamp(-x.clip_low, x.clip_high))",
    ),
    (
        "gmpo: arithmetic mean of ratios",
        OBJ + "gmpo.py",
        "rho_B = torch.exp(torch.where(mask_BT, d_hat_BT, 0.0).sum(-1)",
        "rho_B = (torch.where(mask_BT, d_hat_BT.exp(), 0.0).sum(-1)",
    ),
    (
        "gmpo: clip bounds swapped",
        OBJ + "gmpo.py",
        "d_BT.clamp(-x.clip_low, x.clip_high)",
        "d_BT.clamp(-x.clip_high, x.clip_low)",
    ),
    (
        "rollout IS: a per-sequence loss ignores the weight (gspo, gmpo)",
        OBJ + "surrogate.py",
        "loss = seq_mean(sur.loss * omega_B, mask_BT)",
        "loss = seq_mean(sur.loss, mask_BT)",
    ),
    (
        "dual-clip: max instead of min",
        OBJ + "common.py",
        "torch.minimum(loss, -clip_ratio_c * adv)",
        "torch.maximum(loss, -clip_ratio_c * adv)",
    ),
    (
        "dual-clip: applied to positive advantages",
        OBJ + "common.py",
        "torch.where(adv < 0, torch.minimum(loss",
        "torch.where(adv > 0, torch.minimum(loss",
    ),
    (
        "dual-clip metric: threshold off by one",
        OBJ + "diagnostics.py",
        "& (ratio_BT > clip_ratio_c))[mask_BT]",
        "& (ratio_BT > 1.0 + clip_ratio_c))[mask_BT]",
    ),
    (
        "rollout IS: ratio inverted",
        OBJ + "common.py",
        "old_logp_BT - sampler_logp.to(old_logp_BT.dtype)",
        "sampler_logp.to(old_logp_BT.dtype) - old_logp_BT",
    ),
    (
        "rollout IS: sequence mean instead of sum",
        OBJ + "common.py",
        "diff_BT.sum(-1, keepdim=True)",
        "diff_BT.mean(-1, keepdim=True)",
    ),
    (
        "rollout IS: mask keeps low ratios",
        OBJ + "common.py",
        "(rho_BT < lo) | (rho_BT > hi)",
        "(rho_BT > hi)",
    ),
    (
        "rollout IS: metrics after truncation",
        OBJ + "common.py",
        "rho_N = rho_BT[mask_BT]",
        "rho_N = weight_BT[mask_BT]",
    ),
    (
        "rollout IS: a per-token loss ignores the weight (grpo, cispo, gspo_token)",
        OBJ + "surrogate.py",
        "torch.where(mask_BT, sur.loss * omega_BT, 0.0)",
        "torch.where(mask_BT, sur.loss, 0.0)",
    ),
    (
        "rollout IS: per-sequence weight as max",
        OBJ + "surrogate.py",
        "omega_B = omega_BT.sum(-1) / mask_BT.sum(-1).clamp(min=1)",
        "omega_B = omega_BT.amax(-1)",
    ),
    (
        "rollout IS: missing sampler_logp accepted",
        OBJ + "common.py",
        'if rollout_is != "none" and (sampler_logp is None or',
        'if rollout_is == "never" and (sampler_logp is None or',
    ),
    (
        "kl: k1 sign",
        OBJ + "common.py",
        '"k1": lambda logp, ref: logp - ref',
        '"k1": lambda logp, ref: ref - logp',
    ),
    ("kl: k2 without 1/2", OBJ + "common.py", "0.5 * (logp - ref).square()", "(logp - ref).square()"),
    (
        "kl: low_var_kl uncapped",
        OBJ + "common.py",
        "k3(logp, ref).clamp(max=LOW_VAR_KL_CAP)",
        "k3(logp, ref)",
    ),
    (
        "kl: estimator ignored",
        OBJ + "common.py",
        "KL_ESTIMATORS[estimator](logp_BT",
        'KL_ESTIMATORS["k3"](logp_BT',
    ),
    (
        "config: gmpo accepts token-mean",
        "moe_rl/config.py",
        "if o.loss_agg not in spec.loss_aggs:",
        "if o.loss_agg not in AGGREGATIONS:",
    ),
    (
        "config: dual-clip accepted on cispo",
        "moe_rl/config.py",
        "if o.clip_ratio_c is not None and not spec.dual_clip:",
        "if o.clip_ratio_c is not None and False:",
    ),
]


def run_mutant(name: str, path: str, old: str, new: str) -> tuple[bool, float]:
    files = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    with tempfile.TemporaryDirectory() as tmp:
        for rel in files:
            if rel.startswith(("moe_rl/", "tests/", "conf/")) or rel == "pyproject.toml":
                dst = Path(tmp) / rel
                dst.parent.mkdir(parents=True, exist_ok=True)
                dst.write_bytes((ROOT / rel).read_bytes())
        target = Path(tmp) / path
        text = target.read_text()
        assert text.count(old) == 1, f"{name}: expected one occurrence of {old!r} in {path}"
        target.write_text(text.replace(old, new))
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *TESTS],
            cwd=tmp,
            capture_output=True,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        return proc.returncode != 0, time.perf_counter() - t0


def main() -> int:
    words = sys.argv[1:]
    chosen = [m for m in MUTANTS if not words or any(w in m[0] for w in words)]
    survivors = []
    for name, path, old, new in chosen:
        caught, seconds = run_mutant(name, path, old, new)
        print(f"{'caught  ' if caught else 'SURVIVED'} {seconds:6.1f} s  {name}", flush=True)
        if not caught:
            survivors.append(name)
    print(f"{len(chosen) - len(survivors)}/{len(chosen)} mutants caught")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
