"""lightning_ep: expert parallelism for Mixture-of-Experts training in PyTorch Lightning."""

from lightning_ep.moe.config import MoEConfig
from lightning_ep.moe.layer import MoELayer
from lightning_ep.parallel.fsdp import shard_model
from lightning_ep.parallel.grad_norm import clip_grad_norm_
from lightning_ep.parallel.mesh import init_mesh
from lightning_ep.transform import moe_layers, transform

__all__ = ["MoEConfig", "MoELayer", "clip_grad_norm_", "init_mesh", "moe_layers", "shard_model", "transform"]
__version__ = "0.1.0.dev0"
