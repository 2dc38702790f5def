"""Expert parallelism for the ``MoELayer``s of a model: shard experts on ``ep``, pick dispatchers."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from lightning_ep.moe.dispatch.select import make_dispatcher
from lightning_ep.moe.dispatch.shuffle import TokenShuffle
from lightning_ep.moe.layer import MoELayer
from lightning_ep.moe.layout import Layout


def expert_parameters(layer: MoELayer) -> list[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` of ``layer.experts``'s own parameters whose dim 0 is the expert count."""
    num_experts = layer.num_experts
    return [
        (name, param)
        for name, param in layer.experts.named_parameters(recurse=False)
        if param.ndim >= 1 and param.shape[0] == num_experts
    ]


def parallelize_moe_layers(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Shard every ``MoELayer``'s expert weights on ``mesh["ep"]`` (the world mesh from ``init_mesh``)
    and wire its dispatcher. Every parameter of ``expert_parameters`` becomes a DTensor of the same
    global shape ``[E, ...]``, placed ``Shard(0)`` on the ``ep`` axis: rank ``r`` of the axis keeps
    experts ``r*L .. r*L+L-1``. Works on meta tensors (nothing is allocated). Idempotent. A
    ``ValueError`` when a layer's expert count is not divisible by the ``ep`` size.
    """
    ep_mesh = mesh["ep"]
    degree, ep_rank, group = ep_mesh.size(), ep_mesh.get_local_rank(), ep_mesh.get_group()
    layout = Layout(world=mesh.size(), degree=degree, replicate_degree=mesh["replicate"].size())
    for layer in (m for m in model.modules() if isinstance(m, MoELayer)):
        local = layout.local_experts(layer.num_experts, where=f" (layer {layer.layer_index})")
        for name, param in expert_parameters(layer):
            if isinstance(param, DTensor):
                continue
            shard = param.detach()[ep_rank * local : (ep_rank + 1) * local].clone()
            dtensor = DTensor.from_local(
                shard, ep_mesh, [Shard(0)], run_check=False, shape=param.shape, stride=param.stride()
            )
            setattr(layer.experts, name, nn.Parameter(dtensor, requires_grad=param.requires_grad))
        # All d ranks' tokens reach these experts; FSDP2 averages over the other W / d ranks only.
        layer.experts.grad_scale = 1.0 / degree
        layer.dispatcher = make_dispatcher(layer.config, layer.num_experts, group, layer.execution)
        layer.shuffle = TokenShuffle(group) if layer.config.global_token_shuffle and degree > 1 else None
        layer.ep_rank = ep_rank
    return model
