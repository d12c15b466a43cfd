"""Partial routing replay: keep a replayed expert only while the trainer's own router still rates it
(prime-rl's score-threshold router replay, PR #2703, `TokenChoiceTopKRouter._filter_replayed_experts`).

Shape legend: N tokens, E experts, K top-k.

    keep_nk = score_n(replayed_nk) >= ratio · min_j score_n(own_nj)
    a rejected slot takes, in the trainer's own rank order j = 1..K, the first own expert not already
    among the token's selected experts (the first empty slot first)

`score` is the router's softmax over all experts (the score it takes its top-k of); `own` its own top-k,
best first. The refill always completes: r rejected slots leave K − r kept experts, so at least r of the K
distinct own experts are unused. ratio 0 keeps every replayed expert (plain replay), and the caller skips
the filter then, as prime-rl does.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def partial_replay(scores_NE: torch.Tensor, replayed_NK: torch.Tensor, own_NK: torch.Tensor,
                   ratio: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(the experts each token uses [N, K], which slots were replaced [N, K] bool)."""
    threshold_N1 = scores_NE.gather(1, own_NK).amin(1, keepdim=True) * ratio
    keep_NK = scores_NE.gather(1, replayed_NK) >= threshold_N1
    selected_NK = torch.where(keep_NK, replayed_NK, -1)
    for j in range(own_NK.shape[1]):
        candidate_N1 = own_NK[:, j : j + 1]
        unused_N1 = (selected_NK != candidate_N1).all(1, keepdim=True)
        fillable_NK = (selected_NK < 0) & unused_N1
        first_NK = fillable_NK & (fillable_NK.cumsum(1) == 1)
        selected_NK = torch.where(first_NK, candidate_N1, selected_NK)
    return selected_NK, ~keep_NK
