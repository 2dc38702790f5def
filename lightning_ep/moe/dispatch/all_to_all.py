"""Expert-parallel dispatchers (all-to-all, all-gather) and the global token shuffle.

Legend: T tokens on this rank, H hidden size, K experts per token, E global experts, D ranks of
the expert-parallel group, L = E / D experts per rank (rank ``r`` owns experts ``r*L .. r*L+L-1``),
N = T * K routed rows on this rank, M rows received for the local experts.

The process group is the expert-parallel group, passed in by the caller.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lightning_ep.moe.dispatch.base import (
    Dispatched,
    LocalDispatcher,
    count_ids,
    expert_counts,
    gather_rows,
    inverse_permutation,
    narrow_keys,
    permute_rows,
    sort_by_expert,
    weighted_unsort,
)
from lightning_ep.moe.dispatch.budget import over_budget_message
from lightning_ep.moe.dispatch.comm import (
    all_gather_rows,
    all_to_all,
    finish_all_to_all,
    reduce_scatter_rows,
    start_all_to_all,
)
from lightning_ep.moe.dispatch.dedup import receive_tokens, send_tokens


def expert_layout(num_experts: int, group: dist.ProcessGroup) -> tuple[int, int, int]:
    """``(D, rank, L)`` of an expert-parallel group: its size, this rank, and the experts per rank."""
    degree = dist.get_world_size(group)
    if num_experts % degree:
        raise ValueError(f"num_experts={num_experts} is not divisible by the expert-parallel degree {degree}.")
    return degree, dist.get_rank(group), num_experts // degree


class AllToAllDispatcher:
    """Tokens travel to the rank of their expert and back by variable-size all-to-all.

    Forward: sort pairs by expert -> exchange per-expert counts -> one host read of the split
    sizes -> all-to-all of the rows -> regroup by local expert. ``dispatch`` returns while the rows
    travel (``Dispatched.x_MH`` waits for them on first read). Combine: the exact reverse, then the
    weighted sum over the K choices on the token's own rank.

    ``dedup=True`` (``LayerExecution.token_dedup``): each token travels once per destination rank and
    is copied to its local experts there (``lightning_ep.moe.dispatch.dedup``); the combine is unchanged.
    """

    def __init__(
        self,
        num_experts: int,
        group: dist.ProcessGroup,
        max_tokens_per_rank: int | None = None,
        *,
        dedup: bool = False,
    ) -> None:
        self.group, self.num_experts = group, num_experts
        self.degree, self.rank, self.num_local_experts = expert_layout(num_experts, group)
        self.max_tokens_per_rank = max_tokens_per_rank
        #: Send each token once per destination rank (``lightning_ep.moe.dispatch.dedup``), not once per expert.
        self.dedup = dedup

    #: ``dispatch`` takes ``keep`` (see ``KeptExchange``).
    keeps_exchanges = True

    def dispatch(self, x_TH: torch.Tensor, expert_ids_TK: torch.Tensor, keep: KeptExchange | None = None) -> Dispatched:
        """Rows for the local experts, still travelling when this returns.

        ``keep``: an empty ``KeptExchange`` records this dispatch (and its combine); a complete one
        replays them: the plan and the received rows are reused and nothing is exchanged forward,
        while backward exchanges gradients as usual.
        """
        replay = keep is not None and keep.complete
        if replay:
            assert keep is not None and keep.plan is not None
            plan = keep.plan
        else:
            plan = self._plan(expert_ids_TK)
            if keep is not None:
                keep.plan = plan
        send_splits, recv_splits = plan["splits"]
        received = keep.received if replay and keep is not None else None
        if self.dedup:
            token_splits, token_recv_splits = plan["token_splits"]
            pending, flight = send_tokens(x_TH, plan["token_S"], token_recv_splits, token_splits, self.group, received)
        else:
            x_NH = gather_rows(x_TH, plan["order_N"], expert_ids_TK.shape[1], plan["inverse_N"])
            pending, flight = start_all_to_all(x_NH, recv_splits, send_splits, self.group, received)

        def arrive() -> torch.Tensor:
            if self.dedup:
                # One copy of each received token per local expert it chose, already grouped by expert.
                x_MH = receive_tokens(pending, flight, plan["gather_M"])
                if keep is not None and not replay:
                    assert flight.received is not None
                    keep.received = flight.received.detach()
                return x_MH
            rows_MH = finish_all_to_all(pending, flight)
            if keep is not None and not replay:
                keep.received = rows_MH.detach()
            # Received rows are ordered (source rank, local expert); regroup them by local expert.
            return permute_rows(rows_MH, plan["regroup_M"], plan["unregroup_M"])

        state = {**plan, "keep": keep, "replay": replay}
        return Dispatched(
            None, plan["counts_L"], plan["counts_E"], state, arrive=arrive, counts_host=plan["counts_host"]
        )

    def _plan(self, expert_ids_TK: torch.Tensor) -> dict:
        """Sort order, split sizes (the one host sync) and regrouping of one dispatch."""
        D, L = self.degree, self.num_local_experts
        order_N, counts_E = sort_by_expert(expert_ids_TK, self.num_experts)
        inverse_N = inverse_permutation(order_N)
        # sent_DC[d]: what this rank tells rank d: rows per expert of d (L columns), and with
        # deduplication the number of distinct tokens it sends to d (one more column).
        sent_DC = counts_E.view(D, L)
        if self.dedup:
            T = expert_ids_TK.shape[0]
            dest_TK = torch.div(expert_ids_TK, L, rounding_mode="floor")
            # [D, T], not [T, D]: the scans below run along the inner dim (a scan along the outer dim
            # of a [T, 2] tensor runs in two threads, a long serial scan on a GPU).
            to_rank_DT = torch.zeros((D, T), dtype=torch.bool, device=dest_TK.device).scatter_(0, dest_TK.T, True)
            sent_DC = torch.cat([sent_DC, to_rank_DT.sum(1)[:, None]], dim=1)
        C = sent_DC.shape[1]
        if self.max_tokens_per_rank is None:
            # recv_DC[s]: what rank s tells me.
            recv_DC = torch.empty_like(sent_DC)
            dist.all_to_all_single(recv_DC, sent_DC.contiguous(), group=self.group)
            budget: list[torch.Tensor] = []
        else:
            # With a budget every rank needs every rank's load, so that all of them stop together:
            # gather the whole [D, D, C] matrix instead (the same one host sync).
            all_DDC = torch.empty((D * D, C), dtype=sent_DC.dtype, device=sent_DC.device)
            dist.all_gather_into_tensor(all_DDC, sent_DC.contiguous(), group=self.group)
            all_DDC = all_DDC.view(D, D, C)
            recv_DC = all_DDC[:, self.rank]
            budget = [all_DDC[:, :, :L].sum(dim=(0, 2))]  # rows arriving at each rank
        recv_DL = recv_DC[:, :L]  # recv_DL[s, l]: rows that rank s sends to my local expert l
        dedup_counts = [sent_DC[:, L], recv_DC[:, L]] if self.dedup else []
        # The one host sync: split sizes, the received counts per local expert, and what goes with them.
        host = torch.cat([sent_DC[:, :L].sum(1), recv_DL.sum(1), recv_DL.sum(0), *dedup_counts, *budget]).tolist()
        send_splits, recv_splits, counts_host = host[:D], host[D : 2 * D], host[2 * D : 2 * D + L]
        if budget:
            _check_budget(host[-D:], self.max_tokens_per_rank)  # type: ignore[arg-type]
        segment_M = torch.repeat_interleave(
            torch.arange(D * L, device=recv_DL.device), recv_DL.reshape(-1), output_size=sum(recv_splits)
        )
        regroup_M = torch.argsort(narrow_keys(segment_M % L, L), stable=True)
        plan = {
            "order_N": order_N,
            "inverse_N": inverse_N,
            "regroup_M": regroup_M,
            "unregroup_M": inverse_permutation(regroup_M),
            "splits": (send_splits, recv_splits),
            "counts_L": recv_DL.sum(0),
            "counts_host": counts_host,
            "counts_E": counts_E,
        }
        if self.dedup:
            token_splits = host[2 * D + L : 3 * D + L]
            plan["token_splits"] = (token_splits, host[3 * D + L : 4 * D + L])
            sent_D, recv_D = sent_DC[:, L], recv_DC[:, L]
            plan.update(self._dedup_plan(dest_TK, to_rank_DT, sent_D, recv_D, plan, segment_M, sum(token_splits)))
        return plan

    def _dedup_plan(
        self,
        dest_TK: torch.Tensor,
        to_rank_DT: torch.Tensor,
        send_tokens_D: torch.Tensor,
        recv_tokens_D: torch.Tensor,
        plan: dict,
        segment_M: torch.Tensor,
        num_sent: int,
    ) -> dict:
        """Which token each sent row holds (``token_S``: grouped by destination rank, ascending token)
        and which received row each local-expert row copies (``gather_M``). The sender knows where
        in its rows to rank ``d`` each (token, expert) pair's token sits; that position travels to
        ``d`` in the pairs' own order (a small all-to-all of one integer per pair)."""
        D, L = self.degree, self.num_local_experts
        T = dest_TK.shape[0]
        device = dest_TK.device
        position_DT = torch.cumsum(to_rank_DT, dim=1) - 1  # row of token t among those sent to d
        first_D = torch.cumsum(send_tokens_D, 0) - send_tokens_D
        slot_DT = torch.where(to_rank_DT, first_D[:, None] + position_DT, num_sent)  # unsent: a spare slot
        token_S = torch.empty(num_sent + 1, dtype=torch.int64, device=device)
        token_S.scatter_(0, slot_DT.view(-1), torch.arange(T, device=device).repeat(D))
        position_N = position_DT.T.gather(1, dest_TK).view(-1).index_select(0, plan["order_N"])
        send_splits, recv_splits = plan["splits"]
        position_M = torch.empty(sum(recv_splits), dtype=position_N.dtype, device=device)
        dist.all_to_all_single(position_M, position_N, recv_splits, send_splits, group=self.group)
        # Received pairs are ordered (source rank, local expert); source s's tokens start at first_recv[s].
        first_recv_D = torch.cumsum(recv_tokens_D, 0) - recv_tokens_D
        source_M = torch.div(segment_M, L, rounding_mode="floor")
        gather_M = (position_M + first_recv_D.index_select(0, source_M)).index_select(0, plan["regroup_M"])
        return {"token_S": token_S[:num_sent], "gather_M": gather_M}

    def combine(self, y_MH: torch.Tensor, weights_TK: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        state = dispatched.state
        send_splits, recv_splits = state["splits"]
        keep, replay = state["keep"], state["replay"]
        y_recv_MH = permute_rows(y_MH, state["unregroup_M"], state["regroup_M"])
        y_NH = all_to_all(y_recv_MH, send_splits, recv_splits, self.group, keep.combined if replay else None)
        if keep is not None and not replay:
            keep.combined = y_NH.detach()
        return weighted_unsort(y_NH, state["inverse_N"], state["order_N"], weights_TK)


class KeptExchange:
    """What one all-to-all dispatch and its combine keep so that an activation-checkpointing
    recomputation of the layer skips the count exchange, the host sync and both token exchanges:
    the plan (sort order, split sizes, regrouping) and the rows each exchange received, ``M x H``
    (``R x H`` deduplicated: the received tokens) and ``N x H`` elements held from the forward until
    the recomputation."""

    def __init__(self) -> None:
        self.plan: dict | None = None
        self.received: torch.Tensor | None = None
        self.combined: torch.Tensor | None = None

    @property
    def complete(self) -> bool:
        return self.plan is not None and self.received is not None and self.combined is not None


def exchange_to_keep(records: Any, dispatcher: Any, draw_id: int, backward: bool) -> KeptExchange | None:
    """For ``MoELayer.keep_all_to_all``: a new ``KeptExchange`` recorded in ``records`` (a layer's
    ``ForwardRecords``) for training forward ``draw_id``, or inside backward (``backward``) the one that
    forward recorded, for its activation-checkpointing recomputation; ``None`` on one process."""
    if isinstance(dispatcher, LocalDispatcher):
        return None  # one process: nothing is exchanged
    if not getattr(dispatcher, "keeps_exchanges", False):
        raise ValueError(
            f"MoELayer.keep_all_to_all needs the all-to-all dispatcher, got {type(dispatcher).__name__}; "
            "set MoEConfig(moe_all_to_all_dispatcher=True, capacity_factor=None) and Execution(exchange='collective') "
            "or keep_all_to_all=False."
        )
    return records.recall(draw_id, None) if backward else records.record(draw_id, KeptExchange())


def _check_budget(load_D: list[int], budget: int) -> None:
    if max(load_D) > budget:
        raise RuntimeError(over_budget_message(load_D, budget, guard=True))


class AllGatherDispatcher:
    """Every rank gathers all tokens of the group, runs its local experts on the rows routed to
    them, weights them, and the partial outputs are reduce-scattered back to their ranks.

    Ranks may hold different numbers of tokens (``group_tokens``): each pads its rows to the largest
    count with rows routed nowhere, so the gather and the reduce-scatter stay equal-sized. One host
    read (the number of rows for the local experts) per layer.
    """

    def __init__(self, num_experts: int, group: dist.ProcessGroup) -> None:
        self.group, self.num_experts = group, num_experts
        self.degree, self.rank, self.num_local_experts = expert_layout(num_experts, group)

    #: ``dispatch`` takes every rank's token count (``group_tokens``).
    needs_group_tokens = True

    def dispatch(
        self, x_TH: torch.Tensor, expert_ids_TK: torch.Tensor, *, group_tokens: list[int] | None = None
    ) -> Dispatched:
        """Rows for the local experts. ``group_tokens``: every rank's token count (``None``: all ``T``)."""
        L, K, T = self.num_local_experts, expert_ids_TK.shape[1], x_TH.shape[0]
        padded = max(group_tokens) if group_tokens is not None else T
        # Rows past T pad this rank to the largest count; their id -1 matches no expert.
        x_all_GH = all_gather_rows(_pad_rows(x_TH, padded, 0), self.group)  # G = D * padded
        with torch.no_grad():
            ids_all_GK = all_gather_rows(_pad_rows(expert_ids_TK, padded, -1), self.group)
            # Local experts get keys 0..L-1, every other expert (and padding) the key L (sorted last, dropped).
            local_GK = ids_all_GK - self.rank * L
            key_N = torch.where((local_GK >= 0) & (local_GK < L) & (ids_all_GK >= 0), local_GK, L).reshape(-1)
            sorted_key_N, order_N = torch.sort(narrow_keys(key_N, L + 1), stable=True)
            counts_L = expert_counts(sorted_key_N, L + 1)[:L]
            counts_host = counts_L.tolist()  # the one host sync
            order_M = order_N[: sum(counts_host)]
        # Not a permutation (rows of other ranks' experts are left out): a plain index_select.
        x_MH = x_all_GH.index_select(0, torch.div(order_M, K, rounding_mode="floor"))
        tokens_per_expert_E = count_ids(expert_ids_TK, self.num_experts)
        state = {"order_M": order_M, "rows": x_all_GH.shape[0], "padded": padded}
        return Dispatched(x_MH, counts_L, tokens_per_expert_E, state, counts_host=counts_host)

    def combine(self, y_MH: torch.Tensor, weights_TK: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        order_M, padded = dispatched.state["order_M"], dispatched.state["padded"]
        T, K = weights_TK.shape
        weights_all_N = all_gather_rows(_pad_rows(weights_TK, padded, 0), self.group).reshape(-1)
        weighted_MH = y_MH * weights_all_N.index_select(0, order_M).to(y_MH.dtype)[:, None]
        partial_GH = y_MH.new_zeros((dispatched.state["rows"], y_MH.shape[1]))
        partial_GH = partial_GH.index_add(0, torch.div(order_M, K, rounding_mode="floor"), weighted_MH)
        return reduce_scatter_rows(partial_GH, self.group)[:T]


def _pad_rows(x: torch.Tensor, rows: int, value: float) -> torch.Tensor:
    """``x`` with ``rows - len(x)`` rows of ``value`` appended (``x`` itself when none); differentiable."""
    missing = rows - x.shape[0]
    if missing == 0:
        return x
    return torch.cat([x, x.new_full((missing, *x.shape[1:]), value)])


class TokenShuffle:
    """Permute the tokens of an expert-parallel group across its ranks, and put them back.

    The permutation ``P`` of the group's ``G = sum_r T_r`` tokens (rank ``r`` holds ``T_r``, old
    global positions ``offset_r .. offset_r + T_r - 1``) is drawn from a generator that is seeded
    alike on every rank, so every rank knows every split size from the token counts alone: new
    global position ``q`` receives old global token ``P[q]``, and rank ``r`` keeps ``T_r`` tokens,
    those at its own range of new positions.
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.degree = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def shuffle(
        self,
        x_TH: torch.Tensor,
        generator: torch.Generator,
        group_tokens: list[int] | None = None,
        extra_T: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict, torch.Tensor | None]:
        """This rank's tokens after the permutation, the state ``unshuffle`` needs (``state["source_T"]``:
        the rank each new token came from, on the CPU), and ``extra_T`` (a per-token integer, e.g.
        positions in the sequence) moved along with the tokens.

        ``group_tokens``: every rank's token count in rank order (``None``: all ``T``)."""
        D, r, T = self.degree, self.rank, x_TH.shape[0]
        counts = group_tokens if group_tokens is not None else [T] * D
        if counts[r] != T:
            raise RuntimeError(f"TokenShuffle: rank {r} holds {T} tokens but group_tokens says {counts[r]}.")
        ends_D = torch.tensor(counts).cumsum(0)
        start = int(ends_D[r]) - T
        perm = torch.randperm(int(ends_D[-1]), generator=generator)  # on the CPU: splits need no device sync
        dest_of_old = inverse_permutation(perm)  # new position of each old global token
        mine_old = dest_of_old[start : start + T]
        owner_of_mine = torch.searchsorted(ends_D, mine_old, right=True)  # rank that receives each
        send_order = torch.argsort(mine_old, stable=True)  # my tokens by their new position
        send_splits = torch.bincount(owner_of_mine, minlength=D).tolist()
        source_of_new = torch.searchsorted(ends_D, perm[start : start + T], right=True)  # source rank
        recv_order = torch.argsort(source_of_new, stable=True)  # buffer row i holds new position recv_order[i]
        recv_splits = torch.bincount(source_of_new, minlength=D).tolist()

        device = x_TH.device
        send_order, recv_order = send_order.to(device), recv_order.to(device)
        unsend_order, unrecv_order = inverse_permutation(send_order), inverse_permutation(recv_order)
        send_TH = permute_rows(x_TH, send_order, unsend_order)
        buffer_TH = all_to_all(send_TH, recv_splits, send_splits, self.group)
        state = {
            "send_order": send_order,
            "unsend_order": unsend_order,
            "recv_order": recv_order,
            "unrecv_order": unrecv_order,
            "splits": (send_splits, recv_splits),
        }
        state["source_T"] = source_of_new  # the rank each of my new tokens came from (CPU)
        moved = None
        if extra_T is not None:
            buffer = all_to_all(extra_T.index_select(0, send_order), recv_splits, send_splits, self.group)
            moved = buffer.index_select(0, unrecv_order)
        return permute_rows(buffer_TH, unrecv_order, recv_order), state, moved

    def unshuffle(self, y_TH: torch.Tensor, state: dict) -> torch.Tensor:
        """The exact inverse of ``shuffle`` (and its adjoint in backward)."""
        send_splits, recv_splits = state["splits"]
        send_TH = permute_rows(y_TH, state["recv_order"], state["unrecv_order"])
        buffer_TH = all_to_all(send_TH, send_splits, recv_splits, self.group)
        return permute_rows(buffer_TH, state["unsend_order"], state["send_order"])
