"""The checks of ``ExpertParallelStrategy``'s arguments, each with the argument, its value and the fix:
pure functions, run as early as their facts are known (at construction, or in ``set_world_ranks``)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch

from lightning_ep.execution.choices import Execution
from lightning_ep.moe.config import MoEConfig
from lightning_ep.moe.experts.fp8 import fp8_gemms_blocker
from lightning_ep.moe.experts.frozen import FORMATS
from lightning_ep.parallel.mesh import check_layout

SUPPORTED_PRECISION = ("32-true", "bf16-mixed", "bf16-true")


def check_arguments(
    *,
    degree: Any,
    replicate_degree: Any,
    moe: Any,
    activation_checkpointing: Any,
    tensor_parallel_size: Any,
    execution: Any = None,
    timeout: Any,
    moe_model: Any = None,
    frozen_experts: Any = None,
    expert_gemms: Any = None,
    dither_master_weights: Any = False,
) -> None:
    """The checks of ``ExpertParallelStrategy.__init__``'s arguments that need nothing else."""
    if degree != "auto" and (isinstance(degree, bool) or not isinstance(degree, int) or degree < 1):
        raise ValueError(
            f"ExpertParallelStrategy(degree={degree!r}): pass an int >= 1 that divides the world size and "
            "the expert count, or 'auto'."
        )
    if isinstance(replicate_degree, bool) or not isinstance(replicate_degree, int) or replicate_degree < 1:
        raise ValueError(f"ExpertParallelStrategy(replicate_degree={replicate_degree!r}): pass an int >= 1.")
    if tensor_parallel_size != 1:
        raise ValueError(
            f"ExpertParallelStrategy(tensor_parallel_size={tensor_parallel_size!r}): tensor parallelism "
            "cannot be combined with expert parallelism here; use tensor_parallel_size=1 and spread the "
            "experts with `degree` instead."
        )
    if moe is not None and not isinstance(moe, MoEConfig):
        raise TypeError(f"ExpertParallelStrategy(moe=...) must be a MoEConfig, got {type(moe).__name__}.")
    if moe is not None and not moe.smp_moe and degree not in (1, "auto"):
        raise ValueError(
            f"ExpertParallelStrategy(degree={degree!r}) with MoEConfig(smp_moe=False): the model keeps its "
            "own MoE blocks, which cannot be split across ranks; use degree=1 or smp_moe=True."
        )
    check_activation_checkpointing(activation_checkpointing, moe if moe is not None else MoEConfig())
    if execution is not None and not isinstance(execution, Execution):
        raise TypeError(
            f"ExpertParallelStrategy(execution=...) must be a lightning_ep.Execution, got {type(execution).__name__}."
        )
    # A number would fail only when the process group starts, after the processes were launched.
    if timeout is not None and not isinstance(timeout, timedelta):
        example = f"timedelta(seconds={timeout})" if isinstance(timeout, (int, float)) else "timedelta(minutes=30)"
        raise TypeError(
            f"ExpertParallelStrategy(timeout={timeout!r}): pass a datetime.timedelta, e.g. {example}, or None for "
            "torch's default."
        )
    if frozen_experts is not None and frozen_experts not in FORMATS:
        raise ValueError(
            f"ExpertParallelStrategy(frozen_experts={frozen_experts!r}): pass one of {list(FORMATS)} to keep frozen "
            "expert weights (a LoRA fine-tune's) in that format, or None to keep them in the parameters' dtype."
        )
    if expert_gemms not in (None, "fp8"):
        raise ValueError(
            f"ExpertParallelStrategy(expert_gemms={expert_gemms!r}): pass 'fp8' to run the trainable experts' GEMMs "
            "in FP8, or None for the compute dtype's."
        )
    if expert_gemms is not None and frozen_experts is not None:
        raise ValueError(
            f"ExpertParallelStrategy(expert_gemms={expert_gemms!r}, frozen_experts={frozen_experts!r}): FP8 GEMMs are "
            "for trainable experts, frozen ones are dequantized for the compute dtype's GEMMs; pass one of them."
        )
    for name, value in (("frozen_experts", frozen_experts), ("expert_gemms", expert_gemms)):
        if value is not None and moe is not None and not moe.smp_moe:
            raise ValueError(
                f"ExpertParallelStrategy({name}={value!r}) acts on the experts of lightning_ep's MoE layers, but "
                f"MoEConfig(smp_moe=False) keeps the model's own MoE blocks; use smp_moe=True or {name}=None."
            )
    if not isinstance(dither_master_weights, bool):
        raise TypeError(f"ExpertParallelStrategy(dither_master_weights={dither_master_weights!r}): pass True or False.")
    if moe_model is not None and not isinstance(moe_model, str):
        raise TypeError(
            f"ExpertParallelStrategy(moe_model={moe_model!r}): pass the attribute path of the Hugging Face model "
            "inside the LightningModule as a str (e.g. 'model' or 'policy'), or None."
        )


def check_activation_checkpointing(value: Any, moe: MoEConfig) -> None:
    """``activation_checkpointing`` is a bool or ``"keep_all_to_all"``, and fits ``moe``."""
    if not (isinstance(value, bool) or value == "keep_all_to_all"):
        raise ValueError(
            f"ExpertParallelStrategy(activation_checkpointing={value!r}): pass True, False or 'keep_all_to_all'."
        )
    nccl_a2a = moe.moe_all_to_all_dispatcher and moe.capacity_factor is None
    if value == "keep_all_to_all" and not nccl_a2a:
        raise ValueError(
            "ExpertParallelStrategy(activation_checkpointing='keep_all_to_all') keeps the all-to-all dispatcher's "
            f"exchanges, but MoEConfig has moe_all_to_all_dispatcher={moe.moe_all_to_all_dispatcher}, capacity_factor="
            f"{moe.capacity_factor}; use the dropless all-to-all dispatcher (True, None) or "
            "activation_checkpointing=True."
        )


def check_precision(precision: str) -> None:
    """The Trainer's ``precision`` is one this strategy supports."""
    if precision not in SUPPORTED_PRECISION:
        raise ValueError(
            f"ExpertParallelStrategy does not support precision={precision!r}; choose one of "
            f"{list(SUPPORTED_PRECISION)} (bf16 gives the speed of half precision without loss scaling)."
        )


def check_devices(degree: int, replicate_degree: int, *, devices: int, num_nodes: int) -> None:
    """``degree`` and ``replicate_degree`` fit the world of ``devices x num_nodes`` ranks."""
    try:
        check_layout(devices * num_nodes, degree, replicate_degree)
    except ValueError as error:
        raise ValueError(
            f"ExpertParallelStrategy(degree={degree}, replicate_degree={replicate_degree}) with "
            f"Trainer(devices={devices}, num_nodes={num_nodes}): {error}"
        ) from None


def enable_checkpointing(hf_model: Any, mode: Any) -> None:
    """Hugging Face's activation checkpointing, set to torch's non-reentrant checkpoint:
    ``activation_checkpointing_enable`` (transformers 5.23 on), else ``gradient_checkpointing_enable``
    (its older name, which warns where the new one exists). A model with neither is refused."""
    enable = getattr(hf_model, "activation_checkpointing_enable", None)
    if callable(enable):
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
        return
    enable = getattr(hf_model, "gradient_checkpointing_enable", None)
    if not callable(enable):
        raise TypeError(
            f"ExpertParallelStrategy(activation_checkpointing={mode!r}): {type(hf_model).__name__} has neither "
            "activation_checkpointing_enable() nor gradient_checkpointing_enable(); pass a Hugging Face model or "
            "activation_checkpointing=False."
        )
    enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def check_dither(precision: str) -> None:
    """``dither_master_weights=True`` needs fp32 master weights read in bf16: ``bf16-mixed``."""
    if precision != "bf16-mixed":
        raise ValueError(
            f"ExpertParallelStrategy(dither_master_weights=True) moves fp32 master weights inside their bf16 "
            f"rounding intervals, which only bf16-mixed reads them through, but the Trainer's precision is "
            f"{precision!r}: use precision='bf16-mixed', or drop dither_master_weights (under bf16-true, an "
            "optimizer with stochastic rounding, e.g. torchao's _AdamW(bf16_stochastic_round=True), lands small "
            "updates instead)."
        )


def check_expert_gemms(expert_gemms: str, device: torch.device, precision: str) -> None:
    """At setup, where the device and precision are known: whether ``expert_gemms`` can run."""
    blocker = fp8_gemms_blocker(device)
    if blocker is not None:
        raise ValueError(f"ExpertParallelStrategy(expert_gemms={expert_gemms!r}) needs {blocker}; drop expert_gemms.")
    if precision not in ("bf16-mixed", "bf16-true"):
        raise ValueError(
            f"ExpertParallelStrategy(expert_gemms={expert_gemms!r}) casts bf16 rows to FP8 and writes bf16, but the "
            f"Trainer's precision is {precision!r}: use precision='bf16-mixed' (fp32 master weights) or 'bf16-true', "
            "or drop expert_gemms."
        )
