"""``auto_degree``: the degree ``ExpertParallelStrategy(degree="auto")`` takes, chosen by the plan.

On CUDA the device memory is known (``torch.cuda.get_device_properties``): the smallest degree
whose plan fits it, less ``MEMORY_MARGIN``, at the strategy's ``replicate_degree``, for the
``(micro_batch, seq)`` the strategy was given (``plan_batch``; Lightning knows neither at setup).
If none fits, a ``ValueError`` names the world size or the memory that would; the strategy calls
this before any weight is materialised. Elsewhere (CPU runs: tests, CI, gloo) there is no device
memory to fit, and the rule stays the node-local one: the largest divisor of the expert count that
also divides the devices per node (the all-to-all stays on a node's fast links).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from lightning_ep.moe.quantized import FP8_BLOCK
from lightning_ep.plan.layouts import Layout
from lightning_ep.plan.memory import Checkpointing, Workload
from lightning_ep.plan.model import model_shape
from lightning_ep.plan.planner import MEMORY_MARGIN, Plan, choose_layout
from lightning_ep.plan.report import summary
from lightning_ep.plan.time import Hardware


def node_local_degree(num_experts: int, devices_per_node: int, world_size: int, replicate_degree: int) -> int:
    """The largest divisor of ``num_experts`` that divides ``devices_per_node`` and leaves a valid
    layout (``world_size`` divisible by ``degree * replicate_degree``); 1 if there is none."""
    for d in range(math.gcd(num_experts, devices_per_node), 0, -1):
        if devices_per_node % d == 0 and Layout.fits(world_size, d, replicate_degree, num_experts):
            return d
    return 1


def hardware_for(device: torch.device) -> Hardware:
    """The ``Hardware`` preset nearest the CUDA device (its name says H100, or else H200's rates)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    return Hardware.h100() if "H100" in name else Hardware.h200()


def plan_for_devices(
    hf_config: Any,
    *,
    world_size: int,
    devices_per_node: int,
    replicate_degree: int,
    memory_bytes: int | None,
    precision: str,
    micro_batch: int,
    seq: int,
    activation_checkpointing: Checkpointing,
    capacity_factor: float | None,
    hardware: Hardware | None = None,
    margin: float = MEMORY_MARGIN,
    lora_rank: int = 0,
    frozen_experts: str | None = None,
    fp8_block: tuple[int, int] = FP8_BLOCK,
) -> Plan:
    """``choose_layout`` for ``hf_config`` at the strategy's ``replicate_degree`` (a pure function)."""
    workload = Workload(
        micro_batch=micro_batch,
        seq=seq,
        precision=precision,  # type: ignore[arg-type]
        activation_checkpointing=activation_checkpointing,
        capacity_factor=capacity_factor,
        lora_rank=lora_rank,
        frozen_experts=frozen_experts,  # type: ignore[arg-type]
        fp8_block=fp8_block,
    )
    return choose_layout(
        model_shape(hf_config),
        world_size,
        workload,
        memory_bytes=memory_bytes,
        gpus_per_node=devices_per_node,
        hardware=hardware,
        margin=margin,
        replicate_degree=replicate_degree,
    )


def auto_degree(
    hf_model: Any,
    *,
    num_experts: int,
    world_size: int,
    devices_per_node: int,
    replicate_degree: int,
    device: torch.device,
    precision: str,
    plan_batch: tuple[int, int],
    activation_checkpointing: Checkpointing,
    capacity_factor: float | None,
    rank: int,
    lora_rank: int = 0,
    frozen_experts: str | None = None,
    fp8_block: tuple[int, int] = FP8_BLOCK,
) -> int:
    """The strategy's ``degree="auto"`` (see the module docstring); prints the plan on rank 0."""
    if device.type != "cuda":
        return node_local_degree(num_experts, devices_per_node, world_size, replicate_degree)
    micro_batch, seq = plan_batch
    try:
        plan = plan_for_devices(
            hf_model.config,
            world_size=world_size,
            devices_per_node=devices_per_node,
            replicate_degree=replicate_degree,
            memory_bytes=torch.cuda.get_device_properties(device).total_memory,
            precision=precision,
            micro_batch=micro_batch,
            seq=seq,
            activation_checkpointing=activation_checkpointing,
            capacity_factor=capacity_factor,
            hardware=hardware_for(device),
            lora_rank=lora_rank,
            frozen_experts=frozen_experts,
            fp8_block=fp8_block,
        )
    except ValueError as error:
        raise ValueError(f"ExpertParallelStrategy(degree='auto', plan_batch={plan_batch}): {error}") from None
    if rank == 0:
        print(f"ExpertParallelStrategy(degree='auto') chose {summary(plan)}", flush=True)
    return plan.layout.degree
