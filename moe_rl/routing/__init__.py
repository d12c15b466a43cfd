"""Instrumented MoE routers: record per-token expert choices as data, replay them, and measure them."""

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

__all__ = [
    "Drift",
    "LogitNoise",
    "Recorder",
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
