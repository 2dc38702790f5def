"""Dispatch: moving routed rows to the experts that take them and back.

``base`` holds the ``Dispatcher`` protocol, the one-process ``LocalDispatcher`` and the row
permutations; ``all_to_all`` (dropless, optionally deduplicated by ``dedup``), ``capacity``
(capacity-bounded) and ``symmetric`` (rows pulled through CUDA symmetric memory by ``symm_pull``)
exchange them across an expert-parallel group with the collectives of ``comm``; ``combine`` sums
the weighted expert outputs per token; ``select.make_dispatcher`` picks one from a ``MoEConfig``.
Imports ``config`` and ``kernels`` only.
"""

from lightning_ep.moe.dispatch.base import Dispatched, Dispatcher, LocalDispatcher
from lightning_ep.moe.dispatch.select import make_dispatcher

__all__ = ["Dispatched", "Dispatcher", "LocalDispatcher", "make_dispatcher"]
