"""The all-to-all dispatch with token deduplication (``Execution(token_dedup=True)``): each token
travels once per destination rank.

Legend: T tokens on this rank, H hidden size, K experts per token, D ranks of the expert-parallel
group, S token rows this rank sends (one per token and destination rank that holds at least one of
its K experts, ``S <= D * T``), R token rows it receives, M rows for its local experts (``M >= R``).

Without deduplication a token goes out once per chosen expert: ``T * K`` rows. When the K experts of
a token sit on fewer ranks than K (many small experts per rank), most of those rows are copies. Here
the token is sent once per rank, and the receiving rank copies it to each of its experts the token
chose. The backward is the adjoint: the receiver sums the gradients of a token's copies, the sender
sums what comes back from each rank. Both sums run in fp32 and round once, as the plain dispatch's
sum over the K copies does, so only the order of fp32 additions differs; the gradient travels back
in fp32, ``2x`` the bytes of the forward's rows.

    pending, flight = send_tokens(x_TH, token_S, out_splits, in_splits, group)
    x_MH = receive_tokens(pending, flight, gather_M)     # waits for the rows, copies them

``DedupAllToAllDispatcher`` puts these two in place of the all-to-all's exchange and keeps its
combine; both backwards sum with ``segment_sum``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_ep.moe.dispatch.all_to_all import AllToAllDispatcher, ExchangePlan, regroup
from lightning_ep.moe.dispatch.comm import InFlight
from lightning_ep.moe.dispatch.rows import narrow_keys, sort_by_expert
from lightning_ep.moe.kernels.lazy_triton import lazy_kernels

_BLOCK_H = 1024


@dataclass(frozen=True)
class DedupPlan(ExchangePlan):
    """``ExchangePlan`` plus the token exchange: which token each sent row holds (``token_S``, grouped
    by destination rank, ascending token), the token rows sent to and received from each rank, and
    which received row each local-expert row copies (``gather_M``)."""

    token_S: torch.Tensor
    token_send_splits: list[int]
    token_recv_splits: list[int]
    gather_M: torch.Tensor


class DedupAllToAllDispatcher(AllToAllDispatcher):
    """The all-to-all dispatcher sending each token once per destination rank (see the module docstring)."""

    def plan(self, expert_ids_TK: torch.Tensor) -> DedupPlan:
        """The all-to-all's plan plus the token maps, counted in the same exchange and host read."""
        D, L, T = self.degree, self.num_local_experts, expert_ids_TK.shape[0]
        order_N, counts_E = sort_by_expert(expert_ids_TK, self.num_experts)
        dest_TK = torch.div(expert_ids_TK, L, rounding_mode="floor")
        # [D, T], not [T, D]: the scans below run along the inner dim (a scan along the outer dim
        # of a [T, 2] tensor runs in two threads, a long serial scan on a GPU).
        to_rank_DT = torch.zeros((D, T), dtype=torch.bool, device=dest_TK.device).scatter_(0, dest_TK.T, True)
        sent_DC = torch.cat([counts_E.view(D, L), to_rank_DT.sum(1)[:, None]], dim=1)
        recv_DC, host = self.exchange_counts(sent_DC)
        recv_DL = recv_DC[:, :L]
        send_splits, recv_splits = host[:D], host[D : 2 * D]
        token_send, token_recv = host[2 * D + L : 3 * D + L], host[3 * D + L : 4 * D + L]
        segment_M, regroup_M = regroup(recv_DL, sum(recv_splits))
        # Where each pair's token sits among the rows sent to its destination: the sender knows it,
        # and it travels to the destination in the pairs' own order (one integer per pair).
        num_sent = sum(token_send)
        position_DT = torch.cumsum(to_rank_DT, dim=1) - 1  # row of token t among those sent to d
        first_D = torch.cumsum(sent_DC[:, L], 0) - sent_DC[:, L]
        slot_DT = torch.where(to_rank_DT, first_D[:, None] + position_DT, num_sent)  # unsent: a spare slot
        token_S = torch.empty(num_sent + 1, dtype=torch.int64, device=dest_TK.device)
        token_S.scatter_(0, slot_DT.view(-1), torch.arange(T, device=dest_TK.device).repeat(D))
        position_N = position_DT.T.gather(1, dest_TK).view(-1).index_select(0, order_N)
        position_M = torch.empty(sum(recv_splits), dtype=position_N.dtype, device=dest_TK.device)
        dist.all_to_all_single(position_M, position_N, recv_splits, send_splits, group=self.group)
        # Received pairs are ordered (source rank, local expert); source s's tokens start at first_recv[s].
        first_recv_D = torch.cumsum(recv_DC[:, L], 0) - recv_DC[:, L]
        source_M = torch.div(segment_M, L, rounding_mode="floor")
        gather_M = (position_M + first_recv_D.index_select(0, source_M)).index_select(0, regroup_M)
        plain = self._exchange_plan(order_N, counts_E, recv_DL, host, regroup_M)
        return DedupPlan(
            **vars(plain),
            token_S=token_S[:num_sent],
            token_send_splits=token_send,
            token_recv_splits=token_recv,
            gather_M=gather_M,
        )

    def _send(
        self, x_TH: torch.Tensor, top_k: int, plan: Any, received: torch.Tensor | None
    ) -> tuple[torch.Tensor, InFlight]:
        return send_tokens(x_TH, plan.token_S, plan.token_recv_splits, plan.token_send_splits, self.group, received)

    def _receive(self, pending: torch.Tensor, flight: InFlight, plan: Any) -> tuple[torch.Tensor, torch.Tensor]:
        # One copy of each received token per local expert it chose, already grouped by expert.
        x_MH = receive_tokens(pending, flight, plan.gather_M)
        assert flight.received is not None
        return x_MH, flight.received


def segment_sum(src_JH: torch.Tensor, index_J: torch.Tensor, num_rows: int, dtype: torch.dtype) -> torch.Tensor:
    """``out[r] = sum(src_JH[j] for j in ascending order if index_J[j] == r)``, ``[num_rows, H]``,
    accumulated in fp32 (fp64 for fp64) from zero and rounded once to ``dtype``. The Triton kernel
    (CUDA) adds in the same order as the fp32 ``index_add_`` reference: the same bits, no atomics."""
    hidden = src_JH.shape[1]
    acc_dtype = wire_dtype(src_JH.dtype)
    kernel = _triton() if src_JH.is_cuda and acc_dtype == torch.float32 else None
    if kernel is None:
        acc = torch.zeros((num_rows, hidden), dtype=acc_dtype, device=src_JH.device)
        return acc.index_add_(0, index_J, src_JH.to(acc_dtype)).to(dtype)
    sorted_J, order_J = torch.sort(narrow_keys(index_J, num_rows), stable=True)
    bounds = torch.arange(num_rows + 1, device=index_J.device, dtype=sorted_J.dtype)
    offsets = torch.searchsorted(sorted_J, bounds)
    out = torch.empty((num_rows, hidden), dtype=dtype, device=src_JH.device)
    if num_rows and hidden:
        grid = (num_rows, -(-hidden // _BLOCK_H))
        kernel[grid](src_JH.contiguous(), order_J, offsets, out, H=hidden, BLOCK_H=_BLOCK_H)
    return out


def wire_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype partial gradient sums are added and sent in: at least fp32."""
    return torch.promote_types(dtype, torch.float32)


def send_tokens(
    x_TH: torch.Tensor,
    token_S: torch.Tensor,
    out_splits: list[int],
    in_splits: list[int],
    group: dist.ProcessGroup,
    replay: torch.Tensor | None = None,
) -> tuple[torch.Tensor, InFlight]:
    """``start_all_to_all`` of the rows ``x_TH[token_S]``: a placeholder for ``receive_tokens`` and
    the handle. Backward: waits for the fp32 gradient rows ``receive_tokens``'s backward sent back
    and sums them per token."""
    flight = InFlight(out_splits, in_splits, group)
    return _Send.apply(x_TH, token_S, flight, replay), flight


def receive_tokens(pending: torch.Tensor, flight: InFlight, gather_M: torch.Tensor) -> torch.Tensor:
    """Wait for the rows ``send_tokens`` launched and copy them to the local experts:
    ``x_MH[m] = received_RH[gather_M[m]]`` (``flight.received`` keeps ``received_RH``). Backward:
    sums the gradient of each received row's copies in fp32 and sends it back."""
    return _Receive.apply(pending, flight, gather_M)


class _Send(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x_TH: torch.Tensor, token_S: torch.Tensor, flight: InFlight, replay: torch.Tensor | None
    ) -> torch.Tensor:
        ctx.save_for_backward(token_S)
        ctx.flight, ctx.rows, ctx.dtype = flight, x_TH.shape[0], x_TH.dtype
        rows_SH = x_TH if replay is not None else x_TH.index_select(0, token_S)
        flight.launch(rows_SH, flight.out_splits, flight.in_splits, replay)
        return x_TH.new_empty(0)

    @staticmethod
    def backward(ctx: Any, _grad: torch.Tensor) -> tuple[Any, ...]:
        (token_S,) = ctx.saved_tensors
        grad_SH = ctx.flight.wait()  # in wire_dtype, see _Receive.backward
        return segment_sum(grad_SH, token_S, ctx.rows, ctx.dtype), None, None, None


class _Receive(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, pending: torch.Tensor, flight: InFlight, gather_M: torch.Tensor) -> torch.Tensor:
        received_RH = flight.wait()
        flight.received = received_RH
        ctx.save_for_backward(gather_M)
        ctx.flight, ctx.rows = flight, received_RH.shape[0]
        return received_RH.index_select(0, gather_M)

    @staticmethod
    def backward(ctx: Any, grad_MH: torch.Tensor) -> tuple[Any, ...]:
        (gather_M,) = ctx.saved_tensors
        flight = ctx.flight
        grad_RH = segment_sum(grad_MH, gather_M, ctx.rows, wire_dtype(grad_MH.dtype))
        flight.launch(grad_RH, flight.in_splits, flight.out_splits)
        # The placeholder's gradient only passes control to _Send.backward, which waits for the exchange.
        return grad_MH.new_empty(0), None, None


def _build_kernel(triton: Any, tl: Any) -> Any:
    @triton.jit
    def segment_sum_kernel(src_ptr, order_ptr, offsets_ptr, out_ptr, H: tl.constexpr, BLOCK_H: tl.constexpr):
        # One program per (output row, block of H): out[r] = sum_j src[order[j]], j in [off[r], off[r+1]).
        r = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = offs < H
        start = tl.load(offsets_ptr + r)
        end = tl.load(offsets_ptr + r + 1)
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for j in range(start, end):
            row = tl.load(order_ptr + j).to(tl.int64)
            acc += tl.load(src_ptr + row * H + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + r * H + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)

    return segment_sum_kernel


_triton = lazy_kernels(_build_kernel)
