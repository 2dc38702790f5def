"""Workers for ``test_dither_ep.py``: masters dithered after expert parallelism and FSDP2 sharded
them equal the one-process model's, element for element."""

from __future__ import annotations

import copy

import torch
from torch.distributed.tensor import DTensor
from workers import full, tiny_mixtral

import lightning_ep
from lightning_ep import MoEConfig
from lightning_ep.parallel.dither import dither_master_weights, on_bf16_grid


def run_dither_is_the_same_at_any_layout(rank: int, world: int, degree: int) -> None:
    base = tiny_mixtral()
    with torch.no_grad():
        for p in base.parameters():
            p.copy_(p.to(torch.bfloat16).float())  # fp32 masters of a bf16 checkpoint
    config = MoEConfig(moe_load_balancing="aux_loss")
    reference = lightning_ep.transform(copy.deepcopy(base), config)
    ref_count, _ = dither_master_weights(reference.named_parameters())
    mesh = lightning_ep.init_mesh(degree, device_type="cpu")
    model = lightning_ep.transform(copy.deepcopy(base), config, mesh=mesh)
    lightning_ep.shard_model(model, mesh)
    count, moved = dither_master_weights(model.named_parameters())
    assert count == ref_count and moved > 0
    ours, theirs = dict(model.named_parameters()), dict(reference.named_parameters())
    assert ours.keys() == theirs.keys()
    sharded = [n for n, p in ours.items() if isinstance(p, DTensor) and full(p).numel() != p.to_local().numel()]
    assert any("experts" in n for n in sharded) and any("self_attn" in n for n in sharded)  # the test shards both
    for name, p in ours.items():
        assert torch.equal(full(p), theirs[name]), name
        assert not on_bf16_grid(full(p)), name
        assert torch.equal(full(p).to(torch.bfloat16), full(dict(base.named_parameters())[name]).to(torch.bfloat16))
