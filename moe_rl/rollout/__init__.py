"""Rollouts: batched KV-cache sampling that records routing, and full-forward response log-probs."""

from moe_rl.rollout.forward import (
    position_ids_from_mask,
    response_logprobs,
    response_logprobs_and_aux,
    token_logprobs,
)
from moe_rl.rollout.sampler import Rollout, SamplerConfig, sample
from moe_rl.rollout.support import SamplingSupport

__all__ = [
    "Rollout",
    "SamplerConfig",
    "SamplingSupport",
    "position_ids_from_mask",
    "response_logprobs",
    "response_logprobs_and_aux",
    "sample",
    "token_logprobs",
]
