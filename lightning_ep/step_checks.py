"""What ``ExpertParallelStrategy`` does around each training step: the MoE losses averaged over
ranks and logged, the non-finite check, and the precision plugin's clipping and check hooks."""

from __future__ import annotations

import types
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lightning_ep.moe.layer import MoELayer
from lightning_ep.parallel.grad_norm import clip_grad_norm_

if TYPE_CHECKING:
    import lightning.pytorch as pl


class StepChecks:
    """Per-step MoE losses and non-finite flags, averaged over ranks with one all-reduce.

    ``after_forward`` runs after each ``training_step``; ``raise_if_nonfinite`` once the closure
    (forward and backward) has been launched, before the optimizer step (see ``check_before_step``).

    Args:
        check_finite: keep the layers' non-finite flags and raise on one.
        log_losses: log ``moe/aux_loss``, ``moe/z_loss`` and their per-layer values.
    """

    def __init__(self, *, check_finite: bool, log_losses: bool) -> None:
        self.check_finite = check_finite
        self.log_losses = log_losses
        # Max over the micro-batches since the last check of the all-reduced per-layer flags.
        self._nonfinite: torch.Tensor | None = None

    def after_forward(self, layers: list[MoELayer], module: pl.LightningModule, device: torch.device) -> None:
        """Average the per-layer losses and non-finite flags over ranks (one all-reduce, no host
        sync), keep the flags, and log the losses. Under manual optimization the flags are read at
        once (the optimizer steps ran inside ``training_step``)."""
        if not layers or not (self.check_finite or self.log_losses):
            return
        n = len(layers)
        flags = [lr.nonfinite.float() if self.check_finite else torch.zeros(()) for lr in layers]
        parts = [*(lr.aux_loss for lr in layers), *(lr.z_loss for lr in layers), *flags]
        stacked = torch.stack([p.to(device=device, dtype=torch.float32) for p in parts])
        if dist.is_available() and dist.is_initialized() and (world := dist.get_world_size()) > 1:
            # A plain all-reduce: no barrier and no host sync (unlike Lightning's sync_ddp).
            dist.all_reduce(stacked)
            stacked = stacked / world
        aux, z, nonfinite = stacked[:n], stacked[n : 2 * n], stacked[2 * n :]
        if self.check_finite:
            self._nonfinite = nonfinite if self._nonfinite is None else torch.maximum(self._nonfinite, nonfinite)
            if not module.automatic_optimization:
                self.raise_if_nonfinite(module)
        if not self.log_losses:
            return
        metrics = {"moe/aux_loss": aux.sum(), "moe/z_loss": z.sum()}
        module.log_dict(metrics, prog_bar=True, sync_dist=False, on_step=True, on_epoch=False)
        per_layer = {f"moe/layer_{i}/aux_loss": aux[i] for i in range(n)}
        per_layer |= {f"moe/layer_{i}/z_loss": z[i] for i in range(n)}
        module.log_dict(per_layer, sync_dist=False, on_step=True, on_epoch=False)

    def raise_if_nonfinite(self, module: pl.LightningModule | None) -> None:
        """Raise if a training forward since the last check had a non-finite value on any rank (one
        host read of the flags, which every rank has after the all-reduce)."""
        flags, self._nonfinite = self._nonfinite, None
        if flags is None or not bool(flags.any()):
            return
        bad = [i for i, flag in enumerate(flags.tolist()) if flag > 0]
        step = module.trainer.global_step if module is not None and module._trainer is not None else -1
        raise FloatingPointError(
            f"non-finite router logits or outputs in MoE layer(s) {bad} at global step {step} (on at least "
            "one rank). Lower the learning rate, raise moe_z_loss_coeff, or clip gradients; "
            "ExpertParallelStrategy(check_finite=False) skips this check."
        )


def check_before_step(plugin: Any, checks: StepChecks) -> None:
    """Run ``checks.raise_if_nonfinite`` after the closure (forward and backward launched), before
    the optimizer step: every Lightning precision plugin calls ``_after_closure`` there."""
    after_closure = plugin._after_closure

    def checked(model: pl.LightningModule, optimizer: Any) -> None:
        checks.raise_if_nonfinite(model)
        after_closure(model, optimizer)

    plugin._after_closure = checked


def use_mesh_aware_clipping(plugin: Any) -> None:
    """Route Lightning's ``gradient_clip_val`` through ``clip_grad_norm_``.

    ``torch.nn.utils.clip_grad_norm_`` fails once parameters live on two meshes; the exact norm
    needs per-mesh partial norms combined across ranks.
    """

    def clip_grad_by_norm(_self: Any, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        clip_grad_norm_(list(plugin.main_params(optimizer)), clip_val)

    def clip_grad_by_value(_self: Any, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        for p in plugin.main_params(optimizer):
            if p.grad is not None:
                grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                grad.clamp_(-clip_val, clip_val)

    plugin.clip_grad_by_norm = types.MethodType(clip_grad_by_norm, plugin)
    plugin.clip_grad_by_value = types.MethodType(clip_grad_by_value, plugin)
