"""``weight_decay_groups``: optimizer parameter groups that decay the weight matrices and leave
norms, biases and routers alone.

Weight decay regularises a projection matrix, but a norm's scale pulled toward 0 shrinks the
activations, a bias has no scale to regularise, and decaying a router's logits flattens the routing
the balancing losses shape. The usual recipe (GPT-2, Llama, transformers' ``Trainer``) decays only
the matrices; this module applies it to every supported family, transformed or not, under FSDP2 too.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_ep.models.registry import FAMILIES, supported_model_types
from lightning_ep.moe.layer import MoELayer


def no_weight_decay(model: nn.Module) -> list[str]:
    """The names (in ``named_parameters`` order) of the trainable parameters that
    ``weight_decay_groups`` leaves undecayed:

    - every parameter of a normalisation module (a class whose name contains ``Norm``);
    - every parameter with fewer than 2 dimensions (biases, norm scales, GPT-OSS's ``sinks``) and
      every one whose name ends in ``bias`` (GPT-OSS's 2-D expert biases);
    - the routers of the MoE blocks and Qwen2-MoE's ``shared_expert_gate`` (which gates the shared
      expert per token as the router gates the others), transformed or not.

    Frozen parameters (``requires_grad=False``, as the base weights under LoRA) are in neither list.
    """
    exempt = {id(p) for module in _exempt_modules(model) for p in module.parameters()}
    return [
        name
        for name, p in model.named_parameters()
        if p.requires_grad and (id(p) in exempt or p.ndim < 2 or name.endswith("bias"))
    ]


def weight_decay_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two parameter groups for ``torch.optim.AdamW`` or ``lightning_ep.optim.AdamW``: the trainable
    parameters that decay (``weight_decay``) and those that do not (``no_weight_decay``; 0). Call it in
    ``configure_optimizers``: ``AdamW(weight_decay_groups(self.model, 0.1), lr=...)``. An empty group is
    left out; a parameter reached twice (tied embeddings) is listed once. Raises ``ValueError`` for a
    negative ``weight_decay``.
    """
    if weight_decay < 0:
        raise ValueError(f"weight_decay_groups(weight_decay={weight_decay}) must be >= 0.")
    exempt = set(no_weight_decay(model))
    decay: list[nn.Parameter] = []
    keep: list[nn.Parameter] = []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (keep if name in exempt else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": keep, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def _exempt_modules(model: nn.Module) -> list[nn.Module]:
    """Norm modules, and the routers and shared-expert gates of the MoE blocks (replaced or not)."""
    supported_model_types()  # loads the adapter table
    blocks = {name: family for family in FAMILIES.values() for name in family.block_classes}
    found: list[nn.Module] = []
    for module in model.modules():
        if "Norm" in type(module).__name__:
            found.append(module)
        elif isinstance(module, MoELayer):
            found.append(module.gate)
            shared_gate = module._modules.get(module.child_names["shared_experts_gate"])
            if shared_gate is not None:
                found.append(shared_gate)
        elif (family := blocks.get(type(module).__name__)) is not None:
            found.append(module.get_submodule(family.router_name))
            if family.shared_experts_gate is not None:
                found.append(module.get_submodule(family.shared_experts_gate))
    return found
