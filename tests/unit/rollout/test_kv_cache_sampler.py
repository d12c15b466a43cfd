"""The batched KV-cache sampler: its log-probs and routing agree with a full forward, and it is seeded."""

import pytest
import torch

from moe_rl.models import ModelConfig, build_model
from moe_rl.rollout import SamplerConfig, response_logprobs, sample
from moe_rl.routing import RoutingController

PROMPTS = ["12+345=", "1+1=", "sort 3 1 2:", "reach 24 with 4 6:"] * 2


@pytest.fixture(scope="module")
def policy(tokenizer):
    model = build_model(ModelConfig(), tokenizer)
    return model, RoutingController(model)


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_sampler_logprobs_and_routing_match_full_forward(tokenizer, policy, temperature, top_p):
    """Sampler log-probs equal one full forward's within 1e-5 and its routing trace equals the forward's (fp32)."""
    model, ctl = policy
    cfg = SamplerConfig(temperature=temperature, top_p=top_p, max_new_tokens=12)
    roll = sample(model, tokenizer, PROMPTS, cfg, generator=torch.Generator().manual_seed(0), controller=ctl)
    R = roll.response_ids_BR.shape[1]
    with torch.no_grad(), ctl.record() as rec:
        logp_BR = response_logprobs(model, roll.input_ids_BS, roll.attention_mask_BS, R, temperature)
    mask = roll.response_mask_BR
    assert mask.any(1).all()
    torch.testing.assert_close(logp_BR[mask], roll.logp_BR[mask], rtol=0, atol=1e-5)
    valid_BS = roll.attention_mask_BS[:, :-1].bool()
    assert roll.routing.shape == rec.trace.shape
    assert torch.equal(roll.routing.expert_ids[valid_BS], rec.trace.expert_ids[valid_BS])


def test_sampling_is_reproducible_from_seed(tokenizer, policy):
    """The same generator seed gives the same completions; another seed gives others."""
    model, _ = policy
    cfg = SamplerConfig(max_new_tokens=10)
    a = sample(model, tokenizer, PROMPTS, cfg, generator=torch.Generator().manual_seed(3))
    b = sample(model, tokenizer, PROMPTS, cfg, generator=torch.Generator().manual_seed(3))
    c = sample(model, tokenizer, PROMPTS, cfg, generator=torch.Generator().manual_seed(4))
    assert torch.equal(a.response_ids_BR, b.response_ids_BR) and a.texts == b.texts
    assert not torch.equal(a.response_ids_BR, c.response_ids_BR)


def test_eos_and_padding(tokenizer, policy):
    """After EOS a row holds pad with mask False and log-prob 0; suppressing EOS fills every row to the limit;
    special tokens other than EOS are never drawn."""
    model, _ = policy
    with torch.no_grad():  # make EOS likely so some rows stop early
        model.lm_head.weight[tokenizer.eos_token_id] *= 0
        model.lm_head.weight[tokenizer.eos_token_id] += model.lm_head.weight[5]
    try:
        roll = sample(
            model,
            tokenizer,
            PROMPTS * 4,
            SamplerConfig(max_new_tokens=16),
            generator=torch.Generator().manual_seed(0),
        )
        ids, mask = roll.response_ids_BR, roll.response_mask_BR
        lengths = mask.sum(1)
        assert (lengths < ids.shape[1]).any(), "no row stopped early"
        for i in range(ids.shape[0]):
            n = int(lengths[i])
            assert (ids[i, n:] == tokenizer.pad_token_id).all() and (roll.logp_BR[i, n:] == 0).all()
            if n < ids.shape[1]:
                assert ids[i, n - 1] == tokenizer.eos_token_id
        assert not torch.isin(ids[mask], torch.tensor([0, 1, 3])).any()
        full = sample(
            model,
            tokenizer,
            PROMPTS,
            SamplerConfig(max_new_tokens=16, suppress_eos=True),
            generator=torch.Generator().manual_seed(0),
        )
        assert full.response_mask_BR.all() and full.response_ids_BR.shape[1] == 16
    finally:
        model.load_state_dict(build_model(ModelConfig(), tokenizer).state_dict())


def test_greedy_is_argmax(tokenizer, policy):
    """Temperature 0 decodes greedily: every drawn token is the argmax of a full forward's logits."""
    model, _ = policy
    roll = sample(
        model,
        tokenizer,
        PROMPTS,
        SamplerConfig(temperature=0, max_new_tokens=6),
        generator=torch.Generator().manual_seed(0),
    )
    again = sample(
        model,
        tokenizer,
        PROMPTS,
        SamplerConfig(temperature=0, max_new_tokens=6),
        generator=torch.Generator().manual_seed(9),
    )
    assert torch.equal(roll.response_ids_BR, again.response_ids_BR)


def test_invalid_sampler_config_names_field(tokenizer, policy):
    """Bad sampler settings raise ValueError naming the field."""
    model, _ = policy
    for cfg, field in [
        (SamplerConfig(top_p=0), "sampler.top_p"),
        (SamplerConfig(max_new_tokens=0), "sampler.max_new_tokens"),
        (SamplerConfig(temperature=-1), "sampler.temperature"),
    ]:
        with pytest.raises(ValueError, match=field):
            sample(model, tokenizer, PROMPTS, cfg, generator=torch.Generator())
