"""The dropless all-to-all dispatcher: the plain path of expert parallelism.

Legend: T tokens on this rank, H hidden size, K experts per token, E global experts, D ranks of
the expert-parallel group, L = E / D experts per rank (rank ``r`` owns experts ``r*L .. r*L+L-1``),
N = T * K routed rows on this rank, M rows received for the local experts.

Token deduplication (``dedup``), the padded static plan (``static.padded``) and the replay of a kept
exchange (``kept``) build on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from lightning_ep.moe.collectives import all_gather_single
from lightning_ep.moe.dispatch.base import Dispatched, Dispatcher, expert_layout
from lightning_ep.moe.dispatch.comm import all_to_all, finish_all_to_all, start_all_to_all
from lightning_ep.moe.dispatch.rows import (
    gather_rows,
    inverse_permutation,
    narrow_keys,
    permute_rows,
    sort_by_expert,
    weighted_unsort,
)
from lightning_ep.moe.dispatch.static.budget import over_budget_message

if TYPE_CHECKING:
    from lightning_ep.moe.dispatch.comm import InFlight
    from lightning_ep.moe.dispatch.kept import KeptExchange
    from lightning_ep.moe.tokens import LayerTokens


@dataclass(frozen=True)
class ExchangePlan:
    """One dispatch: the pairs' sort order, the split sizes read on the host, the regrouping of the
    received rows by local expert (each with its inverse), the rows per local expert, pairs per expert."""

    order_N: torch.Tensor
    inverse_N: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    regroup_M: torch.Tensor
    unregroup_M: torch.Tensor
    counts_L: torch.Tensor
    counts_host: list[int]
    counts_E: torch.Tensor


@dataclass(frozen=True)
class _Call:
    """What a dispatch hands its combine: the plan, and the kept exchange it records or replays."""

    plan: Any
    keep: KeptExchange | None
    replay: bool


class AllToAllDispatcher(Dispatcher):
    """Tokens travel to the rank of their expert and back by variable-size all-to-all.

    Forward: sort pairs by expert -> exchange per-expert counts -> one host read of the split sizes
    -> all-to-all of the rows -> regroup by local expert. ``dispatch`` returns while the rows travel
    (``Dispatched.x_MH`` waits for them on first read). Combine: the exact reverse, then the weighted
    sum over the K choices on the token's own rank. ``max_tokens_per_rank`` (``MoEConfig``): a guard;
    a layer whose routing sends more rows to one rank raises before anything is exchanged.
    """

    group: dist.ProcessGroup

    keeps_exchanges = True

    def __init__(self, num_experts: int, group: dist.ProcessGroup, max_tokens_per_rank: int | None = None) -> None:
        self.group, self.num_experts = group, num_experts
        self.degree, self.rank, self.num_local_experts = expert_layout(num_experts, group)
        self.max_tokens_per_rank = max_tokens_per_rank

    def dispatch(
        self,
        x_TH: torch.Tensor,
        expert_ids_TK: torch.Tensor,
        weights_TK: torch.Tensor,
        tokens: LayerTokens | None = None,
        keep: KeptExchange | None = None,
    ) -> Dispatched:
        """Rows for the local experts, still travelling when this returns. ``keep``: see ``kept.KeptExchange``."""
        replay = keep is not None and keep.complete
        plan = keep.plan if keep is not None and replay else self.plan(expert_ids_TK)
        if keep is not None and not replay:
            keep.plan = plan
        pending, flight = self._send(x_TH, expert_ids_TK.shape[1], plan, keep.received if keep and replay else None)

        def arrive() -> torch.Tensor:
            x_MH, received = self._receive(pending, flight, plan)
            if keep is not None and not replay:
                keep.received = received.detach()
            return x_MH

        call = _Call(plan, keep, replay)
        return Dispatched(None, plan.counts_L, plan.counts_E, call, arrive=arrive, counts_host=plan.counts_host)

    def combine(self, y_MH: torch.Tensor, weights_TK: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        call: _Call = dispatched.plan
        plan, keep = call.plan, call.keep
        y_recv_MH = permute_rows(y_MH, plan.unregroup_M, plan.regroup_M)
        replayed = keep.combined if keep is not None and call.replay else None
        y_NH = all_to_all(y_recv_MH, plan.send_splits, plan.recv_splits, self.group, replayed)
        if keep is not None and not call.replay:
            keep.combined = y_NH.detach()
        return weighted_unsort(y_NH, plan.inverse_N, plan.order_N, weights_TK)

    def plan(self, expert_ids_TK: torch.Tensor) -> ExchangePlan:
        """Sort order, split sizes (the one host sync) and regrouping of one dispatch."""
        D, L = self.degree, self.num_local_experts
        order_N, counts_E = sort_by_expert(expert_ids_TK, self.num_experts)
        recv_DL, host = self.exchange_counts(counts_E.view(D, L))
        _, regroup_M = regroup(recv_DL, sum(host[D : 2 * D]))
        return self._exchange_plan(order_N, counts_E, recv_DL, host, regroup_M)

    def _exchange_plan(
        self,
        order_N: torch.Tensor,
        counts_E: torch.Tensor,
        recv_DL: torch.Tensor,
        host: list[int],
        regroup_M: torch.Tensor,
    ) -> ExchangePlan:
        """The ``ExchangePlan`` of a sort order, the counts received (``recv_DL``, and ``host`` as
        ``exchange_counts`` reads it) and the regrouping."""
        D, L = self.degree, self.num_local_experts
        return ExchangePlan(
            order_N,
            inverse_permutation(order_N),
            host[:D],
            host[D : 2 * D],
            regroup_M,
            inverse_permutation(regroup_M),
            recv_DL.sum(0),
            host[2 * D : 2 * D + L],
            counts_E,
        )

    def exchange_counts(self, sent_DC: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """Tell every rank what this one sends it: ``sent_DC[d]`` holds the rows for each of rank
        ``d``'s experts (``L`` columns), then any columns of a subclass's own. Returns what every rank
        sent this one (``recv_DC``), and, read on the host in one sync: the rows sent to each rank
        (``D``), received from each (``D``), per local expert (``L``), then the extra columns, sent
        (``D`` each) and received (``D`` each). With ``max_tokens_per_rank`` the whole ``[D, D, C]``
        matrix is gathered instead, so that every rank sees every rank's load and all raise together."""
        D, L, C = self.degree, self.num_local_experts, sent_DC.shape[1]
        sent_DC = sent_DC.contiguous()
        loads: list[torch.Tensor] = []
        if self.max_tokens_per_rank is None:
            recv_DC = torch.empty_like(sent_DC)
            dist.all_to_all_single(recv_DC, sent_DC, group=self.group)
        else:
            all_DDC = torch.empty((D * D, C), dtype=sent_DC.dtype, device=sent_DC.device)
            all_gather_single(all_DDC, sent_DC, group=self.group)
            recv_DC = all_DDC.view(D, D, C)[:, self.rank]
            loads = [all_DDC.view(D, D, C)[:, :, :L].sum(dim=(0, 2))]  # rows arriving at each rank
        recv_DL = recv_DC[:, :L]
        extra = [sent_DC[:, L:].T.reshape(-1), recv_DC[:, L:].T.reshape(-1)]
        host = torch.cat([sent_DC[:, :L].sum(1), recv_DL.sum(1), recv_DL.sum(0), *extra, *loads]).tolist()
        if loads:
            load_D, host = host[-D:], host[:-D]
            if max(load_D) > self.max_tokens_per_rank:  # type: ignore[operator]
                raise RuntimeError(over_budget_message(load_D, self.max_tokens_per_rank, guard=True))  # type: ignore[arg-type]
        return recv_DC, host

    def _send(
        self, x_TH: torch.Tensor, top_k: int, plan: Any, received: torch.Tensor | None
    ) -> tuple[torch.Tensor, InFlight]:
        """Launch the exchange of the rows in sorted order (``received``: replay those instead)."""
        x_NH = gather_rows(x_TH, plan.order_N, top_k, plan.inverse_N)
        return start_all_to_all(x_NH, plan.recv_splits, plan.send_splits, self.group, received)

    def _receive(self, pending: torch.Tensor, flight: InFlight, plan: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The received rows grouped by local expert, and as they came (what a ``KeptExchange`` keeps)."""
        rows_MH = finish_all_to_all(pending, flight)  # ordered (source rank, local expert)
        return permute_rows(rows_MH, plan.regroup_M, plan.unregroup_M), rows_MH


def regroup(recv_DL: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For ``rows`` received rows ordered (source rank, local expert), ``recv_DL`` rows each: the
    segment ``s * L + l`` of each row, and the stable order that groups them by local expert."""
    D, L = recv_DL.shape
    segment_M = torch.repeat_interleave(
        torch.arange(D * L, device=recv_DL.device), recv_DL.reshape(-1), output_size=rows
    )
    return segment_M, torch.argsort(narrow_keys(segment_M % L, L), stable=True)
