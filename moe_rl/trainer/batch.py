"""`Batch`: a scored rollout in mini-batch order, the value an RL step's phases and metrics all read.

Its own module, so that `trainer/step.py` (which builds it) and the modules that read it (`plan.py`,
`reduce.py`, `step_metrics.py`) import it from here and not from each other.

Shape legend: B rollout rows, S sequence (prompt P + response R), S1 = S - 1 positions a forward sees,
M mini-batches, C runs of M consecutive rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moe_rl.objectives import group_advantages
from moe_rl.rollout import Rollout, SamplingSupport
from moe_rl.routing import RoutingTrace
from moe_rl.trainer.distributed import Dist, minibatch_rows


@dataclass
class Batch:
    """A scored rollout in mini-batch order (rows permuted once, mini-batches are contiguous slices)."""

    input_ids_BS: torch.Tensor
    attention_mask_BS: torch.Tensor
    response_mask_BR: torch.Tensor
    valid_BS1: torch.Tensor  # positions a forward sees that hold real tokens predicting real tokens
    adv_B: torch.Tensor
    sampler_logp_BR: torch.Tensor
    sampler_trace: RoutingTrace | None
    rows_B: torch.Tensor | None = None
    """Each row's index in the step's global rollout batch (what routing.logit_noise is keyed by)."""
    support: SamplingSupport | None = None
    """Each response token's top-p support (sampler.keep_sampling_mask), else None."""
    minibatches: list[slice] = field(default_factory=list)
    """The mini-batches, contiguous slices of the rows (`build`); empty for a batch built by hand."""
    perm_B: torch.Tensor | None = None
    """This rank's rows in batch order, as indices into its own rows of the rollout (`build`)."""
    topk_ids_BRK: torch.Tensor | None = None
    topk_logp_BRK: torch.Tensor | None = None
    """The sampler's top-k tokens and log-probs per response position (Rollout.topk_ids_BRK), else None."""

    @classmethod
    def build(
        cls,
        roll: Rollout,
        rewards_B: torch.Tensor,
        *,
        group_size: int,
        mini_batches: int,
        group_minibatches: bool,
        normalize_std: bool,
        shuffle_gen: torch.Generator,
        dist: Dist,
    ) -> Batch:
        """This rank's rows of the step's rollout in mini-batch order, with their group advantages.

        The mini-batches are drawn for the global batch identically on every rank (`minibatch_rows`:
        whole groups with `group_minibatches`); this rank takes its runs of M rows of each."""
        adv_B = group_advantages(rewards_B, group_size, normalize_std=normalize_std)
        n = len(rewards_B)
        rows_MC = minibatch_rows(n * dist.world, mini_batches, shuffle_gen, group_size if group_minibatches else 1)
        c = rows_MC.shape[1] // dist.world
        perm_B = (rows_MC[:, dist.rank * c : (dist.rank + 1) * c] - dist.rank * n).reshape(-1)
        dev = roll.logp_BR.device
        batch = cls.from_rollout(roll, adv_B.to(dev), perm_B.to(dev), dist.rank * n)
        batch.minibatches = [slice(j * c, (j + 1) * c) for j in range(mini_batches)]
        batch.perm_B = perm_B
        return batch

    def support_of(self, sl: slice) -> SamplingSupport | None:
        """The sampling support of mini-batch `sl`, which its old-policy and update forwards renormalise over."""
        return None if self.support is None else self.support.rows(sl)

    @classmethod
    def from_rollout(
        cls, roll: Rollout, adv_B: torch.Tensor, perm_B: torch.Tensor, row_offset: int = 0
    ) -> Batch:
        """The rollout's rows in the order `perm_B`; this rank's rows start at global row `row_offset`."""
        valid_BS = torch.cat([roll.prompt_mask_BP.bool(), roll.response_mask_BR], dim=1)
        trace = roll.routing.rows(perm_B) if roll.routing is not None else None
        return cls(
            roll.input_ids_BS[perm_B],
            roll.attention_mask_BS[perm_B],
            roll.response_mask_BR[perm_B],
            # A real token followed by a real token: a row's last token counts nowhere, however far the
            # batch is padded after it (on one rank or split over several).
            (valid_BS[:, :-1] & valid_BS[:, 1:])[perm_B],
            adv_B[perm_B],
            roll.logp_BR[perm_B],
            trace,
            perm_B + row_offset,
            roll.support.rows(perm_B.cpu()) if roll.support is not None else None,
            topk_ids_BRK=None if roll.topk_ids_BRK is None else roll.topk_ids_BRK[perm_B],
            topk_logp_BRK=None if roll.topk_logp_BRK is None else roll.topk_logp_BRK[perm_B],
        )
