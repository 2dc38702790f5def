"""What ``ExpertParallelStrategy`` does around each training step: the MoE losses averaged over
ranks and logged, the non-finite check, the row budgets' reruns, and clipping across meshes
(``mesh_aware``: the precision plugin's subclass that clips across meshes)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from lightning_ep.moe.dispatch.host import HostCopy
from lightning_ep.moe.layer import MoELayer
from lightning_ep.parallel.grad_norm import clip_grad_norm_
from lightning_ep.strategy.budget_fallback import BudgetFallback

if TYPE_CHECKING:
    import lightning.pytorch as pl


class StepChecks:
    """Per-step MoE losses and non-finite flags, averaged over ranks with one all-reduce.

    ``after_forward`` runs after each ``training_step``; ``before_optimizer_step`` from the closure
    handed to the precision plugin, after forward and backward were launched and before the optimizer
    step and Lightning's clipping (``ExpertParallelStrategy.optimizer_step``). Each forward's averaged
    values are copied to pinned host memory right after its all-reduce (queued, not waited for);
    ``before_optimizer_step`` waits for the last copy (the forward's end, not the backward's), raises
    on a non-finite flag and logs the losses, averaged over the step's micro-batches, as CPU tensors:
    a device tensor logged with ``prog_bar=True`` would be read back at every batch end, draining the
    GPU's queue between steps.

    ``check_finite``: keep the layers' non-finite flags and raise on one; ``log_losses``: log
    ``moe/aux_loss``, ``moe/z_loss`` and their per-layer values; ``precision``: the Trainer's, for the
    cause the non-finite error names (``nonfinite_fix``).
    """

    def __init__(self, *, check_finite: bool, log_losses: bool, precision: str = "32-true") -> None:
        self.check_finite = check_finite
        self.log_losses = log_losses
        self.precision = precision
        self._layers: list[MoELayer] = []  # of the last forward, for the non-finite error
        # Per micro-batch since the last optimizer step: the host copy of the all-reduced
        # [aux..., z..., flags...] (flags only with check_finite).
        self._pending: list[HostCopy] = []
        # The layers' dispatchers that keep a static row budget (``watch_budgets``).
        self._budgets: list[Any] = []
        #: Runs a forward again when it went over a budget (``watch_budgets``).
        self.fallback = BudgetFallback([])
        self._hooks: list[RemovableHandle] = []

    def after_forward(self, layers: list[MoELayer], module: pl.LightningModule, device: torch.device) -> None:
        """Average the per-layer losses and non-finite flags over ranks (one all-reduce, no host
        sync) and queue their copy to the host; under manual optimization, check and log at once."""
        if layers and (self.check_finite or self.log_losses):
            self._layers = layers
            parts = [*(lr.aux_loss for lr in layers), *(lr.z_loss for lr in layers)]
            if self.check_finite:
                parts += [lr.nonfinite.float() for lr in layers]
            stacked = torch.stack([p.to(device=device, dtype=torch.float32) for p in parts])
            if dist.is_available() and dist.is_initialized() and (world := dist.get_world_size()) > 1:
                # A plain all-reduce: no barrier and no host sync (unlike Lightning's sync_ddp).
                dist.all_reduce(stacked)
                stacked = stacked / world
            self._pending.append(_queue_to_host(stacked))
        if not module.automatic_optimization:
            self.before_optimizer_step(module)

    def before_optimizer_step(self, module: pl.LightningModule | None) -> None:
        """Raise on a non-finite flag or rows over a static dispatch budget, then log the losses
        kept since the last optimizer step."""
        pending, self._pending = self._pending, []
        if pending:
            pending[-1].wait()  # one stream: the last copy done, all are
        n = len(self._layers)
        if pending and self.check_finite:
            self._raise_if_nonfinite(torch.stack([copy.host[2 * n :] for copy in pending]).amax(0), module)
        for dispatcher in self._budgets:  # rows past a static budget that no rerun took back
            dispatcher.raise_if_over_budget()
        if module is not None and self.fallback.layers:  # a CPU tensor: read without waiting for the GPU
            reruns = torch.tensor(float(self.fallback.reruns))
            module.log("moe/budget_reruns", reruns, on_step=True, on_epoch=False, sync_dist=False)
        if not pending or module is None or not self.log_losses:
            return
        total = sum((copy.host[: 2 * n] for copy in pending[1:]), pending[0].host[: 2 * n])
        aux, z = total[:n] / len(pending), total[n:] / len(pending)
        # CPU tensors: Lightning reads progress-bar values back at every batch end.
        metrics = {"moe/aux_loss": aux.sum(), "moe/z_loss": z.sum()}
        module.log_dict(metrics, prog_bar=True, sync_dist=False, on_step=True, on_epoch=False)
        per_layer = {f"moe/layer_{i}/aux_loss": aux[i] for i in range(n)}
        per_layer |= {f"moe/layer_{i}/z_loss": z[i] for i in range(n)}
        module.log_dict(per_layer, sync_dist=False, on_step=True, on_epoch=False)

    def watch_budgets(self, layers: list[MoELayer], model: nn.Module | None = None) -> None:
        """Check the row budgets of ``layers``' dispatchers on every rank at once, not at their dispatches
        (where an excess may reach one rank's host before another's): ``fallback``'s hooks on ``model``
        rerun a forward over budget; an excess they did not read raises before the optimizer step."""
        self.release()
        self._budgets = [lr.dispatcher for lr in layers if getattr(lr.dispatcher, "budget", None) is not None]
        self.fallback = BudgetFallback(layers if model is not None else [])
        self._hooks = self.fallback.attach(model) if model is not None else []
        for dispatcher in self._budgets:
            dispatcher.budget.raise_at_dispatch = False

    def release(self) -> None:
        """Remove the budget fallback's hooks from the model."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _raise_if_nonfinite(self, flags: torch.Tensor, module: pl.LightningModule | None) -> None:
        """Raise if a forward since the last check had a non-finite value on any rank (``flags``: the
        per-layer maximum over those forwards)."""
        if not bool(flags.any()):
            return
        bad = [i for i, flag in enumerate(flags.tolist()) if flag > 0]
        step = _global_step(module)
        layers = [self._layers[i] for i in bad if i < len(self._layers)]
        raise FloatingPointError(
            f"non-finite router logits or outputs in MoE layer(s) {bad} at global step {step} (on at least "
            f"one rank). {nonfinite_fix(self.precision, layers)} ExpertParallelStrategy(check_finite=False) "
            "skips this check."
        )


def _global_step(module: pl.LightningModule | None) -> int:
    """The Trainer's global step, -1 without one."""
    try:
        return module.trainer.global_step if module is not None else -1
    except RuntimeError:  # not attached to a Trainer
        return -1


def _queue_to_host(values: torch.Tensor) -> HostCopy:
    """``values``' copy to the host, queued on the current stream (``HostCopy``)."""
    return HostCopy(values)


def nonfinite_fix(precision: str, layers: list[MoELayer]) -> str:
    """The likely cause and fix of a non-finite MoE value: half-precision weights under ``"32-true"``
    (no autocast: the layers compute in the weights' own dtype), else the usual instability."""
    half = (torch.float16, torch.bfloat16)
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for lr in layers for p in lr.parameters() if p.dtype in half})
    if precision == "32-true" and dtypes:
        overflow = " (float16 overflows past 65504)" if "float16" in dtypes else ""
        return (
            f"The MoE weights are {' and '.join(dtypes)} under Trainer(precision='32-true'), which computes in "
            f"the weights' own dtype{overflow}: use precision='bf16-mixed' or 'bf16-true', or cast the model to "
            "float32 (e.g. self.model.float() in configure_model)."
        )
    return "Lower the learning rate, raise moe_z_loss_coeff, or clip gradients;"


class _ClipsAcrossMeshes:
    """Lightning's ``gradient_clip_val`` through ``clip_grad_norm_``: ``torch.nn.utils.clip_grad_norm_``
    fails once parameters live on two meshes; the exact norm needs per-mesh partial norms combined
    across ranks. Clipping by value clamps each rank's local shard."""

    def clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        clip_grad_norm_(list(self.main_params(optimizer)), clip_val)  # type: ignore[attr-defined]

    def clip_grad_by_value(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        for p in self.main_params(optimizer):  # type: ignore[attr-defined]
            if p.grad is not None:
                grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                grad.clamp_(-clip_val, clip_val)


class MeshAwarePrecision(_ClipsAcrossMeshes, Precision):
    """``32-true``, clipping across meshes."""


class MeshAwareHalfPrecision(_ClipsAcrossMeshes, HalfPrecision):
    """``bf16-true`` / ``16-true``, clipping across meshes."""


class MeshAwareMixedPrecision(_ClipsAcrossMeshes, MixedPrecision):
    """``bf16-mixed``, clipping across meshes, with fused optimizers too.

    Lightning's ``MixedPrecision`` refuses ``gradient_clip_val`` for an optimizer that unscales
    gradients itself (``torch.optim.AdamW(fused=True)``, ``lightning_ep.optim.AdamW``), since under
    fp16 its gradients would still carry the loss scale when clipped. bf16 has no loss scale
    (``scaler`` is ``None``): the gradients are the true ones, so they are clipped as in ``32-true``.
    """

    def clip_gradients(
        self,
        optimizer: torch.optim.Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        if self.scaler is None:
            Precision.clip_gradients(self, optimizer, clip_val, gradient_clip_algorithm)
        else:
            super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)


def mesh_aware(plugin: Precision) -> Precision:
    """The precision plugin Lightning chose, as its subclass that clips across meshes (same arguments);
    a plugin of another class (a user's own) is kept as it is."""
    kind = type(plugin)
    if kind is Precision:
        return MeshAwarePrecision()
    if kind is HalfPrecision:
        return MeshAwareHalfPrecision(plugin.precision)  # type: ignore[arg-type]
    if kind is MixedPrecision:
        mixed: Any = plugin
        return MeshAwareMixedPrecision(mixed.precision, mixed.device, mixed.scaler)
    return plugin
