"""Routing: the router (top-k, Sinkhorn, balanced bias), its losses and the seeded randomness.

Imports ``lightning_ep.moe.config`` and ``lightning_ep.moe.kernels`` only.
"""

from lightning_ep.moe.routing.losses import load_balancing_loss, z_loss
from lightning_ep.moe.routing.router import Routing, TopKRouter, sinkhorn_log

__all__ = ["Routing", "TopKRouter", "load_balancing_loss", "sinkhorn_log", "z_loss"]
