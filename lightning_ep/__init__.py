"""lightning_ep: expert parallelism for Mixture-of-Experts training in PyTorch Lightning."""

from lightning_ep.moe.config import MoEConfig
from lightning_ep.moe.layer import MoELayer
from lightning_ep.transform import moe_layers, transform

__all__ = ["MoEConfig", "MoELayer", "moe_layers", "transform"]
__version__ = "0.1.0.dev0"
