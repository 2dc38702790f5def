"""The gloo worker for frozen expert weights kept quantized under expert parallelism (see
``test_frozen_ep.py``): a PEFT LoRA Mixtral whose experts are loaded from a bf16 folder into FP8 or
MXFP4, sharded, against the same model on one process."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from families_workers import CONFIG, RTOL, rel_err
from lora_workers import backward_both, tiny_peft
from torch import nn
from torch.distributed.tensor import DTensor, Shard

import lightning_ep
from lightning_ep.models.hf_io import load_pretrained_sharded
from lightning_ep.moe.experts.frozen import FrozenExpertWeight, keep_frozen_experts


def frozen_lora(fmt: str, folder: Path, degree: int | None = None) -> nn.Module:
    """A tiny PEFT LoRA Mixtral, transformed (on a mesh of ``degree`` when given, then FSDP2-sharded),
    its experts kept in ``fmt`` and every base weight read from ``folder``."""
    model = tiny_peft("mixtral")
    mesh = lightning_ep.init_mesh(degree, device_type="cpu") if degree is not None else None
    lightning_ep.transform(model, CONFIG, mesh=mesh)
    keep_frozen_experts(model, fmt)  # type: ignore[arg-type]
    if mesh is not None:
        lightning_ep.shard_model(model, mesh)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_pretrained_sharded(model, folder)


def check_frozen_lora(rank: int, world: int, fmt: str, folder: Path, degree: int) -> None:
    """Each rank holds its experts' quantized bytes, equal to the one-process model's; the loss and every
    gradient equal the one-process model's fed every rank's micro-batch (averaged), within 1e-5."""
    tag = f"{fmt} world={world} degree={degree} rank {rank}"
    reference = frozen_lora(fmt, folder)
    model = frozen_lora(fmt, folder, degree)
    ours = {n: m for n, m in model.named_modules() if isinstance(m, FrozenExpertWeight)}
    theirs = {n: m for n, m in reference.named_modules() if isinstance(m, FrozenExpertWeight)}
    assert ours.keys() == theirs.keys() and len(ours) == 4, tag
    local = 8 // degree
    first = (rank % degree) * local
    for name, frozen in ours.items():
        for key, buffer in frozen.named_buffers():
            assert isinstance(buffer, DTensor) and buffer.placements == (Shard(0),), (tag, name, key)
            expected = theirs[name].stored()[key][first : first + local]
            assert torch.equal(buffer.to_local(), expected), (tag, name, key)

    backward_both(reference, model, rank, world, tag)
    expected_grads = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}
    got = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert got.keys() == expected_grads.keys() and any("_lora_" in n for n in got), tag
    for name, grad in got.items():
        assert grad is not None and expected_grads[name] is not None, (tag, name)
        full = grad.full_tensor() if isinstance(grad, DTensor) else grad
        assert rel_err(full, expected_grads[name]) <= RTOL, (tag, name)


def run_frozen(rank: int, world: int, folder: str, cases: list[tuple[str, int]]) -> None:
    for fmt, degree in cases:
        check_frozen_lora(rank, world, fmt, Path(folder), degree)
