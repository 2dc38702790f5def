"""``shard_model``: FSDP2 for experts (over ``("replicate", "edp")``) and everything else (whole mesh)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from lightning_ep.moe.experts.frozen import FrozenExpertWeight
from lightning_ep.moe.layer import MoELayer
from lightning_ep.parallel.mesh import dense_mesh, expert_data_mesh
from lightning_ep.parallel.single_rank import keep_dense_local


def _fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    # A 2-D (replicate, shard) mesh is HSDP; with replicate size 1 the plain 1-D shard mesh is FSDP.
    return mesh if mesh.size(0) > 1 else mesh[mesh.mesh_dim_names[1]]  # type: ignore[index]


def _fsdp_kwargs(mp_policy: MixedPrecisionPolicy | None, reshard_after_forward: bool) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    return kwargs


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """Entries of every ``nn.ModuleList`` that holds MoE layers: the transformer's decoder layers."""
    blocks: list[nn.Module] = []
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and any(isinstance(m, MoELayer) for m in module.modules()):
            blocks.extend(module)
    return blocks


def shard_model(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = True,
    shard_experts: bool | None = None,
    in_place_on_one_rank: bool = False,
) -> nn.Module:
    """Apply FSDP2 to a model whose MoE layers were parallelised by ``transform(..., mesh=mesh)``.

    - Each ``MoELayer.experts`` is sharded over ``("replicate", "edp")`` on dim 1 (its expert dim 0
      stays sharded on ``ep``). FSDP2 averages its gradient over those ``W / d`` ranks; the
      experts' ``grad_scale = 1 / d`` (set by ``parallelize_moe_layers``) supplies the rest, so it
      is divided by the world size ``W`` exactly like a dense parameter's.
    - Frozen expert weights kept quantized (``moe.experts.frozen``: buffers, which FSDP2 leaves whole)
      get the same split of their bytes over ``edp`` (``FrozenExpertWeight.shard_rows_``), gathered
      in each forward and backward by one all-gather per weight.
    - When that mesh has one rank (``degree`` = world size), FSDP2 would only copy (gradients cast to
      the reduce dtype and back included): the experts are then left out of FSDP2 (their DTensors on
      ``ep`` need no reduction), with ``compute_dtype = mp_policy.param_dtype`` for the matmuls.
    - Each decoder layer, then the output projection (see ``output_head``), then the root, is
      sharded over ``("replicate", "shard")``: HSDP when the replicate degree is above 1. With
      ``in_place_on_one_rank`` (one rank in all, else a ``ValueError``), ``keep_dense_local``
      replaces FSDP2 there: the same numbers without FSDP2's copies of every dense parameter and gradient.

    Every trainable parameter ends up a DTensor; a ``RuntimeError`` says which one did not.

    Args:
        model: the transformed model (``self.model`` of a LightningModule, never the module itself).
        mp_policy: FSDP2 mixed precision (e.g. bf16 params, fp32 reduce).
        reshard_after_forward: free unsharded parameters after forward (ZeRO-3) or keep them (ZeRO-2).
        shard_experts: apply FSDP2 to the experts; ``None`` (default) does so only when they have
            expert-data-parallel ranks (``replicate x edp > 1``). Both give the same numbers.
    """
    kwargs = _fsdp_kwargs(mp_policy, reshard_after_forward)
    experts_mesh = _fsdp_mesh(expert_data_mesh(mesh))
    if shard_experts is None:
        shard_experts = experts_mesh.size() > 1
    unsharded: set[nn.Parameter] = set()
    for layer in (m for m in model.modules() if isinstance(m, MoELayer)):
        if isinstance(layer.experts, FSDPModule):
            continue
        if not any(isinstance(t, DTensor) for t in (*layer.experts.parameters(), *layer.experts.buffers())):
            raise RuntimeError(
                "shard_model: the MoE layers are not expert-parallel yet; call "
                "lightning_ep.transform(model, config, mesh=mesh) before shard_model."
            )
        if shard_experts:
            if layer.execution.cuda_graphs:
                raise ValueError(
                    "Execution(cuda_graphs=True) needs the experts' weights to stay in place, but they have "
                    f"{experts_mesh.size()} expert-data-parallel ranks, so FSDP2 would gather them anew every step; "
                    "use an expert-parallel degree equal to the world size (and replicate_degree=1), or "
                    "cuda_graphs=False."
                )
            fully_shard(layer.experts, mesh=experts_mesh, shard_placement_fn=lambda p: Shard(1), **kwargs)
            if mesh["edp"].size() > 1:
                for frozen in (m for m in layer.experts.modules() if isinstance(m, FrozenExpertWeight)):
                    frozen.shard_rows_(mesh)
        else:
            unsharded.update(layer.experts.parameters(recurse=False))
            layer.experts.compute_dtype = mp_policy.param_dtype if mp_policy is not None else None
    if unsharded:
        kwargs["ignored_params"] = unsharded
    blocks = decoder_blocks(model)
    if not in_place_on_one_rank:
        blocks = [block for block in blocks if not isinstance(block, FSDPModule)]
    _shard_dense(model, mesh, blocks, mp_policy, kwargs, in_place_on_one_rank)
    check_all_sharded(model)
    return model


def _shard_dense(
    model: nn.Module,
    mesh: DeviceMesh,
    blocks: list[nn.Module],
    mp_policy: MixedPrecisionPolicy | None,
    kwargs: dict[str, Any],
    in_place_on_one_rank: bool,
) -> None:
    """``blocks``, the output head (``output_head``) and the root over ``("replicate", "shard")``, or
    with ``in_place_on_one_rank`` the same units kept out of FSDP2 (``keep_dense_local``)."""
    shard_mesh = _fsdp_mesh(dense_mesh(mesh))
    if in_place_on_one_rank:
        if shard_mesh.size() != 1:
            raise ValueError(
                f"in_place_on_one_rank=True needs one rank in all, but the dense parameters span {shard_mesh.size()} "
                "ranks; leave it False there (FSDP2 shards them)."
            )
        head = output_head(model)
        units = [*blocks, *([head] if head is not None else [])]
        keep_dense_local(model, shard_mesh, compute_dtype=mp_policy.param_dtype if mp_policy else None, units=units)
        return
    for block in blocks:
        fully_shard(block, mesh=shard_mesh, **kwargs)
    head = output_head(model)
    if head is not None:
        fully_shard(head, mesh=shard_mesh, **{**kwargs, "reshard_after_forward": False})
        head.register_forward_hook(_reshard_without_grad)  # runs after FSDP2's own post-forward hook
    if not isinstance(model, FSDPModule):
        fully_shard(model, mesh=shard_mesh, **kwargs)


def output_head(model: nn.Module) -> nn.Module | None:
    """The model's output projection (Hugging Face's ``get_output_embeddings()``, the ``lm_head``)
    when it shares no weight with the input embedding, else ``None``. ``shard_model`` gives it an
    FSDP2 unit of its own, kept gathered from a training forward to its backward (a forward without
    grad reshards it at once): its gradient's reduce-scatter then overlaps the decoder layers'
    backward, and the last decoder layer's all-gather the head's backward.
    """
    get_output = getattr(model, "get_output_embeddings", None)
    head = get_output() if callable(get_output) else None
    if not isinstance(head, nn.Module) or isinstance(head, FSDPModule):
        return None
    get_input = getattr(model, "get_input_embeddings", None)
    try:
        embedding = get_input() if callable(get_input) else None
    except NotImplementedError:  # Hugging Face's default when it cannot find one: ties unknown
        return None
    head_weights = {id(p) for p in head.parameters()}
    if embedding is not None and any(id(p) in head_weights for p in embedding.parameters()):
        return None  # tied: one parameter cannot sit in two FSDP2 units
    return head


def _reshard_without_grad(module: nn.Module, _args: Any, _output: Any) -> None:
    # No backward follows a forward without grad (evaluation, generation): free the gathered
    # weight now, so that the parameters are sharded DTensors again, as after every other unit's.
    if not torch.is_grad_enabled():
        module.reshard()  # type: ignore[operator]


def shard_named_blocks(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = True,
    in_place_on_one_rank: bool = False,
) -> list[nn.Module]:
    """FSDP2 for a model that keeps its own MoE blocks (``MoEConfig(smp_moe=False)``): each module
    whose class is named in the model's ``_no_split_modules`` (Hugging Face's decoder layers), then
    the output projection and the root, over ``("replicate", "shard")`` like ``shard_model``'s
    dense part; with ``in_place_on_one_rank`` (one rank in all), ``keep_dense_local`` instead. Returns
    the blocks sharded, in module order."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    _shard_dense(model, mesh, blocks, mp_policy, _fsdp_kwargs(mp_policy, reshard_after_forward), in_place_on_one_rank)
    return blocks


def shard_dense_modules(
    modules: list[nn.Module],
    mesh: DeviceMesh,
    *,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = True,
) -> None:
    """FSDP2 for trainable modules outside the MoE model (a value head beside it), each one unit over
    ``("replicate", "shard")`` like the model's dense parts: their gradients are averaged over every
    rank, as in data parallelism. FSDP2 gathers a unit's weights in its ``forward``, so the module
    must be called, not its weights read. Modules already sharded are skipped."""
    kwargs = _fsdp_kwargs(mp_policy, reshard_after_forward)
    shard_mesh = _fsdp_mesh(dense_mesh(mesh))
    for module in modules:
        if not isinstance(module, FSDPModule):
            fully_shard(module, mesh=shard_mesh, **kwargs)


def check_all_sharded(model: nn.Module) -> None:
    """Raise if a trainable parameter is not a DTensor: it would never get its gradients synced."""
    plain = [name for name, p in model.named_parameters() if p.requires_grad and not isinstance(p, DTensor)]
    if plain:
        raise RuntimeError(
            f"{len(plain)} trainable parameters are not sharded (their gradients would never be "
            f"synchronised across ranks), e.g. {plain[:3]}; shard the modules that own them with FSDP2."
        )


def gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Turn FSDP2 gradient reduction on or off (off on non-final micro-batches of accumulation)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_requires_gradient_sync(enabled, recurse=False)


__all__ = [
    "check_all_sharded",
    "decoder_blocks",
    "gradient_sync",
    "output_head",
    "shard_dense_modules",
    "shard_model",
    "shard_named_blocks",
]
