"""The dispatcher interface: move routed token rows to the experts that own them and bring the outputs back.

Legend: T tokens on this rank, H hidden size, K experts per token, E global experts, D ranks of the
expert-parallel group, L = E / D experts held per rank, N = T * K routed rows on this rank, M rows
received for the local experts.

Every dispatcher has the same two calls; what ``combine`` needs travels in ``Dispatched.plan`` (a
frozen plan of the dispatcher's own), and what it keeps between calls (a row budget) it declares:

    dispatched = dispatcher.dispatch(x_TH, expert_ids_TK, weights_TK, tokens)  # rows by local expert
    y_MH = experts(dispatched.x_MH, dispatched.counts_L, dispatched.counts_host)
    out_TH = dispatcher.combine(y_MH, weights_TK, dispatched)   # weighted sum over the K choices

``LocalDispatcher`` (one process) is the reference every other one equals. Process groups are
always passed in by the caller.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist

from lightning_ep.moe.collectives import all_gather_single
from lightning_ep.moe.dispatch.rows import gather_rows, inverse_permutation, sort_by_expert, weighted_unsort
from lightning_ep.moe.layout import Layout

if TYPE_CHECKING:
    from lightning_ep.moe.dispatch.kept import KeptExchange
    from lightning_ep.moe.dispatch.static.budget import RowBudget
    from lightning_ep.moe.tokens import LayerTokens


class Dispatched:
    """Rows for the local experts, plus what ``combine`` needs to undo the dispatch. A dispatcher may
    return while the rows are still travelling (``arrive``): the first read of ``x_MH`` waits for
    them, so work done between ``dispatch`` and that read (the layer's shared experts) overlaps the
    exchange.

    Attributes:
        x_MH: rows sorted by local expert.
        counts_L: rows per local expert (int64, device), summing to ``M``.
        tokens_per_expert_E: tokens this rank routed to each global expert (int64, device).
        plan: the dispatcher's frozen record of this dispatch, read by its ``combine``.
        counts_host: ``counts_L`` as host integers when the dispatcher read them anyway (its one
            host sync), else ``None``; the experts may then pick a path that needs them.
        kept_per_expert_E: the pairs each expert kept, where a capacity dropped some (``None``: all).
        tokens_dropped: (token, expert) pairs the capacity dropped (0-dim int64), or ``None``.
    """

    def __init__(
        self,
        x_MH: torch.Tensor | None,
        counts_L: torch.Tensor,
        tokens_per_expert_E: torch.Tensor,
        plan: Any = None,
        *,
        arrive: Callable[[], torch.Tensor] | None = None,
        counts_host: list[int] | None = None,
        kept_per_expert_E: torch.Tensor | None = None,
        tokens_dropped: torch.Tensor | None = None,
    ) -> None:
        if (x_MH is None) == (arrive is None):
            raise ValueError("Dispatched needs exactly one of x_MH and arrive.")
        self._x_MH, self._arrive = x_MH, arrive
        self.counts_L, self.counts_host, self.tokens_per_expert_E = counts_L, counts_host, tokens_per_expert_E
        self.plan = plan
        self.kept_per_expert_E, self.tokens_dropped = kept_per_expert_E, tokens_dropped

    @property
    def x_MH(self) -> torch.Tensor:
        if self._arrive is not None:
            self._x_MH, self._arrive = self._arrive(), None
        assert self._x_MH is not None
        return self._x_MH


class Dispatcher(abc.ABC):
    """The interface every dispatcher implements, with the capabilities it declares. ``dispatch``
    uses what it needs of the routing weights and ``tokens`` (``LayerTokens``: padding mask,
    positions, every rank's token count; ``None``: all real, equal counts); ``keep`` only where
    ``keeps_exchanges``."""

    num_experts: int
    num_local_experts: int
    #: The expert-parallel group; ``None`` on one process.
    group: dist.ProcessGroup | None = None
    #: ``dispatch(keep=...)`` records an exchange and replays it in a recomputation (``kept.KeptExchange``).
    keeps_exchanges: ClassVar[bool] = False
    #: ``dispatch`` needs every rank's token count (``tokens.group_tokens``).
    needs_group_tokens: bool = False
    #: The row budget of a static plan (``static.budget.RowBudget``), or ``None``.
    budget: RowBudget | None = None
    #: Take the dynamic plan despite a budget: the budget fallback's rerun of a step over budget.
    dynamic: bool = False

    @abc.abstractmethod
    def dispatch(
        self,
        x_TH: torch.Tensor,
        expert_ids_TK: torch.Tensor,
        weights_TK: torch.Tensor,
        tokens: LayerTokens | None = None,
        keep: KeptExchange | None = None,
    ) -> Dispatched:
        """The rows of ``x_TH`` for this rank's experts, grouped by local expert."""

    @abc.abstractmethod
    def combine(self, y_MH: torch.Tensor, weights_TK: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        """``out_TH``: each token's expert outputs ``y_MH`` brought back and summed, weighted by ``weights_TK``."""

    @property
    def static_plan(self) -> bool:
        """Whether ``dispatch_static`` runs: every shape follows from ``T`` and ``K`` and nothing is read
        back to the host, so a CUDA graph can capture it (``lightning_ep.moe.graphs``)."""
        return False

    def dispatch_static(
        self, x_TH: torch.Tensor, expert_ids_TK: torch.Tensor
    ) -> tuple[Dispatched, torch.Tensor | None]:
        """``dispatch`` on the static plan, without host-side bookkeeping, and the rows received per
        rank for the budget's note (``None``: no budget)."""
        raise NotImplementedError(f"{type(self).__name__} has no static plan.")

    def compile_plan(self, **compile_kwargs: Any) -> None:
        """Run the plan's index arithmetic through ``torch.compile``; a no-op where nothing is worth it."""
        return None

    def raise_if_over_budget(self) -> None:
        """Raise if a layer's rows exceeded the row budget since the last check (one host sync)."""
        if self.budget is not None:
            self.budget.check(wait=True)


def expert_layout(num_experts: int, group: dist.ProcessGroup | None) -> tuple[int, int, int]:
    """``(D, rank, L)`` of an expert-parallel group (``None``: one process)."""
    degree = dist.get_world_size(group) if group is not None else 1
    local = Layout(world=degree, degree=degree).local_experts(num_experts)
    return degree, dist.get_rank(group) if group is not None else 0, local


def gather_counts(counts_E: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's pairs per expert, ``[D, E]`` on the device (no host sync)."""
    world = dist.get_world_size(group)
    flat = counts_E.new_empty(world * counts_E.numel())  # gloo gathers into a flat tensor only
    all_gather_single(flat, counts_E, group=group)
    return flat.view(world, -1)


@dataclass(frozen=True)
class SortPlan:
    """This rank's pairs sorted by expert: ``order_N`` (sorted position -> flat pair) and its inverse."""

    order_N: torch.Tensor
    inverse_N: torch.Tensor


class LocalDispatcher(Dispatcher):
    """All experts on this process: sort rows by expert, run, unsort and combine.

    Its shapes depend on ``T`` and ``K`` alone and it reads nothing back to the host, so its plan is
    static (CUDA graphs capture it at degree 1)."""

    def __init__(self, num_experts: int) -> None:
        self.num_experts = self.num_local_experts = num_experts

    def dispatch(
        self,
        x_TH: torch.Tensor,
        expert_ids_TK: torch.Tensor,
        weights_TK: torch.Tensor,
        tokens: LayerTokens | None = None,
        keep: KeptExchange | None = None,
    ) -> Dispatched:
        return self.dispatch_static(x_TH, expert_ids_TK)[0]

    @property
    def static_plan(self) -> bool:
        return True

    def dispatch_static(self, x_TH: torch.Tensor, expert_ids_TK: torch.Tensor) -> tuple[Dispatched, None]:
        order_N, counts_E = sort_by_expert(expert_ids_TK, self.num_experts)
        inverse_N = inverse_permutation(order_N)
        x_NH = gather_rows(x_TH, order_N, expert_ids_TK.shape[1], inverse_N)
        return Dispatched(x_NH, counts_E, counts_E, SortPlan(order_N, inverse_N)), None

    def combine(self, y_MH: torch.Tensor, weights_TK: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        plan: SortPlan = dispatched.plan
        return weighted_unsort(y_MH, plan.inverse_N, plan.order_N, weights_TK)
