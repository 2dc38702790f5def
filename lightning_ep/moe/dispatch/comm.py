"""Differentiable collectives used by the expert-parallel dispatchers; each backward is the adjoint
collective: all-to-all with the split sizes swapped, all-gather <-> reduce-scatter (sum).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lightning_ep.moe.collectives import all_gather_single, reduce_scatter_single


def all_to_all(
    x: torch.Tensor,
    out_splits: list[int],
    in_splits: list[int],
    group: dist.ProcessGroup,
    replay: torch.Tensor | None = None,
) -> torch.Tensor:
    """Variable-size all-to-all of the rows of ``x``: ``in_splits[j]`` rows go to rank ``j``,
    ``out_splits[j]`` rows come from rank ``j``. Differentiable. ``replay``: the rows this very exchange
    received before (an activation-checkpointing recomputation), returned without communicating;
    backward exchanges as usual."""
    return finish_all_to_all(*start_all_to_all(x, out_splits, in_splits, group, replay))


class InFlight:
    """An all-to-all launched by ``start_all_to_all`` and not yet waited for by ``finish_all_to_all``.
    Work queued between the two overlaps the exchange, in forward and backward alike: the backward of
    ``finish_all_to_all`` launches the reverse exchange and that of ``start_all_to_all`` waits for it;
    autograd runs the backward of whatever was computed between them (created later, so run earlier)
    in between.
    """

    def __init__(self, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup) -> None:
        self.out_splits, self.in_splits, self.group = out_splits, in_splits, group
        self.work: Any = None
        self.buffers: tuple[torch.Tensor, ...] = ()  # kept alive until the exchange is waited for
        self.received: torch.Tensor | None = None  # what the forward exchange brought, if its user keeps it

    def launch(
        self, x: torch.Tensor, out_splits: list[int], in_splits: list[int], replay: torch.Tensor | None = None
    ) -> torch.Tensor:
        if replay is not None:  # the rows are already here (see all_to_all's replay)
            self.buffers = (replay.view_as(replay),) * 2
            return self.buffers[1]
        x = x.contiguous()
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        self.work = dist.all_to_all_single(out, x, out_splits, in_splits, group=self.group, async_op=True)
        self.buffers = (x, out)
        return out

    def wait(self) -> torch.Tensor:
        """Wait (on CUDA: make the current stream wait) and return the received rows."""
        if self.work is not None:
            self.work.wait()
        out = self.buffers[1]
        self.work, self.buffers = None, ()
        return out


def start_all_to_all(
    x: torch.Tensor,
    out_splits: list[int],
    in_splits: list[int],
    group: dist.ProcessGroup,
    replay: torch.Tensor | None = None,
) -> tuple[torch.Tensor, InFlight]:
    """Launch ``all_to_all`` without waiting: a tensor that must only be passed to
    ``finish_all_to_all`` (its rows are still arriving), and the handle. Differentiable."""
    flight = InFlight(out_splits, in_splits, group)
    return _StartAllToAll.apply(x, flight, replay), flight


def finish_all_to_all(pending: torch.Tensor, flight: InFlight) -> torch.Tensor:
    """Wait for the exchange begun by ``start_all_to_all``; the received rows. Differentiable."""
    return _FinishAllToAll.apply(pending, flight)


def all_gather_rows(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Concatenate the equally shaped ``x`` of every rank along dim 0. Backward: reduce-scatter."""
    return _WithAdjoint.apply(x, group, _gather_raw, _reduce_scatter_raw)


def reduce_scatter_rows(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum ``x`` over ranks and keep this rank's equal slice of dim 0. Backward: all-gather."""
    return _WithAdjoint.apply(x, group, _reduce_scatter_raw, _gather_raw)


def _gather_raw(x: torch.Tensor, group: Any) -> torch.Tensor:
    world = dist.get_world_size(group)
    out = x.new_empty((world * x.shape[0], *x.shape[1:]))
    all_gather_single(out, x.contiguous(), group=group)
    return out


def _reduce_scatter_raw(x: torch.Tensor, group: Any) -> torch.Tensor:
    world = dist.get_world_size(group)
    if x.shape[0] % world:
        raise RuntimeError(f"reduce_scatter_rows: {x.shape[0]} rows do not split evenly over {world} ranks.")
    out = x.new_empty((x.shape[0] // world, *x.shape[1:]))
    reduce_scatter_single(out, x.contiguous(), op=dist.ReduceOp.SUM, group=group)
    return out


class _WithAdjoint(torch.autograd.Function):
    """The collective ``forward(x, group)``, whose backward is the ``adjoint`` collective."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, forward: Any, adjoint: Any) -> torch.Tensor:
        ctx.group, ctx.adjoint = group, adjoint
        return forward(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return ctx.adjoint(grad, ctx.group), None, None, None


class _StartAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, flight: InFlight, replay: torch.Tensor | None) -> torch.Tensor:
        ctx.flight = flight
        return flight.launch(x, flight.out_splits, flight.in_splits, replay)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        # ``grad`` only passes control: the gradient is what _FinishAllToAll.backward's reverse
        # exchange is still writing.
        return ctx.flight.wait(), None, None


class _FinishAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, pending: torch.Tensor, flight: InFlight) -> torch.Tensor:
        ctx.flight = flight
        return flight.wait().view_as(pending)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        flight = ctx.flight
        flight.launch(grad, flight.in_splits, flight.out_splits)
        # Autograd wants a gradient shaped like the pending rows; the real one is in flight.
        return grad, None
