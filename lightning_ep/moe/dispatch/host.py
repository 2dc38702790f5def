"""``HostCopy``: a device tensor copied to the host without a host sync where it is queued."""

from __future__ import annotations

import torch


class HostCopy:
    """``values`` on the host: on CUDA a copy queued on the current stream into pinned memory, with an
    event behind it (a CPU tensor is copied at once). ``wait`` blocks the host only until that copy
    is done: read well after the queueing point (a backward reading its forward's counts, the
    optimizer step reading its micro-batches' losses), the GPU has long passed it, so it drains nothing.
    """

    def __init__(self, values: torch.Tensor) -> None:
        self.event: torch.cuda.Event | None = None
        if values.is_cuda:
            self.host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self.host.copy_(values, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = values.detach().clone()

    def wait(self) -> torch.Tensor:
        """The host tensor, once the copy is done (waits for it on CUDA)."""
        if self.event is not None:
            self.event.synchronize()
        return self.host
