"""The sampler's top-k tokens and log-probs per response position (issue 53: DPPO's top-k divergences),
from the hf engine, against one full forward of the same tokens; and the update forward's log-probs of
those tokens."""

import pytest
import torch

from moe_rl.models import ModelConfig, build_model
from moe_rl.models.tokenizer import build_tokenizer
from moe_rl.rollout import SamplerConfig, response_logprobs_and_aux, sample


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_hf_topk_is_the_forwards_topk_with_the_drawn_token_kept(temperature):
    """Each valid position's K tokens are the full forward's K most likely (the drawn one in the last slot
    when it ranks lower), with its log-probs at the sampler's temperature; padding is token 0 at 0; and the
    update forward's log-probs of the same ids (`topk_ids_BRK`) equal the sampler's."""
    tokenizer = build_tokenizer()
    tokenizer.padding_side = "left"
    model = build_model(ModelConfig(dtype="float32"), tokenizer).eval()
    K = 4
    cfg = SamplerConfig(max_new_tokens=8, temperature=temperature)
    roll = sample(model, tokenizer, ["12+7=", "3+4=", "100+23=", "9+9="] * 2, cfg,
                  generator=torch.Generator().manual_seed(0), topk=K)
    R = roll.response_ids_BR.shape[1]
    mask_BS = roll.attention_mask_BS[:, :-1]
    with torch.no_grad():
        logits = model(input_ids=roll.input_ids_BS[:, :-1], attention_mask=mask_BS,
                       position_ids=(mask_BS.cumsum(-1) - 1).clamp(min=0)).logits[:, -R:].float()
    logp_BRV = (logits / temperature).log_softmax(-1)
    m = roll.response_mask_BR
    ids, lp = roll.topk_ids_BRK, roll.topk_logp_BRK
    assert ids.shape == (m.shape[0], R, K) and (ids[~m] == 0).all() and (lp[~m] == 0).all()
    torch.testing.assert_close(lp[m], logp_BRV.gather(-1, ids)[m], rtol=0, atol=2e-6)
    drawn = roll.response_ids_BR
    assert (ids == drawn[..., None]).any(-1)[m].all()
    best = logp_BRV.topk(K, -1).indices
    swapped = ~(best == drawn[..., None]).any(-1)
    assert torch.equal(ids[..., :-1][m & swapped], best[..., :-1][m & swapped])
    assert torch.equal(ids[m & ~swapped].sort(-1).values, best[m & ~swapped].sort(-1).values)
    _, _, again = response_logprobs_and_aux(model, roll.input_ids_BS, roll.attention_mask_BS, R, temperature,
                                            topk_ids_BRK=ids)
    torch.testing.assert_close(again[m], lp[m], rtol=0, atol=2e-6)
