"""The world mesh: axes ``("replicate", "edp", "ep")``, validated up front.

World size ``W = R * S`` with ``R`` the replicate (HSDP) degree and ``S = E_dp * d`` the shard
degree, ``d`` the expert-parallel degree. Dense parameters are FSDP2-sharded over
``("replicate", "shard")`` (``shard`` = ``edp`` x ``ep`` flattened); experts over
``("replicate", "edp")`` with their expert dim sharded on ``ep``.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from lightning_ep.moe.layout import Layout

MESH_AXES = ("replicate", "edp", "ep")


def check_layout(world_size: int, degree: int, replicate_degree: int = 1) -> int:
    """Validate a layout (``Layout``, whose errors name the fix); the expert-data-parallel size ``W / (R * d)``."""
    return Layout(world=world_size, degree=degree, replicate_degree=replicate_degree).edp


def init_mesh(degree: int, *, replicate_degree: int = 1, device_type: str = "cuda") -> DeviceMesh:
    """The world mesh with axes ``("replicate", "edp", "ep")`` and a flattened ``"shard"`` axis, for
    expert-parallel ``degree`` and HSDP ``replicate_degree`` (1: plain FSDP) on ``"cuda"`` or ``"cpu"``
    (gloo). The default process group must be initialised."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("init_mesh needs an initialised default process group: call dist.init_process_group first.")
    edp = check_layout(dist.get_world_size(), degree, replicate_degree)
    mesh = init_device_mesh(device_type, (replicate_degree, edp, degree), mesh_dim_names=MESH_AXES)
    shard_mesh(mesh)
    return mesh


def shard_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D ``"shard"`` mesh (``edp`` x ``ep`` flattened). Its process group is made once, by the
    first call (``init_mesh``'s); later calls return the same mesh."""
    return mesh["edp", "ep"]._flatten("shard")


def dense_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The ``("replicate", "shard")`` mesh that dense parameters are sharded over, built from the
    ``replicate`` axis and the ``shard`` mesh: torch deprecates slicing a flattened axis by name."""
    concatenate = getattr(DeviceMesh, "_concatenate", None)
    if concatenate is None:  # a torch without it: the slice, without torch's deprecation warning
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Slicing a flattened dim", category=UserWarning)
            return mesh["replicate", "shard"]
    return concatenate([mesh["replicate"], shard_mesh(mesh)])


def expert_data_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The ``("replicate", "edp")`` mesh that FSDP2 shards experts over."""
    return mesh["replicate", "edp"]


def local_block(tensor: torch.Tensor, who: str, name: str) -> tuple[torch.Tensor, tuple[int, ...]]:
    """This rank's block of ``tensor`` (a DTensor's local tensor, or a plain tensor's detached view:
    both write through to it) and the global index of its first element per dim. ``who`` and
    ``name`` start the error for placements that hold no contiguous block of the global tensor."""
    if not isinstance(tensor, DTensor):
        return tensor.detach(), (0,) * tensor.ndim
    if not all(isinstance(p, (Shard, Replicate)) for p in tensor.placements):
        raise ValueError(
            f"{who}: {name!r} is placed {tuple(tensor.placements)} on mesh {tensor.device_mesh.mesh_dim_names}; "
            "only Shard and Replicate placements hold one contiguous block of the global tensor. Shard the model "
            "with lightning_ep.shard_model."
        )
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    local = tensor.to_local()
    if tuple(local.shape) != tuple(shape):
        raise RuntimeError(
            f"{who}: local shard of {name!r} is {list(local.shape)} but its placements "
            f"{tuple(tensor.placements)} give {list(shape)}; please report this with your torch version."
        )
    return local, tuple(int(o) for o in offset)
