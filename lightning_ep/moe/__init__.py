"""Pure-torch MoE building blocks, by concept: ``config`` (``MoEConfig``), ``routing`` (router,
losses, randomness), ``dispatch`` (dispatchers and the exchange primitives), ``experts`` (grouped
experts and variants), ``kernels`` (Triton, with their torch references), ``graphs`` (the CUDA-graph
wrapper of a layer) and ``layer`` (``MoELayer``: route, dispatch, experts, combine; ``tokens``: its
view of padded batches). Imports flow kernels -> routing, dispatch -> experts -> graphs -> layer.

Nothing here imports Lightning or transformers; process groups are passed in by the caller.
"""

from lightning_ep.moe.config import MoEConfig
from lightning_ep.moe.dispatch.base import Dispatched, Dispatcher, LocalDispatcher
from lightning_ep.moe.experts.grouped import GroupedExperts, RoutedExperts
from lightning_ep.moe.experts.variants import InterleavedGLUExperts
from lightning_ep.moe.layer import MoELayer
from lightning_ep.moe.routing.losses import load_balancing_loss, z_loss
from lightning_ep.moe.routing.router import Routing, TopKRouter, sinkhorn_log

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
