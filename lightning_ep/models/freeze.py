"""``freeze_routers``: keep a model's routing fixed during a fine-tune."""

from __future__ import annotations

from torch import nn

from lightning_ep.moe.layer import MoELayer


def freeze_routers(model: nn.Module) -> list[str]:
    """Stop every MoE router of ``model`` from training: its ``weight`` (and logit ``bias``) no longer
    require grad. A frozen router routes as before; its layer still reports the balancing losses but
    attaches none to the gradients, and its selection bias (``"balanced"``'s or
    ``e_score_correction_bias``) stays where it is (``TopKRouter.frozen``). Call it before or after
    ``lightning_ep.transform``, or on a PEFT model. Returns the names of the parameters it froze;
    raises ``ValueError`` when ``model`` holds no MoE router of a supported family.
    """
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, MoELayer)]
    routers: list[tuple[str, nn.Module]]
    routers = [(f"{name}.{m.child_names['gate']}", m.gate) for name, m in layers] if layers else _hf_routers(model)
    frozen = []
    for prefix, router in routers:
        for name, parameter in router.named_parameters():
            parameter.requires_grad_(False)
            frozen.append(f"{prefix}.{name}" if prefix else name)
    if not frozen:
        raise ValueError(
            f"freeze_routers(model): found no MoE router in the {type(model).__name__}; pass a Hugging Face MoE "
            "model of a supported family, transformed by lightning_ep.transform or not."
        )
    return frozen


def _hf_routers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The routers of an untransformed Hugging Face model (PEFT-wrapped or not), by family table."""
    from lightning_ep.models.registry import FAMILIES, find_moe_blocks, supported_model_types

    supported_model_types()  # registers the families
    get_base_model = getattr(model, "get_base_model", None)
    hf_model = get_base_model() if callable(get_base_model) else model
    family = FAMILIES.get(getattr(getattr(hf_model, "config", None), "model_type", None))  # type: ignore[arg-type]
    if family is None:
        return []
    prefix = {id(m): name for name, m in model.named_modules()}
    return [
        (f"{prefix[id(block)]}.{family.router_name}", block.get_submodule(family.router_name))
        for _, block in find_moe_blocks(hf_model, family)
    ]
