"""Dispatch: moving routed rows to the experts that take them and back.

``base`` holds the ``Dispatcher`` interface and the one-process ``LocalDispatcher``; ``rows`` the row
permutations. Across an expert-parallel group: ``all_to_all`` (dropless; ``dedup`` sends each token
once per rank, ``kept`` replays an exchange in a recomputation), ``all_gather``, ``capacity``
(capacity-bounded), and in ``static`` the plans sized by a row budget (padded all-to-all, symmetric
memory), all on the collectives of ``comm``; ``shuffle`` is the global token shuffle; ``combine`` sums
the weighted expert outputs per token; ``select.make_dispatcher`` picks one. Imports ``config``,
``kernels``, ``layer_execution`` and ``tokens`` only.
"""

from lightning_ep.moe.dispatch.base import Dispatched, Dispatcher, LocalDispatcher
from lightning_ep.moe.dispatch.select import make_dispatcher

__all__ = ["Dispatched", "Dispatcher", "LocalDispatcher", "make_dispatcher"]
