"""Workers for the overlap tests: ``start_all_to_all`` / ``finish_all_to_all`` and the shared experts
that run between them (imported by spawned processes)."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from families_workers import CONFIG, full, micro_batch, rel_err, tiny_family

import lightning_ep
from lightning_ep.moe.dispatch import comm


def _splits(rank: int, world: int) -> tuple[list[int], list[int]]:
    """Uneven split sizes: rank ``s`` sends ``3 + s + 2 d`` rows to rank ``d`` (a zero-free table)."""
    send = [3 + rank + 2 * d for d in range(world)]
    recv = [3 + s + 2 * rank for s in range(world)]
    return send, recv


class _Probe(torch.autograd.Function):
    """Identity; logs whether ``flight`` has an exchange outstanding, in forward and in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, flight: comm.InFlight, log: list[str]) -> torch.Tensor:
        log.append(f"forward in flight={flight.work is not None}")
        ctx.flight, ctx.log = flight, log
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        ctx.log.append(f"backward in flight={ctx.flight.work is not None}")
        return grad, None, None


def run_start_finish(rank: int, world: int) -> None:
    """The split all-to-all equals the plain one in values and gradients, and work queued between
    its two halves runs while the exchange is outstanding, in forward and in backward."""
    send, recv = _splits(rank, world)
    group = dist.group.WORLD
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(sum(send), 16, generator=g, requires_grad=True)
    side = torch.randn(5, 16, generator=g, requires_grad=True)
    upstream = torch.randn(sum(recv), 16, generator=g)

    plain = comm.all_to_all(x, recv, send, group)
    (plain * upstream).sum().backward()
    want_out, want_grad = plain.detach(), x.grad.clone()
    x.grad = None

    log: list[str] = []
    pending, flight = comm.start_all_to_all(x, recv, send, group)
    between = _Probe.apply(side, flight, log) * 2.0  # "independent work" between the halves
    got = comm.finish_all_to_all(pending, flight)
    assert flight.work is None
    ((got * upstream).sum() + between.sum()).backward()
    assert torch.equal(got.detach(), want_out)
    assert torch.equal(x.grad, want_grad)
    assert torch.equal(side.grad, torch.full_like(side, 2.0))
    assert log == ["forward in flight=True", "backward in flight=True"], log
    assert flight.work is None and flight.buffers == ()


def _logged_step(model: torch.nn.Module, ids: torch.Tensor, overlap: bool) -> tuple[torch.Tensor, list[str]]:
    """One forward + backward, logging the exchanges' launches and waits and the shared experts'
    forward and backward, in the order the host issues them."""
    events: list[str] = []
    for layer in lightning_ep.moe_layers(model):
        layer.overlap_shared = overlap
        shared = layer._modules[layer.child_names["shared_experts"]]
        shared.register_forward_hook(lambda *_: events.append("shared forward"))
        shared.register_full_backward_hook(lambda *_: events.append("shared backward"))
    launch, wait = comm.InFlight.launch, comm.InFlight.wait

    def logged_launch(self: comm.InFlight, *args: Any) -> torch.Tensor:
        events.append("launch")
        return launch(self, *args)

    def logged_wait(self: comm.InFlight) -> torch.Tensor:
        events.append("wait")
        return wait(self)

    comm.InFlight.launch, comm.InFlight.wait = logged_launch, logged_wait  # type: ignore[method-assign]
    try:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    finally:
        comm.InFlight.launch, comm.InFlight.wait = launch, wait  # type: ignore[method-assign]
    return loss.detach(), events


def run_shared_overlap(rank: int, world: int, model_types: list[str], device: str = "cpu") -> None:
    """At degree 2, shared experts run while the dispatch exchange is outstanding (forward and
    backward), and give the losses and gradients of running them after the rows arrived: bitwise on
    the CPU; on CUDA within 1e-5 (fp32), as attention's backward kernels need not be deterministic."""
    if device == "cuda":
        device = f"cuda:{rank}"
        torch.backends.cuda.matmul.allow_tf32 = False
    for model_type in model_types:
        base = tiny_family(model_type).to(device)
        results = []
        for overlap in (True, False):
            model = copy.deepcopy(base)
            mesh = lightning_ep.init_mesh(2, device_type=torch.device(device).type)
            lightning_ep.transform(model, CONFIG, mesh=mesh)
            lightning_ep.shard_model(model, mesh)
            loss, events = _logged_step(model, micro_batch(0, rank).to(device), overlap)
            results.append((loss, {name: full(p.grad) for name, p in model.named_parameters()}))
            layers = len(lightning_ep.moe_layers(model))
            # Per layer, in forward and in (reversed) backward, the dispatch's halves bracket the
            # shared experts when overlapping, and follow or precede them otherwise.
            text = " ".join(events)
            fwd = "launch shared forward wait" if overlap else "launch wait shared forward"
            bwd = "launch shared backward wait" if overlap else "shared backward launch wait"
            assert text.count(fwd) == layers and text.count(bwd) == layers, (model_type, overlap, events)
        (loss_a, grads_a), (loss_b, grads_b) = results
        for name, (a, b) in {"loss": (loss_a, loss_b), **{n: (g, grads_b[n]) for n, g in grads_a.items()}}.items():
            if device == "cpu":
                assert torch.equal(a, b), (model_type, name)
            else:
                assert rel_err(a, b) <= 1e-5, (model_type, name, rel_err(a, b))
