"""Keep sampling mask and the sampler's log-prob convention (issue 25 item 4): sampler.keep_sampling_mask and
sampler.logprobs=raw|processed, against float64 references and bitwise against today's numbers."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from moe_rl.rollout import SamplerConfig, response_logprobs, sample
from moe_rl.rollout.sampler import draw_tokens
from moe_rl.rollout.support import SamplingSupport, renormalised_logprobs
from moe_rl.trainer.run import build_context
from moe_rl.trainer.step import rl_step
from tests.integration.test_train_loop import TINY, compose_config
from tests.unit.routing.test_router_noise import same_rows


def _keeps(B: int, R: int, V: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    keeps = [torch.rand(B, V, generator=g) < 0.3 for _ in range(R)]
    keeps[1][0] = False  # a token with no support recorded (padding)
    return keeps


def test_support_roundtrips_rows_and_dense_mask():
    """Ragged supports rebuild the dense mask exactly (all-True where none is recorded), in any row order,
    and cost 2 bytes per entry plus 4 per token."""
    B, R, V = 5, 4, 37
    keeps = _keeps(B, R, V, 0)
    sup = SamplingSupport.from_steps(keeps, V)
    dense_BRV = torch.stack(keeps, 1)
    expected = dense_BRV | ~dense_BRV.any(-1, keepdim=True)
    assert torch.equal(sup.mask(), expected)
    perm = torch.tensor([3, 0, 4, 1, 2])
    assert torch.equal(sup.rows(perm).mask(), expected[perm])
    assert torch.equal(sup.rows(perm).rows(slice(1, 3)).mask(), expected[perm][1:3])
    assert sup.ids_N.dtype == torch.int16 and sup.nbytes == 2 * int(dense_BRV.sum()) + 4 * B * R


def test_renormalised_logprobs_match_float64_reference():
    """log π(y | S) = z_y / T − logsumexp_{v ∈ S} z_v / T, values and gradients, against float64."""
    B, R, V, T = 3, 4, 11, 0.7
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(B, R, V, generator=g, dtype=torch.float64).requires_grad_()
    tokens = torch.randint(V, (B, R), generator=g)
    mask = torch.rand(B, R, V, generator=g) < 0.4
    mask.scatter_(-1, tokens[..., None], True)  # the drawn token is always in its support
    got = renormalised_logprobs(logits.float(), tokens, T, mask)
    ref = torch.empty(B, R, dtype=torch.float64)
    for b in range(B):
        for t in range(R):
            z = [logits[b, t, v] / T for v in range(V) if mask[b, t, v]]
            ref[b, t] = logits[b, t, tokens[b, t]] / T - torch.logsumexp(torch.stack(z), 0)
    assert_close(got.double(), ref, atol=2e-6, rtol=0)
    (g_got,) = torch.autograd.grad(got.sum(), logits)
    (g_ref,) = torch.autograd.grad(ref.sum(), logits)
    assert_close(g_got, g_ref, atol=2e-6, rtol=0)


def test_draw_records_the_nucleus_it_drew_from_even_under_ties():
    """The nucleus is exactly the tokens the top-p cut kept (ties at the boundary included: the sampler's
    own choice, not a re-sort), every draw lies in it, and processed log-probs are its renormalisation."""
    # Four tied tokens straddle the 0.5 cut: the warper keeps some of them, arbitrarily but once.
    logits_BV = torch.tensor([[3.0, 1.0, 1.0, 1.0, 1.0, -2.0, 0.0]]).repeat(64, 1)
    cfg = SamplerConfig(temperature=1.0, top_p=0.5)
    tok_B, drawn_BV = draw_tokens(logits_BV, cfg, [], torch.Generator().manual_seed(0))
    keep_BV = torch.isfinite(drawn_BV)
    assert keep_BV.gather(-1, tok_B[:, None]).all()
    p64 = torch.softmax(logits_BV.double(), -1)
    kept_mass = (p64 * keep_BV).sum(-1)
    assert (kept_mass >= 0.5).all() and ((kept_mass - p64.masked_fill(~keep_BV, 1).min(-1).values) < 0.5).all()
    sup = SamplingSupport.from_steps([keep_BV], logits_BV.shape[-1])
    assert torch.equal(sup.mask()[:, 0], keep_BV)
    processed = torch.log_softmax(drawn_BV, -1).gather(-1, tok_B[:, None]).squeeze(-1)
    ref = (p64.gather(-1, tok_B[:, None]).squeeze(-1) / kept_mass).log()
    assert_close(processed.double(), ref, atol=1e-6, rtol=0)


@pytest.fixture(scope="module")
def tiny():
    cfg = compose_config(["warmstart.enabled=false", "objective=grpo", *TINY])
    ctx, _ = build_context(cfg)
    return ctx


def test_processed_logprobs_equal_the_trainers_renormalised_forward(tiny):
    """At top_p < 1: raw and processed draw the same tokens; raw log-probs are the untruncated forward's,
    processed ones (with the recorded support) the renormalised forward's, and processed ≥ raw."""
    prompts = ["1+2=", "3-1=", "4+4=", "9-5="] * 4
    runs = {}
    for mode in ("raw", "processed"):
        cfg = SamplerConfig(temperature=1.0, top_p=0.6, max_new_tokens=6, logprobs=mode,
                            keep_sampling_mask=mode == "processed")
        runs[mode] = sample(tiny.model, tiny.tokenizer, prompts, cfg, generator=torch.Generator().manual_seed(3))
    raw, proc = runs["raw"], runs["processed"]
    assert torch.equal(raw.response_ids_BR, proc.response_ids_BR) and raw.support is None
    R, m = raw.response_mask_BR.shape[1], raw.response_mask_BR
    full = response_logprobs(tiny.model, raw.input_ids_BS, raw.attention_mask_BS, R)
    renorm = response_logprobs(tiny.model, proc.input_ids_BS, proc.attention_mask_BS, R, support=proc.support)
    assert_close(raw.logp_BR[m], full[m], atol=1e-5, rtol=0)
    assert_close(proc.logp_BR[m], renorm[m], atol=1e-5, rtol=0)
    assert (proc.logp_BR[m] >= raw.logp_BR[m] - 1e-6).all() and (proc.logp_BR[m] > raw.logp_BR[m] + 1e-4).any()
    assert torch.equal(proc.support.size_BR[~m], torch.zeros_like(proc.support.size_BR[~m]))
    sizes = proc.support.size_BR[m].float()
    assert 1 <= sizes.min() and sizes.max() < proc.support.vocab_size


def _two_steps(overrides: list[str]) -> tuple[list[dict], dict]:
    cfg = compose_config(["warmstart.enabled=false", "objective=grpo", "trainer.lr=3e-3", *TINY, *overrides])
    ctx, _ = build_context(cfg)
    metrics = [rl_step(ctx, step) for step in range(2)]
    return metrics, {k: v.clone() for k, v in ctx.model.state_dict().items()}


@pytest.mark.slow
def test_keep_sampling_mask_at_top_p_one_changes_nothing_bitwise():
    """With top_p = 1, keep_sampling_mask=true and logprobs=processed give a 2-step run bitwise equal to the
    default one (every metric and every parameter). (At top_p < 1 the grpo_keep_mask preset's 2-step run.)"""
    base_m, base_p = _two_steps([])
    mask_m, mask_p = _two_steps(["sampler.keep_sampling_mask=true", "sampler.logprobs=processed"])
    assert all(same_rows(a, b) for a, b in zip(base_m, mask_m, strict=True))
    assert all(torch.equal(base_p[k], mask_p[k]) for k in base_p)
