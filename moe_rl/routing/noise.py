"""Router-logit noise: the GSPO paper's expert volatility as a controlled perturbation.

Natural re-routing flips a token whose k-th and (k+1)-th router logits nearly tie: the runner-up takes
the slot at about the same gate. Selecting the top-k on `logits + scale·ε` (ε ~ N(0, 1) per expert)
does exactly that, and nothing else: a token with a wide margin keeps its experts, the gates of the
chosen experts come from the live logits (`replay_gates`), as under replay, and the backward pass runs
through the experts the perturbed selection chose. `routing.drift` (moe_rl.routing.Drift), by contrast,
swaps a chosen expert for a uniformly random one whatever the margins: expert dropout.

ε is a deterministic function of (seed, step, the row's index in the step's global batch, the token's
position within its own sequence, layer, expert) (`logit_noise`), drawn by a counter-based hash rather
than a generator stream. So a token gets the same ε in the old-policy forward and in its update forward,
whichever mini-batch it lands in, whatever the padding, and on one process or W; and changing σ never
changes the rollouts or any other draw.

Shape legend: B rows, T positions a forward sees, L MoE layers, E experts, K top-k, N = B*T.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (int64 tensors holding values in [0, 2**32)): two rounds of
    xor-shift-multiply (the 0x45d9f3b constant of the well-known `hash32` finaliser). Products stay
    below 2**59, so int64 never overflows."""
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _M32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _M32
    return x ^ (x >> 16)


def _chain(*keys: torch.Tensor | int) -> torch.Tensor:
    """Hash of a tuple of integer keys (broadcast), folding one key at a time."""
    h = torch.zeros((), dtype=torch.int64)
    for k in keys:
        k = torch.as_tensor(k, dtype=torch.int64) & _M32
        h = _mix32((h * 0x9E3779B1 + k) & _M32)  # the golden-ratio multiplier spreads consecutive keys
    return h


def hash_normal(*keys: torch.Tensor | int) -> torch.Tensor:
    """Standard normal float64 values, one per broadcast element of `keys`, deterministic in the keys:
    two independent 32-bit hashes give uniforms u1 in (0, 1], u2 in [0, 1) and Box-Muller
    sqrt(-2 ln u1) cos(2π u2)."""
    h1, h2 = _chain(*keys, 0x5EED1), _chain(*keys, 0x5EED2)
    u1 = (h1.double() + 1.0) / 2.0**32
    u2 = h2.double() / 2.0**32
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)


def logit_noise(
    seed: int, step: int, rows_B: torch.Tensor, positions_BT: torch.Tensor, num_layers: int, num_experts: int
) -> torch.Tensor:
    """`[B, T, L, E]` float32 ε ~ N(0, 1): row b's token at position t (its index within its own sequence,
    pads included at their clamped positions) gets ε keyed by (seed, step, rows_B[b], positions_BT[b, t],
    layer, expert)."""
    B, T = positions_BT.shape
    row = rows_B.long().view(B, 1, 1, 1)
    pos = positions_BT.long().view(B, T, 1, 1)
    layer = torch.arange(num_layers).view(1, 1, -1, 1)
    expert = torch.arange(num_experts).view(1, 1, 1, -1)
    return hash_normal(seed, step, row, pos, layer, expert).float()


def noise_scale(sigma: float, growth: str, minibatch: int) -> float:
    """The noise scale of mini-batch `minibatch` (0-based): σ·sqrt(j - 1) for the j-th mini-batch under
    growth `sqrt` (the on-policy mini-batch is exact, and the perturbation grows like a random walk with
    the updates it has seen), σ under `constant`."""
    if growth == "sqrt":
        return sigma * math.sqrt(minibatch)
    if growth == "constant":
        return sigma
    raise ValueError(f"noise growth {growth!r}: expected 'sqrt' or 'constant'")


@dataclass
class LogitNoise:
    """Noise for one forward: top-k is taken on `logits + scale · eps_BTLE[:, :, layer]`.

    `eps_BTLE` must cover exactly the forward's [B, T] (checked at each router: noise that does not fit
    raises, it is never dropped). The change it causes is measured as expert change, where it is logged.
    """

    eps_BTLE: torch.Tensor
    scale: float

    def perturb(
        self, layer: int, logits_NE: torch.Tensor, ids_NK: torch.Tensor, B: int, T: int
    ) -> torch.Tensor:
        """The top-k ids of the perturbed logits, `[N, K]` long."""
        eB, eT, eL, eE = self.eps_BTLE.shape
        if (eB, eT) != (B, T) or eE != logits_NE.shape[-1] or layer >= eL:
            raise ValueError(
                f"logit noise of shape {tuple(self.eps_BTLE.shape)} does not fit the forward at MoE layer "
                f"{layer}: [B, T] = [{B}, {T}], {logits_NE.shape[-1]} experts"
            )
        eps_NE = self.eps_BTLE[:, :, layer].reshape(B * T, eE).to(logits_NE.device)
        noisy_NE = logits_NE.detach().float() + self.scale * eps_NE
        return noisy_NE.topk(ids_NK.shape[1], dim=-1).indices
