"""Dropless expert-parallel dispatch within one node through CUDA symmetric memory
(``MoEConfig.symmetric_memory_dispatch``).

Legend: T tokens on this rank, H hidden size, K experts per token, E global experts, D ranks of
the expert-parallel group, L = E / D experts per rank, N = T * K routed pairs on this rank, M rows
received for the local experts; ``C[s, e]``: pairs of rank ``s`` routed to expert ``e``.

The all-to-all dispatcher copies rows four times per direction: into sorted order, through NCCL,
into expert order, and back. Here each rank instead reads (pulls) the rows it needs straight
from the other GPUs' memory, already in the order it needs them (``lightning_ep.moe.symm_pull``):

- dispatch: each rank puts its tokens ``[T, H]`` and its sorted pairs in its buffer; the experts'
  rank reads row ``m`` (expert-major, then source rank, then the source's sorted order: the
  all-to-all dispatcher's order) from the token row of its source rank;
- combine: each rank puts its experts' output ``[M, H]`` in its buffer; a token's rank reads its K
  rows and sums them weighted in fp32 (the fused combine's arithmetic);
- backward: the same two pulls with the roles swapped; the experts' rank computes the combine's
  weight gradients, and the token's rank pulls them.

Every rank only ever writes its own buffer; remote memory is only read.

Same numbers as the all-to-all dispatcher, bit for bit (``tests/gpu``). One host read per layer,
like it: the gathered counts ``C``, which size ``M`` and the buffer.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from lightning_ep.moe.dispatch import Dispatched, inverse_permutation, sort_by_expert
from lightning_ep.moe.dispatch_ep import _check_budget, expert_layout
from lightning_ep.moe.symm_pull import SymmetricWorkspace, pull_combine_backward, pull_rows, pull_sum, region_sizes


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
    counts_host: list[int]


def plan_pulls(
    counts_DE: torch.Tensor, rank: int, num_local: int, expert_ids_TK: torch.Tensor, inverse_N: torch.Tensor, rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pull indices, from the gathered counts ``C = counts_DE`` (no host sync; ``rows`` is
    this rank's ``M``).

    Returns ``src_M, pos_M`` (receiver side) and ``src_TK, row_TK`` (sender side), int32.
    """
    D, L = counts_DE.shape[0], num_local
    device = counts_DE.device
    start_DE = torch.cumsum(counts_DE, 1) - counts_DE  # where expert e's pairs start among rank s's sorted pairs
    # Receiver: rows in segments (local expert l, source s) of C[s, rank * L + l] rows each.
    sizes = counts_DE[:, rank * L : (rank + 1) * L].T.reshape(-1)
    segment_M = torch.repeat_interleave(torch.arange(L * D, device=device), sizes, output_size=rows)
    first = torch.cumsum(sizes, 0) - sizes
    src_M = segment_M % D
    expert_M = rank * L + torch.div(segment_M, D, rounding_mode="floor")
    pos_M = start_DE[src_M, expert_M] + torch.arange(rows, device=device) - first[segment_M]
    # Sender: expert e's rows start at block[e] on its rank; the lower ranks' pairs come first.
    total_E = counts_DE.sum(0)
    before_E = torch.cumsum(total_E, 0) - total_E
    block_E = before_E - before_E.view(D, L)[:, :1].expand(D, L).reshape(-1)
    offset_E = block_E + counts_DE[:rank].sum(0) - start_DE[rank]
    ids_N = expert_ids_TK.reshape(-1)
    row_TK = (offset_E.index_select(0, ids_N) + inverse_N).view_as(expert_ids_TK)
    src_TK = torch.div(expert_ids_TK, L, rounding_mode="floor")
    as32 = torch.int32
    return src_M.to(as32), pos_M.to(as32), src_TK.to(as32), row_TK.to(as32)


class SymmetricMemoryDispatcher:
    """Dropless dispatch by pulls through symmetric memory (see the module docstring).

    Needs CUDA, an NCCL group whose ranks share one node with peer access between their GPUs, and
    Triton. ``max_tokens_per_rank`` as in ``AllToAllDispatcher``.
    """

    keeps_exchanges = False

    def __init__(self, num_experts: int, group: dist.ProcessGroup, max_tokens_per_rank: int | None = None) -> None:
        backend = dist.get_backend(group)
        if backend != "nccl":
            raise ValueError(
                f"MoEConfig.symmetric_memory_dispatch=True needs CUDA GPUs in an NCCL process group, got the "
                f"{backend!r} backend; set symmetric_memory_dispatch=False (the all-to-all dispatcher runs anywhere)."
            )
        self.group, self.num_experts = group, num_experts
        self.degree, self.rank, self.num_local_experts = expert_layout(num_experts, group)
        self.max_tokens_per_rank = max_tokens_per_rank

    def dispatch(self, x_TH: torch.Tensor, expert_ids_TK: torch.Tensor) -> Dispatched:
        workspace = SymmetricWorkspace.of(self.group, x_TH.device)
        plan, counts_E = self._plan(expert_ids_TK, x_TH.shape[1], x_TH.element_size(), workspace)
        x_MH = _PullDispatch.apply(x_TH.contiguous(), plan, workspace)
        return Dispatched(x_MH, plan.counts_L, counts_E, {"plan": plan}, counts_host=plan.counts_host)

    def combine(self, y_MH: torch.Tensor, weights_TK: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        workspace = SymmetricWorkspace.of(self.group, y_MH.device)
        return _PullCombine.apply(y_MH.contiguous(), weights_TK.contiguous(), dispatched.state["plan"], workspace)

    def _plan(
        self, expert_ids_TK: torch.Tensor, hidden: int, element_size: int, workspace: SymmetricWorkspace
    ) -> tuple[PullPlan, torch.Tensor]:
        D, L, K = self.degree, self.num_local_experts, expert_ids_TK.shape[1]
        order_N, counts_E = sort_by_expert(expert_ids_TK, self.num_experts)
        counts_DE = torch.empty((D, self.num_experts), dtype=counts_E.dtype, device=counts_E.device)
        dist.all_gather_into_tensor(counts_DE, counts_E, group=self.group)
        counts_host_DE = counts_DE.cpu()  # the one host sync: every rank's counts
        loads_D = counts_host_DE.view(D, D, L).sum(dim=(0, 2))  # rows arriving at each rank
        tokens_D = torch.div(counts_host_DE.sum(1), K, rounding_mode="floor")
        if self.max_tokens_per_rank is not None:
            _check_budget(loads_D.tolist(), self.max_tokens_per_rank)
        rows = int(loads_D[self.rank])
        workspace.reserve(region_sizes(int(tokens_D.max()), int(loads_D.max()), K, hidden, element_size))
        inverse_N = inverse_permutation(order_N)
        src_M, pos_M, src_TK, row_TK = plan_pulls(counts_DE, self.rank, L, expert_ids_TK, inverse_N, rows)
        mine = slice(self.rank * L, (self.rank + 1) * L)
        counts_L, counts_host = counts_DE[:, mine].sum(0), counts_host_DE[:, mine].sum(0).tolist()
        plan = PullPlan(src_M, pos_M, src_TK, row_TK, order_N.to(torch.int32), counts_L, counts_host)
        return plan, counts_E


class _PullDispatch(torch.autograd.Function):
    """``x_MH``: the rows of every rank's tokens routed to this rank's experts, in expert order.
    Backward: the sum of each token's K row gradients, pulled from the experts' ranks."""

    @staticmethod
    def forward(ctx: Any, x_TH: torch.Tensor, plan: PullPlan, ws: SymmetricWorkspace) -> torch.Tensor:
        T, H = x_TH.shape
        ws.region(ws.at["tokens"], (T, H), x_TH.dtype).copy_(x_TH)
        ws.region(ws.at["order"], (plan.order_N.numel(),), torch.int32).copy_(plan.order_N)
        ws.barrier()
        x_MH = x_TH.new_empty((plan.src_M.numel(), H))
        pull_rows(ws, ws.at["tokens"], ws.at["order"], plan.src_M, plan.pos_M, x_MH, plan.src_TK.shape[1])
        ctx.plan, ctx.ws, ctx.tokens = plan, ws, T
        return x_MH

    @staticmethod
    def backward(ctx: Any, grad_MH: torch.Tensor) -> tuple[Any, ...]:
        plan, ws = ctx.plan, ctx.ws
        grad_MH = grad_MH.contiguous()
        ws.region(ws.at["rows"], tuple(grad_MH.shape), grad_MH.dtype).copy_(grad_MH)
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
        ws.region(ws.at["rows"], tuple(y_MH.shape), y_MH.dtype).copy_(y_MH)
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
        ws.region(ws.at["tokens"], tuple(grad_TH.shape), y_MH.dtype).copy_(grad_TH)
        ws.region(ws.at["order"], (N,), torch.int32).copy_(plan.order_N)
        ws.region(ws.at["weights"], (N,), torch.float32).copy_(weights_TK.reshape(-1))
        ws.barrier()
        grad_y_MH = torch.empty_like(y_MH)
        grad_w_M = ws.region(ws.at["grad_w"], (y_MH.shape[0],), torch.float32)
        pull_combine_backward(ws, ws.at, plan.src_M, plan.pos_M, y_MH, grad_y_MH, grad_w_M, weights_TK.shape[1])
        ws.barrier()
        # Each pair's weight gradient, pulled from its expert's rank: a pull of one fp32 per pair.
        grad_w_N1 = torch.empty((N, 1), dtype=torch.float32, device=y_MH.device)
        pull_sum(ws, ws.at["grad_w"], plan.src_TK.view(N, 1), plan.row_TK.view(N, 1), None, grad_w_N1)
        return grad_y_MH, grad_w_N1.view(weights_TK.shape).to(weights_TK.dtype), None, None
