"""`RoutingTrace`: the experts each token was sent to, as plain data.

Shape legend: B batch rows, T time steps (tokens), L MoE layers, K experts per token, E experts.

A trace recorded on a whole model also carries a per-row digest of the token ids it was recorded on
(`token_digest_B`), so that a replay can check it is replayed on the same tokens, row by row: shapes
alone cannot tell a trace whose rows were permuted differently from its inputs.
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


_DIGEST_MOD = (1 << 24) - 3  # position weights and token ids stay below 2**24: no int64 overflow for T < 2**15


def position_weights(start: int, length: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """`[length]` int64 pseudo-random weights of absolute positions start..start+length-1, in [1, 2**24)."""
    t = torch.arange(start, start + length, dtype=torch.int64, device=device)
    return (t * 2654435761 + 40503) % _DIGEST_MOD + 1


def token_digest(token_ids_BT: torch.Tensor, start: int = 0) -> torch.Tensor:
    """`[B]` int64 digest of each row's tokens at absolute positions start.., additive over time chunks:
    digest(x[:, :a]) + digest(x[:, a:], start=a) == digest(x). Σ_t id_t * w(t); equal rows give equal
    digests, and a row differing in any token almost surely does not (ids < 2**24)."""
    weights_T = position_weights(start, token_ids_BT.shape[1], token_ids_BT.device)
    return (token_ids_BT.long() % (1 << 24) * weights_T).sum(-1)


@dataclass(frozen=True)
class RoutingTrace:
    """Per-token expert choices of one or more forwards.

    expert_ids_BTLK: top-k expert ids in the router's own order, smallest integer dtype.
    num_experts: E, the experts per layer.
    router_logits_BTLE: optional float32 router logits (for entropy), or None.
    token_digest_B: `token_digest` of the T token ids each row was recorded on (int64), or None for a
        trace recorded on a bare MoE block, which never sees token ids.
    gates_BTLK: optional combine weights of those experts, in the same order (float32), recorded for a
        replay of the gates too (routing.replay_gates), or None.
    """

    expert_ids_BTLK: torch.Tensor
    num_experts: int
    router_logits_BTLE: torch.Tensor | None = None
    token_digest_B: torch.Tensor | None = None
    gates_BTLK: torch.Tensor | None = None

    def __post_init__(self) -> None:
        assert self.expert_ids_BTLK.dim() == 4, "expert_ids must be [B, T, L, K]"
        if self.router_logits_BTLE is not None:
            assert self.router_logits_BTLE.shape[:3] == self.expert_ids_BTLK.shape[:3]
        if self.token_digest_B is not None:
            assert self.token_digest_B.shape == self.expert_ids_BTLK.shape[:1]
        if self.gates_BTLK is not None:
            assert self.gates_BTLK.shape == self.expert_ids_BTLK.shape

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
        for extra in (self.router_logits_BTLE, self.gates_BTLK):
            if extra is not None:
                n += extra.numel() * extra.element_size()
        return n

    def _map(self, fn, digest) -> RoutingTrace:
        logits = None if self.router_logits_BTLE is None else fn(self.router_logits_BTLE)
        gates = None if self.gates_BTLK is None else fn(self.gates_BTLK)
        return RoutingTrace(fn(self.expert_ids_BTLK), self.num_experts, logits, digest, gates)

    def rows(self, index: slice | torch.Tensor | list[int]) -> RoutingTrace:
        """The trace of a subset of batch rows (a mini-batch)."""
        digest = None if self.token_digest_B is None else self.token_digest_B[index]
        return self._map(lambda x: x[index], digest)

    def time(self, index: slice) -> RoutingTrace:
        """The trace of a span of time steps. It keeps no token digest: the digest covers whole rows."""
        return self._map(lambda x: x[:, index], None)

    def to(self, device: torch.device | str) -> RoutingTrace:
        """The same trace on another device."""
        digest = None if self.token_digest_B is None else self.token_digest_B.to(device)
        return self._map(lambda x: x.to(device), digest)

    @staticmethod
    def cat(traces: list[RoutingTrace], dim: int = 0) -> RoutingTrace:
        """Concatenate traces along rows (dim=0) or time (dim=1)."""
        logits = [t.router_logits_BTLE for t in traces]
        has_logits = all(x is not None for x in logits)
        digests = [t.token_digest_B for t in traces]
        digest = None
        if all(d is not None for d in digests):
            # Along time the chunks' digests do not add up without their offsets: keep none.
            digest = torch.cat(digests) if dim == 0 else None
        gates = [t.gates_BTLK for t in traces]
        return RoutingTrace(
            torch.cat([t.expert_ids_BTLK for t in traces], dim=dim),
            traces[0].num_experts,
            torch.cat(logits, dim=dim) if has_logits else None,
            digest,
            torch.cat(gates, dim=dim) if all(g is not None for g in gates) else None,
        )
