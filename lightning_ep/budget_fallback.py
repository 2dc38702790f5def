"""A training forward over a static row budget runs again on the dynamic plan: never an error,
never a dropped token.

A static plan (``Execution(row_budget=...)``) sizes its exchanges from a row budget and reads
nothing on the host, so a layer whose routing exceeds the budget leaves rows out of its output.
Its ``RowBudget`` notes that on the device, with the same loads on every rank (they come from the
gathered counts). ``BudgetFallback.run`` wraps the ``training_step`` call: after the forward it reads
the notes (one host sync per training forward), and if a layer went over, it puts that forward's
state back and runs ``training_step`` again with the layers over budget on their dynamic plan (one
host sync each), until none is over. Then:

- the random state is the one the first run started from: torch's CPU and CUDA generators, and
  each MoE layer's draw counter (router jitter, token shuffle) and pending ``"balanced"`` load;
- ``self.log`` calls inside ``training_step`` are held back and made once, from the run that counts;
- an automatic budget grows to fit the loads seen (``RowBudget.grow``; CUDA graphs of the layer are
  released and captured anew); a forced one stays;
- the reruns so far are logged as ``moe/budget_reruns`` at every step.

The discarded forward was never backpropagated, so the gradients are exactly those of the dynamic
plan. Other side effects of a user's ``training_step`` (a torchmetrics ``update``, a counter) happen
once per run. Under manual optimization the step cannot be run again (its backward and optimizer
step ran inside ``training_step``): an excess raises there instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_ep.moe.layer import MoELayer


class BudgetFallback:
    """Runs ``training_step`` under the layers' row budgets (see the module docstring).

    Args:
        layers: the model's MoE layers; those whose dispatcher has a budget are watched.
    """

    def __init__(self, layers: list[MoELayer]) -> None:
        self.layers = [lr for lr in layers if getattr(lr.dispatcher, "budget", None) is not None]
        self._all = layers  # whose random state a rerun puts back
        #: Training forwards run again since setup.
        self.reruns = 0

    def run(self, module: pl.LightningModule | None, step: Callable[[], Any]) -> Any:
        """``step()`` (the ``training_step`` call), run again while a layer is over its budget
        (without watched layers: once, as it is)."""
        if not self.layers or module is None:
            return step()
        saved = _save_state(self._all)
        held: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        module.log = lambda *args, **kwargs: held.append((args, kwargs))  # type: ignore[method-assign]
        try:
            while True:
                output = step()
                over = self._over_budget()
                if not over:
                    break
                del output
                held.clear()
                _restore_state(self._all, saved)
                self.reruns += 1
                for layer, loads in over:
                    dispatcher: Any = layer.dispatcher
                    dispatcher.dynamic = True
                    if dispatcher.budget.grow(loads):
                        layer.release_graphs()  # captured for the old budget's shapes
        finally:
            del module.log  # the class's method again
            for layer in self.layers:
                layer.dispatcher.dynamic = False  # type: ignore[attr-defined]
        for args, kwargs in held:
            module.log(*args, **kwargs)
        # A CPU tensor: the loggers read it without waiting for the GPU.
        module.log("moe/budget_reruns", torch.tensor(float(self.reruns)), on_step=True, on_epoch=False, sync_dist=False)
        return output

    def _over_budget(self) -> list[tuple[MoELayer, list[int]]]:
        """The layers on their static plan whose loads exceeded the budget in this forward."""
        over = []
        for layer in self.layers:
            dispatcher: Any = layer.dispatcher
            loads = dispatcher.budget.take_excess(wait=True)
            if loads is not None and not dispatcher.dynamic:
                over.append((layer, loads))
        return over


def _save_state(layers: list[MoELayer]) -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    state["draws"] = [(lr._draws.count, list(lr._draws.pending)) for lr in layers]
    state["load"] = [lr.gate.pending_load.clone() if lr.gate.mode == "balanced" else None for lr in layers]
    return state


def _restore_state(layers: list[MoELayer], state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
    for layer, (count, pending), load in zip(layers, state["draws"], state["load"], strict=True):
        layer._draws.count = count
        layer._draws.pending.clear()
        layer._draws.pending.extend(pending)
        if load is not None:
            layer.gate.pending_load.copy_(load)
