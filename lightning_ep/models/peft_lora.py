"""Seeing through PEFT's LoRA: a ``PeftModel`` whose experts carry ``ParamWrapper`` adapters.

``LoraConfig(target_parameters=["experts.gate_up_proj", "experts.down_proj"])`` wraps each targeted
3-D expert weight in a ``lora.ParamWrapper`` (nested when both weights of one experts module are
targeted). ``transform`` leaves PEFT's ``lora.Linear`` layers where they are (they train under FSDP2
as any other module) and peels the ``ParamWrapper``s off each experts module, carrying their factors
into ``LoRAGroupedExperts`` as expert-stacked parameters.

Layouts (E experts, r rank, a weight ``[E, out, in]``): PEFT keeps ``lora_A.weight [r * E, in]`` (rows
``e * r .. e * r + r - 1`` for expert ``e``) and ``lora_B.weight [out, r * E]`` (column ``j * E + e``
for rank ``j`` of expert ``e``), delta ``scaling * B_e @ A_e``; this library keeps ``A [E, r, in]``
and ``B [E, out, r]`` (``peft_to_stacked``, ``stacked_to_peft``). PEFT is imported only when the
model holds its modules (it is then already loaded).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from lightning_ep.moe.experts.lora import ADAPTABLE, ExpertLoRA, LoRAGroupedExperts, lora_names

#: The fix every refusal of an adapter on the router shares.
_ROUTER_FIX = (
    "leave the router out of the LoRA targets (it stays frozen), or train it in full: leave it out of target_modules "
    "and target_parameters and call {path}.requires_grad_(True) after get_peft_model"
)


def _peft() -> Any:
    """The ``peft`` module if it was imported (a model holding PEFT modules implies it), else ``None``."""
    return sys.modules.get("peft")


def peft_configs(model: nn.Module) -> dict[str, Any]:
    """``{adapter name: PEFT config}`` of the PEFT model ``model`` is or holds, ``{}`` without PEFT."""
    peft = _peft()
    if peft is None:
        return {}
    for module in model.modules():
        configs = module.__dict__.get("peft_config")
        if isinstance(configs, dict) and isinstance(module, (peft.PeftModel, peft.tuners.tuners_utils.BaseTuner)):
            return dict(configs)
    return {}


def check_peft_model(model: nn.Module) -> Any | None:
    """The ``LoraConfig`` of ``model``'s PEFT adapter, ``None`` without PEFT; raises ``ValueError`` with
    the fix for what this library cannot train exactly: another PEFT method, several adapters, and
    ``target_parameters`` entries that matched no parameter (PEFT accepts those if another matched)."""
    configs = peft_configs(model)
    if not configs:
        return None
    peft = _peft()
    for name, config in configs.items():
        if not isinstance(config, peft.LoraConfig):
            method = getattr(getattr(config, "peft_type", None), "value", type(config).__name__)
            raise ValueError(
                f"transform(model): the model's PEFT adapter {name!r} uses {method}, and lightning_ep trains PEFT's "
                "LoRA only (its expert adapters become expert-parallel parameters); wrap the model with "
                "peft.get_peft_model(model, LoraConfig(...)) instead, or pass the Hugging Face model without PEFT."
            )
    if len(configs) > 1:
        raise ValueError(
            f"transform(model): the PEFT model holds {len(configs)} adapters {sorted(configs)}; lightning_ep trains "
            "one LoRA adapter at a time. Delete the others (model.delete_adapter(name)) before training."
        )
    config = next(iter(configs.values()))
    wrapped = []  # PEFT's wrappers (nested ones sit at <experts>.base_layer...), or what transform made of them
    for path, module in model.named_modules():
        if is_param_wrapper(module):
            wrapped.append(f"{path.replace('.base_layer', '')}.{module.parameter_name}")
        elif isinstance(module, LoRAGroupedExperts):
            wrapped.extend(f"{path}.{weight}" for weight in module.lora_scaling)
    for target in sorted(config.target_parameters or ()):
        if not any(name == target or name.endswith("." + target) for name in wrapped):
            raise ValueError(
                f"transform(model): LoraConfig(target_parameters=[..., {target!r}, ...]) matches no parameter of the "
                "model, so that adapter does not exist. Name the experts' 3-D weights as they are in the Hugging Face "
                "model, e.g. target_parameters=['experts.gate_up_proj', 'experts.down_proj'], or drop the entry."
            )
    return config


def is_param_wrapper(module: nn.Module) -> bool:
    """Whether ``module`` is PEFT's LoRA wrapper of a 3-D parameter (``False`` without PEFT)."""
    peft = _peft()
    return peft is not None and isinstance(module, peft.tuners.lora.ParamWrapper)


def _is_tuner_layer(module: nn.Module) -> bool:
    peft = _peft()
    if peft is None:
        return False
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    return isinstance(module, (BaseTunerLayer, AuxiliaryTrainingWrapper))


def check_router(block: nn.Module, router_name: str, where: str) -> None:
    """Refuse a PEFT module at or inside the router ``block.<router_name>``: the MoE layer computes
    the routing from the router's weight itself, so an adapter there would be dropped."""
    router = block.get_submodule(router_name)
    for path, module in router.named_modules():
        if _is_tuner_layer(module):
            name = f"{where}.{router_name}{'.' + path if path else ''}"
            raise ValueError(
                f"transform(model): the router {name} carries a PEFT {type(module).__name__} (a LoRA target matched "
                f"it, e.g. target_modules=[..., {router_name!r}] or target_parameters=[..., "
                f"'{router_name}.weight']); lightning_ep routes with the router's own weight and would drop that "
                f"adapter. Fix: {_ROUTER_FIX.format(path=name)}."
            )


def peel_expert_adapters(
    block: nn.Module, experts_name: str, where: str
) -> tuple[dict[str, ExpertLoRA], dict[str, str]]:
    """Take PEFT's LoRA ``ParamWrapper``s off ``block.<experts_name>``, in place. Returns
    ``({"gate_up_proj" and/or "down_proj": ExpertLoRA}, renames)``: the factors as new expert-stacked
    parameters (same values and ``requires_grad``), and ``{name in the block: name in the MoE layer}``
    for every parameter renamed; ``({}, {})`` without adapters. ``ValueError`` for an adapter this
    library cannot carry exactly (merged, disabled, several, transposed, on another parameter).
    """
    module: Any = block.get_submodule(experts_name)  # PEFT's modules are untyped
    adapters: dict[str, ExpertLoRA] = {}
    renames: dict[str, str] = {}
    prefix = experts_name
    while is_param_wrapper(module):
        weight, adapter, scaling = _check_wrapper(module, f"{where}.{prefix}")
        base = module.get_base_layer()
        num_experts = getattr(base, weight).shape[0]
        A, B = module.lora_A[adapter].weight, module.lora_B[adapter].weight
        A_stacked, B_stacked = peft_to_stacked(A.detach(), B.detach(), num_experts)
        name_A, name_B = lora_names(weight)
        adapters[weight] = ExpertLoRA(
            nn.Parameter(A_stacked, requires_grad=A.requires_grad),
            nn.Parameter(B_stacked, requires_grad=B.requires_grad),
            scaling,
        )
        renames[f"{prefix}.lora_A.{adapter}.weight"] = f"{experts_name}.{name_A}"
        renames[f"{prefix}.lora_B.{adapter}.weight"] = f"{experts_name}.{name_B}"
        module = module.base_layer
        prefix += ".base_layer"
    if not adapters:
        _refuse_other_tuners(module, f"{where}.{experts_name}")
        return {}, {}
    _refuse_other_tuners(module, f"{where}.{prefix}")
    for name, _ in module.named_parameters():
        renames[f"{prefix}.{name}"] = f"{experts_name}.{name}"
    owner, _, child = experts_name.rpartition(".")
    setattr(block.get_submodule(owner) if owner else block, child, module)
    return adapters, renames


def _check_wrapper(wrapper: Any, where: str) -> tuple[str, str, float]:
    """``(weight name, adapter name, scaling)`` of one ``ParamWrapper``, or a clear refusal."""
    weight = wrapper.parameter_name
    if weight not in ADAPTABLE:
        raise ValueError(
            f"transform(model): PEFT adapts {where}.{weight}, but lightning_ep carries LoRA on the experts' "
            f"{list(ADAPTABLE)} only; drop {weight!r} from LoraConfig(target_parameters=...)."
        )
    if getattr(wrapper.get_base_layer(), "is_transposed", False):
        raise ValueError(
            f"transform(model): {where} stores its experts transposed ([E, in, out]); lightning_ep carries LoRA on "
            f"the [E, out, in] layout only. Leave {weight!r} out of LoraConfig(target_parameters=...)."
        )
    names = list(wrapper.lora_A.keys())
    if len(names) != 1:
        raise ValueError(
            f"transform(model): {where}.{weight} holds the LoRA adapters {names}; lightning_ep trains exactly one. "
            "Delete the others (model.delete_adapter(name)) before training."
        )
    adapter = names[0]
    if wrapper.merged or wrapper.disable_adapters or adapter not in wrapper.active_adapters:
        state = "merged into the weight" if wrapper.merged else "disabled or inactive"
        raise ValueError(
            f"transform(model): the LoRA adapter {adapter!r} on {where}.{weight} is {state}; transform a model whose "
            f"adapter is active and unmerged (model.unmerge_adapter(); model.set_adapter({adapter!r}))."
        )
    return weight, adapter, float(wrapper.scaling[adapter])


def _refuse_other_tuners(module: nn.Module, where: str) -> None:
    for path, sub in module.named_modules():
        if _is_tuner_layer(sub):
            raise ValueError(
                f"transform(model): {where}{'.' + path if path else ''} carries a PEFT {type(sub).__name__}; "
                "lightning_ep replaces the experts module and carries only LoRA adapters on its 3-D weights "
                "(LoraConfig(target_parameters=['experts.gate_up_proj', 'experts.down_proj'])). Leave the experts "
                "module and its children out of target_modules."
            )


def peft_to_stacked(A: torch.Tensor, B: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's ``lora_A.weight [r * E, in]`` and ``lora_B.weight [out, r * E]`` as ``A [E, r, in]`` and
    ``B [E, out, r]`` (new contiguous tensors)."""
    rank = A.shape[0] // num_experts
    A_stacked = A.reshape(num_experts, rank, A.shape[1]).clone()
    B_stacked = B.reshape(B.shape[0], rank, num_experts).permute(2, 0, 1).contiguous()
    return A_stacked, B_stacked


def stacked_to_peft(A: torch.Tensor, B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of ``peft_to_stacked``: ``A [E, r, in]``, ``B [E, out, r]`` in PEFT's layout."""
    num_experts, rank, in_features = A.shape
    return A.reshape(num_experts * rank, in_features).clone(), B.permute(1, 2, 0).reshape(B.shape[1], -1).contiguous()


def lora_layers(model: nn.Module) -> Iterator[tuple[str, Any]]:
    """``(name, module)`` of every PEFT LoRA layer of ``model`` (``lora.Linear`` and the like)."""
    peft = _peft()
    if peft is None:
        return
    for name, module in model.named_modules():
        if isinstance(module, peft.tuners.lora.LoraLayer):
            yield name, module


@torch.no_grad()
def reset_lora_parameters(model: nn.Module) -> None:
    """Initialise every LoRA factor of ``model`` as PEFT does for a new adapter (after a meta-device
    build): PEFT's ``reset_lora_parameters`` for its layers, ``LoRAGroupedExperts``' for the experts."""
    configs = peft_configs(model)
    for _, layer in lora_layers(model):
        for adapter in layer.lora_A:
            init = getattr(configs.get(adapter), "init_lora_weights", True)
            layer.reset_lora_parameters(adapter, init if init in (True, False, "gaussian") else True)
    init = getattr(next(iter(configs.values()), None), "init_lora_weights", True)
    for module in model.modules():
        if isinstance(module, LoRAGroupedExperts):
            module.reset_lora_parameters(init if init in (True, False, "gaussian") else True)


__all__ = [
    "check_peft_model",
    "check_router",
    "lora_layers",
    "peel_expert_adapters",
    "peft_configs",
    "peft_to_stacked",
    "reset_lora_parameters",
    "stacked_to_peft",
]
