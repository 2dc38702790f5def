"""``KeptExchange``: an all-to-all dispatch replayed by its activation-checkpointing recomputation
(``ExpertParallelStrategy(activation_checkpointing="keep_all_to_all")``)."""

from __future__ import annotations

from typing import Any

import torch

from lightning_ep.moe.dispatch.base import LocalDispatcher


class KeptExchange:
    """What one all-to-all dispatch and its combine keep so that the recomputation of the layer skips
    the count exchange, the host sync and both token exchanges: the plan and the rows each exchange
    received, ``M x H`` (deduplicated: the received tokens) and ``N x H`` elements held from the
    forward until the recomputation. Same numbers. An empty one given to ``dispatch(keep=...)``
    records; a complete one replays (nothing is exchanged forward; backward exchanges gradients as usual).
    """

    def __init__(self) -> None:
        self.plan: Any = None
        self.received: torch.Tensor | None = None
        self.combined: torch.Tensor | None = None

    @property
    def complete(self) -> bool:
        return self.plan is not None and self.received is not None and self.combined is not None


def exchange_to_keep(records: Any, dispatcher: Any, draw_id: int, backward: bool) -> KeptExchange | None:
    """For ``MoELayer.keep_all_to_all``: a new ``KeptExchange`` recorded in ``records`` for training
    forward ``draw_id``, or inside ``backward`` the one that forward recorded; ``None`` on one process."""
    if isinstance(dispatcher, LocalDispatcher):
        return None  # one process: nothing is exchanged
    if not dispatcher.keeps_exchanges:
        raise ValueError(
            f"MoELayer.keep_all_to_all needs the all-to-all dispatcher, got {type(dispatcher).__name__}; "
            "set MoEConfig(moe_all_to_all_dispatcher=True, capacity_factor=None) and Execution(exchange='collective') "
            "or keep_all_to_all=False."
        )
    return records.recall(draw_id, None) if backward else records.record(draw_id, KeptExchange())
