"""Instrumented MoE routers: record per-token expert choices as data, replay them, and measure them."""

from moe_rl.routing.controller import (
    Drift,
    Recorder,
    RoutingController,
    RoutingReplayError,
    UnsupportedRouterError,
    replay_gates,
)
from moe_rl.routing.metrics import (
    dead_expert_fraction,
    expert_change_by_layer,
    expert_change_fraction,
    expert_load,
    margin_summary,
    router_entropy,
    router_margins,
    token_change_fraction,
)
from moe_rl.routing.trace import RoutingTrace, ids_dtype, token_digest

__all__ = [
    "Drift",
    "Recorder",
    "RoutingController",
    "RoutingReplayError",
    "RoutingTrace",
    "UnsupportedRouterError",
    "dead_expert_fraction",
    "expert_change_by_layer",
    "expert_change_fraction",
    "expert_load",
    "ids_dtype",
    "margin_summary",
    "replay_gates",
    "router_entropy",
    "router_margins",
    "token_change_fraction",
    "token_digest",
]
