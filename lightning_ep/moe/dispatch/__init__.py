"""Dispatch: moving routed rows to the experts that take them and back.

``base`` holds the ``Dispatcher`` interface and the one-process ``LocalDispatcher``; across a group:
``all_to_all`` (with ``dedup`` and ``kept``), ``all_gather``, ``capacity`` and the row-budget plans of
``static``, on the collectives of ``comm``; ``select.make_dispatcher`` picks one. Imports ``config``,
``kernels``, ``layer_execution`` and ``tokens`` only.
"""

from lightning_ep.moe.dispatch.base import Dispatched, Dispatcher, LocalDispatcher
from lightning_ep.moe.dispatch.select import make_dispatcher

__all__ = ["Dispatched", "Dispatcher", "LocalDispatcher", "make_dispatcher"]
