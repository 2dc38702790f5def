"""Seeded random streams for MoE layers, independent of the global torch RNG.

A layer asks for a generator per random draw (router jitter, token shuffle). Each draw has an id
that counts the layer's training forwards, so the stream is reproducible from ``random_seed``
alone; a forward re-run by activation checkpointing replays the id of the forward it recomputes,
so it draws the very same numbers.
"""

from __future__ import annotations

from collections import deque
from typing import Generic, TypeVar

import torch

_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant (golden ratio): spreads nearby seeds apart
_MASK = (1 << 63) - 1


def in_backward() -> bool:
    """True while autograd runs a backward pass (e.g. activation checkpointing recomputes); never in
    code traced by ``torch.compile``, whose recomputation is part of the compiled backward."""
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1


class DrawCounter:
    """Numbers the random draws of one layer; recomputation replays the newest unreplayed id."""

    def __init__(self, max_pending: int = 64) -> None:
        self.count = 0
        self.pending: deque[int] = deque(maxlen=max_pending)

    def next_id(self) -> int:
        if in_backward() and self.pending:
            return self.pending.pop()
        draw_id = self.count
        self.count += 1
        # Kept even without grad: reentrant checkpointing runs its first forward under no_grad.
        self.pending.append(draw_id)
        return draw_id


_JITTER_STREAM = 0
_SHUFFLE_STREAM = 1


def layer_generator(
    seed: int, ep_rank: int, layer_index: int, draw_id: int, device: torch.device, *, shared: bool
) -> torch.Generator:
    """The generator on ``device`` of one MoE layer's draw ``draw_id``: the token shuffle's (``shared``:
    the same on every rank of the expert-parallel group) or the router jitter's (one stream per rank)."""
    stream = (draw_id * 1024 + layer_index) * 4 + (_SHUFFLE_STREAM if shared else _JITTER_STREAM)
    seed = seed if shared else seed + ep_rank
    generator = torch.Generator(device=device)
    generator.manual_seed(((seed * _MIX) ^ (stream * 0x2545F4914F6CDD1D + 1)) & _MASK)
    return generator


def jitter_factors(x_TH: torch.Tensor, noise: float, generator: torch.Generator) -> torch.Tensor:
    """Multiplicative router jitter for ``x_TH``: ``U(1 - noise, 1 + noise)``, drawn in fp32, in ``x_TH``'s dtype."""
    factors = torch.empty(x_TH.shape, dtype=torch.float32, device=x_TH.device)
    factors.uniform_(1.0 - noise, 1.0 + noise, generator=generator)
    return factors.to(x_TH.dtype)


V = TypeVar("V")


class ForwardRecords(Generic[V]):
    """What training forwards recorded for their activation-checkpointing recomputation, by draw id
    (``DrawCounter``): the recomputation inside backward recalls its forward's value. At most
    ``limit`` are kept; the oldest, of forwards never recomputed, are dropped first."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._values: dict[int, V] = {}

    def record(self, draw_id: int, value: V) -> V:
        self._values[draw_id] = value
        while len(self._values) > self.limit:
            del self._values[next(iter(self._values))]
        return value

    def recall(self, draw_id: int, default: V) -> V:
        return self._values.pop(draw_id, default)

    def __len__(self) -> int:
        """How many forwards still await their recomputation."""
        return len(self._values)
