"""Pure-torch MoE building blocks: config, router, losses, dispatchers, experts, layer.

Nothing here imports Lightning or transformers; process groups are passed in by the caller.
"""

from lightning_ep.moe.config import MoEConfig
from lightning_ep.moe.dispatch import Dispatched, Dispatcher, LocalDispatcher
from lightning_ep.moe.experts import GroupedExperts, RoutedExperts
from lightning_ep.moe.experts_variants import InterleavedGLUExperts
from lightning_ep.moe.layer import MoELayer
from lightning_ep.moe.losses import load_balancing_loss, z_loss
from lightning_ep.moe.router import Routing, TopKRouter, sinkhorn_log

__all__ = [
    "Dispatched",
    "Dispatcher",
    "GroupedExperts",
    "InterleavedGLUExperts",
    "LocalDispatcher",
    "MoEConfig",
    "MoELayer",
    "RoutedExperts",
    "Routing",
    "TopKRouter",
    "load_balancing_loss",
    "sinkhorn_log",
    "z_loss",
]
