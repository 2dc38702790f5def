"""Capacity-bounded routing on one process: which rows survive, that dropped ones add nothing, the count."""

from __future__ import annotations

import copy
import math
import re

import pytest
import torch
from conftest import rel_err, tiny_mixtral

import lightning_ep
from lightning_ep import MoEConfig
from lightning_ep.moe.dispatch.capacity import capacity, capacity_tensor, keep_slots


def test_capacity_formula() -> None:
    assert capacity(num_tokens=32, top_k=2, num_experts=8, capacity_factor=1.0) == 8
    assert capacity(num_tokens=32, top_k=2, num_experts=8, capacity_factor=1.1) == 9  # ceil(8.8)
    assert capacity(num_tokens=1, top_k=1, num_experts=8, capacity_factor=0.1) == 1  # at least one


def _megatron_get_capacity(num_tokens: int, num_experts: int, capacity_factor: float) -> int:
    """Megatron-Core's ``moe_utils.get_capacity``, called with ``num_tokens = T * K``, written out."""
    return math.ceil((num_tokens / num_experts) * capacity_factor)


@pytest.mark.parametrize(
    ("tokens", "top_k", "experts", "factor"),
    [(30, 6, 4, 2.2), (30, 6, 2, 1.1), (15, 6, 2, 2.2), (25, 6, 2, 2.2), (45, 6, 2, 2.2), (32, 2, 8, 1.1)],
)
def test_capacity_is_megatrons_integer_at_exact_boundaries(
    tokens: int, top_k: int, experts: int, factor: float
) -> None:
    """Where ``factor * T * K / E`` and ``(T * K / E) * factor`` round to different sides of an integer
    (all but the last case), the capacity is Megatron-Core's; the device version gives the same."""
    expected = _megatron_get_capacity(tokens * top_k, experts, factor)
    assert capacity(tokens, top_k, experts, factor) == expected
    assert int(capacity_tensor(torch.tensor(tokens), top_k, experts, factor)) == expected
    if (tokens, top_k, experts, factor) != (32, 2, 8, 1.1):
        assert math.ceil(factor * tokens * top_k / experts) != expected  # the boundary is real


def test_position_policy_keeps_the_earliest_tokens() -> None:
    ids = torch.tensor([[0], [0], [1], [0], [0]])  # T=5, K=1, E=2, capacity 2
    rank, keep, counts = keep_slots(ids, None, num_experts=2, cap=2, policy="position")
    assert keep.tolist() == [True, True, True, False, False]
    assert rank.tolist() == [0, 1, 0, 2, 3]
    assert counts.tolist() == [4, 1]


def test_position_policy_keeps_the_earliest_positions_of_every_sequence() -> None:
    """Megatron-Core flattens ``[S, B]``: under capacity the last positions of every sequence drop, not
    the last sequences of the micro-batch. Two sequences of 4 tokens ([B, S] order), all on expert 0,
    capacity 4: positions 0 and 1 of both sequences stay."""
    ids = torch.zeros(8, 1, dtype=torch.int64)
    positions = torch.arange(8) % 4
    rank, keep, _ = keep_slots(ids, None, num_experts=2, cap=4, policy="position", positions_T=positions)
    assert keep.tolist() == [True, True, False, False, True, True, False, False]
    # Within the expert: (position, sequence) order, i.e. s * B + b.
    assert rank.tolist() == [0, 2, 4, 6, 1, 3, 5, 7]


def test_probs_policy_keeps_the_highest_weights() -> None:
    ids = torch.tensor([[0], [0], [1], [0], [0]])
    weights = torch.tensor([[0.1], [0.9], [0.5], [0.3], [0.8]])
    rank, keep, _ = keep_slots(ids, weights, num_experts=2, cap=2, policy="probs")
    assert keep.tolist() == [False, True, True, False, True]
    assert rank.tolist() == [3, 0, 0, 2, 1]  # best first within expert 0


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_padded_pairs_take_no_capacity(policy: str) -> None:
    """Padded tokens (``valid_T``) are never kept and do not push real tokens out, even with the best
    weights or the earliest positions; they count neither as routed nor as dropped."""
    ids = torch.tensor([[0], [0], [0], [0], [1]])
    weights = torch.tensor([[0.99], [0.2], [0.3], [0.1], [0.5]])
    valid = torch.tensor([False, True, True, True, True])
    _, keep, counts = keep_slots(ids, weights, 2, cap=2, policy=policy, valid_T=valid)
    assert not keep[0]
    assert keep.tolist()[1:] == [True, True, False, True]  # expert 0 keeps two of its three real pairs
    assert counts.tolist() == [3, 1]


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
    fix = "MoEConfig(moe_all_to_all_dispatcher=True, capacity_factor=None) and Execution(exchange='collective') or keep"
    with pytest.raises(ValueError, match=re.escape(fix)):
        model(input_ids=torch.randint(0, 128, (2, 8)))


def _route_everything_to(layer: torch.nn.Module, experts: list[int]) -> None:
    """Every token picks ``experts`` (weights renormalised over them)."""
    from lightning_ep.moe.routing.router import Routing

    def hook(_gate: torch.nn.Module, _inputs: tuple, routing: Routing) -> Routing:
        ids = torch.tensor(experts).expand(routing.expert_ids_TK.shape[0], len(experts))
        weights = routing.probs_TE.gather(1, ids)
        return Routing(routing.logits_TE, routing.probs_TE, ids, weights / weights.sum(-1, keepdim=True))

    layer.gate.register_forward_hook(hook)


def test_position_policy_keeps_the_earliest_positions_of_each_sequence_in_a_batch() -> None:
    """A ``[B, S, H]`` input whose 2 x 8 tokens all pick experts 0 and 1, capacity 8 per expert: each
    expert keeps positions 0-3 of both sequences, so positions 4-7 of each come out zero (not the whole
    second sequence, as the earliest rows of the flattened batch would)."""
    model = lightning_ep.transform(
        tiny_mixtral(), MoEConfig(moe_load_balancing="none", capacity_factor=2.0, drop_policy="position")
    )
    layer = lightning_ep.moe_layers(model)[0]
    _route_everything_to(layer, [0, 1])
    y = layer(torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(0)))
    kept = y.abs().sum(-1) > 0
    assert kept.tolist() == [[True] * 4 + [False] * 4] * 2
    assert int(layer.tokens_dropped) == 16


def test_balanced_counts_the_pairs_each_expert_kept() -> None:
    """Under a capacity, ``"balanced"`` counts the (token, expert) pairs each expert kept, as Megatron-Core
    counts its capacity-masked routing map; ``tokens_per_expert`` still reports the routed pairs."""
    model = lightning_ep.transform(tiny_mixtral(), MoEConfig(moe_load_balancing="balanced", capacity_factor=1.0))
    layer = lightning_ep.moe_layers(model)[0]
    _route_everything_to(layer, [0, 1])
    layer(torch.randn(2, 8, 64))
    cap = capacity(16, 2, 8, 1.0)  # 4
    assert layer.tokens_per_expert.tolist() == [16, 16, 0, 0, 0, 0, 0, 0]
    assert layer.gate.pending_load.tolist() == [cap, cap, 0, 0, 0, 0, 0, 0]
    assert int(layer.tokens_dropped) == 2 * (16 - cap)
