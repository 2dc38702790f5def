"""Which tokens of one model call are real: the padding mask as the MoE layers see it.

Legend: B batch, S positions of this call, T = B * S tokens, N real (unpadded) tokens, D ranks of an
expert-parallel group.

A Hugging Face model is called with ``attention_mask [B, S_total]`` (1 at real tokens, 0 at padding;
``S_total >= S`` during generation with a cache, whose current positions are the last ``S``). The
model's forward pre-hook (``lightning_ep.models.padding``) wraps it in a ``TokenBatch`` and hands the
same object to every MoE layer of that call, so the derived index of real tokens (one host read) and
the token counts of an expert-parallel group (one small all-gather) are computed once per call, not
once per layer.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist

from lightning_ep.moe.config import MoEConfig


class TokenBatch:
    """The padding mask of one model call, shared by its MoE layers, with what they derive from it.

    Args:
        attention_mask: ``[B, S_total]`` (any dtype; nonzero marks a real token), or ``None`` when the
            call has no mask (every token is real).
    """

    def __init__(self, attention_mask: torch.Tensor | None) -> None:
        if attention_mask is not None and attention_mask.ndim != 2:
            raise ValueError(
                "TokenBatch(attention_mask=...) needs a [batch, sequence] mask, got shape "
                f"{list(attention_mask.shape)}."
            )
        self.mask_BS = None if attention_mask is None else attention_mask != 0
        self._real: dict[tuple[int, int], torch.Tensor | None] = {}
        self._group_counts: dict[int, list[int]] = {}

    def valid(self, shape: torch.Size) -> torch.Tensor | None:
        """bool ``[T]``: which tokens of a layer input of ``shape`` (``[B, S, H]``, or ``[B * S, H]``)
        are real; ``None`` when the call has no mask."""
        if self.mask_BS is None:
            return None
        batch, total = self.mask_BS.shape
        if len(shape) == 3 and shape[0] == batch and shape[1] <= total:
            return self.mask_BS[:, total - shape[1] :].reshape(-1)
        if len(shape) == 2 and shape[0] == batch * total:
            return self.mask_BS.reshape(-1)
        raise ValueError(
            f"the attention_mask of this call has shape {[batch, total]}, but a MoE layer got hidden states of "
            f"shape {list(shape)}: the mask must be [batch, sequence] of the tokens the model is called with."
        )

    def real_tokens(self, shape: torch.Size) -> torch.Tensor | None:
        """int64 ``[N]``: positions (in the flattened ``[T]``) of the real tokens of a layer input of
        ``shape``; ``None`` when every token is real. One host read per call and shape, cached."""
        valid_T = self.valid(shape)
        if valid_T is None:
            return None
        key = (int(shape[0]), int(shape[1]) if len(shape) == 3 else 0)
        if key not in self._real:
            index_N = valid_T.nonzero().squeeze(1)  # the host read: N
            self._real[key] = None if index_N.numel() == valid_T.numel() else index_N
        return self._real[key]

    def group_counts(self, count: int, group: dist.ProcessGroup, device: torch.device) -> list[int]:
        """The token counts of every rank of ``group`` (this rank's is ``count``), cached per group:
        every MoE layer of one call routes the same number of tokens."""
        key = id(group)
        if key not in self._group_counts:
            self._group_counts[key] = gather_counts(count, group, device)
        return self._group_counts[key]


def gather_counts(count: int, group: dist.ProcessGroup, device: torch.device) -> list[int]:
    """``count`` of every rank of ``group``, in rank order: one all-gather of one integer per rank and
    one host read."""
    mine = torch.tensor([count], dtype=torch.int64)
    if device.type == "cuda":  # a pinned copy, so that only the read of the result waits
        mine = mine.pin_memory().to(device, non_blocking=True)
    every = torch.empty(dist.get_world_size(group), dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(every, mine, group=group)
    return every.tolist()


def positions_in_sequence(shape: torch.Size, device: torch.device) -> torch.Tensor:
    """int64 ``[T]``: the position of each token in its sequence (``t % S`` for a ``[B, S, H]`` input;
    a ``[T, H]`` input is one sequence)."""
    num_tokens = shape[0] * shape[1] if len(shape) == 3 else shape[0]
    positions = torch.arange(num_tokens, device=device)
    return positions % shape[1] if len(shape) == 3 else positions


class LayerTokens(NamedTuple):
    """Which tokens one call of a layer routes, and what its dispatch needs to know of them.

    Attributes:
        real_N: int64 positions of the real tokens in the flattened input, when padding is left out
            of the call (eager: the rows are selected, the output scattered back); ``None``: all.
        valid_T: bool, ``False`` at padded tokens, when the call keeps its shapes instead (traced by
            ``torch.compile``); ``None`` otherwise.
        positions_T: each routed token's position in its sequence (the ``"position"`` drop policy).
        group_tokens: every expert-parallel rank's token count, when the dispatch or the token shuffle
            needs it (ranks may hold different numbers of tokens).
    """

    real_N: torch.Tensor | None
    valid_T: torch.Tensor | None
    positions_T: torch.Tensor | None
    group_tokens: list[int] | None


def origin_weights(source_T: torch.Tensor, group_tokens: list[int] | None, device: torch.device) -> torch.Tensor | None:
    """After the token shuffle, each token's weight ``T / T_source`` in this rank's mean over its
    ``T`` tokens, so that a per-token loss weighs every token as data parallelism does (by ``1 / T_s``
    on its own rank ``s``); ``None`` when every rank holds as many tokens (all weights 1)."""
    if group_tokens is None or len(set(group_tokens)) == 1:
        return None
    counts = torch.tensor(group_tokens, dtype=torch.float64)
    return (source_T.numel() / counts[source_T]).to(device=device)


def select_tokens(
    batch: TokenBatch | None,
    shape: torch.Size,
    config: MoEConfig,
    group: dist.ProcessGroup | None,
    device: torch.device,
) -> LayerTokens:
    """Which tokens of a layer input of ``shape`` one call routes, and what its dispatch needs to know
    of them (``LayerTokens``): the real tokens of ``batch`` (selected eagerly, masked when traced),
    their positions for the ``"position"`` drop policy, and ``group``'s token counts when given."""
    real_N = valid_T = None
    if batch is not None:
        if torch.compiler.is_compiling():
            valid_T = batch.valid(shape)  # no data-dependent shapes in a traced graph
        else:
            real_N = batch.real_tokens(shape)
    positions_T = None
    if config.capacity_factor is not None and config.drop_policy == "position":
        positions_T = positions_in_sequence(shape, device)
        if real_N is not None:
            positions_T = positions_T.index_select(0, real_N)
    group_tokens = None
    if group is not None:
        count = real_N.numel() if real_N is not None else math.prod(shape[:-1])
        group_tokens = (
            batch.group_counts(count, group, device) if batch is not None else gather_counts(count, group, device)
        )
    return LayerTokens(real_N, valid_T, positions_T, group_tokens)
