"""``MoEConfig.cuda_graphs`` on the CPU: its configuration errors, and nothing changes where there is
no static plan to capture (one process). The graphs themselves: ``tests/gpu/test_cuda_graphs.py``."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_ep.moe import GroupedExperts, LocalDispatcher, MoEConfig, MoELayer, TopKRouter
from lightning_ep.moe.graphs import LayerGraphs


@pytest.mark.parametrize(
    ("kwargs", "shown"),
    [
        ({}, "symmetric_memory_dispatch=False, max_tokens_per_rank=None"),
        ({"symmetric_memory_dispatch": True}, "symmetric_memory_dispatch=True, max_tokens_per_rank=None"),
        ({"max_tokens_per_rank": 64}, "symmetric_memory_dispatch=False, max_tokens_per_rank=64"),
    ],
)
def test_cuda_graphs_need_the_static_plan(kwargs: dict, shown: str) -> None:
    message = f"MoEConfig.cuda_graphs=True captures the static plan of the symmetric-memory dispatch, but {shown}; "
    with pytest.raises(ValueError, match=re.escape(message) + "set symmetric_memory_dispatch=True and"):
        MoEConfig(cuda_graphs=True, **kwargs)
    config = MoEConfig(symmetric_memory_dispatch=True, max_tokens_per_rank=64, cuda_graphs=True)
    assert config.cuda_graphs


def test_layer_graphs_refuse_a_dispatcher_without_a_budget() -> None:
    experts = GroupedExperts(nn.Parameter(torch.zeros(4, 16, 8)), nn.Parameter(torch.zeros(4, 8, 8)), F.silu)
    with pytest.raises(ValueError, match="cuda_graphs=True needs the static plan"):
        LayerGraphs(LocalDispatcher(4), experts)


def _layer(config: MoEConfig) -> MoELayer:
    g = torch.Generator().manual_seed(0)
    gate = TopKRouter(nn.Parameter(torch.randn(8, 64, generator=g)), top_k=2, mode="none")
    w1 = nn.Parameter(torch.randn(8, 64, 64, generator=g) * 0.1)
    w2 = nn.Parameter(torch.randn(8, 64, 32, generator=g) * 0.1)
    return MoELayer(gate, GroupedExperts(w1, w2, F.silu), config).train()


def test_one_process_runs_eagerly_with_the_same_numbers() -> None:
    """At degree 1 there is no symmetric memory and no static plan: the option changes nothing."""
    base = MoEConfig(moe_load_balancing="none", symmetric_memory_dispatch=True, max_tokens_per_rank=256)
    plain, graphed = _layer(base), _layer(MoEConfig(**{**base.__dict__, "cuda_graphs": True}))
    x = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(1))
    results = []
    for layer in (plain, graphed):
        xi = x.clone().requires_grad_(True)
        for _ in range(4):  # past the warm-up calls
            out = layer(xi)
            out.square().sum().backward()
        results.append([out.detach(), xi.grad, *(p.grad for p in layer.parameters())])
    assert graphed._graphs() is None
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)
