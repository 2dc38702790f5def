"""The gloo worker for frozen expert weights kept quantized under expert parallelism (see
``test_frozen_ep.py``): a PEFT LoRA model whose experts are loaded from a folder into FP8, MXFP4 or
NF4, sharded, against the same model on one process."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from families_workers import CONFIG, RTOL, rel_err, tiny_family
from lora_workers import backward_both, lora_config, tiny_peft
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

import lightning_ep
from lightning_ep.models.hf_io import load_pretrained_sharded
from lightning_ep.moe.experts.frozen import FrozenExpertWeight, keep_frozen_experts

#: ``(model_type, format, degree, folder name, FP8 block)``: a case of ``run_frozen``.
Case = tuple[str, str, int, str, tuple[int, int]]


#: GPT-OSS's experts 64 wide (NF4 groups 64 input features).
GPT_OSS = {"intermediate_size": 64}


def peft_model(model_type: str) -> nn.Module:
    """A tiny PEFT LoRA model: Mixtral with adapters on attention and both expert weights (``mixtral64``:
    its experts 64 wide, for NF4), GPT-OSS (built as ``tiny_family(model_type, **GPT_OSS)``) with
    adapters on attention."""
    if model_type == "mixtral":
        return tiny_peft("mixtral")
    from peft import get_peft_model

    if model_type == "mixtral64":
        from conftest import tiny_mixtral

        mixtral = tiny_mixtral(0, intermediate_size=64).train()
        torch.manual_seed(1)
        return get_peft_model(mixtral, lora_config())

    base = tiny_family(model_type, **GPT_OSS).train()
    torch.manual_seed(1)
    return get_peft_model(base, lora_config(target_parameters=[]))


def frozen_lora(
    model_type: str, fmt: str, folder: Path, degree: int | None = None, block: tuple[int, int] = (128, 128)
) -> nn.Module:
    """``peft_model(model_type)``, transformed (on a mesh of ``degree`` when given, then FSDP2-sharded),
    its experts kept in ``fmt`` (FP8 in blocks of ``block``) and every base weight read from ``folder``."""
    model = peft_model(model_type)
    mesh = lightning_ep.init_mesh(degree, device_type="cpu") if degree is not None else None
    lightning_ep.transform(model, CONFIG, mesh=mesh)
    keep_frozen_experts(model, fmt, block=block)  # type: ignore[arg-type]
    if mesh is not None:
        lightning_ep.shard_model(model, mesh)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_pretrained_sharded(model, folder)


def check_frozen_lora(rank: int, world: int, case: Case, folders: Path) -> None:
    """Each rank holds its experts' quantized bytes (split over the expert-data-parallel ranks when the
    degree is below the world size), equal to the one-process model's, and gathers them whole; the
    loss and every gradient equal the one-process model's fed every rank's micro-batch (averaged),
    within 1e-5."""
    model_type, fmt, degree, folder, block = case
    tag = f"{case} world={world} rank {rank}"
    reference = frozen_lora(model_type, fmt, folders / folder, block=block)
    model = frozen_lora(model_type, fmt, folders / folder, degree, block)
    ours = {n: m for n, m in model.named_modules() if isinstance(m, FrozenExpertWeight)}
    theirs = {n: m for n, m in reference.named_modules() if isinstance(m, FrozenExpertWeight)}
    assert ours.keys() == theirs.keys() and len(ours) == 4, tag
    edp = world // degree
    local = 8 // degree
    first = (rank % degree) * local
    placements = (Shard(0),) if edp == 1 else (Replicate(), Shard(1), Shard(0))
    for name, frozen in ours.items():
        gathered, spans = frozen.stored(), frozen.held_rows()
        for key, buffer in frozen.named_buffers():
            assert isinstance(buffer, DTensor) and buffer.placements == placements, (tag, name, key)
            expected = theirs[name].stored()[key][first : first + local]
            start, stop = spans[key]
            rows = expected.shape[1]
            chunk, index = -(-rows // edp), rank // degree  # torch.chunk's split over the edp axis
            assert (start, stop) == (min(rows, index * chunk), min(rows, (index + 1) * chunk)), (tag, name, key)
            assert torch.equal(buffer.to_local(), expected[:, start:stop]), (tag, name, key)
            assert torch.equal(gathered[key], expected), (tag, name, key)

    backward_both(reference, model, rank, world, tag)
    expected_grads = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}
    got = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert got.keys() == expected_grads.keys() and any("lora_" in n for n in got), tag
    for name, grad in got.items():
        assert grad is not None and expected_grads[name] is not None, (tag, name)
        full = grad.full_tensor() if isinstance(grad, DTensor) else grad
        assert rel_err(full, expected_grads[name]) <= RTOL, (tag, name)


def run_frozen(rank: int, world: int, folders: str, cases: list[Case]) -> None:
    for case in cases:
        check_frozen_lora(rank, world, case, Path(folders))


def check_resharded(rank: int, world: int, folders: Path, saved: int, loaded: int) -> None:
    """A DCP checkpoint of frozen FP8 experts saved at degree ``saved`` loads at degree ``loaded`` (the
    bytes split over the expert-data-parallel ranks on one side): each rank then holds exactly the
    one-process model's rows, and the full state dict (``export_hf``'s) its experts whole."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    checkpoint = folders / f"dcp_{saved}_to_{loaded}"
    dcp.save(frozen_lora("mixtral", "fp8", folders / "bf16", saved).state_dict(), checkpoint_id=checkpoint)
    dist.barrier()
    model = frozen_lora("mixtral", "fp8", folders / "bf16", loaded)
    frozen = {n: m for n, m in model.named_modules() if isinstance(m, FrozenExpertWeight)}
    for weight in frozen.values():
        for block in weight.held().values():
            block.zero_()
    state = model.state_dict()
    dcp.load(state, checkpoint_id=checkpoint)
    model.load_state_dict(state)
    reference = frozen_lora("mixtral", "fp8", folders / "bf16")
    local = 8 // loaded
    first = (rank % loaded) * local
    for name, weight in frozen.items():
        spans = weight.held_rows()
        for key, block in weight.held().items():
            start, stop = spans[key]
            expected = reference.get_submodule(name).stored()[key][first : first + local, start:stop]
            assert torch.equal(block, expected), (saved, loaded, rank, name, key)
    # The full state dict that export_hf gathers holds every expert whole.
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        for name, weight in frozen.items():
            for key in weight.held():
                assert torch.equal(full[f"{name}.{key}"], reference.get_submodule(name).stored()[key]), (name, key)


def run_resharded(rank: int, world: int, folders: str) -> None:
    check_resharded(rank, world, Path(folders), 2, 1)
    check_resharded(rank, world, Path(folders), 1, 2)


def run_initialised(rank: int, world: int) -> None:
    """A frozen FP8 weight ``[8, 80, 64]`` (blocks of 24 rows, which straddle the two ranks' halves)
    split over 2 expert-data-parallel ranks and initialised with a shared seed: gathered whole, its
    bytes equal those of the same weight initialised with that seed on one process."""
    from torch.distributed.tensor import DTensor, Shard

    mesh = lightning_ep.init_mesh(1, device_type="cpu")
    like = DTensor.from_local(torch.empty(8, 80, 64, device="meta"), mesh["ep"], [Shard(0)], run_check=False)
    weight = FrozenExpertWeight("fp8", like, block=(24, 24))
    weight.shard_rows_(mesh)
    reference = FrozenExpertWeight("fp8", torch.empty(8, 80, 64, device="meta"), block=(24, 24))
    assert weight.held_rows() == {"data": (40 * rank, 40 * rank + 40), "scale_inv": (2 * rank, 2 * rank + 2)}
    for frozen in (weight, reference):
        frozen.to_empty(device="cpu")
        torch.manual_seed(5)
        frozen.init_normal_(0.02)
    expected = reference.stored()
    for key, whole in weight.stored().items():
        assert torch.equal(whole, expected[key]), (rank, key)
