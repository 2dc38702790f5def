"""Plan before you launch: per-GPU memory and step time of every expert-parallel layout.

From a Hugging Face MoE config (no weights: the model is counted on the ``meta`` device), a world
size and a workload, ``plan_layouts`` gives for every valid ``(degree, replicate_degree)`` the
bytes each GPU holds (parameters, gradients and AdamW states exactly as the strategy shards them;
activations, exchange buffers and FSDP2's gathered copies estimated) and an estimated step time.
``choose_layout`` is the rule of ``ExpertParallelStrategy(degree="auto")``. The command line:
``python -m lightning_ep.plan --config CONFIG --gpus N``.

Imports ``lightning_ep.models`` and transformers; ``lightning_ep.moe`` and ``lightning_ep.parallel``
never import it.
"""

from lightning_ep.plan.layouts import Layout, valid_layouts
from lightning_ep.plan.memory import RankMemory, Workload, rank_memory, rank_params, state_bytes
from lightning_ep.plan.model import ModelShape, model_shape
from lightning_ep.plan.planner import MEMORY_MARGIN, Plan, choose_layout, plan_layout, plan_layouts
from lightning_ep.plan.time import Hardware, StepTime, step_time

__all__ = [
    "MEMORY_MARGIN",
    "Hardware",
    "Layout",
    "ModelShape",
    "Plan",
    "RankMemory",
    "StepTime",
    "Workload",
    "choose_layout",
    "model_shape",
    "plan_layout",
    "plan_layouts",
    "rank_memory",
    "rank_params",
    "state_bytes",
    "step_time",
    "valid_layouts",
]
