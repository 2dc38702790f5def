"""torch.distributed's single-tensor all-gather and reduce-scatter under the names torch 2.13 gives them
(``all_gather_single``, ``reduce_scatter_single``), or the older names where the torch in use lacks
those (``all_gather_into_tensor``, ``reduce_scatter_tensor``, which 2.13 deprecates with a warning on
every call site). The same collectives, the same arguments."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

all_gather_single: Callable[..., Any] = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single: Callable[..., Any] = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

__all__ = ["all_gather_single", "reduce_scatter_single"]
