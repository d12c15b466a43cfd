"""The keep sampling mask (DeepSeek-V3.2, arXiv 2512.02556, §3.1): the top-p support each token was drawn from.

Shape legend: B rows, R response length, V vocabulary, N = total support entries of a batch.

The sampler draws token y_t from the top-p nucleus S_t of softmax(z_t / T) (after the task's special-token
suppression). With `sampler.keep_sampling_mask=true` it records S_t, and the old-policy and update forwards
compute log-probs renormalised over it,

    log π(y_t | S_t) = z_t[y_t] / T − logsumexp_{v ∈ S_t} z_t[v] / T,

so π_old and π_θ act on the action set the sampler used (as slime and DeepSeek-V3.2 do).

Storage is ragged (CSR): the ids of every support, row by row and token by token, and each token's support
size. It costs (Σ |S_t|) · id bytes + B·R·4 bytes (int16 ids for V ≤ 32768, int32 above), against B·R·V
bytes for a bool mask: for a nucleus of n tokens out of V, n·2 (or 4) bytes per token instead of V.

The ids are the ones the sampler's own top-p cut kept, not a count re-applied to other logits: the trainer's
forward computes slightly different logits than the cached decode did, so re-sorting them near the cut could
pick another set, and among tied logits at the boundary only the sampler knows which it kept. So the
support is exact under ties and under sampler/trainer numerical mismatch. A token with no recorded support
(padding after EOS, or `sampler.top_p=1`, where nothing is truncated) uses the whole vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def support_ids_dtype(vocab_size: int) -> torch.dtype:
    """The smallest signed integer dtype that holds token ids 0..vocab_size-1."""
    return torch.int16 if vocab_size <= 32768 else torch.int32


@dataclass(frozen=True)
class SamplingSupport:
    """Each sampled token's top-p support, ragged.

    size_BR: int32 support size of each token (0 = none recorded: the whole vocabulary).
    ids_N: the supports' token ids, row-major over (row, token), each support in increasing id order.
    vocab_size: V.
    """

    size_BR: Tensor
    ids_N: Tensor
    vocab_size: int

    def __post_init__(self) -> None:
        assert self.size_BR.dim() == 2 and self.ids_N.dim() == 1
        assert int(self.size_BR.sum()) == self.ids_N.numel(), "support sizes and ids disagree"

    @property
    def nbytes(self) -> int:
        """Bytes held (the sizes and the ids)."""
        return self.size_BR.numel() * self.size_BR.element_size() + self.ids_N.numel() * self.ids_N.element_size()

    def _row_spans(self) -> tuple[Tensor, Tensor]:
        per_row_B = self.size_BR.long().sum(-1)
        return torch.cumsum(per_row_B, 0) - per_row_B, per_row_B

    def rows(self, index: slice | Tensor | list[int]) -> SamplingSupport:
        """The supports of a subset of rows (a permutation or a mini-batch), in that order."""
        start_B, count_B = self._row_spans()
        picked = torch.arange(self.size_BR.shape[0])[index]
        starts, counts = start_B[picked], count_B[picked]
        total = int(counts.sum())
        offsets = torch.cumsum(counts, 0) - counts  # where each picked row starts in the result
        within = torch.arange(total) - torch.repeat_interleave(offsets, counts)
        gather = torch.repeat_interleave(starts, counts) + within
        return SamplingSupport(self.size_BR[picked], self.ids_N[gather.to(self.ids_N.device)], self.vocab_size)

    def mask(self, device: torch.device | str = "cpu") -> Tensor:
        """`[B, R, V]` bool on `device`: True on each token's support (everywhere where none is recorded)."""
        B, R = self.size_BR.shape
        size_N = self.size_BR.flatten().long()
        flat_N = torch.repeat_interleave(torch.arange(B * R), size_N).to(device)
        mask_BRV = torch.zeros(B * R, self.vocab_size, dtype=torch.bool, device=device)
        mask_BRV[flat_N, self.ids_N.to(device).long()] = True
        mask_BRV[(size_N == 0).to(device)] = True
        return mask_BRV.view(B, R, self.vocab_size)

    @staticmethod
    def from_steps(keep_per_step: list[Tensor], vocab_size: int) -> SamplingSupport:
        """Assemble from the decode loop's `[B, V]` bool supports, one per step (all False = none recorded).
        Only one step's `[B, V]` mask is ever dense; the result is reordered from step-major to row-major."""
        R = len(keep_per_step)
        sizes, keys, ids = [], [], []
        for t, keep_BV in enumerate(keep_per_step):
            nz = keep_BV.nonzero().cpu()  # (b, id) pairs, by b then by id
            sizes.append(keep_BV.sum(-1, dtype=torch.int32).cpu())
            keys.append(nz[:, 0] * R + t)
            ids.append(nz[:, 1])
        order = torch.argsort(torch.cat(keys), stable=True)  # stable: ids stay increasing within a token
        ids_N = torch.cat(ids)[order].to(support_ids_dtype(vocab_size))
        return SamplingSupport(torch.stack(sizes, dim=1), ids_N, vocab_size)


def renormalised_logprobs(logits_BRV: Tensor, tokens_BR: Tensor, temperature: float, mask_BRV: Tensor) -> Tensor:
    """`[B, R]` float32 log softmax(logits / T) over the support `mask_BRV` at `tokens_BR`."""
    logits = logits_BRV.float()
    if temperature != 1.0:
        logits = logits / temperature
    logits = logits.masked_fill(~mask_BRV.to(logits.device), float("-inf"))
    return logits.gather(-1, tokens_BR.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
