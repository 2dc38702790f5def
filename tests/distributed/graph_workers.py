"""Workers for ``LayerExecution(cuda_graphs=True)`` (``Execution(cuda_graphs=True)`` under the strategy;
1 or 2 GPUs, NCCL: ``tests/gpu/test_cuda_graphs.py``; on the CPU only the refusal of FSDP2-sharded
experts, ``tests/distributed/test_symm_dispatch.py``).

The graphs replay the eager kernels on the same values, so every comparison here is bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from conftest import count_syncs  # tests/ is on sys.path under pytest, also in spawned workers
from torch import nn

from lightning_ep.moe import GroupedExperts, MoEConfig, MoELayer, TopKRouter
from lightning_ep.moe.experts.grouped import local_tensor
from lightning_ep.moe.graphs import WARMUP
from lightning_ep.moe.layer_execution import LayerExecution


def _config(balancing: str = "none") -> MoEConfig:
    return MoEConfig(moe_load_balancing=balancing)  # type: ignore[arg-type]


def _execution(budget: int, graphs: bool, degree: int) -> LayerExecution:
    """The static plan the graphs capture: at degree 1 the local dispatch (static already), above it
    the symmetric-memory exchange with a row budget of ``budget``; the eager model runs the same plan."""
    if degree == 1:
        return LayerExecution(cuda_graphs=graphs)
    return LayerExecution(exchange="symmetric_memory", row_budget=budget, cuda_graphs=graphs)


def _local_grads(model: nn.Module) -> list[torch.Tensor]:
    return [local_tensor(p.grad) for p in model.parameters() if p.grad is not None]


def _assert_equal(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    assert len(got) == len(want), (what, len(got), len(want))
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.shape == b.shape and torch.equal(a, b), (what, i, (a.float() - b.float()).abs().max())


def run_model_matches_eager(rank: int, world: int) -> None:
    """A 3-layer Mixtral under FSDP2 (experts outside it, degree = world), AdamW, with and without
    ``cuda_graphs``: the same losses and gradients, bit for bit, over eight steps (one of two
    accumulated micro-batches, one with two forwards before a single backward, two in Lightning's
    order: forward, ``zero_grad``, backward, so that the forward replays run while ``.grad`` still
    holds the backward graphs' buffers, uncopied), and the same logits in evaluation; the graphs are
    captured in step ``WARMUP`` and reused after; a weight assigned anew is refused."""
    from workers import BATCH, SEQ, micro_batch, tiny_mixtral

    import lightning_ep

    device = torch.device("cuda", rank)
    mesh = lightning_ep.init_mesh(world, device_type="cuda")
    budget = 2 * world * BATCH * SEQ  # every row of the group on one rank: never over budget
    models, optimizers = [], []
    for graphs in (False, True):
        model = tiny_mixtral(num_hidden_layers=3).to(device=device, dtype=torch.bfloat16)
        lightning_ep.transform(model, _config("aux_loss"), mesh=mesh, execution=_execution(budget, graphs, world))
        lightning_ep.shard_model(model, mesh)
        models.append(model)
        optimizers.append(torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False))
    layers = lightning_ep.moe_layers(models[1])

    def step(model: nn.Module, optimizer: torch.optim.Optimizer, batches: list[list[torch.Tensor]], kind: str) -> list:
        losses = []
        for group in batches:  # micro-batches; a group of two is two forwards before one backward
            group_losses = [model(input_ids=ids, labels=ids).loss for ids in group]
            if kind.startswith("lightning"):  # Lightning's closure: the forward, zero_grad, then backward
                if model is models[1] and kind == "lightning again":  # the last step's .grad outlived the replays
                    _assert_grads_in_graph_buffers(layers)
                optimizer.zero_grad(set_to_none=True)
            sum(group_losses).backward()  # type: ignore[union-attr]
            losses += [loss.detach() for loss in group_losses]
        grads = [g.clone() for g in _local_grads(model)]
        optimizer.step()
        if not kind.startswith("lightning"):
            optimizer.zero_grad(set_to_none=True)
        return [*losses, *grads]

    schedule = {4: "accumulate", 5: "two forwards", 6: "lightning", 7: "lightning again"}
    for i in range(8):
        ids = micro_batch(i, rank).to(device)
        more = micro_batch(100 + i, rank).to(device)
        kind = schedule.get(i, "plain")
        batches = {"accumulate": [[ids], [more]], "two forwards": [[ids, more]]}.get(kind, [[ids]])
        want = step(models[0], optimizers[0], batches, kind)
        got = step(models[1], optimizers[1], batches, kind)
        _assert_equal(got, want, f"step {i} ({kind})")
        captured = all(layer.graphed.graphs is not None and layer.graphed.graphs.bwd is not None for layer in layers)
        assert captured == (i >= WARMUP), (i, captured)
        if captured:  # at degree 1 the graphs hold the routing too (its router under FSDP2)
            assert all((layer.graphed.graphs._gate is not None) == (world == 1) for layer in layers), i  # type: ignore[union-attr]
        # A layer's forward still pending after its step would leave the next one eager.
        assert not any(layer.graphed.graphs.pending for layer in layers), i  # type: ignore[union-attr]

    for model in models:
        model.eval()
    ids = micro_batch(50, rank).to(device)
    with torch.no_grad():
        logits = [model(input_ids=ids).logits for model in models]
    assert torch.equal(logits[0], logits[1])

    models[1].train()
    experts = layers[0].experts
    experts.gate_up_proj = nn.Parameter(experts.gate_up_proj.detach().clone())
    try:
        models[1](input_ids=ids, labels=ids).loss.backward()
    except RuntimeError as error:
        assert "the experts' weights moved in memory" in str(error), error
    else:
        raise AssertionError("a graph ran on weights assigned after its capture")
    for layer in layers:  # before the harness destroys the process group (see LayerGraphs.release)
        layer.release_graphs()
        assert layer.graphed.graphs is None


def _assert_grads_in_graph_buffers(layers: list[MoELayer]) -> None:
    """Each expert weight's ``.grad`` is still its backward graph's buffer: no forward replay copied
    it out (the backward graphs keep a memory pool of their own)."""
    for layer in layers:
        graphs = layer.graphed.graphs
        assert graphs is not None
        for p, buffer in zip(graphs._weights(), graphs._grads[len(graphs._writable) :], strict=True):
            assert buffer is not None and p.grad is not None
            assert local_tensor(p.grad).data_ptr() == buffer.data_ptr(), layer.layer_index


def _layer(
    budget: int,
    graphs: bool,
    device: torch.device,
    dtype: torch.dtype = torch.bfloat16,
    balancing: str = "none",
    *,
    degree: int,
) -> MoELayer:
    """One layer whose dispatcher ``parallelize_moe_layers`` builds at ``degree`` with ``_execution``."""
    g = torch.Generator().manual_seed(0)
    H, I, E, K = 128, 64, 8, 2  # noqa: E741
    gate = TopKRouter(nn.Parameter(torch.randn(E, H, generator=g) * H**-0.5), top_k=K, mode=balancing)  # type: ignore[arg-type]
    w1 = nn.Parameter(torch.randn(E, 2 * I, H, generator=g) * 0.1)
    w2 = nn.Parameter(torch.randn(E, H, I, generator=g) * 0.1)
    layer = MoELayer(gate, GroupedExperts(w1, w2, F.silu), _config(balancing))
    layer.set_execution(_execution(budget, graphs, degree))  # as transform(..., execution=...) does
    return layer.to(device=device, dtype=dtype).train()


def run_layer_replays_without_syncs(rank: int, world: int) -> None:
    """One layer: after its capture a forward + backward makes no host sync, and its output, input
    gradient, weight gradients (the router's too), losses, non-finite flag and tokens per expert
    equal the eager layer's; a gradient of the graph's weights left in ``.grad`` from an earlier
    backward is accumulated into, not overwritten. At degree 1 the graphs hold the routing (the
    Sinkhorn kernel's cooperative launch included), above it they start at the dispatch."""
    for balancing, check_finite in (("none", False), ("sinkhorn", True), ("aux_loss", False)):
        _layer_replays_without_syncs(rank, world, balancing, check_finite)


def _layer_replays_without_syncs(rank: int, world: int, balancing: str, check_finite: bool) -> None:
    import lightning_ep
    from lightning_ep.parallel.expert import parallelize_moe_layers

    device = torch.device("cuda", rank)
    mesh = lightning_ep.init_mesh(world, device_type="cuda")
    T = 256
    layers = []
    for graphs in (False, True):
        layer = _layer(2 * world * T, graphs, device, balancing=balancing, degree=world)
        parallelize_moe_layers(nn.ModuleDict({"moe": layer}), mesh)
        layer.check_finite = check_finite
        layers.append(layer)
    g = torch.Generator(device=device).manual_seed(rank)

    def fwd_bwd(layer: MoELayer, x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        out = layer(x)
        out.backward(grad)
        return out

    for i in range(WARMUP + 3):
        x = torch.randn(T, 128, generator=g, device=device).to(torch.bfloat16)
        grad = torch.randn(T, 128, generator=g, device=device).to(torch.bfloat16)
        results = []
        for layer in layers:
            xi = x.clone().requires_grad_(True)
            out = fwd_bwd(layer, xi, grad)
            if i == WARMUP + 1:  # accumulate a second backward into the same .grad
                out = fwd_bwd(layer, xi, grad)
            stats = [layer.tokens_per_expert, layer.aux_loss, layer.z_loss, layer.router_entropy, layer.nonfinite]
            results.append([out.detach(), xi.grad, *stats, *_local_grads(layer)])
            layer.zero_grad(set_to_none=True)
        _assert_equal(results[1], results[0], f"{balancing}, call {i}")

    x = torch.randn(T, 128, generator=g, device=device).to(torch.bfloat16).requires_grad_(True)
    graphed = layers[1]
    assert graphed.graphed.graphs is not None and graphed.graphed.graphs.bwd is not None
    assert (graphed.graphed.graphs._gate is not None) == (world == 1), balancing  # the routing captured
    syncs = count_syncs(lambda: fwd_bwd(graphed, x, torch.ones_like(x)))
    assert syncs == 0, syncs
    graphed.release_graphs()


def run_capture_again_after_release(rank: int, world: int) -> None:
    """A layer captured after every earlier graph was released, while a tensor from the earlier
    graphs' pool lives on (a gradient kept by the caller), captures into a new pool and gives the
    eager layer's bits (sharing the old pool hit an internal assert of CUDA's caching allocator)."""
    import lightning_ep
    from lightning_ep.parallel.expert import parallelize_moe_layers

    device = torch.device("cuda", rank)
    mesh = lightning_ep.init_mesh(world, device_type="cuda")
    T = 64
    g = torch.Generator(device=device).manual_seed(rank)
    first = _layer(2 * world * T, True, device, degree=world)
    parallelize_moe_layers(nn.ModuleDict({"moe": first}), mesh)
    x = torch.randn(T, 128, generator=g, device=device).to(torch.bfloat16).requires_grad_(True)
    for _ in range(WARMUP + 2):
        first(x).sum().backward()
    assert first.graphed.graphs is not None and first.graphed.graphs.bwd is not None
    kept = [grad for grad in first.graphed.graphs._grads if grad is not None]  # allocated in the first pool
    first.release_graphs()
    layers = []
    for graphs in (False, True):
        layer = _layer(2 * world * T, graphs, device, degree=world)
        parallelize_moe_layers(nn.ModuleDict({"moe": layer}), mesh)
        layers.append(layer)
    for i in range(WARMUP + 2):
        results = []
        for layer in layers:
            xi = x.detach().clone().requires_grad_(True)
            out = layer(xi)
            out.backward(torch.ones_like(out))
            results.append([out.detach(), xi.grad, *_local_grads(layer)])
            layer.zero_grad(set_to_none=True)
        _assert_equal(results[1], results[0], f"call {i}")
    assert layers[1].graphed.graphs is not None and layers[1].graphed.graphs.bwd is not None
    assert kept  # alive until here
    layers[1].release_graphs()


def run_fp32_experts_refuse_graphs(rank: int, world: int) -> None:
    """fp32 experts take the per-expert loop, which reads the counts on the host: the warm-up calls
    run eagerly, then the capture refuses with the fix, before capturing anything."""
    import lightning_ep
    from lightning_ep.parallel.expert import parallelize_moe_layers

    device = torch.device("cuda", rank)
    mesh = lightning_ep.init_mesh(world, device_type="cuda")
    T = 64
    layer = _layer(2 * world * T, True, device, torch.float32, degree=world)
    parallelize_moe_layers(nn.ModuleDict({"moe": layer}), mesh)
    x = torch.randn(T, 128, device=device, requires_grad=True)
    for _ in range(WARMUP):
        layer(x).sum().backward()
    try:
        layer(x)
    except ValueError as error:
        message = str(error)
        assert "cuda_graphs=True) needs the experts' grouped GEMM" in message, message
        assert "torch.float32" in message and "cuda_graphs=False" in message, message
    else:
        raise AssertionError("cuda_graphs captured fp32 experts, whose per-expert loop reads the host")
    assert layer.graphed.graphs is not None and layer.graphed.graphs.fwd is None
    layer.release_graphs()


def run_sharded_experts_refuse_graphs(rank: int, world: int) -> None:
    """Experts with expert-data-parallel ranks are gathered by FSDP2 every step, so their weights
    move: ``shard_model`` refuses ``cuda_graphs`` with the fix, before any step (gloo, degree 1)."""
    from workers import tiny_mixtral

    import lightning_ep

    mesh = lightning_ep.init_mesh(1, device_type="cpu")  # two expert-data-parallel ranks
    model = tiny_mixtral()
    lightning_ep.transform(model, _config(), mesh=mesh, execution=_execution(128, True, degree=1))
    try:
        lightning_ep.shard_model(model, mesh)
    except ValueError as error:
        assert "Execution(cuda_graphs=True) needs the experts' weights to stay in place" in str(error), error
        assert "2 expert-data-parallel ranks" in str(error) and "cuda_graphs=False" in str(error), error
    else:
        raise AssertionError("shard_model let FSDP2 gather experts that CUDA graphs read in place")
