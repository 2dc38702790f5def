"""torch.distributed on top of ``lightning_ep.moe``: meshes, expert sharding, FSDP2, grad norm."""

from lightning_ep.parallel.expert import parallelize_moe_layers
from lightning_ep.parallel.fsdp import shard_model
from lightning_ep.parallel.grad_norm import clip_grad_norm_
from lightning_ep.parallel.mesh import MESH_AXES, check_layout, dense_mesh, expert_data_mesh, init_mesh

__all__ = [
    "MESH_AXES",
    "check_layout",
    "clip_grad_norm_",
    "dense_mesh",
    "expert_data_mesh",
    "init_mesh",
    "parallelize_moe_layers",
    "shard_model",
]
