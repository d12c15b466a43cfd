"""Selection-only routing perturbations, and DeepSeek-V3's auxiliary-loss-free balancing bias.

Shape legend: N flattened tokens, E experts, K top-k, L MoE layers.

`select_topk(logits_NE, bias_E, k)` is top-k on `logits + bias`; the gates are then rebuilt from the live,
unbiased logits at those ids (`replay_gates`), exactly as under replay. That is DeepSeek-V3's
aux-loss-free balancing (arXiv 2412.19437, §2.1.2: "the bias term is only used for routing", eq. 16) and
also the router-logit noise of docs/PAPER-NOTES ("top-k on logits + σε, gates from the live logits"), with
bias = σε per token: one function serves both. `update_bias` is DeepSeek-V3's bias rule: after each
step, b_e decreases by γ if expert e was overloaded and increases by γ if it was underloaded.

Which load balancing moe-rl uses, and why: the family's own aux loss (`model.router_aux_loss_coef`,
`warmstart.pretrain_aux_loss_coef`). The bias is provided here but wired into nothing, because it does
not fit these families cleanly:
- Mechanically it fits the controller's router hook. The gate check (`controller._check_gates`) runs
  on the router's own, unbiased output, so it still passes; the hook selects with `select_topk` and
  rebuilds gates with `replay_gates`, as replay does. Inside the router module it would mean replacing
  transformers' router class (the controller never does), and the router's own logits output would no
  longer be what it selected on; transformers' own biased router (DeepSeek-V3's, sigmoid affinities
  plus `e_score_correction_bias`) fails the gate check and raises `UnsupportedRouterError`.
- But the bias is routing state outside the transformers model. `save_pretrained` does not store it, so a
  warm start balanced by it would need the bias saved beside the weights (and in the cache key), loaded
  by the run, and applied by *every* forward (sampler, old policy, update, eval, probes), or the policy
  RL starts from would route differently from the one that was trained. Every consumer of a checkpoint
  would have to know about it; the aux loss needs nothing outside the model.
- It departs from DeepSeek-V3 itself: V3's affinities are sigmoids and its gates normalise the chosen
  sigmoids; these families' gates are a softmax over all experts. The bias is added to the logits here
  (a probability-space bias would depend on the softmax's scale).
- The bias moves every step by ±γ: near-tied tokens flip with no parameter change. That is a source of
  natural volatility worth measuring, but it must then be counted in margins (measured on logits + bias).
"""

from __future__ import annotations

import torch


def select_topk(logits_NE: torch.Tensor, bias_E: torch.Tensor | None, k: int) -> torch.Tensor:
    """`[N, K]` int64 ids of the k largest `logits_NE + bias_E` per token, largest first.

    bias_E: `[E]` (one per expert, DeepSeek-V3's b), `[N, E]` (per token, e.g. σ·ε noise) or None (plain
    top-k of the logits). Selection only: the caller takes gates from the unbiased logits
    (`replay_gates(module, logits_NE, ids_NK)`). Scores are formed in at least float32, so a bf16 router
    is not rounded into extra ties. With no bias, the ids equal the router's own top-k of its softmax
    probabilities (softmax is monotone) except where two logits tie.
    """
    E = logits_NE.shape[-1]
    if not 1 <= k <= E:
        raise ValueError(f"select_topk: k={k} must be in [1, {E}]")
    scores_NE = logits_NE.detach().to(torch.promote_types(logits_NE.dtype, torch.float32))
    if bias_E is not None:
        if bias_E.shape[-1] != E or bias_E.dim() > 2:
            raise ValueError(f"select_topk: bias shape {tuple(bias_E.shape)} must be [E={E}] or [N, E]")
        scores_NE = scores_NE + bias_E.to(scores_NE)
    return torch.topk(scores_NE, k, dim=-1, sorted=True).indices


@torch.no_grad()
def update_bias(bias_LE: torch.Tensor, tokens_per_expert_LE: torch.Tensor, gamma: float) -> torch.Tensor:
    """DeepSeek-V3's bias update: `bias + γ·sign(mean load - load)` per layer (a new tensor).

    tokens_per_expert_LE: the step's top-k assignments per expert (e.g. `expert_load(trace,
    mask)["tokens_per_expert"]`); an expert above its layer's mean load is pushed down by γ, one below
    pushed up by γ, one exactly at the mean left alone. γ is the bias update speed (V3: 0.001 for most of
    pretraining).
    """
    if not gamma >= 0:
        raise ValueError(f"update_bias: gamma={gamma} must be >= 0")
    if bias_LE.shape != tokens_per_expert_LE.shape:
        raise ValueError(
            f"update_bias: bias {tuple(bias_LE.shape)} and load {tuple(tokens_per_expert_LE.shape)} differ"
        )
    load_LE = tokens_per_expert_LE.to(torch.float64)
    step_LE = torch.sign(load_LE.mean(1, keepdim=True) - load_LE)
    return bias_LE + (gamma * step_LE).to(bias_LE.dtype)
