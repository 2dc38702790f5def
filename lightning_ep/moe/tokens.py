"""Which tokens of one model call are real: the padding mask as the MoE layers see it.

Legend: B batch, S positions of this call, T = B * S tokens, N real (unpadded) tokens.

A Hugging Face model is called with ``attention_mask [B, S_total]`` (1 at real tokens, 0 at padding;
``S_total >= S`` during generation with a cache, whose current positions are the last ``S``). Its
forward pre-hook (``lightning_ep.models.padding``) hands one ``TokenBatch`` to every MoE layer of the
call: the index of real tokens (one host read) and the group's token counts (one small all-gather)
are computed once per call.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist

from lightning_ep.moe.collectives import all_gather_single
from lightning_ep.moe.config import MoEConfig


class TokenBatch:
    """The padding mask of one model call, shared by its MoE layers, with what they derive from it:
    ``attention_mask [B, S_total]`` (any dtype; nonzero marks a real token), or ``None`` (all real)."""

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
        """``gather_counts``, cached per group: every MoE layer of one call routes as many tokens."""
        key = id(group)
        if key not in self._group_counts:
            self._group_counts[key] = gather_counts(count, group, device)
        return self._group_counts[key]


def gather_counts(count: int, group: dist.ProcessGroup, device: torch.device) -> list[int]:
    """``count`` of every rank of ``group``, in rank order: one small all-gather and one host read."""
    mine = torch.tensor([count], dtype=torch.int64)
    if device.type == "cuda":  # a pinned copy, so that only the read of the result waits
        mine = mine.pin_memory().to(device, non_blocking=True)
    every = torch.empty(dist.get_world_size(group), dtype=torch.int64, device=device)
    all_gather_single(every, mine, group=group)
    return every.tolist()


class LayerTokens(NamedTuple):
    """Which tokens one call of a layer routes, and what its dispatch needs to know of them.

    Attributes:
        real_N: int64 positions of the real tokens in the flattened input, when eager; ``None``: all.
        valid_T: bool, ``False`` at padded tokens, when the call keeps its shapes instead (traced by
            ``torch.compile``); ``None`` otherwise.
        positions_T: each routed token's position in its sequence (the ``"position"`` drop policy).
        group_tokens: every expert-parallel rank's token count, when the dispatch or the shuffle needs it.
    """

    real_N: torch.Tensor | None
    valid_T: torch.Tensor | None
    positions_T: torch.Tensor | None
    group_tokens: list[int] | None


def origin_weights(source_T: torch.Tensor, group_tokens: list[int] | None, device: torch.device) -> torch.Tensor | None:
    """After the token shuffle, each token's weight ``T / T_source`` in this rank's mean, so that a
    per-token loss weighs it as data parallelism does; ``None`` when every rank holds as many tokens."""
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
    """The ``LayerTokens`` of a layer input of ``shape``: the real tokens of ``batch`` (selected eagerly,
    masked when traced), their positions when needed, and ``group``'s token counts when given."""
    real_N = valid_T = None
    if batch is not None:
        if torch.compiler.is_compiling():
            valid_T = batch.valid(shape)  # no data-dependent shapes in a traced graph
        else:
            real_N = batch.real_tokens(shape)
    positions_T = None
    if config.capacity_factor is not None and config.drop_policy == "position":
        if len(shape) == 3:  # each token's position in its sequence; a [T, H] input is one sequence
            positions_T = torch.arange(shape[0] * shape[1], device=device) % shape[1]
        else:
            positions_T = torch.arange(shape[0], device=device)
        if real_N is not None:
            positions_T = positions_T.index_select(0, real_N)
    group_tokens = None
    if group is not None:
        count = real_N.numel() if real_N is not None else math.prod(shape[:-1])
        counts = batch.group_counts if batch is not None else gather_counts
        group_tokens = counts(count, group, device)
    return LayerTokens(real_N, valid_T, positions_T, group_tokens)
