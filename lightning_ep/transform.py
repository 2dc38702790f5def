"""``transform``: replace a Hugging Face model's sparse MoE blocks by ``MoELayer`` in place."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from lightning_ep.models.causal_mask import separate_packed_documents, skip_causal_mask
from lightning_ep.models.hf_compat import keep_hf_behaviour, refuse_transformers_expert_parallelism
from lightning_ep.models.padding import watch_padding
from lightning_ep.models.peft_lora import check_peft_model, check_router, peel_expert_adapters
from lightning_ep.models.registry import family_for, find_moe_blocks, replace_module, supported_model_types
from lightning_ep.moe.config import MoEConfig, config_differences
from lightning_ep.moe.layer import MoELayer
from lightning_ep.moe.layer_execution import LayerExecution

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def moe_layers(model: nn.Module) -> list[MoELayer]:
    """Every ``MoELayer`` in ``model``, in module order."""
    return [m for m in model.modules() if isinstance(m, MoELayer)]


def transform(
    model: nn.Module,
    config: MoEConfig | None = None,
    *,
    mesh: DeviceMesh | None = None,
    execution: LayerExecution | None = None,
) -> nn.Module:
    """Replace every supported MoE block of ``model`` with a ``MoELayer``, in place.

    The new layers adopt the blocks' own ``Parameter`` objects: parameter names, global shapes and
    values are unchanged, so ``state_dict()`` and ``save_pretrained`` still match the Hugging Face
    model (``"balanced"`` mode adds one buffer per layer, ``gate.expert_bias``, unless the model has
    its own selection bias, as DeepSeek-V3's ``gate.e_score_correction_bias``, which it then updates).
    The supported families are those of ``lightning_ep.models`` (``config.model_type`` picks one):
    mixtral, qwen2_moe, qwen3_moe, olmoe, deepseek_v3, glm4_moe and gpt_oss.

    Args:
        model: a Hugging Face MoE model (e.g. ``MixtralForCausalLM``), on any device, meta included.
            Only the sparse MoE blocks are replaced; dense MLP layers interleaved with them stay.
        config: routing, balancing and dispatch options; ``smp_moe=False`` returns ``model`` untouched.
        mesh: ``None`` for one process. A mesh from ``init_mesh`` shards the experts on its ``"ep"``
            axis and exchanges tokens there (``lightning_ep.parallel.expert``).
        execution: how the layers run (``LayerExecution``; ``ExpertParallelStrategy`` passes the one
            its ``Execution`` resolves to). Given again on a transformed model, it replaces the layers'.
    Packed rows (``position_ids`` restarting at 0 per document, no ``attention_mask``, as transformers'
    ``DataCollatorWithFlattening`` makes them) are masked per document whatever ``config.use_cache``
    says (``lightning_ep.models.causal_mask.separate_packed_documents``).

    Returns ``model`` itself. Calling it again on a transformed model with the same ``config`` only
    applies ``mesh``; with another ``config`` it raises ``ValueError`` (``check_config_in_force``).
    """
    config = config if config is not None else MoEConfig()
    if not isinstance(config, MoEConfig):
        raise TypeError(f"transform(config=...) must be a MoEConfig, got {type(config).__name__}.")
    check_config_in_force(
        model,
        config,
        asked_by="transform(model, config)",
        fix="drop one of the two transform() calls, or pass both the same MoEConfig",
    )
    if not config.smp_moe:
        return model
    if not moe_layers(model):
        refuse_transformers_expert_parallelism(model)
        check_peft_model(model)
        family = family_for(model)
        blocks = find_moe_blocks(model, family)
        if not blocks:
            raise ValueError(
                f"transform(model): found no {'/'.join(family.block_classes)} in {type(model).__name__}; "
                f"supported families: {supported_model_types()}. Is every layer dense?"
            )
        for index, (name, block) in enumerate(blocks):
            before = dict(block.named_parameters())
            check_router(block, family.router_name, name)
            adapters, renames = peel_expert_adapters(block, family.gate_up_proj.rpartition(".")[0], name)
            layer = family.build_layer(block, model.config, config, index, adapters)  # type: ignore[arg-type]
            _check_same_parameters(name, before, block, layer, renames)
            layer.train(block.training)
            replace_module(model, name, layer)
        keep_hf_behaviour(model)
    watch_padding(model)
    skip_causal_mask(model)
    separate_packed_documents(model)
    if execution is not None:
        _apply_execution(model, config, execution, mesh)
    if mesh is not None:
        from lightning_ep.parallel.expert import parallelize_moe_layers

        parallelize_moe_layers(model, mesh)
    return model


def _apply_execution(model: nn.Module, config: MoEConfig, execution: LayerExecution, mesh: DeviceMesh | None) -> None:
    """Give every MoE layer ``execution``; the layers of a model already split over ranks (``mesh``
    not given again) get their dispatchers rebuilt on the group they exchange in."""
    from lightning_ep.moe.dispatch.select import make_dispatcher

    for layer in moe_layers(model):
        group = None if mesh is not None else layer.dispatcher.group
        degree = mesh["ep"].size() if mesh is not None else (group.size() if group is not None else 1)
        execution.check(config, degree)
        layer.set_execution(execution)
        if group is not None:
            layer.dispatcher = make_dispatcher(config, layer.num_experts, group, execution)


def check_execution_in_force(model: nn.Module, execution: LayerExecution) -> None:
    """Refuse a model whose MoE layers were given other execution choices by hand
    (``transform(..., execution=...)``) than the strategy's ``execution``, the one home of those choices."""
    for layer in moe_layers(model):
        if layer.execution not in (LayerExecution(), execution):
            raise ValueError(
                f"ExpertParallelStrategy: the model's MoE layers were given {layer.execution} by transform(), but the "
                f"strategy's Execution resolves to {execution}; drop transform()'s execution= and pass the choices "
                "to ExpertParallelStrategy(execution=Execution(...))."
            )


def check_config_in_force(model: nn.Module, config: MoEConfig, *, asked_by: str, fix: str) -> None:
    """Refuse ``config`` for a model whose ``MoELayer``s were built with another ``MoEConfig``: a
    ``ValueError`` naming every differing field, who asks for it (``asked_by``) and the ``fix``.

    The layers' routing, losses and dispatch were fixed when they were built; accepting another
    config would leave theirs silently in force. Re-applying it in place is not attempted: a new
    balancing mode changes the layers' buffers (``gate.expert_bias``) and state-dict keys.
    """
    for in_force in dict.fromkeys(layer.config for layer in moe_layers(model)):
        differences = config_differences(in_force, config)
        if differences:
            fields = ", ".join(f"{name}={old!r} (asked: {new!r})" for name, (old, new) in differences.items())
            raise ValueError(
                f"{asked_by}: the model's MoE layers were already built by transform() with another MoEConfig, "
                f"which stays in force: {fields}. A model is transformed once; {fix}."
            )


def _check_same_parameters(
    name: str, before: dict[str, nn.Parameter], block: nn.Module, layer: MoELayer, renames: dict[str, str]
) -> None:
    """Strict check: the layer's parameters are exactly the block's ``before`` (names, shapes,
    objects), but for ``renames`` (PEFT's expert adapters, see ``models.peft_lora``: the base weights
    keep their objects under the new names, the LoRA factors are new expert-stacked parameters), and
    it keeps every persistent buffer of the block (e.g. DeepSeek's ``e_score_correction_bias``)."""
    converted = {new for old, new in renames.items() if "lora_" in new and "lora_" in old}
    before = {renames.get(k, k): v for k, v in before.items()}
    after = dict(layer.named_parameters())
    if before.keys() != after.keys() or any(before[k] is not after[k] for k in before if k not in converted):
        raise RuntimeError(
            f"adapter bug at {name}: block parameters {sorted(before)} became {sorted(after)}; "
            "the MoE layer must adopt every parameter of the block under the same name."
        )
    buffers_before = {k: v for k, v in block.state_dict(keep_vars=True).items() if k not in before}
    buffers_after = layer.state_dict(keep_vars=True)
    if any(buffers_after.get(k) is not v for k, v in buffers_before.items()):
        raise RuntimeError(
            f"adapter bug at {name}: block buffers {sorted(buffers_before)} are not all kept by the MoE layer "
            f"(its state dict: {sorted(buffers_after)}); it must adopt every persistent buffer under the same name."
        )
