"""PEFT LoRA models (tiny Mixtral, Qwen3-MoE, OLMoE) and the gloo worker that checks them under
expert parallelism against PEFT's LoRA on the unsharded model on one process.

Imported by spawned processes and by ``tests/unit/test_lora.py``. The adapters sit on the four
attention projections (PEFT's ``lora.Linear``) and on both expert weights (``target_parameters``);
``init_lora_weights=False`` gives ``B`` random values, so that every factor gets a non-zero gradient.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from families_workers import CONFIG, RTOL, family_config, micro_batch, rel_err
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from workers import tiny_mixtral

import lightning_ep
from lightning_ep.models.peft_lora import stacked_to_peft
from lightning_ep.strategy.arguments import enable_checkpointing

LORA_FAMILIES = ("mixtral", "qwen3_moe", "olmoe")
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]


def lora_config(**overrides: Any) -> Any:
    from peft import LoraConfig

    fields: dict[str, Any] = dict(
        r=8, lora_alpha=16, target_modules=ATTENTION, target_parameters=EXPERTS, init_lora_weights=False
    )
    return LoraConfig(**{**fields, **overrides})


def tiny_base(model_type: str, seed: int = 0) -> nn.Module:
    """A fp32 ``*ForCausalLM`` of ``model_type`` (hidden 64, 8 experts, top-2), in train mode."""
    if model_type == "mixtral":
        return tiny_mixtral(seed).train()
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(family_config(model_type)).float().train()


def tiny_peft(model_type: str, seed: int = 0, **lora: Any) -> nn.Module:
    """``peft.get_peft_model(tiny_base(model_type), lora_config(**lora))``; equal seeds give equal weights."""
    from peft import get_peft_model

    base = tiny_base(model_type, seed)
    torch.manual_seed(seed + 1)
    return get_peft_model(base, lora_config(**lora))


def peft_expert_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """The transformed model's gradients under PEFT's names and layouts (full tensors; expert factors
    ``A [E, r, in]``, ``B [E, out, r]`` turned into PEFT's ``[r * E, in]``, ``[out, r * E]``)."""
    grads: dict[str, torch.Tensor] = {}
    params = dict(model.named_parameters())
    for name, p in params.items():
        if not p.requires_grad:
            continue
        assert p.grad is not None, (name, "no gradient")
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        if "_lora_" not in name:
            grads[name] = grad
            continue
        experts, _, factor = name.rpartition(".")
        weight, _, which = factor.partition("_lora_")
        if which == "B":
            continue
        grad_B = params[f"{experts}.{weight}_lora_B"].grad
        assert grad_B is not None
        grad_B = grad_B.full_tensor() if isinstance(grad_B, DTensor) else grad_B
        A, B = stacked_to_peft(grad, grad_B)
        # PEFT nests the wrappers: down_proj's is the outer one, gate_up_proj's sits at base_layer.
        where = experts if weight == "down_proj" else f"{experts}.base_layer"
        grads[f"{where}.lora_A.default.weight"] = A
        grads[f"{where}.lora_B.default.weight"] = B
    return grads


def backward_both(reference: nn.Module, model: nn.Module, rank: int, world: int, tag: str, rtol: float = RTOL) -> None:
    """Backward of ``reference`` on every rank's micro-batch (each loss divided by ``world``) and of
    ``model`` on this rank's; their mean losses agree within ``rtol``."""
    ref_loss = 0.0
    for r in range(world):
        ids = micro_batch(0, r)
        loss = reference(input_ids=ids, labels=ids).loss / world
        loss.backward()
        ref_loss += loss.item()
    ids = micro_batch(0, rank)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    mean_loss = loss.detach().float().clone()
    dist.all_reduce(mean_loss)
    assert abs(mean_loss.item() / world - ref_loss) <= rtol * abs(ref_loss), (tag, mean_loss.item() / world, ref_loss)


def check_lora_layout(rank: int, world: int, model_type: str, degree: int, replicate: int) -> None:
    """Under ``transform(mesh=...)`` + ``shard_model`` at ``(world, degree, replicate)``: the loss and
    every LoRA gradient equal PEFT's LoRA on the unsharded model fed every rank's micro-batch
    (averaged), within 1e-5; each expert factor is a DTensor sharded on the expert dim of ``ep``;
    the frozen base weights get no gradient and AdamW keeps no state for them."""
    tag = f"{model_type} world={world} degree={degree} replicate={replicate} rank {rank}"
    reference = tiny_peft(model_type)
    model = copy.deepcopy(reference)
    mesh = lightning_ep.init_mesh(degree, replicate_degree=replicate, device_type="cpu")
    lightning_ep.transform(model, CONFIG, mesh=mesh)
    for layer in lightning_ep.moe_layers(model):  # each rank holds its experts' factors
        for name in ("gate_up_proj_lora_A", "gate_up_proj_lora_B", "down_proj_lora_A", "down_proj_lora_B"):
            factor = layer.experts.get_parameter(name)
            assert isinstance(factor, DTensor) and factor.placements == (Shard(0),), (tag, name)
            assert factor.shape[0] == 8 and factor.to_local().shape[0] == 8 // degree, (tag, name)
            assert factor.requires_grad and not layer.experts.gate_up_proj.requires_grad, (tag, name)
    lightning_ep.shard_model(model, mesh)

    backward_both(reference, model, rank, world, tag)

    expected = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}
    got = peft_expert_grads(model)
    assert got.keys() == expected.keys(), (tag, sorted(set(got) ^ set(expected))[:4])
    assert any("experts" in n for n in got), tag
    for name, grad in expected.items():
        assert grad is not None, (tag, name)
        err = rel_err(got[name], grad)
        assert err <= RTOL, (tag, name, err)

    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), (tag, name, "not sharded")
        assert p.requires_grad or p.grad is None, (tag, name, "a frozen weight got a gradient")

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer.step()
    stateful = {id(p) for p in optimizer.state}
    for name, p in model.named_parameters():
        assert (id(p) in stateful) == p.requires_grad, (tag, name, "optimizer state")


def run_lora_layouts(rank: int, world: int, layouts: list[tuple[int, int]], model_types: list[str]) -> None:
    for degree, replicate in layouts:
        for model_type in model_types:
            check_lora_layout(rank, world, model_type, degree, replicate)


def check_lora_bf16(rank: int, world: int, model_type: str, precision: str) -> None:
    """A fine-grained family under FSDP2 in bf16 (``"bf16-mixed"``: bf16 compute, fp32 weights and
    reduction; ``"bf16-true"``: bf16 weights) with activation checkpointing, at degree 2: the loss and
    the LoRA gradients (all together) are PEFT's fp32 ones to bf16 accuracy."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    tag = f"{model_type} {precision} rank {rank}"
    reference = tiny_peft(model_type)
    model = copy.deepcopy(reference)
    if precision == "bf16-true":
        model = model.to(torch.bfloat16)
    enable_checkpointing(model, True)
    mesh = lightning_ep.init_mesh(2, device_type="cpu")
    lightning_ep.transform(model, CONFIG, mesh=mesh)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    lightning_ep.shard_model(model, mesh, mp_policy=policy if precision == "bf16-mixed" else None)
    backward_both(reference, model, rank, world, tag, rtol=2e-2)
    # All LoRA gradients together: bf16 rounding can flip a near-tie in the routing, which moves
    # single experts' gradients by more than bf16 accuracy but the whole only a little.
    got = peft_expert_grads(model)
    names = [name for name, p in reference.named_parameters() if p.requires_grad]
    ours = torch.cat([got[name].float().flatten() for name in names])
    theirs = torch.cat([reference.get_parameter(name).grad.flatten() for name in names])  # type: ignore[union-attr]
    assert torch.isfinite(ours).all(), tag
    assert rel_err(ours, theirs) <= 0.05, (tag, rel_err(ours, theirs))


def run_lora_bf16(rank: int, world: int, model_types: list[str]) -> None:
    for model_type in model_types:
        for precision in ("bf16-mixed", "bf16-true"):
            check_lora_bf16(rank, world, model_type, precision)
