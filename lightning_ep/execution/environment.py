"""``ExpertParallelStrategy``'s side of ``lightning_ep.execution.choices``: what the strategy sees, and the
names of the optimizers whose kernels the table reports."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from lightning_ep.execution.adamw import KERNEL_ADAMW
from lightning_ep.execution.choices import Environment, Resolved, resolve
from lightning_ep.models.registry import MoEShape

if TYPE_CHECKING:
    from lightning_ep.strategy.expert_parallel import ExpertParallelStrategy


def environment(strategy: ExpertParallelStrategy, hf_model: nn.Module | None = None) -> Environment:
    """What ``strategy`` runs on, once its mesh is built, for ``hf_model`` (PEFT-wrapped or not)."""
    degree = strategy.degree
    assert isinstance(degree, int)
    return Environment(
        device_type=strategy.root_device.type,
        triton=importlib.util.find_spec("triton") is not None,
        num_nodes=strategy.num_nodes,
        devices_per_node=strategy.num_processes,
        degree=degree,
        replicate_degree=strategy.replicate_degree,
        precision=str(strategy.precision_plugin.precision),
        activation_checkpointing=strategy.activation_checkpointing,
        lora_ranks=expert_lora_ranks(hf_model) if hf_model is not None else (),
        accumulate_grad_batches=_accumulation(strategy),
        reshard_after_forward=strategy.reshard_after_forward,
        expert_elements=MoEShape.of(hf_model).expert_elements if hf_model is not None else 0,
        frozen_experts=strategy.frozen_experts,
        expert_gemms=strategy.expert_gemms,
    )


def _accumulation(strategy: ExpertParallelStrategy) -> int:
    """The micro-batches per optimizer step (1 without a Trainer, or under manual optimization)."""
    module = strategy.lightning_module
    if module is None or not module.automatic_optimization:
        return 1
    try:
        return int(module.trainer.accumulate_grad_batches)
    except RuntimeError:  # not attached to a Trainer
        return 1


def fsdp_options(strategy: ExpertParallelStrategy) -> dict[str, Any]:
    """FSDP2's ``mp_policy`` and ``reshard_after_forward`` for ``strategy``: bf16 parameters with fp32
    reduction under bf16 precisions; on a single rank (``Execution.single_rank_fsdp``) the gathered
    parameters stay from forward to backward and gradients reduce in bf16 (the same bits)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    single = strategy.resolved is not None and strategy.resolved.single_rank_fsdp
    mp_policy = None
    if strategy.precision_plugin.precision in ("bf16-mixed", "bf16-true"):
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=None if single else torch.float32)
    return {"mp_policy": mp_policy, "reshard_after_forward": not single and strategy.reshard_after_forward is not False}


def expert_lora_ranks(model: nn.Module) -> tuple[int, ...]:
    """The ranks of the LoRA adapters on 3-D expert weights, sorted and without repeats: those of
    PEFT's parameter wrappers, or of their factors carried into the experts."""
    from lightning_ep.models.peft_lora import is_param_wrapper
    from lightning_ep.moe.experts.lora import LoRAGroupedExperts

    ranks: set[int] = set()
    for module in model.modules():
        if isinstance(module, LoRAGroupedExperts):
            ranks.update(module.lora_rank.values())
        elif is_param_wrapper(module):
            ranks.update(int(r) for r in cast(dict[str, int], module.r).values())  # PEFT: {adapter name: rank}
    return tuple(sorted(ranks))


def resolve_for(strategy: ExpertParallelStrategy, hf_model: nn.Module) -> Resolved:
    """The execution choices for ``strategy`` and its model."""
    return resolve(strategy.execution, environment(strategy, hf_model), strategy.moe)


def optimizer_names(optimizers: Iterable[torch.optim.Optimizer]) -> tuple[str, ...]:
    """How ``Environment.optimizers`` names each of ``optimizers``: ``lightning_ep.optim.AdamW`` for an
    instance of that class (subclasses too), torch's by their ``torch.optim`` name, any other by its
    module and class."""
    from lightning_ep.optim import AdamW

    names = []
    for optimizer in optimizers:
        cls = type(optimizer)
        if isinstance(optimizer, AdamW):
            names.append(KERNEL_ADAMW)
        elif getattr(torch.optim, cls.__name__, None) is cls:
            names.append(f"torch.optim.{cls.__name__}")
        else:
            names.append(f"{cls.__module__}.{cls.__qualname__}")
    return tuple(names)
