"""Rollouts: batched KV-cache sampling that records routing, and full-forward response log-probs.

The sampler and the forwards are imported on first use (PEP 562): they need torch and transformers, and
the schema (`moe_rl.rollout.config`, read by `moe_rl.config`) needs none of it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from moe_rl.lazy import lazy_attributes
from moe_rl.rollout.config import RolloutConfig, SamplerConfig

if TYPE_CHECKING:
    from moe_rl.rollout.forward import (
        position_ids_from_mask,
        response_logprobs,
        response_logprobs_and_aux,
        token_logprobs,
    )
    from moe_rl.rollout.sampler import Rollout, sample
    from moe_rl.rollout.support import SamplingSupport

_LAZY = {
    "position_ids_from_mask": "moe_rl.rollout.forward",
    "response_logprobs": "moe_rl.rollout.forward",
    "response_logprobs_and_aux": "moe_rl.rollout.forward",
    "token_logprobs": "moe_rl.rollout.forward",
    "Rollout": "moe_rl.rollout.sampler",
    "sample": "moe_rl.rollout.sampler",
    "SamplingSupport": "moe_rl.rollout.support",
}

__all__ = [
    "Rollout",
    "RolloutConfig",
    "SamplerConfig",
    "SamplingSupport",
    "position_ids_from_mask",
    "response_logprobs",
    "response_logprobs_and_aux",
    "sample",
    "token_logprobs",
]

__getattr__ = lazy_attributes(__name__, _LAZY)
