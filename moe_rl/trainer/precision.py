"""Low-precision training: AdamW on float32 master copies of bfloat16 (or float16) parameters.

Why: with the parameters themselves in bfloat16 (8 mantissa bits), an AdamW step of size ~lr is rounded
away whenever it is below half a unit in the last place of the weight: at lr = 1e-4 every weight of
magnitude above ~0.05 (norm gains at 1.0, most embeddings) never moves, and at lr = 1e-6 (the pretrained
presets) almost nothing does. Mixed-precision trainers (Megatron, the GSPO paper's setting) therefore keep
float32 master weights: forwards and backwards run in bfloat16, the optimizer updates the float32 copy,
and the copy is rounded back into the model after every step.

`MasterAdamW` does exactly that and nothing else: its master parameters and AdamW state are float32, its
`step` copies each bfloat16 gradient into the master's gradient, takes a `torch.optim.AdamW` step, and
writes the rounded master back. Its state dict carries the master weights, so a resumed run continues
from the float32 values rather than from their rounding.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

LOW_PRECISION = (torch.bfloat16, torch.float16)
"""Parameter dtypes that get float32 master weights under trainer.master_weights=true."""

MASTER_KEY = "master_params"
"""Key of the float32 master weights in `MasterAdamW.state_dict()`."""


class MasterAdamW(torch.optim.AdamW):
    """AdamW whose parameters are float32 copies of the model's (possibly low-precision) parameters.

    The scheduler, `param_groups` and `state` are those of the float32 copies; `zero_grad` also clears the
    model's gradients. Parameters already in float32 get a master that is a copy of them, so the update is
    the same as plain AdamW's.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]], **kwargs: Any) -> None:
        given = list(params)
        groups = given if given and isinstance(given[0], dict) else [{"params": given}]
        self.model_params, masters = [], []
        for group in groups:
            own = [p for p in group["params"] if p.requires_grad]
            self.model_params += own
            masters.append({**group, "params": [p.detach().float().clone().requires_grad_(True) for p in own]})
        super().__init__(masters, **kwargs)

    @property
    def master_params(self) -> list[torch.Tensor]:
        """The float32 master weights, in the order of `model_params` (parameter groups concatenated)."""
        return [m for group in self.param_groups for m in group["params"]]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Copy gradients to the masters (float32), step AdamW on them, round the masters into the model."""
        assert closure is None, "MasterAdamW takes no closure"
        for p, m in zip(self.model_params, self.master_params, strict=True):
            m.grad = None if p.grad is None else p.grad.float()
        super().step()
        for p, m in zip(self.model_params, self.master_params, strict=True):
            p.copy_(m)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the masters' and the model's gradients."""
        super().zero_grad(set_to_none=set_to_none)
        for p in self.model_params:
            p.grad = None

    def state_dict(self) -> dict[str, Any]:
        """AdamW's state dict plus the float32 master weights under `MASTER_KEY`."""
        sd = super().state_dict()
        sd[MASTER_KEY] = [m.detach().clone() for m in self.master_params]
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore AdamW's state and the master weights (and round them into the model)."""
        state_dict = dict(state_dict)
        masters = state_dict.pop(MASTER_KEY)
        super().load_state_dict(state_dict)
        with torch.no_grad():
            for p, m, saved in zip(self.model_params, self.master_params, masters, strict=True):
                m.copy_(saved)
                p.copy_(m)


def master_copies(optimizer: torch.optim.Optimizer) -> dict[int, torch.Tensor]:
    """id(model parameter) -> its float32 master weight when `optimizer` keeps them (`MasterAdamW`); {} for
    an optimizer that updates the parameters themselves."""
    if not isinstance(optimizer, MasterAdamW):
        return {}
    return {id(p): m for p, m in zip(optimizer.model_params, optimizer.master_params, strict=True)}


def router_param_groups(
    model: torch.nn.Module, routers: Iterable[torch.nn.Module], lr: float, scale: float
) -> Iterable[torch.nn.Parameter] | list[dict[str, Any]]:
    """The optimizer's parameters with the routers' at lr x `scale` (trainer.router_lr_scale).

    scale 1: `model.parameters()` itself, one group, so the optimizer (and its checkpoints) are exactly
    those of runs before the option. Otherwise two groups in `model.parameters()` order: every other
    parameter at `lr`, then every parameter of `routers` at lr x scale (key "lr_scale" records the factor,
    for code that resets group lrs). ValueError when no parameter belongs to a router."""
    if scale == 1:
        return model.parameters()
    in_router = {id(p) for r in routers for p in r.parameters()}
    rest = [p for p in model.parameters() if id(p) not in in_router]
    own = [p for p in model.parameters() if id(p) in in_router]
    if not own:
        raise ValueError(f"trainer.router_lr_scale={scale}: the model has no router parameters to scale")
    return [{"params": rest}, {"params": own, "lr": lr * scale, "lr_scale": scale}]


def make_optimizer(
    params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]], dtype: torch.dtype, master_weights: bool,
    **kwargs: Any,
) -> torch.optim.AdamW:
    """`MasterAdamW` for a low-precision model when `master_weights`, else plain AdamW on the parameters
    (or parameter groups)."""
    if master_weights and dtype in LOW_PRECISION:
        return MasterAdamW(params, **kwargs)
    return torch.optim.AdamW(params, **kwargs)
