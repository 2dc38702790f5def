"""Capacity-bounded routing on one process: which rows survive, that dropped ones add nothing, the count."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from conftest import rel_err, tiny_mixtral

import lightning_ep
from lightning_ep import MoEConfig
from lightning_ep.moe.dispatch_capacity import capacity, keep_slots


def test_capacity_formula() -> None:
    assert capacity(num_tokens=32, top_k=2, num_experts=8, capacity_factor=1.0) == 8
    assert capacity(num_tokens=32, top_k=2, num_experts=8, capacity_factor=1.1) == 9  # ceil(8.8)
    assert capacity(num_tokens=1, top_k=1, num_experts=8, capacity_factor=0.1) == 1  # at least one


def test_position_policy_keeps_the_earliest_tokens() -> None:
    ids = torch.tensor([[0], [0], [1], [0], [0]])  # T=5, K=1, E=2, capacity 2
    slot, keep, counts = keep_slots(ids, None, num_experts=2, cap=2, policy="position")
    assert keep.tolist() == [True, True, True, False, False]
    assert slot[keep].tolist() == [0, 1, 2]  # expert 0 slots 0, 1; expert 1 slot 0 -> 1 * 2 + 0
    assert counts.tolist() == [4, 1]


def test_probs_policy_keeps_the_highest_weights() -> None:
    ids = torch.tensor([[0], [0], [1], [0], [0]])
    weights = torch.tensor([[0.1], [0.9], [0.5], [0.3], [0.8]])
    slot, keep, _ = keep_slots(ids, weights, num_experts=2, cap=2, policy="probs")
    assert keep.tolist() == [False, True, True, False, True]
    assert sorted(slot[keep].tolist()) == [0, 1, 2]
    assert slot[1].item() == 0 and slot[4].item() == 1  # best first within expert 0


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_ample_capacity_equals_dropless(policy: str) -> None:
    model = tiny_mixtral()
    dropless = lightning_ep.transform(copy.deepcopy(model), MoEConfig(moe_load_balancing="none"))
    capped = lightning_ep.transform(
        copy.deepcopy(model), MoEConfig(moe_load_balancing="none", capacity_factor=8.0, drop_policy=policy)
    )
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    a, b = dropless(input_ids=ids, labels=ids), capped(input_ids=ids, labels=ids)
    assert rel_err(b.logits, a.logits) < 1e-6
    a.loss.backward()
    b.loss.backward()
    for (name, p), q in zip(dropless.named_parameters(), capped.parameters(), strict=True):
        assert rel_err(q.grad, p.grad) < 1e-5, name
    assert all(int(layer.tokens_dropped) == 0 for layer in lightning_ep.moe_layers(capped))


def test_dropped_pairs_contribute_nothing_and_are_counted() -> None:
    torch.manual_seed(0)
    layer = lightning_ep.moe_layers(
        lightning_ep.transform(tiny_mixtral(), MoEConfig(moe_load_balancing="none", capacity_factor=0.5))
    )[0]
    x = torch.randn(24, 64)
    out = layer(x)
    routing = layer.gate(x)
    T, K = routing.expert_ids_TK.shape
    cap = capacity(T, K, 8, 0.5)
    _, keep, counts = keep_slots(routing.expert_ids_TK, routing.weights_TK, 8, cap, "probs")
    assert int(layer.tokens_dropped) == T * K - int(torch.clamp(counts, max=cap).sum()) > 0
    expected = torch.zeros_like(x)
    w1, w2 = layer.experts.gate_up_proj, layer.experts.down_proj
    for t in range(T):
        for k in range(K):
            if keep[t * K + k]:
                e = int(routing.expert_ids_TK[t, k])
                gate, up = (w1[e] @ x[t]).chunk(2)
                expected[t] += routing.weights_TK[t, k] * (w2[e] @ (torch.nn.functional.silu(gate) * up))
    assert rel_err(out, expected) < 1e-5


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"capacity_factor": 0.0}, "MoEConfig.capacity_factor must be > 0, got 0.0; use None for dropless routing."),
        ({"capacity_factor": -1.0}, "MoEConfig.capacity_factor must be a finite number >= 0, got -1.0."),
        ({"capacity_factor": float("nan")}, "MoEConfig.capacity_factor must be a finite number >= 0, got nan."),
        (
            {"capacity_factor": 1.0, "moe_all_to_all_dispatcher": False},
            "MoEConfig.capacity_factor needs the all-to-all dispatcher, but moe_all_to_all_dispatcher=False",
        ),
        (
            {"drop_policy": "random"},
            "MoEConfig.drop_policy='random' is not supported; choose one of ['probs', 'position'].",
        ),
        ({"max_tokens_per_rank": 0}, "MoEConfig.max_tokens_per_rank must be >= 1, got 0."),
    ],
)
def test_capacity_config_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        MoEConfig(**kwargs)


def test_keep_all_to_all_refuses_a_dispatcher_without_kept_exchanges() -> None:
    """``MoELayer.keep_all_to_all`` on a dispatcher that cannot keep its exchanges (here the capacity
    dispatcher) fails at the first training forward, naming the settings that fix it."""
    model = lightning_ep.transform(tiny_mixtral(), MoEConfig(capacity_factor=1.0, moe_load_balancing="none"))
    for layer in lightning_ep.moe_layers(model):
        layer.keep_all_to_all = True
    with pytest.raises(ValueError, match=re.escape("capacity_factor=None, symmetric_memory_dispatch=False) or keep")):
        model(input_ids=torch.randint(0, 128, (2, 8)))
