"""``LayerExecution(cuda_graphs=True)`` (``Execution(cuda_graphs=True)`` under the strategy) on the
CPU: its configuration errors, and nothing changes off CUDA. The graphs themselves:
``tests/gpu/test_cuda_graphs.py``."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_mixtral
from torch import nn

import lightning_ep
from lightning_ep import LayerExecution
from lightning_ep.moe import GroupedExperts, LocalDispatcher, MoEConfig, MoELayer, TopKRouter
from lightning_ep.moe.dispatch.capacity import CapacityDispatcher
from lightning_ep.moe.dispatch.select import make_dispatcher
from lightning_ep.moe.graphs import LayerGraphs


@pytest.mark.parametrize(
    ("kwargs", "shown"),
    [
        ({}, "exchange='collective', row_budget=None"),
        ({"exchange": "symmetric_memory"}, "exchange='symmetric_memory', row_budget=None"),
        ({"row_budget": 64}, "exchange='collective', row_budget=64"),
        ({"row_budget": "auto"}, "exchange='collective', row_budget='auto'"),
    ],
)
def test_cuda_graphs_above_degree_1_need_the_static_plan(kwargs: dict, shown: str) -> None:
    """Checked where the dispatcher is made (``LayerExecution.check``, from ``make_dispatcher`` and
    ``transform``), which knows the degree: at degree 1 the local dispatch is static already."""
    config = MoEConfig()
    graphs = LayerExecution(cuda_graphs=True)
    graphs.check(config, 1)
    assert isinstance(make_dispatcher(config, 8, execution=graphs), LocalDispatcher)
    message = (
        "Execution(cuda_graphs=True) needs a static plan above degree 1 (exchange='symmetric_memory' with an int "
        f"row_budget), but capacity_factor=None, degree=2, {shown}; set cuda_graphs=False, or what it needs."
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        LayerExecution(cuda_graphs=True, **kwargs).check(config, 2)
    LayerExecution(exchange="symmetric_memory", row_budget=64, cuda_graphs=True).check(config, 2)


def test_cuda_graphs_refuse_a_capacity_bound() -> None:
    message = (
        "Execution(cuda_graphs=True) needs a dropless dispatch (capacity_factor is set), but capacity_factor=1.25, "
    )
    config = MoEConfig(capacity_factor=1.25)
    with pytest.raises(ValueError, match=re.escape(message) + "degree=1"):
        LayerExecution(cuda_graphs=True).check(config, 1)
    with pytest.raises(ValueError, match=re.escape(message)):
        make_dispatcher(config, 8, execution=LayerExecution(cuda_graphs=True))
    with pytest.raises(ValueError, match=re.escape(message)):
        lightning_ep.transform(tiny_mixtral(), config, execution=LayerExecution(cuda_graphs=True))
    assert isinstance(make_dispatcher(config, 8), CapacityDispatcher)  # off: the capacity dispatch


def test_transform_gives_every_layer_its_execution() -> None:
    """``transform(..., execution=...)`` sets each layer's ``execution`` (checked for the degree first);
    given again on the transformed model, it replaces the layers'."""
    model = lightning_ep.transform(tiny_mixtral(), MoEConfig(moe_load_balancing="none"))
    layers = lightning_ep.moe_layers(model)
    assert all(layer.execution == LayerExecution() for layer in layers)
    graphs = LayerExecution(cuda_graphs=True)
    assert lightning_ep.transform(model, MoEConfig(moe_load_balancing="none"), execution=graphs) is model
    assert lightning_ep.moe_layers(model) == layers
    assert all(layer.execution is graphs and not layer.experts.host_counts_in_backward for layer in layers)
    with pytest.raises(ValueError, match=r"changes the dropless all-to-all between expert-parallel ranks.*degree=1"):
        lightning_ep.transform(model, MoEConfig(moe_load_balancing="none"), execution=LayerExecution(row_budget=64))
    assert all(layer.execution is graphs for layer in layers)  # refused before any layer changed
    lightning_ep.transform(model, MoEConfig(moe_load_balancing="none"), execution=LayerExecution())
    assert all(layer.execution == LayerExecution() and layer.experts.host_counts_in_backward for layer in layers)


def test_layer_graphs_take_a_dispatcher_with_a_static_plan_only() -> None:
    experts = GroupedExperts(nn.Parameter(torch.zeros(4, 16, 8)), nn.Parameter(torch.zeros(4, 8, 8)), F.silu)
    LayerGraphs(LocalDispatcher(4), experts)
    with pytest.raises(ValueError, match="needs a dispatch with a static plan, got CapacityDispatcher without one"):
        LayerGraphs(CapacityDispatcher(4, 1.0, "probs", None), experts)


def _layer(config: MoEConfig) -> MoELayer:
    g = torch.Generator().manual_seed(0)
    gate = TopKRouter(nn.Parameter(torch.randn(8, 64, generator=g)), top_k=2, mode="none")
    w1 = nn.Parameter(torch.randn(8, 64, 64, generator=g) * 0.1)
    w2 = nn.Parameter(torch.randn(8, 64, 32, generator=g) * 0.1)
    return MoELayer(gate, GroupedExperts(w1, w2, F.silu), config).train()


def test_on_the_cpu_the_layer_runs_eagerly_with_the_same_numbers() -> None:
    """CUDA graphs are CUDA's: on the CPU the local dispatch's graphs never capture, and the option
    changes nothing (on GPUs, at degree 1: ``tests/gpu/test_cuda_graphs.py``)."""
    base = MoEConfig(moe_load_balancing="none")
    plain, graphed = _layer(base), _layer(base)
    graphed.set_execution(LayerExecution(cuda_graphs=True))
    x = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(1))
    results = []
    for layer in (plain, graphed):
        xi = x.clone().requires_grad_(True)
        for _ in range(4):  # past the warm-up calls
            out = layer(xi)
            out.square().sum().backward()
        results.append([out.detach(), xi.grad, *(p.grad for p in layer.parameters())])
    assert graphed.graphed.graphs is not None and graphed.graphed.graphs.fwd is None
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_the_routing_run_on_a_graphs_buffers_equals_the_routing_on_the_router() -> None:
    """What ``LayerGraphs`` captures with the routing, run here without a graph: ``route`` on copies
    of the router's tensors (``swapped`` in for its own, then restored) gives the same choices, losses
    and gradients as on the router itself; ``backward_of`` takes the output's and the losses'
    gradients; the key tells modes, checks and gradient needs apart."""
    from lightning_ep.moe.graph_inputs import backward_of, gate_tensors, routed_key, static_copy, swapped
    from lightning_ep.moe.routing.route import route

    g = torch.Generator().manual_seed(0)
    gate = TopKRouter(nn.Parameter(torch.randn(8, 16, generator=g)), top_k=2, mode="balanced").train()
    gate.expert_bias.copy_(torch.randn(8, generator=g) * 0.1)
    x = torch.randn(32, 16, generator=g, requires_grad=True)
    ids, weights, stats = route(gate, x, True)
    want = torch.autograd.grad([weights.sum(), stats.aux_loss, stats.z_loss], [x, gate.weight])

    names = [name for name, _ in gate_tensors(gate)]
    assert names == ["weight", "expert_bias", "pending_load"]
    static = [static_copy(t) for _, t in gate_tensors(gate)]
    assert isinstance(static[0], nn.Parameter) and static[0].requires_grad and not static[1].requires_grad
    x_static = static_copy(x)
    with swapped(gate, dict(zip(names, static, strict=True))):
        got_ids, got_weights, got = route(gate, x_static, True)
    assert gate.weight is not static[0] and gate.expert_bias is not static[1]  # restored
    outputs = (got_weights.sum(), got_ids, got.aux_loss, got.z_loss, got.entropy, got.logits_finite)
    grads = backward_of(outputs, [x_static, *static])
    assert torch.equal(got_ids, ids) and torch.equal(got_weights, weights)
    for a, b in ((got.aux_loss, stats.aux_loss), (got.z_loss, stats.z_loss), (got.entropy, stats.entropy)):
        assert torch.equal(a, b)
    assert grads[2] is None and grads[3] is None  # buffers: no gradient
    assert torch.equal(grads[0], want[0]) and torch.equal(grads[1], want[1])

    key = routed_key(x, gate, True, [])
    assert key == routed_key(x, gate, True, [])
    assert key != routed_key(x, gate, False, []) and key != routed_key(x.detach(), gate, True, [])
    assert key != routed_key(x, gate.eval(), True, [])
