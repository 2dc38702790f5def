"""``TokenShuffle``: the global token shuffle of an expert-parallel group (``MoEConfig(global_token_shuffle=True)``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from lightning_ep.moe.dispatch.comm import all_to_all
from lightning_ep.moe.dispatch.rows import inverse_permutation, permute_rows


@dataclass(frozen=True)
class ShufflePlan:
    """One shuffle: the orders of the rows sent and received (with their inverses), the split
    sizes, and ``source_T``: the rank each of this rank's new tokens came from (CPU)."""

    send_order: torch.Tensor
    unsend_order: torch.Tensor
    recv_order: torch.Tensor
    unrecv_order: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    source_T: torch.Tensor


class TokenShuffle:
    """Permute the tokens of an expert-parallel group across its ranks, and put them back. The
    permutation ``P`` of the group's ``G = sum_r T_r`` tokens (rank ``r`` holds ``T_r``, old
    global positions ``offset_r .. offset_r + T_r - 1``) is drawn from a generator that is seeded
    alike on every rank, so every rank knows every split size from the token counts alone: new
    global position ``q`` receives old global token ``P[q]``, and rank ``r`` keeps ``T_r`` tokens,
    those at its own range of new positions.
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group, self.degree, self.rank = group, dist.get_world_size(group), dist.get_rank(group)

    def shuffle(
        self,
        x_TH: torch.Tensor,
        generator: torch.Generator,
        group_tokens: list[int] | None = None,
        extra_T: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ShufflePlan, torch.Tensor | None]:
        """This rank's tokens after the permutation, the plan ``unshuffle`` needs, and ``extra_T`` (a
        per-token integer, e.g. positions) moved along. ``group_tokens``: every rank's count (``None``: all ``T``)."""
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

        send_order, recv_order = send_order.to(x_TH.device), recv_order.to(x_TH.device)
        unsend_order, unrecv_order = inverse_permutation(send_order), inverse_permutation(recv_order)
        send_TH = permute_rows(x_TH, send_order, unsend_order)
        buffer_TH = all_to_all(send_TH, recv_splits, send_splits, self.group)
        plan = ShufflePlan(send_order, unsend_order, recv_order, unrecv_order, send_splits, recv_splits, source_of_new)
        moved = None
        if extra_T is not None:
            buffer = all_to_all(extra_T.index_select(0, send_order), recv_splits, send_splits, self.group)
            moved = buffer.index_select(0, unrecv_order)
        return permute_rows(buffer_TH, unrecv_order, recv_order), plan, moved

    def unshuffle(self, y_TH: torch.Tensor, plan: ShufflePlan) -> torch.Tensor:
        """The exact inverse of ``shuffle`` (and its adjoint in backward)."""
        send_TH = permute_rows(y_TH, plan.recv_order, plan.unrecv_order)
        buffer_TH = all_to_all(send_TH, plan.send_splits, plan.recv_splits, self.group)
        return permute_rows(buffer_TH, plan.unsend_order, plan.send_order)
