"""Instrumented MoE routers: record per-token expert choices as data, replay them, and measure them."""

from moe_rl.routing.controller import Recorder, RoutingController, RoutingReplayError
from moe_rl.routing.metrics import (
    expert_change_by_layer,
    expert_change_fraction,
    expert_load,
    router_entropy,
    token_change_fraction,
)
from moe_rl.routing.trace import RoutingTrace, ids_dtype

__all__ = [
    "Recorder",
    "RoutingController",
    "RoutingReplayError",
    "RoutingTrace",
    "expert_change_by_layer",
    "expert_change_fraction",
    "expert_load",
    "ids_dtype",
    "router_entropy",
    "token_change_fraction",
]
