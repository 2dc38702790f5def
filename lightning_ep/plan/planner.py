"""``Plan``: memory and time of one layout; ``plan_layouts`` for all of them; ``choose_layout``,
the rule behind ``ExpertParallelStrategy(degree="auto")``.

``choose_layout`` takes the smallest degree, then the smallest replicate degree, whose peak fits
the device memory less ``MEMORY_MARGIN`` of it (allocator fragmentation, NCCL and CUDA context,
the estimate's own error). With no memory limit (``memory_bytes=None``, a CPU run) every layout
fits; the strategy then keeps its node-local rule (see ``lightning_ep.plan.auto``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_ep.plan.layouts import Layout, valid_layouts
from lightning_ep.plan.memory import RankMemory, Workload, rank_memory, rank_params
from lightning_ep.plan.model import ModelShape
from lightning_ep.plan.time import Hardware, StepTime, step_time

MEMORY_MARGIN = 0.10  # of device memory, kept free by the "fits" judgement


@dataclass(frozen=True)
class Plan:
    """One layout's plan for one rank (rank 0, the one with the largest shards)."""

    shape: ModelShape
    layout: Layout
    workload: Workload
    hardware: Hardware
    memory: RankMemory
    time: StepTime
    params_per_rank: int
    memory_limit: int | None

    @property
    def fits(self) -> bool:
        return self.memory_limit is None or self.memory.total <= self.memory_limit

    @property
    def tokens_per_s(self) -> float:
        """Tokens per second per GPU."""
        return self.workload.tokens / self.time.step_s

    @property
    def mfu(self) -> float:
        """Model FLOPs per second over the datasheet's dense bf16 peak."""
        return self.tokens_per_s * self.shape.flops_per_token(self.workload.seq) / (self.hardware.peak_tflops * 1e12)

    def as_dict(self) -> dict[str, Any]:
        """The JSON record of ``python -m lightning_ep.plan --json``."""
        return {
            "world": self.layout.world,
            "degree": self.layout.degree,
            "replicate_degree": self.layout.replicate_degree,
            "edp": self.layout.edp,
            "params_per_rank": self.params_per_rank,
            "bytes": self.memory.as_dict(),
            "peak_phase": self.memory.peak_phase,
            "memory_limit": self.memory_limit,
            "fits": self.fits,
            "step_time_s": self.time.step_s,
            "all_to_all_bytes_per_layer": self.time.all_to_all_bytes,
            "all_to_all_share": self.time.all_to_all_share,
            "all_to_all_crosses_nodes": self.time.all_to_all_crosses_nodes,
            "tokens_per_s_per_gpu": self.tokens_per_s,
            "mfu": self.mfu,
        }


def size(nbytes: float) -> str:
    """``nbytes`` in GiB, or in MiB below one GiB."""
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def usable_memory(memory_bytes: int | None, margin: float = MEMORY_MARGIN) -> int | None:
    """What a plan may use of ``memory_bytes``: all but ``margin`` of it (``None``: no limit)."""
    return None if memory_bytes is None else int(memory_bytes * (1.0 - margin))


def plan_layout(
    shape: ModelShape,
    layout: Layout,
    workload: Workload,
    hardware: Hardware | None = None,
    *,
    memory_bytes: int | None = None,
    margin: float = MEMORY_MARGIN,
) -> Plan:
    """The plan of ``layout``; it fits when its peak is within ``memory_bytes`` less ``margin``."""
    hardware = hardware if hardware is not None else Hardware.h200()
    layout.local_experts(shape.num_experts)
    return Plan(
        shape=shape,
        layout=layout,
        workload=workload,
        hardware=hardware,
        memory=rank_memory(shape, layout, workload),
        time=step_time(shape, layout, workload, hardware),
        params_per_rank=rank_params(shape, layout).total,
        memory_limit=usable_memory(memory_bytes, margin),
    )


def plan_layouts(
    shape: ModelShape,
    world: int,
    workload: Workload,
    hardware: Hardware | None = None,
    *,
    gpus_per_node: int = 8,
    memory_bytes: int | None = None,
    margin: float = MEMORY_MARGIN,
    degree: int | None = None,
    replicate_degree: int | None = None,
) -> list[Plan]:
    """Plans of every valid layout of ``world`` ranks (or those with the given degrees), smallest
    degree first, then smallest replicate degree."""
    layouts = [
        layout
        for layout in valid_layouts(world, shape.num_experts, gpus_per_node=gpus_per_node)
        if (degree is None or layout.degree == degree)
        and (replicate_degree is None or layout.replicate_degree == replicate_degree)
    ]
    return [plan_layout(shape, lay, workload, hardware, memory_bytes=memory_bytes, margin=margin) for lay in layouts]


def choose_layout(
    shape: ModelShape,
    world: int,
    workload: Workload,
    *,
    memory_bytes: int | None,
    gpus_per_node: int = 8,
    hardware: Hardware | None = None,
    margin: float = MEMORY_MARGIN,
    replicate_degree: int | None = None,
) -> Plan:
    """The plan with the smallest degree, then the smallest replicate degree, that fits.

    Raises:
        ValueError: no layout of ``world`` ranks fits; the message names the smallest world size (a
            multiple of ``gpus_per_node``, up to 64 nodes) and the device memory that would fit.
    """
    plans = plan_layouts(
        shape,
        world,
        workload,
        hardware,
        gpus_per_node=gpus_per_node,
        memory_bytes=memory_bytes,
        margin=margin,
        replicate_degree=replicate_degree,
    )
    for plan in plans:
        if plan.fits:
            return plan
    raise ValueError(no_fit_message(shape, world, workload, plans, gpus_per_node, hardware, margin, replicate_degree))


def no_fit_message(
    shape: ModelShape,
    world: int,
    workload: Workload,
    plans: list[Plan],
    gpus_per_node: int,
    hardware: Hardware | None,
    margin: float,
    replicate_degree: int | None,
) -> str:
    """What would fit: the smallest peak here and the memory it needs, and the smallest world size."""
    if not plans:
        return (
            f"no layout of {world} GPUs suits {shape.num_experts} experts with replicate_degree={replicate_degree}; "
            "choose a world size that a divisor of the expert count divides."
        )
    best = min(plans, key=lambda p: p.memory.total)
    limit = best.memory_limit or 0
    needed = best.memory.total / (1.0 - margin)
    fixes = [
        f"GPUs with at least {size(needed)} (degree={best.layout.degree}, "
        f"replicate_degree={best.layout.replicate_degree} needs {size(best.memory.total)} per GPU "
        f"plus the {margin:.0%} margin)"
    ]
    memory = None if best.memory_limit is None else int(best.memory_limit / (1.0 - margin))
    for candidate in range(world + 1, 64 * gpus_per_node + 1):
        if candidate % gpus_per_node and candidate > gpus_per_node:
            continue
        more = plan_layouts(
            shape,
            candidate,
            workload,
            hardware,
            gpus_per_node=gpus_per_node,
            memory_bytes=memory,
            margin=margin,
            replicate_degree=replicate_degree,
        )
        fitting = [p for p in more if p.fits]
        if fitting:
            p = fitting[0]
            fixes.insert(
                0, f"{candidate} GPUs (degree={p.layout.degree}, replicate_degree={p.layout.replicate_degree})"
            )
            break
    return (
        f"no layout of {world} GPUs fits {shape.model_type} ({shape.total_params / 1e9:.2f} B parameters, "
        f"micro_batch={workload.micro_batch}, seq={workload.seq}, precision={workload.precision!r}, "
        f"activation_checkpointing={workload.activation_checkpointing!r}) in {size(limit)} per GPU "
        f"({1 - margin:.0%} of the device); the smallest needs {size(best.memory.total)}. It would fit on "
        + " or on ".join(fixes)
        + "; or lower micro_batch / seq, or turn activation checkpointing on."
    )
