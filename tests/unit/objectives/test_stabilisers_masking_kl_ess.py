"""Issue 25's stabilisers against float64 references: off-policy sequence masking, the unbiased KL,
geometric-mean rollout IS, ESS and χ² of the IS weights, and the shared surrogate's structure.

SAPO's loss and metrics are checked with the other objectives (test_grpo_gspo_references.py, test_cispo_gmpo_rollout_is_kl.py) and against
TRL (test_trl_parity.py); IcePop and the geometric modes' losses in test_rollout_is_matches_reference.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from moe_rl.objectives import OBJECTIVES
from tests.unit.objectives.test_cispo_gmpo_rollout_is_kl import (
    CLIP,
    agg,
    call,
    compose_config,
    grad_of,
    make_batch,
    ref_loss,
    rows,
    toks,
)


def ref_opsm(logp, sampler, adv, mask, delta):
    """{(i, t): 1 keep / 0 drop}: drop Â_i < 0 sequences whose mean log(π_sampler / π_θ) exceeds δ."""
    keep = {}
    for i in rows(mask):
        kl = sum(sampler[i, t].item() - logp[i, t].item() for t in toks(mask, i)) / len(toks(mask, i))
        for t in toks(mask, i):
            keep[i, t] = (1.0, 1.0 if adv[i] >= 0 or kl <= delta else 0.0)
    return keep


@pytest.mark.parametrize("name", ["grpo", "gspo", "cispo", "sapo"])
def test_opsm_matches_reference(name):
    """opsm_delta drops exactly the negative-advantage sequences past δ, in value, gradient and
    policy/opsm_masked_frac; the sampler's log-probs decide it (π_old's when there are none)."""
    logp, old, adv, mask, _, sampler = make_batch(seed=21, sampler_gap=0.4)
    delta = 0.05
    loss, metrics = call(name, logp, old, adv, mask, sampler_logp=sampler, opsm_delta=delta)
    keep = ref_opsm(logp, sampler, adv, mask, delta)
    expected = ref_loss(name, logp, old, adv, mask, *CLIP[name], weights=keep)
    assert_close(loss, expected)
    assert_close(grad_of(loss, logp), grad_of(expected, logp))
    dropped = [k for _, k in keep.values()].count(0.0) / len(keep)
    assert 0 < dropped < 1 and metrics["policy/opsm_masked_frac"] == pytest.approx(dropped, rel=1e-12)
    no_sampler, _ = call(name, logp, old, adv, mask, opsm_delta=delta)  # π_old stands in for the sampler
    expected_old = ref_loss(name, logp, old, adv, mask, *CLIP[name], weights=ref_opsm(logp, old, adv, mask, delta))
    assert_close(no_sampler, expected_old)


def test_opsm_with_huge_delta_changes_nothing_bitwise():
    """A δ no sequence reaches keeps every token: loss and gradient bitwise those without the mask."""
    logp, old, adv, mask, _, sampler = make_batch(seed=22)
    plain, _ = call("grpo", logp, old, adv, mask, sampler_logp=sampler)
    masked, m = call("grpo", logp, old, adv, mask, sampler_logp=sampler, opsm_delta=1e9)
    assert torch.equal(plain, masked) and torch.equal(grad_of(plain, logp), grad_of(masked, logp))
    assert m["policy/opsm_masked_frac"] == 0.0


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
def test_k3_unbiased_matches_reference_and_its_gradient_is_the_reverse_kl_s(loss_agg):
    """kl_estimator=k3_unbiased adds beta·agg(r·k3), r = π_θ/π_old; its gradient per token is
    beta·w·r·(logp − ref)·∇logp (w the aggregation's weight): DeepSeek-V3.2's unbiased reverse-KL gradient."""
    logp, old, adv, mask, ref, _ = make_batch(seed=23)
    ref = torch.where(mask, ref, old)
    base, _ = call("grpo", logp, old, adv, mask, loss_agg=loss_agg)
    loss, m = call("grpo", logp, old, adv, mask, loss_agg=loss_agg, beta=0.1, ref_logp=ref,
                   kl_estimator="k3_unbiased")
    per_row = [[torch.exp(logp[i, t] - old[i, t]) * (torch.exp(ref[i, t] - logp[i, t]) - (ref[i, t] - logp[i, t]) - 1)
                for t in toks(mask, i)] for i in rows(mask)]
    kl = agg(per_row, loss_agg)
    assert_close(loss - base, 0.1 * kl)
    assert m["policy/ref_kl"] == pytest.approx(kl.item(), rel=1e-12)
    g = grad_of(loss, logp) - grad_of(base, logp)
    for i in rows(mask):
        for t in toks(mask, i):
            w = 1 / mask.sum().item() if loss_agg == "token-mean" else 1 / len(toks(mask, i)) / len(rows(mask))
            r = math.exp(logp[i, t].item() - old[i, t].item())
            assert g[i, t].item() == pytest.approx(0.1 * w * r * (logp[i, t].item() - ref[i, t].item()), rel=1e-9)


def test_ess_and_chi2_of_the_sequence_weights():
    """rollout_is/ess = (Σw)²/(B' Σw²) and rollout_is/chi2 = mean w² − 1 over sequences, w_i = π_old(y)/π_s(y);
    logged with any correction and, via mismatch_diagnostics, with none; absent otherwise."""
    logp, old, adv, mask, _, sampler = make_batch(seed=24, sampler_gap=0.2)
    w = [math.exp(sum(old[i, t].item() - sampler[i, t].item() for t in toks(mask, i))) for i in rows(mask)]
    ess = sum(w) ** 2 / (len(w) * sum(x * x for x in w))
    chi2 = sum(x * x for x in w) / len(w) - 1
    for kw in ({"rollout_is": "geo_sequence_mask"}, {"rollout_is": "icepop"}, {"mismatch_diagnostics": True}):
        _, m = call("grpo", logp, old, adv, mask, sampler_logp=sampler, **kw)
        assert m["rollout_is/ess"] == pytest.approx(ess, rel=1e-12) and 0 < ess < 1
        assert m["rollout_is/chi2"] == pytest.approx(chi2, rel=1e-12)
    _, plain = call("grpo", logp, old, adv, mask, sampler_logp=sampler)
    assert not any(k.startswith("rollout_is/") for k in plain)


def test_geometric_sequence_weight_does_not_depend_on_length():
    """With the same per-token sampler gap, a 2-token and an 8-token sequence get the same geometric-mean
    weight (so the same mask decision), while the product ratio masks only the long one."""
    B, T = 2, 8
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[0, :2], mask[1, :] = True, True
    old = torch.full((B, T), -1.0, dtype=torch.float64)
    sampler = old - 0.2  # ρ_it = e^0.2 everywhere
    logp = old.clone().requires_grad_()
    adv = torch.tensor([1.0, 1.0], dtype=torch.float64)
    for mode, kept in (("geo_sequence_mask", [True, True]), ("sequence_mask", [True, False])):
        loss, _ = call("grpo", logp, old, adv, mask, sampler_logp=sampler, rollout_is=mode, rollout_is_cap=1.5)
        g = grad_of(loss, logp)
        assert [bool((g[i][mask[i]] != 0).all()) for i in range(B)] == kept, mode


def test_grpo_and_gspo_differ_only_in_the_ratio():
    """The registry's GRPO and GSPO share the surrogate (ppo_clip): only the ratio (and what it implies:
    the level watched, the aggregations, per-sequence advantages) differs. SAPO's variants likewise."""
    grpo, gspo = OBJECTIVES["grpo"], OBJECTIVES["gspo"]
    assert grpo.surrogate is gspo.surrogate and grpo.build_ratio is not gspo.build_ratio
    assert OBJECTIVES["sapo"].surrogate is OBJECTIVES["sapo_seq"].surrogate
    assert OBJECTIVES["sapo"].build_ratio is grpo.build_ratio and OBJECTIVES["sapo_seq"].build_ratio is gspo.build_ratio


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (["objective=sapo", "objective.tau_neg=0"], "objective.tau_neg"),
        (["objective=sapo", "objective.tau_pos=-1"], "objective.tau_pos"),
        (["objective=grpo_opsm", "objective.opsm_delta=-0.1"], "objective.opsm_delta"),
        (["objective=grpo_icepop", "objective.rollout_is_band=[1.5,5]"], "objective.rollout_is_band"),
        (["objective=grpo", "objective.kl_estimator=k3_biased"], "objective.kl_estimator"),
        (["objective=grpo_geo_mis", "objective.rollout_is_cap=0.5"], "objective.rollout_is_cap"),
        (["objective=rspo", "objective.router_shift_floor=0"], "objective.router_shift_floor"),
        (["objective=rspo", "objective.router_shift_floor=1.5"], "objective.router_shift_floor"),
        (["sampler.logprobs=logits"], "sampler.logprobs"),
        (["sampler.keep_sampling_mask=true", "sampler.top_p=0.9"], "sampler.keep_sampling_mask"),
    ],
)
def test_new_options_fail_at_start_up_naming_the_field(overrides, field):
    """A bad value of a new option raises one ValueError line that starts with the field."""
    with pytest.raises(ValueError) as err:
        compose_config(overrides)
    assert str(err.value).startswith(field + "=") and "\n" not in str(err.value)


def test_new_presets_carry_their_defaults():
    """Each new preset composes, with its source's defaults."""
    o = {n: compose_config([f"objective={n}"]).objective for n in (
        "sapo", "sapo_seq", "grpo_opsm", "grpo_geo_tis", "grpo_geo_mis", "grpo_icepop", "grpo_kl_unbiased")}
    assert (o["sapo"].name, o["sapo"].tau_pos, o["sapo"].tau_neg) == ("sapo", 1.0, 1.05)
    assert o["sapo_seq"].name == "sapo_seq" and o["grpo_opsm"].opsm_delta == 1e-4
    assert o["grpo_geo_tis"].rollout_is == "geo_sequence_truncate" and o["grpo_geo_mis"].rollout_is == "geo_sequence_mask"
    assert (o["grpo_icepop"].rollout_is, o["grpo_icepop"].rollout_is_band) == ("icepop", [0.5, 5.0])
    assert (o["grpo_kl_unbiased"].kl_estimator, o["grpo_kl_unbiased"].beta) == ("k3_unbiased", 0.001)
    assert all(cfg.preset == name for name, cfg in o.items())
    rspo, keep = compose_config(["objective=rspo"]), compose_config(["objective=grpo_keep_mask"])
    assert (rspo.objective.name, rspo.objective.router_shift, rspo.objective.router_shift_floor) == ("gmpo", True, 0.8)
    assert (keep.sampler.top_p, keep.sampler.logprobs, keep.sampler.keep_sampling_mask) == (0.9, "processed", True)


@pytest.mark.slow
@pytest.mark.parametrize(
    "preset", ["sapo", "sapo_seq", "grpo_opsm", "grpo_geo_tis", "grpo_geo_mis", "grpo_icepop", "grpo_kl_unbiased",
               "rspo", "grpo_keep_mask"]
)
def test_new_presets_run_two_steps_end_to_end(tmp_path, preset):
    """Each new preset trains 2 steps with a bf16 sampler (so the corrections act) and logs finite losses."""
    from moe_rl.trainer.run import train
    from tests.unit.objectives.test_cispo_gmpo_rollout_is_kl import TINY

    cfg = compose_config([*TINY, "trainer.steps=2", f"objective={preset}", "trainer.sampler_dtype=bfloat16"])
    final = train(cfg, tmp_path)["final"]
    assert math.isfinite(final["train/loss"]) and math.isfinite(final["rollout_is/ess"])
