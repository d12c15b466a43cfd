"""`RoutingTrace`: the experts each token was sent to, as plain data.

Shape legend: B batch rows, T time steps (tokens), L MoE layers, K experts per token, E experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def ids_dtype(num_experts: int) -> torch.dtype:
    """The smallest integer dtype that holds expert ids 0..num_experts-1."""
    if num_experts <= 256:
        return torch.uint8
    if num_experts <= 32768:
        return torch.int16
    return torch.int32


@dataclass(frozen=True)
class RoutingTrace:
    """Per-token expert choices of one or more forwards.

    expert_ids_BTLK: top-k expert ids in the router's own order, smallest integer dtype.
    num_experts: E, the experts per layer.
    router_logits_BTLE: optional float32 router logits (for entropy), or None.
    """

    expert_ids_BTLK: torch.Tensor
    num_experts: int
    router_logits_BTLE: torch.Tensor | None = None

    def __post_init__(self) -> None:
        assert self.expert_ids_BTLK.dim() == 4, "expert_ids must be [B, T, L, K]"
        if self.router_logits_BTLE is not None:
            assert self.router_logits_BTLE.shape[:3] == self.expert_ids_BTLK.shape[:3]

    @property
    def expert_ids(self) -> torch.Tensor:
        """Alias of expert_ids_BTLK."""
        return self.expert_ids_BTLK

    @property
    def shape(self) -> torch.Size:
        """(B, T, L, K)."""
        return self.expert_ids_BTLK.shape

    @property
    def nbytes(self) -> int:
        """Bytes held by the ids (and logits, when recorded)."""
        n = self.expert_ids_BTLK.numel() * self.expert_ids_BTLK.element_size()
        if self.router_logits_BTLE is not None:
            n += self.router_logits_BTLE.numel() * self.router_logits_BTLE.element_size()
        return n

    def _map(self, fn) -> RoutingTrace:
        logits = None if self.router_logits_BTLE is None else fn(self.router_logits_BTLE)
        return RoutingTrace(fn(self.expert_ids_BTLK), self.num_experts, logits)

    def rows(self, index: slice | torch.Tensor | list[int]) -> RoutingTrace:
        """The trace of a subset of batch rows (a mini-batch)."""
        return self._map(lambda x: x[index])

    def time(self, index: slice) -> RoutingTrace:
        """The trace of a span of time steps."""
        return self._map(lambda x: x[:, index])

    def to(self, device: torch.device | str) -> RoutingTrace:
        """The same trace on another device."""
        return self._map(lambda x: x.to(device))

    @staticmethod
    def cat(traces: list[RoutingTrace], dim: int = 0) -> RoutingTrace:
        """Concatenate traces along rows (dim=0) or time (dim=1)."""
        logits = [t.router_logits_BTLE for t in traces]
        has_logits = all(x is not None for x in logits)
        return RoutingTrace(
            torch.cat([t.expert_ids_BTLK for t in traces], dim=dim),
            traces[0].num_experts,
            torch.cat(logits, dim=dim) if has_logits else None,
        )
