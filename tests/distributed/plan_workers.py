"""Gloo workers checking ``lightning_ep.plan`` against what the strategy's sharding holds.

For every family's tiny model and each layout: the sum of the local shard sizes of the DTensors
after ``transform(mesh=...)`` and ``shard_model`` (built on meta, nothing allocated) equals the
plan's count for this rank, and rank 0, whose count the plan reports, holds the most. For Mixtral
and GPT-OSS (expert biases) with real weights, after a forward, a backward and an AdamW step, the
bytes of the local gradients and optimizer states equal the plan's, in fp32 and in bf16; and so for a
PEFT LoRA Mixtral with its experts in fp32, FP8 and MXFP4 (``Workload(lora_rank=, frozen_experts=)``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from families_workers import FAMILY_NAMES, family_config, micro_batch
from torch.distributed.tensor import DTensor

import lightning_ep
from lightning_ep import MoEConfig
from lightning_ep.moe.quantized import FP8_BLOCK
from lightning_ep.plan import Layout, Workload, model_shape, rank_params, state_bytes

CONFIG = MoEConfig(moe_load_balancing="none", moe_z_loss_coeff=0.0, moe_aux_loss_coeff=0.0)


def tiny_config(model_type: str) -> Any:
    if model_type == "mixtral":
        from conftest import tiny_mixtral_config

        return tiny_mixtral_config()
    return family_config(model_type)


def _local_bytes(tensors: Any) -> int:
    total = 0
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total


def check_params(rank: int, world: int, layouts: list[tuple[int, int]]) -> None:
    from transformers import AutoModelForCausalLM

    for degree, replicate in layouts:
        mesh = lightning_ep.init_mesh(degree, replicate_degree=replicate, device_type="cpu")
        layout = Layout(world=world, degree=degree, replicate_degree=replicate)
        for model_type in ("mixtral", *FAMILY_NAMES):
            config = tiny_config(model_type)
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config)
            lightning_ep.transform(model, CONFIG, mesh=mesh)
            lightning_ep.shard_model(model, mesh)
            held = sum(p.to_local().numel() for p in model.parameters())
            shape = model_shape(config)
            tag = (model_type, world, degree, replicate, rank)
            assert rank_params(shape, layout, rank).total == held, (tag, rank_params(shape, layout, rank), held)
            most = torch.tensor(held)
            dist.all_reduce(most, op=dist.ReduceOp.MAX)
            assert rank_params(shape, layout, 0).total == most.item(), tag
        for model_type in ("mixtral", "gpt_oss"):
            for dtype, precision in ((torch.float32, "32-true"), (torch.bfloat16, "bf16-true")):
                check_states(rank, world, mesh, layout, model_type, dtype, precision)
        for fmt, block in (
            (None, FP8_BLOCK),
            ("fp8", FP8_BLOCK),
            ("fp8", (16, 8)),
            ("mxfp4", FP8_BLOCK),
            ("nf4", FP8_BLOCK),
        ):
            check_lora_states(rank, world, mesh, layout, fmt, block)


def check_states(rank: int, world: int, mesh: Any, layout: Layout, model_type: str, dtype: Any, precision: str) -> None:
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(dtype).train()
    lightning_ep.transform(model, CONFIG, mesh=mesh)
    lightning_ep.shard_model(model, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = micro_batch(0, rank, batch=1, seq=8)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    params = list(model.parameters())
    states = [t for state in optimizer.state.values() for t in state.values()]
    plan = state_bytes(model_shape(config), layout, Workload(precision=precision), rank)  # type: ignore[arg-type]
    held = (_local_bytes(params), _local_bytes(p.grad for p in params), _local_bytes(states))
    assert plan == held, (model_type, precision, layout, rank, plan, held)


def check_lora_states(
    rank: int, world: int, mesh: Any, layout: Layout, fmt: str | None, block: tuple[int, int]
) -> None:
    """A PEFT LoRA Mixtral (rank 8 on attention and both expert weights, ``lora_workers``) with its
    experts kept in ``fmt`` (or fp32; FP8 in blocks of ``block``): the bytes of the local parameters
    and frozen buffers, gradients and AdamW states after a step equal the plan's for
    ``Workload(lora_rank=8, frozen_experts=fmt, fp8_block=block)``. Under NF4, which groups 64 input
    features, the experts are 64 wide instead of 32."""
    from conftest import tiny_mixtral_config
    from lora_workers import lora_config
    from peft import get_peft_model
    from workers import tiny_mixtral

    from lightning_ep.moe.experts.frozen import FrozenExpertWeight, keep_frozen_experts

    width = {"intermediate_size": 64} if fmt == "nf4" else {}
    base = tiny_mixtral(0, **width).train()
    torch.manual_seed(1)
    model = get_peft_model(base, lora_config(r=8))
    lightning_ep.transform(model, CONFIG, mesh=mesh)
    if fmt is not None:
        keep_frozen_experts(model, fmt, block=block)  # type: ignore[arg-type]
    lightning_ep.shard_model(model, mesh)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-3)
    ids = micro_batch(0, rank, batch=1, seq=8)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    frozen = [b for m in model.modules() if isinstance(m, FrozenExpertWeight) for b in m.buffers()]
    states = [t for state in optimizer.state.values() for t in state.values()]
    held = (_local_bytes([*model.parameters(), *frozen]), _local_bytes(p.grad for p in trainable), _local_bytes(states))
    workload = Workload(precision="32-true", lora_rank=8, frozen_experts=fmt, fp8_block=block)  # type: ignore[arg-type]
    plan = state_bytes(model_shape(tiny_mixtral_config(**width)), layout, workload, rank)
    assert plan == held, ("lora", fmt, block, layout, rank, plan, held)


def run_plan_checks(rank: int, world: int, layouts: list[tuple[int, int]]) -> None:
    check_params(rank, world, layouts)
