"""model.router_dtype=float32: the routers of a lower-precision model compute in float32.

vLLM's `moe_router_dtype` and prime-rl keep the router in float32 under a bfloat16 model: the router's
weight is float32 and a forward pre-hook casts the hidden states it receives to float32, so its logits
z = W h, the softmax over experts and the top-k choice are all float32:

    z = W_fp32 · float32(h_bf16),   p = softmax(z),   ids = top-k(p),   gates = p[ids] (renormalised)

The gates stay float32 (transformers' experts multiply each expert's output by them and cast the sum
into the hidden dtype). The rest of the model keeps its dtype; gradients flow into the bfloat16 hidden
states through the cast. Where it applies: every model the run holds at below float32 (the trained
policy at model.dtype, a sampler copy at trainer.sampler_dtype), from the start of RL; the warm start
is built at model.dtype as before, and its cache key does not depend on this field.
"""

from __future__ import annotations

import torch
from torch import nn

from moe_rl.routing.controller import routers_of

_HOOKED = "_moe_rl_router_fp32"


def _to_float32(module: nn.Module, args: tuple) -> tuple:
    return (args[0].float(), *args[1:])


def float32_routers(model: nn.Module) -> nn.Module:
    """Cast every router of `model` to float32 and make it compute on float32 inputs (module docstring);
    idempotent (the pre-hook is registered once per router, and a deep copy keeps it). Returns `model`."""
    for router in routers_of(model):
        router.to(torch.float32)
        if not getattr(router, _HOOKED, False):
            router.register_forward_pre_hook(_to_float32)
            setattr(router, _HOOKED, True)
    return model
