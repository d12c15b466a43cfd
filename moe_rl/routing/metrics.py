"""Routing metrics: pure functions of `RoutingTrace`s and a `[B, T]` bool token mask.

| function | formula |
|---|---|
| `expert_change_by_layer(a, b, m)` | per layer l: mean over valid tokens of 1 - \\|A_tl ∩ B_tl\\| / K |
| `expert_change_fraction(a, b, m)` | mean of the above over layers: the GSPO paper's "fraction of activated experts that differ" (§5.3) |
| `token_change_fraction(a, b, m)` | fraction of valid tokens whose expert set differs in at least one layer |
| `expert_load(t, m)` | per layer: tokens per expert, its coefficient of variation std/mean, max/mean, fraction of dead experts |
| `router_entropy(t, m)` | per layer: mean over valid tokens of -Σ_e p_e log p_e, p = softmax(router logits) |
| `router_margins(z, k)` | per token and layer: z_(k) - z_(k+1), the k-th minus the (k+1)-th largest router logit |
| `predicted_change(m, s, k)` | (1/K) mean Φ(-m / (s√2)): expert change that iid N(0, s²) logit noise causes at those margins |
| `centred_shift_sq(a, b)` | Σ over tokens, layers, experts of (Δz - mean_e Δz)², Δz = a - b: a logit shift that can re-route |
| `margin_summary(margin_N)` | median, 10th percentile and fraction below 0.1 of pooled margins |
| `dead_expert_fraction(load_LE, s)` | per layer: fraction of experts whose load is below s x the uniform load N K / E |

Shape legend: B rows, T tokens, L layers, K top-k, E experts, N valid tokens.
"""

from __future__ import annotations

import math

import torch

from moe_rl.routing.trace import RoutingTrace


def _valid(ids_BTLK: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """The valid tokens' ids as `[N, L, K]` long."""
    if mask_BT.shape != ids_BTLK.shape[:2]:
        raise ValueError(
            f"mask shape {tuple(mask_BT.shape)} does not match trace [B, T] {tuple(ids_BTLK.shape[:2])}"
        )
    return ids_BTLK[mask_BT.to(ids_BTLK.device, torch.bool)].long()


def _overlap_NL(a: RoutingTrace, b: RoutingTrace, mask_BT: torch.Tensor) -> torch.Tensor:
    """|A ∩ B| per valid token and layer. Top-k ids of one token are distinct, so matches count the overlap."""
    if a.shape != b.shape:
        raise ValueError(f"traces differ in shape: {tuple(a.shape)} vs {tuple(b.shape)}")
    a_NLK, b_NLK = (
        _valid(a.expert_ids_BTLK, mask_BT),
        _valid(b.expert_ids_BTLK, mask_BT).to(a.expert_ids_BTLK.device),
    )
    return (a_NLK.unsqueeze(-1) == b_NLK.unsqueeze(-2)).any(-1).sum(-1)


@torch.no_grad()
def expert_change_by_layer(a: RoutingTrace, b: RoutingTrace, mask_BT: torch.Tensor) -> torch.Tensor:
    """`[L]` float: per layer, mean over valid tokens of 1 - |A ∩ B| / K. Zeros when no token is valid."""
    overlap_NL = _overlap_NL(a, b, mask_BT)
    if overlap_NL.shape[0] == 0:
        return torch.zeros(a.shape[2])
    return (1.0 - overlap_NL.float() / a.shape[3]).mean(0).cpu()


@torch.no_grad()
def expert_change_fraction(a: RoutingTrace, b: RoutingTrace, mask_BT: torch.Tensor) -> float:
    """Mean over valid tokens and layers of 1 - |A ∩ B| / K (GSPO paper §5.3)."""
    return float(expert_change_by_layer(a, b, mask_BT).mean())


@torch.no_grad()
def token_change_fraction(a: RoutingTrace, b: RoutingTrace, mask_BT: torch.Tensor) -> float:
    """Fraction of valid tokens whose expert set differs from `b`'s in at least one layer."""
    overlap_NL = _overlap_NL(a, b, mask_BT)
    if overlap_NL.shape[0] == 0:
        return 0.0
    return float((overlap_NL < a.shape[3]).any(-1).float().mean())


@torch.no_grad()
def expert_load(trace: RoutingTrace, mask_BT: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-layer load: `tokens_per_expert` `[L, E]`, and `[L]` vectors `cv`, `max_over_mean`, `dead_frac`."""
    ids_NLK = _valid(trace.expert_ids_BTLK, mask_BT)
    N, L, K = ids_NLK.shape
    counts_LE = torch.zeros(L, trace.num_experts, dtype=torch.float64, device=ids_NLK.device)
    counts_LE.scatter_add_(
        1,
        ids_NLK.permute(1, 0, 2).reshape(L, N * K),
        torch.ones(L, N * K, dtype=torch.float64, device=ids_NLK.device),
    )
    mean_L = counts_LE.mean(1)
    safe_L = mean_L.clamp_min(1e-12)
    return {
        "tokens_per_expert": counts_LE.cpu(),
        "cv": (counts_LE.std(1, unbiased=False) / safe_L).cpu(),
        "max_over_mean": (counts_LE.max(1).values / safe_L).cpu(),
        "dead_frac": (counts_LE == 0).double().mean(1).cpu(),
    }


@torch.no_grad()
def router_entropy(trace: RoutingTrace, mask_BT: torch.Tensor) -> torch.Tensor:
    """`[L]`: mean router entropy (nats) over valid tokens; needs a trace recorded with logits."""
    if trace.router_logits_BTLE is None:
        raise ValueError("router_entropy needs a trace recorded with logits: record(with_logits=True)")
    logits_NLE = trace.router_logits_BTLE[mask_BT.to(trace.router_logits_BTLE.device, torch.bool)].float()
    if logits_NLE.shape[0] == 0:
        return torch.zeros(trace.shape[2])
    logp_NLE = torch.log_softmax(logits_NLE, dim=-1)
    return (-(logp_NLE.exp() * logp_NLE).sum(-1)).mean(0).cpu()


def router_margins(logits_BTLE: torch.Tensor, top_k: int) -> torch.Tensor:
    """`[B, T, L]`: the k-th minus the (k+1)-th largest router logit of each token and layer (>= 0).

    A token flips one expert when a perturbation of its logits closes this gap: it is the distance to
    natural re-routing. Softmax is monotone, so the order is that of the router's probabilities; ties
    give 0. Computed in the logits' dtype promoted to at least float32. Differentiable (topk values).
    Works on any leading shape `[..., E]`; raises ValueError unless 1 <= top_k < E.
    """
    E = logits_BTLE.shape[-1]
    if not 1 <= top_k < E:
        raise ValueError(f"router_margins: top_k={top_k} must be in [1, {E - 1}] for {E} experts")
    z = logits_BTLE.to(torch.promote_types(logits_BTLE.dtype, torch.float32))
    top_BTLk = torch.topk(z, top_k + 1, dim=-1, sorted=True).values
    return top_BTLk[..., top_k - 1] - top_BTLk[..., top_k]


MARGIN_SMALL = 0.1
"""`margin_summary`'s threshold for a near-tie (logit units)."""


@torch.no_grad()
def margin_summary(margin_N: torch.Tensor, small: float = MARGIN_SMALL) -> dict[str, float]:
    """`median`, `p10` (10th percentile, linear interpolation) and `frac_below` (share of margins < `small`)
    of a pool of margins (any shape, flattened); NaNs when the pool is empty."""
    m = margin_N.detach().flatten().double()
    if m.numel() == 0:
        return dict(median=float("nan"), p10=float("nan"), frac_below=float("nan"))
    return dict(
        median=float(m.quantile(0.5)),
        p10=float(m.quantile(0.1)),
        frac_below=float((m < small).double().mean()),
    )


@torch.no_grad()
def dead_expert_fraction(tokens_per_expert_LE: torch.Tensor, min_share: float = 0.0) -> torch.Tensor:
    """`[L]`: fraction of experts whose load is below `min_share` x the uniform load (total / E) of
    their layer; `min_share` = 0 counts experts that received no token at all (`expert_load`'s
    `dead_frac`). Relative to uniform, so one threshold means the same for 8 and for 128 experts."""
    if min_share < 0:
        raise ValueError(f"dead_expert_fraction: min_share={min_share} must be >= 0")
    load_LE = tokens_per_expert_LE.double()
    uniform_L1 = load_LE.sum(1, keepdim=True) / load_LE.shape[1]
    dead_LE = load_LE == 0 if min_share == 0 else load_LE < min_share * uniform_L1
    return dead_LE.double().mean(1)


def predicted_change(margins: torch.Tensor, scale: float, top_k: int) -> float:
    """Expert change that iid N(0, scale²) noise on every router logit predicts at these margins, counting
    only swaps across the k / k+1 boundary: the pair swaps when ε_(k+1) - ε_(k) ~ N(0, 2 scale²) exceeds
    the margin, and a swap changes 1 of K experts, so (1/K) mean_m Φ(-m / (scale √2)). A lower bound
    when several experts crowd the boundary. NaN without margins; 0 at scale 0."""
    if margins.numel() == 0:
        return math.nan
    if scale <= 0:
        return 0.0
    tail = 0.5 * torch.erfc(margins.double() / (2.0 * scale))  # Φ(-m/(s√2)) = erfc(m / (2s)) / 2
    return float(tail.mean()) / top_k


@torch.no_grad()
def centred_shift_sq(logits_a: torch.Tensor, logits_b: torch.Tensor) -> float:
    """Σ (Δz - mean_e Δz)² over every token, layer and expert of `[..., E]` logits, Δz = a - b. A shift
    common to all experts re-routes nothing, so it is removed; divided by the element count it is the
    variance s² of an equivalent iid logit noise (`predicted_change`)."""
    d = logits_a.double() - logits_b.double()
    return float(((d - d.mean(-1, keepdim=True)) ** 2).sum())
