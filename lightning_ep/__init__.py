"""lightning_ep: expert parallelism for Mixture-of-Experts training in PyTorch Lightning.

``import lightning_ep`` stays light: the Lightning strategy and callback are imported on first use
of ``lightning_ep.ExpertParallelStrategy`` and ``lightning_ep.MoEMonitor``, and the short name
``strategy="expert_parallel"`` is registered with Lightning as soon as Lightning's strategy
registry is loaded.
"""

from typing import Any

from lightning_ep.execution.choices import Execution
from lightning_ep.models.freeze import freeze_routers
from lightning_ep.moe.config import MoEConfig
from lightning_ep.moe.layer import MoELayer
from lightning_ep.moe.layer_execution import LayerExecution
from lightning_ep.parallel.fsdp import shard_model
from lightning_ep.parallel.grad_norm import clip_grad_norm_
from lightning_ep.parallel.mesh import init_mesh
from lightning_ep.strategy.registration import register_when_lightning_loads
from lightning_ep.transform import moe_layers, transform

__all__ = [
    "Execution",
    "ExpertParallelStrategy",
    "LayerExecution",
    "MoEConfig",
    "MoELayer",
    "MoEMonitor",
    "clip_grad_norm_",
    "freeze_routers",
    "init_mesh",
    "moe_layers",
    "shard_model",
    "transform",
]
__version__ = "0.1.0.dev0"

_LAZY = {
    "ExpertParallelStrategy": "lightning_ep.strategy.expert_parallel",
    "MoEMonitor": "lightning_ep.monitor.callback",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lightning_ep' has no attribute {name!r}")


register_when_lightning_loads()
