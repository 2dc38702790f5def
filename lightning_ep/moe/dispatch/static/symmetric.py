"""Dropless expert-parallel dispatch within one node through CUDA symmetric memory
(``Execution(exchange="symmetric_memory")``).

Legend: T tokens on this rank, H hidden size, K experts per token, E global experts, D ranks of
the expert-parallel group, L = E / D experts per rank, N = T * K routed pairs on this rank, M rows
received for the local experts; ``C[s, e]``: pairs of rank ``s`` routed to expert ``e``.

The all-to-all dispatcher copies rows four times per direction: into sorted order, through NCCL,
into expert order, and back. Here each rank instead pulls the rows it needs straight from the other
GPUs' memory, already in the order it needs them (``symm_pull``):

- dispatch: each rank puts its tokens ``[T, H]`` and its sorted pairs in its buffer; the experts'
  rank reads row ``m`` (expert-major, then source rank, then the source's sorted order: the
  all-to-all dispatcher's order) from the token row of its source rank;
- combine: each rank puts its experts' output ``[M, H]`` in its buffer; a token's rank reads its K
  rows and sums them weighted in fp32 (the fused combine's arithmetic);
- backward: the same two pulls with the roles swapped; the experts' rank computes the combine's
  weight gradients, and the token's rank pulls them.

Same numbers as the all-to-all dispatcher, bit for bit (``tests/gpu``). One host read per layer,
like it: the gathered counts ``C``, which size ``M`` and the buffer. With a row budget
(``Execution(row_budget=R)``) the plan is static and there is no host read at all: every rank's
``M`` is padded to ``R`` rows (a padding row has source ``-1``: no kernel reads or writes it, and
the grouped GEMMs stop at the last expert's offset) and the buffer is sized from ``R`` alone. Rows
past ``R`` are left out and noted by the ``RowBudget``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist

from lightning_ep.moe.dispatch.base import Dispatched, Dispatcher, expert_layout, gather_counts
from lightning_ep.moe.dispatch.rows import block_of_rows, inverse_permutation, sort_by_expert
from lightning_ep.moe.dispatch.static.budget import RowBudget
from lightning_ep.moe.dispatch.static.symm_pull import (
    SymmetricWorkspace,
    copy_live_rows,
    pull_combine_backward,
    pull_rows,
    pull_sum,
    region_sizes,
)

if TYPE_CHECKING:
    from lightning_ep.moe.dispatch.kept import KeptExchange
    from lightning_ep.moe.tokens import LayerTokens


class PullPlan(NamedTuple):
    """Where every row of one dispatch is read from, on both sides."""

    #: int32 ``[M]``: source rank of each local row; int32 ``[M]``: its position among the source's sorted pairs.
    src_M: torch.Tensor
    pos_M: torch.Tensor
    #: int32 ``[T, K]``: the rank holding each pair's expert, and the pair's row among that rank's ``M``.
    src_TK: torch.Tensor
    row_TK: torch.Tensor
    #: int32 ``[N]``: this rank's pairs in sorted order (flat ``t * K + k``).
    order_N: torch.Tensor
    counts_L: torch.Tensor
    counts_host: list[int] | None


def plan_pulls(
    counts_DE: torch.Tensor,
    rank: int,
    num_local: int,
    expert_ids_TK: torch.Tensor,
    inverse_N: torch.Tensor,
    rows: int,
    *,
    padded: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``src_M, pos_M`` (receiver side) and ``src_TK, row_TK`` (sender side), int32, from the
    gathered counts ``C = counts_DE``; ``rows`` is this rank's ``M``. No host sync. ``padded``: a
    static plan, ``rows`` being every rank's budget ``R``: rows past the ones received get source -1
    (padding), and pairs whose row on their expert's rank is ``R`` or more (over budget) get row -1.
    """
    D, L = counts_DE.shape[0], num_local
    device = counts_DE.device
    start_DE = torch.cumsum(counts_DE, 1) - counts_DE  # where expert e's pairs start among rank s's sorted pairs
    # Receiver: rows in segments (local expert l, source s) of C[s, rank * L + l] rows each.
    sizes = counts_DE[:, rank * L : (rank + 1) * L].T.reshape(-1)
    ends = torch.cumsum(sizes, 0)
    arange_M = torch.arange(rows, device=device)
    if padded:  # the segment of each row by binary search; rows past the last are padding
        segment_M = block_of_rows(ends, arange_M)
    else:
        segment_M = torch.repeat_interleave(torch.arange(L * D, device=device), sizes, output_size=rows)
    first = ends - sizes
    src_M = segment_M % D
    expert_M = rank * L + torch.div(segment_M, D, rounding_mode="floor")
    pos_M = start_DE[src_M, expert_M] + arange_M - first[segment_M]
    if padded:
        src_M = torch.where(arange_M < ends[-1], src_M, -1)
    # Sender: expert e's rows start at block[e] on its rank; the lower ranks' pairs come first.
    total_E = counts_DE.sum(0)
    before_E = torch.cumsum(total_E, 0) - total_E
    block_E = before_E - before_E.view(D, L)[:, :1].expand(D, L).reshape(-1)
    offset_E = block_E + counts_DE[:rank].sum(0) - start_DE[rank]
    ids_N = expert_ids_TK.reshape(-1)
    row_TK = (offset_E.index_select(0, ids_N) + inverse_N).view_as(expert_ids_TK)
    if padded:
        row_TK = torch.where(row_TK < rows, row_TK, -1)
    src_TK = torch.div(expert_ids_TK, L, rounding_mode="floor")
    as32 = torch.int32
    return src_M.to(as32), pos_M.to(as32), src_TK.to(as32), row_TK.to(as32)


def sort_pairs(expert_ids_TK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``sort_by_expert`` of this rank's pairs, and its inverse permutation ``inverse_N``. No host sync."""
    order_N, counts_E = sort_by_expert(expert_ids_TK, num_experts)
    return order_N, counts_E, inverse_permutation(order_N)


def static_plan(
    counts_DE: torch.Tensor,
    rank: int,
    num_local: int,
    expert_ids_TK: torch.Tensor,
    order_N: torch.Tensor,
    inverse_N: torch.Tensor,
    budget: int,
) -> tuple[torch.Tensor, ...]:
    """The plan padded to ``budget`` rows (``plan_pulls(padded=True)``), the sorted pairs as int32,
    the local experts' row counts clamped to the budget, and the rows received per rank. Every shape
    follows from the inputs and ``budget``, so ``torch.compile`` can fuse it (``compile_plan``)."""
    D, L = counts_DE.shape[0], num_local
    src_M, pos_M, src_TK, row_TK = plan_pulls(counts_DE, rank, L, expert_ids_TK, inverse_N, budget, padded=True)
    received_DL = counts_DE.view(D, D, L).sum(0)  # rows arriving at each rank, per local expert
    # The experts' blocks end within the budget's rows (only a rank over budget has more).
    ends_L = torch.cumsum(received_DL[rank], 0).clamp(max=budget)
    counts_L = torch.diff(ends_L, prepend=ends_L.new_zeros(1))
    return src_M, pos_M, src_TK, row_TK, order_N.to(torch.int32), counts_L, received_DL.sum(1)


class SymmetricMemoryDispatcher(Dispatcher):
    """Dropless dispatch by pulls through symmetric memory (see the module docstring). Needs CUDA,
    Triton and an NCCL group whose ranks share one node with peer access between their GPUs.
    ``max_tokens_per_rank``: the static, sync-free plan with that row budget ``R`` (each rank's tokens
    must not exceed it either); ``None`` reads the counts on the host and sizes every buffer to fit.
    """

    group: dist.ProcessGroup

    def __init__(self, num_experts: int, group: dist.ProcessGroup, max_tokens_per_rank: int | None = None) -> None:
        backend = dist.get_backend(group)
        if backend != "nccl":
            raise ValueError(
                "Execution(exchange='symmetric_memory') needs CUDA GPUs in an NCCL process group, got the "
                f"{backend!r} backend; use exchange='collective' (the all-to-all runs anywhere)."
            )
        self.group, self.num_experts = group, num_experts
        self.degree, self.rank, self.num_local_experts = expert_layout(num_experts, group)
        self.budget = RowBudget(max_tokens_per_rank) if max_tokens_per_rank is not None else None
        # Eager by default; ``compile_plan`` swaps in compiled versions of the same functions.
        self._sort_pairs_fn = sort_pairs
        self._static_plan_fn = static_plan

    def compile_plan(self, **compile_kwargs: Any) -> None:
        """``torch.compile`` the pair sort and the static plan: a few fused kernels, not some fifty."""
        self._sort_pairs_fn = torch.compile(sort_pairs, **compile_kwargs)
        self._static_plan_fn = torch.compile(static_plan, **compile_kwargs)

    @property
    def static_plan(self) -> bool:
        return self.budget is not None

    def dispatch(
        self,
        x_TH: torch.Tensor,
        expert_ids_TK: torch.Tensor,
        weights_TK: torch.Tensor,
        tokens: LayerTokens | None = None,
        keep: KeptExchange | None = None,
    ) -> Dispatched:
        if self.budget is not None and not self.dynamic:
            if self.budget.raise_at_dispatch:
                self.budget.check(wait=False)  # an earlier layer's excess, if its note has reached the host
            dispatched, loads_D = self.dispatch_static(x_TH, expert_ids_TK)
            self.budget.note(loads_D)
            return dispatched
        D, L, K = self.degree, self.num_local_experts, expert_ids_TK.shape[1]
        workspace = SymmetricWorkspace.of(self.group, x_TH.device)
        order_N, counts_E, inverse_N = self._sort_pairs_fn(expert_ids_TK, self.num_experts)
        counts_DE = gather_counts(counts_E, self.group)
        counts_host_DE = counts_DE.cpu()  # the one host sync: every rank's counts
        loads_D = counts_host_DE.view(D, D, L).sum(dim=(0, 2))  # rows arriving at each rank
        tokens_D = torch.div(counts_host_DE.sum(1), K, rounding_mode="floor")
        rows = int(loads_D[self.rank])
        workspace.reserve(region_sizes(int(tokens_D.max()), int(loads_D.max()), K, x_TH.shape[1], x_TH.element_size()))
        src_M, pos_M, src_TK, row_TK = plan_pulls(counts_DE, self.rank, L, expert_ids_TK, inverse_N, rows)
        mine = slice(self.rank * L, (self.rank + 1) * L)
        counts_L, counts_host = counts_DE[:, mine].sum(0), counts_host_DE[:, mine].sum(0).tolist()
        plan = PullPlan(src_M, pos_M, src_TK, row_TK, order_N.to(torch.int32), counts_L, counts_host)
        x_MH = _PullDispatch.apply(x_TH.contiguous(), plan, workspace)
        return Dispatched(x_MH, counts_L, counts_E, plan, counts_host=counts_host)

    def dispatch_static(self, x_TH: torch.Tensor, expert_ids_TK: torch.Tensor) -> tuple[Dispatched, torch.Tensor]:
        """The dispatch on the plan padded to the row budget ``R``, and the rows received per rank
        ``loads_D`` (int64, device) for ``RowBudget.note``; no host read or state (``Dispatcher``)."""
        if self.budget is None:
            raise ValueError("dispatch_static needs a row budget: Execution(row_budget=...).")
        K, R = expert_ids_TK.shape[1], self.budget.budget
        assert R is not None  # an int budget (automatic ones are the padded all-to-all's)
        T, H = x_TH.shape
        if T > R:
            raise ValueError(
                f"Execution(row_budget={R}) is below this rank's {T} tokens; with "
                "exchange='symmetric_memory' it sizes the buffer of every rank's tokens too. Raise it (rows "
                f"arriving at a rank's experts average tokens x top_k = {T * K} here)."
            )
        workspace = SymmetricWorkspace.of(self.group, x_TH.device)
        order_N, counts_E, inverse_N = self._sort_pairs_fn(expert_ids_TK, self.num_experts)
        counts_DE = gather_counts(counts_E, self.group)
        workspace.reserve(region_sizes(R, R, K, H, x_TH.element_size()))  # the same sizes on every rank
        src_M, pos_M, src_TK, row_TK, order32_N, counts_L, loads_D = self._static_plan_fn(
            counts_DE, self.rank, self.num_local_experts, expert_ids_TK, order_N, inverse_N, R
        )
        plan = PullPlan(src_M, pos_M, src_TK, row_TK, order32_N, counts_L, None)
        x_MH = _PullDispatch.apply(x_TH.contiguous(), plan, workspace)
        return Dispatched(x_MH, plan.counts_L, counts_E, plan), loads_D

    def combine(self, y_MH: torch.Tensor, weights_TK: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        workspace = SymmetricWorkspace.of(self.group, y_MH.device)
        return _PullCombine.apply(y_MH.contiguous(), weights_TK.contiguous(), dispatched.plan, workspace)


class _PullDispatch(torch.autograd.Function):
    """``x_MH``: the rows of every rank's tokens routed to this rank's experts, in expert order.
    Backward: the sum of each token's K row gradients, pulled from the experts' ranks."""

    @staticmethod
    def forward(ctx: Any, x_TH: torch.Tensor, plan: PullPlan, ws: SymmetricWorkspace) -> torch.Tensor:
        T, H = x_TH.shape
        ws.region("tokens", (T, H), x_TH.dtype).copy_(x_TH)
        ws.region("order", (plan.order_N.numel(),), torch.int32).copy_(plan.order_N)
        ws.barrier()
        x_MH = x_TH.new_empty((plan.src_M.numel(), H))
        pull_rows(ws, ws.at["tokens"], ws.at["order"], plan.src_M, plan.pos_M, x_MH, plan.src_TK.shape[1])
        ctx.plan, ctx.ws, ctx.tokens = plan, ws, T
        return x_MH

    @staticmethod
    def backward(ctx: Any, grad_MH: torch.Tensor) -> tuple[Any, ...]:
        plan, ws = ctx.plan, ctx.ws
        grad_MH = grad_MH.contiguous()
        _offer_rows(ws, grad_MH, plan)
        ws.barrier()
        grad_TH = grad_MH.new_empty((ctx.tokens, grad_MH.shape[1]))
        pull_sum(ws, ws.at["rows"], plan.src_TK, plan.row_TK, None, grad_TH)
        return grad_TH, None, None


class _PullCombine(torch.autograd.Function):
    """``out[t] = sum_k weights[t, k] * y[row of (t, k)]``, the rows pulled from the experts' ranks.
    Backward: each local row's gradient (and its weight's) from its token's rank."""

    @staticmethod
    def forward(
        ctx: Any, y_MH: torch.Tensor, weights_TK: torch.Tensor, plan: PullPlan, ws: SymmetricWorkspace
    ) -> torch.Tensor:
        _offer_rows(ws, y_MH, plan)
        ws.barrier()
        out_TH = y_MH.new_empty((weights_TK.shape[0], y_MH.shape[1]))
        pull_sum(ws, ws.at["rows"], plan.src_TK, plan.row_TK, weights_TK, out_TH)
        ctx.save_for_backward(y_MH, weights_TK)
        ctx.plan, ctx.ws = plan, ws
        return out_TH

    @staticmethod
    def backward(ctx: Any, grad_TH: torch.Tensor) -> tuple[Any, ...]:
        y_MH, weights_TK = ctx.saved_tensors
        plan, ws = ctx.plan, ctx.ws
        N = weights_TK.numel()
        ws.region("tokens", tuple(grad_TH.shape), y_MH.dtype).copy_(grad_TH)
        ws.region("order", (N,), torch.int32).copy_(plan.order_N)
        ws.region("weights", (N,), torch.float32).copy_(weights_TK.reshape(-1))
        ws.barrier()
        grad_y_MH = torch.empty_like(y_MH)
        grad_w_M = ws.region("grad_w", (y_MH.shape[0],), torch.float32)
        pull_combine_backward(ws, ws.at, plan.src_M, plan.pos_M, y_MH, grad_y_MH, grad_w_M, weights_TK.shape[1])
        ws.barrier()
        # Each pair's weight gradient, pulled from its expert's rank: a pull of one fp32 per pair.
        grad_w_N1 = torch.empty((N, 1), dtype=torch.float32, device=y_MH.device)
        pull_sum(ws, ws.at["grad_w"], plan.src_TK.view(N, 1), plan.row_TK.view(N, 1), None, grad_w_N1)
        return grad_y_MH, grad_w_N1.view(weights_TK.shape).to(weights_TK.dtype), None, None


def _offer_rows(ws: SymmetricWorkspace, x_MH: torch.Tensor, plan: PullPlan) -> None:
    """Put this rank's rows ``[M, H]`` in its region ``rows``; of a static plan's ``R`` rows only the
    received ones (its padding rows are never pulled)."""
    region = ws.region("rows", tuple(x_MH.shape), x_MH.dtype)
    if plan.counts_host is None:  # padded to the row budget
        copy_live_rows(region, x_MH, plan.src_M)
    else:
        region.copy_(x_MH)
