"""Worker bodies for the padded all-to-all (``lightning_ep.moe.dispatch.static.padded``): the same bits as
the dynamic all-to-all within its row budget, and an excess noted alike on every rank."""

from __future__ import annotations

import torch
import torch.distributed as dist
from skew_workers import E, H, moe_layer

from lightning_ep import MoEConfig
from lightning_ep.moe.dispatch.all_to_all import AllToAllDispatcher
from lightning_ep.moe.dispatch.static.padded import PaddedAllToAllDispatcher
from lightning_ep.moe.routing.router import Routing

K = 2  # top-k


def _layer(world: int):
    return moe_layer(MoEConfig(moe_load_balancing="sinkhorn"), world, top_k=K)


def _run(layer, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    x = x.clone().requires_grad_(True)
    out = layer(x)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    grads = [x.grad] + [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in layer.parameters()]
    return out.detach(), grads


def _to_expert_zero(gate, _inputs, routing: Routing) -> Routing:
    ids = routing.expert_ids_TK.clone()
    ids[:, 0] = 0  # every token's first choice: expert 0, on expert-parallel rank 0
    ids[:, 1] = torch.where(ids[:, 1] == 0, 1, ids[:, 1])
    return Routing(routing.logits_TE, routing.probs_TE, ids, routing.weights_TK)


def run_padded_matches_dynamic(rank: int, world: int) -> None:
    """Ragged tokens across ranks (12-27): forward output, input and weight gradients equal the
    dynamic plan's bit for bit, for an automatic budget (sized by its first, dynamic, dispatch) and
    a forced one; then a skewed layer over the budget notes the same loads on every rank."""
    dynamic = _layer(world)
    assert type(dynamic.dispatcher) is AllToAllDispatcher
    T = 12 + 5 * rank
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(rank))
    want_out, want_grads = _run(dynamic, x)
    for budget in ("auto", 8 * world * 4):
        padded = _layer(world)
        padded.dispatcher = PaddedAllToAllDispatcher(E, dynamic.dispatcher.group, budget)
        static = padded.dispatcher
        for attempt in range(2):  # "auto": the first dispatch is dynamic and sizes the budget
            padded.zero_grad(set_to_none=True)
            out, grads = _run(padded, x)
            assert torch.equal(out, want_out), (budget, attempt)
            for i, (a, b) in enumerate(zip(grads, want_grads, strict=True)):
                assert torch.equal(a, b), (budget, attempt, i)
            assert static.budget.take_excess() is None
        assert static.budget.budget is not None and static.budget.budget % world == 0
    # Over budget: expert 0's rank receives every token once, far past a budget of 8 rows per rank.
    tight = _layer(world)
    tight.dispatcher = PaddedAllToAllDispatcher(E, dynamic.dispatcher.group, 8)
    tight.gate.register_forward_hook(_to_expert_zero)
    out = tight(x.clone().requires_grad_(True))
    assert torch.isfinite(out).all()
    loads = tight.dispatcher.budget.take_excess()
    assert loads is not None and max(loads) > 8, loads
    everyone = [None] * world
    dist.all_gather_object(everyone, loads)
    assert all(v == loads for v in everyone), everyone
    assert loads[0] == max(loads) >= (12 + 5 * (world - 1)) * world  # rank 0: every token of the largest rank
    assert tight.dispatcher.budget.take_excess() is None  # read once
    # Without grad (evaluation) the plan is dynamic: the full output, nothing noted.
    tight.eval()
    with torch.no_grad():
        tight(x)
    assert tight.dispatcher.budget.take_excess() is None


def run_execution_given_again_rebuilds_the_dispatchers(rank: int, world: int) -> None:
    """``transform(model, config, execution=...)`` on a model already split over ranks (no ``mesh``
    again) checks the choices at the model's degree and rebuilds each layer's dispatcher on its
    group: a row budget then pads the exchange, with the dynamic plan's numbers."""
    import lightning_ep
    from lightning_ep import LayerExecution

    config = MoEConfig(moe_load_balancing="sinkhorn")
    dynamic = _layer(world)
    x = torch.randn(12 + 5 * rank, H, generator=torch.Generator().manual_seed(rank))
    want_out, want_grads = _run(dynamic, x)
    model = torch.nn.Sequential(_layer(world))
    lightning_ep.transform(model, config, execution=LayerExecution(row_budget=8 * world * 4))
    layer = model[0]
    assert type(layer.dispatcher) is PaddedAllToAllDispatcher, type(layer.dispatcher)
    assert layer.dispatcher.group is dynamic.dispatcher.group or dist.get_world_size(layer.dispatcher.group) == world
    out, grads = _run(layer, x)
    assert torch.equal(out, want_out)
    assert all(torch.equal(a, b) for a, b in zip(grads, want_grads, strict=True))
    lightning_ep.transform(model, config, execution=LayerExecution())
    assert type(layer.dispatcher) is AllToAllDispatcher
