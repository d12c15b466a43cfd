"""Instrumented MoE routers: record per-token expert choices as data, replay them, and measure them.

Its names are imported on first use (PEP 562): they need torch, and the schema (`moe_rl.routing.config`,
read by `moe_rl.config`) needs none of it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from moe_rl.lazy import lazy_attributes
from moe_rl.routing.config import RoutingConfig

if TYPE_CHECKING:
    from moe_rl.routing.controller import (
        Drift,
        Recorder,
        RoutingController,
        RoutingReplayError,
        UnsupportedRouterError,
        replay_gates,
        routers_of,
    )
    from moe_rl.routing.metrics import (
        centred_shift_sq,
        dead_expert_fraction,
        expert_change_by_layer,
        expert_change_fraction,
        expert_load,
        margin_summary,
        predicted_change,
        router_entropy,
        router_margins,
        token_change_fraction,
    )
    from moe_rl.routing.noise import LogitNoise, hash_normal, logit_noise, noise_scale
    from moe_rl.routing.precision import float32_routers
    from moe_rl.routing.trace import RoutingTrace, ids_dtype, token_digest

_LAZY = {
    "Drift": "moe_rl.routing.controller",
    "Recorder": "moe_rl.routing.controller",
    "RoutingController": "moe_rl.routing.controller",
    "RoutingReplayError": "moe_rl.routing.controller",
    "UnsupportedRouterError": "moe_rl.routing.controller",
    "replay_gates": "moe_rl.routing.controller",
    "routers_of": "moe_rl.routing.controller",
    "centred_shift_sq": "moe_rl.routing.metrics",
    "dead_expert_fraction": "moe_rl.routing.metrics",
    "expert_change_by_layer": "moe_rl.routing.metrics",
    "expert_change_fraction": "moe_rl.routing.metrics",
    "expert_load": "moe_rl.routing.metrics",
    "margin_summary": "moe_rl.routing.metrics",
    "predicted_change": "moe_rl.routing.metrics",
    "router_entropy": "moe_rl.routing.metrics",
    "router_margins": "moe_rl.routing.metrics",
    "token_change_fraction": "moe_rl.routing.metrics",
    "LogitNoise": "moe_rl.routing.noise",
    "hash_normal": "moe_rl.routing.noise",
    "logit_noise": "moe_rl.routing.noise",
    "noise_scale": "moe_rl.routing.noise",
    "float32_routers": "moe_rl.routing.precision",
    "RoutingTrace": "moe_rl.routing.trace",
    "ids_dtype": "moe_rl.routing.trace",
    "token_digest": "moe_rl.routing.trace",
}

__all__ = [
    "Drift",
    "LogitNoise",
    "Recorder",
    "RoutingConfig",
    "RoutingController",
    "RoutingReplayError",
    "RoutingTrace",
    "UnsupportedRouterError",
    "centred_shift_sq",
    "dead_expert_fraction",
    "expert_change_by_layer",
    "expert_change_fraction",
    "expert_load",
    "float32_routers",
    "hash_normal",
    "ids_dtype",
    "logit_noise",
    "margin_summary",
    "noise_scale",
    "predicted_change",
    "replay_gates",
    "router_entropy",
    "router_margins",
    "routers_of",
    "token_change_fraction",
    "token_digest",
]

__getattr__ = lazy_attributes(__name__, _LAZY)
