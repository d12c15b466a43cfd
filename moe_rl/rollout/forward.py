"""The policy's log-probabilities of response tokens: one full forward, shared by sampler checks and trainer.

Shape legend: B rows, P prompt length (left-padded), R response length (right-padded), S = P + R,
V vocabulary. A forward sees `input_ids[:, :-1]` (S - 1 positions): the last token is never an input,
so a routing trace of a sequence covers S - 1 positions, exactly what the sampler feeds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # annotations only: importing PreTrainedModel loads transformers' model code
    from transformers import PreTrainedModel

from moe_rl.rollout.support import SamplingSupport, renormalised_logprobs


def position_ids_from_mask(mask_BS: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding: 0 at each row's first real token (pads get 0 too)."""
    return (mask_BS.long().cumsum(-1) - 1).clamp_min(0)


def token_logprobs(logits_BRV: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / temperature)[token] in float32, without materialising a float64 vocabulary tensor.
    `tokens`: `[B, R]` (one token per position) or `[B, R, K]` (K per position, e.g. the sampler's top-k)."""
    logits = logits_BRV.float()
    if temperature != 1.0:
        logits = logits / temperature
    lse_BR = torch.logsumexp(logits, dim=-1)
    if tokens.dim() == logits.dim():
        return logits.gather(-1, tokens) - lse_BR.unsqueeze(-1)
    return logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - lse_BR


def response_logprobs(
    model: PreTrainedModel,
    input_ids_BS: torch.Tensor,
    attention_mask_BS: torch.Tensor,
    response_len: int,
    temperature: float = 1.0,
    support: SamplingSupport | None = None,
) -> torch.Tensor:
    """`[B, R]` float32 log-probs of the last `response_len` tokens of each row under `model`, renormalised
    over each token's sampling support when one is given (the keep sampling mask, moe_rl.rollout.support).

    One forward over `input_ids[:, :-1]`; only the R positions that predict response tokens reach the
    LM head (`logits_to_keep`). Open a routing `record()` or `replay()` around the call to capture or
    fix its routing: the trace it sees is `[B, S - 1, L, K]`.
    """
    return response_logprobs_and_aux(model, input_ids_BS, attention_mask_BS, response_len, temperature,
                                     support=support)[0]


def response_logprobs_and_aux(
    model: PreTrainedModel,
    input_ids_BS: torch.Tensor,
    attention_mask_BS: torch.Tensor,
    response_len: int,
    temperature: float = 1.0,
    with_aux: bool = False,
    support: SamplingSupport | None = None,
    topk_ids_BRK: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """`response_logprobs`; with `with_aux` the family's own load-balancing loss of the forward
    (transformers' `load_balancing_loss_func` over every MoE layer's router logits, padding masked), else
    None; with `topk_ids_BRK` the `[B, R, K]` log-probs of those tokens at each position (no gradient; the
    DPPO top-k divergences), else None. Under replay the loss is the family's function of the live router
    logits (its f_i counts the router's own top-k, its P_i carries the gradient), as in supervised training."""
    inputs_BS = input_ids_BS[:, :-1]
    mask_BS = attention_mask_BS[:, :-1]
    out = model(
        input_ids=inputs_BS,
        attention_mask=mask_BS,
        position_ids=position_ids_from_mask(mask_BS),
        use_cache=False,
        logits_to_keep=response_len,
        **({"output_router_logits": True} if with_aux else {}),
    )
    tokens_BR = input_ids_BS[:, -response_len:]
    if support is None:
        logp_BR = token_logprobs(out.logits, tokens_BR, temperature)
    else:
        logp_BR = renormalised_logprobs(out.logits, tokens_BR, temperature, support.mask(out.logits.device))
    topk_logp_BRK = None
    if topk_ids_BRK is not None:
        with torch.no_grad():
            topk_logp_BRK = token_logprobs(out.logits, topk_ids_BRK.to(out.logits.device), temperature)
    return logp_BR, (out.aux_loss if with_aux else None), topk_logp_BRK
