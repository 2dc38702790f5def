"""``RowBudget``: the static row budget of a dispatch plan that never reads counts on the host.

A static plan (symmetric memory or the padded all-to-all with ``Execution(row_budget=...)``) sizes
every buffer from a budget ``R`` of rows received per rank, so the host queues layer after layer
without waiting for the GPU. Rows routed past it are left out of that layer's output, and the
budget notes it on the device. Who reads the note decides what happens:

- ``check`` raises (the plan's own guard, outside ``ExpertParallelStrategy``);
- ``take_excess`` returns the loads without raising: under ``ExpertParallelStrategy`` the step then
  runs again with the layers over budget on their dynamic plan (``lightning_ep.strategy.budget_fallback``),
  and an automatic budget grows to fit (``grow``).
"""

from __future__ import annotations

import math

import torch

#: An automatic budget is the largest load seen, times this, rounded up (``RowBudget.fit``).
HEADROOM = 1.25


class RowBudget:
    """The most rows each rank's experts received in one layer since the last read, kept on the
    device (no host sync) and compared with the budget ``R`` on the host when its copy has landed.
    ``budget``: ``R``, or ``None`` for an automatic budget not sized yet (``fit``; until then the
    dispatcher takes its dynamic plan). ``adaptive``: ``grow`` may raise ``R``. ``multiple``: ``R`` is
    kept a multiple of it (the padded all-to-all splits it over the ranks).

    Every dispatch queues a copy of the running maximum into pinned host memory. The maximum only
    grows, so whatever value the host reads is a true lower bound: ``check(wait=False)`` costs
    nothing and raises as soon as an excess is seen; ``check(wait=True)`` waits for the last copy.

    ``raise_at_dispatch``: whether each dispatch runs ``check(wait=False)`` first. The copy may land
    on one rank a layer earlier than on another, so that raise can come on some ranks only (the
    launcher then stops the others). ``StepChecks.watch_budgets`` turns it off: under
    ``ExpertParallelStrategy`` every rank reads the budgets at the same point.
    """

    def __init__(self, budget: int | None, *, adaptive: bool = False, multiple: int = 1) -> None:
        self.multiple = multiple
        self.budget = None if budget is None else _round_up(budget, multiple)
        self.adaptive = adaptive
        self.raise_at_dispatch = True
        self._worst_D: torch.Tensor | None = None
        self._host_D: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None

    def note(self, loads_D: torch.Tensor) -> None:
        """Keep the maximum of ``loads_D`` (rows received per rank, on the device) and queue its copy."""
        worst = loads_D if self._worst_D is None else torch.maximum(self._worst_D, loads_D)
        self._worst_D = worst
        if self._host_D is None:
            self._host_D = torch.zeros(worst.shape, dtype=worst.dtype, pin_memory=worst.is_cuda)
        self._host_D.copy_(worst, non_blocking=True)
        if worst.is_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()

    def take_excess(self, *, wait: bool = True) -> list[int] | None:
        """The noted loads per rank if one exceeded the budget since the last read, else ``None``;
        either way the note starts afresh (``wait``: first wait for the last dispatch's copy)."""
        host, copied = self._host_D, self._copied
        self._worst_D, self._host_D, self._copied = None, None, None
        if host is None or self.budget is None:
            return None
        if wait and copied is not None:
            copied.synchronize()
        return host.tolist() if int(host.max()) > self.budget else None

    def check(self, *, wait: bool) -> None:
        """Raise if some rank received more than ``budget`` rows in a layer (``wait``: first wait for
        the last copy; otherwise read what has landed, and keep the note if it shows no excess yet)."""
        if self._host_D is None or self.budget is None:
            return
        if wait and self._copied is not None:
            self._copied.synchronize()
        if int(self._host_D.max()) <= self.budget:
            return
        loads = self.take_excess(wait=False)
        assert loads is not None
        raise RuntimeError(
            f"{over_budget_message(loads, self.budget)} The static plan's buffers hold that many rows, so the rows "
            "past it were left out of that layer's output: that step's results are wrong."
        )

    def fit(self, loads: list[int]) -> int:
        """Size an automatic budget from a dispatch's loads per rank (the same on every rank): the
        largest times ``HEADROOM``, rounded up to a multiple of 8 and of ``multiple``."""
        self.budget = _round_up(math.ceil(max(max(loads), 1) * HEADROOM), math.lcm(8, self.multiple))
        return self.budget

    def grow(self, loads: list[int]) -> bool:
        """After an excess: whether the budget is adaptive and so now ``fit`` to ``loads``."""
        if not self.adaptive:
            return False
        self.fit(loads)
        return True


def over_budget_message(load_D: list[int], budget: int, *, guard: bool = False) -> str:
    """The error for rows over a row budget (``guard``: over ``MoEConfig.max_tokens_per_rank``)."""
    limit = f"MoEConfig.max_tokens_per_rank={budget}" if guard else f"the row budget Execution(row_budget={budget})"
    worst = max(range(len(load_D)), key=load_D.__getitem__)
    return (
        f"MoE routing sent {load_D[worst]} rows to the experts of expert-parallel rank {worst} in one layer, over "
        f"{limit} (loads per rank: {load_D}). Routing is this skewed early in training or with a collapsed "
        f"router: raise {'it' if guard else 'the row budget'} if memory allows, set a capacity_factor "
        "to drop the excess, or use load balancing (aux_loss / sinkhorn)."
    )


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
