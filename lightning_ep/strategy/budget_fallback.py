"""A forward over a static row budget runs again on the dynamic plan: never an error, never a
dropped token.

A static plan (``Execution(row_budget=...)``) sizes its exchanges from a row budget and reads
nothing on the host, so a layer whose routing exceeds the budget leaves rows out of its output; its
``RowBudget`` notes that on the device, alike on every rank. ``BudgetFallback.attach`` puts two hooks
on the model: a forward pre-hook (the first to run) keeps the call's arguments and the random state,
and a forward hook (the last) reads the notes (one host sync per forward with gradients) and, if a
layer went over, restores the random state (torch's CPU and CUDA generators, each layer's draw
counter and pending ``"balanced"`` load) and calls the model again with those layers on their
dynamic plan (one host sync each), until none is over; the caller gets that call's output.

Only the model's forward runs again (``training_step`` and its ``self.log`` calls run once). An
automatic budget grows to fit the loads seen (``RowBudget.grow``, recapturing the layer's CUDA
graphs); a forced one stays. ``reruns`` counts the forwards run again (logged as
``moe/budget_reruns``). The discarded forward is never backpropagated, so the gradients are exactly
those of the dynamic plan. Forwards without gradients (evaluation) take the dynamic plan already.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

if TYPE_CHECKING:
    from lightning_ep.moe.layer import MoELayer


class BudgetFallback:
    """Reruns the model's forwards that went over a row budget (see the module docstring); of ``layers``,
    those whose dispatcher has a budget are watched."""

    def __init__(self, layers: list[MoELayer]) -> None:
        self.layers = [lr for lr in layers if getattr(lr.dispatcher, "budget", None) is not None]
        self._all = layers  # whose random state a rerun puts back
        #: Forwards run again since setup.
        self.reruns = 0
        self._call: tuple[tuple[Any, ...], dict[str, Any], dict[str, Any]] | None = None
        self._rerunning = False

    def attach(self, model: nn.Module) -> list[RemovableHandle]:
        """Hook ``model`` (whose forward calls the layers) if a layer is watched; returns the handles."""
        if not self.layers:
            return []
        return [
            model.register_forward_pre_hook(self._before, with_kwargs=True, prepend=True),
            model.register_forward_hook(self._after, with_kwargs=True),
        ]

    def _before(self, _model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not self._rerunning and torch.is_grad_enabled():
            self._call = (args, dict(kwargs), _save_state(self._all))

    def _after(self, model: nn.Module, _args: Any, _kwargs: Any, output: Any) -> Any:
        if self._rerunning or self._call is None:
            return None
        (args, kwargs, saved), self._call = self._call, None
        over = self._over_budget()
        if not over:
            return None
        self._rerunning = True
        try:
            while over:
                del output
                _restore_state(self._all, saved)
                self.reruns += 1
                for layer, loads in over:
                    dispatcher: Any = layer.dispatcher
                    dispatcher.dynamic = True
                    if dispatcher.budget.grow(loads):
                        layer.release_graphs()  # captured for the old budget's shapes
                output = model(*args, **kwargs)
                over = self._over_budget()
        finally:
            self._rerunning = False
            for layer in self.layers:
                layer.dispatcher.dynamic = False  # type: ignore[attr-defined]
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
