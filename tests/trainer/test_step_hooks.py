"""The user's optimizer is stepped as they built it, through the real Trainer on one CPU process.

``torch.optim.AdamW(fused=True)`` and ``lightning_ep.optim.AdamW``, each without a scheduler, with a
``LambdaLR`` stepped by Lightning, and under manual optimization: the optimizer keeps its class and
the ``step`` the scheduler wrapped, the user's step pre- and post-hooks fire once per step, the
``"balanced"`` expert biases (moved by the strategy's step post-hook) move at every step, and the
learning rate follows the schedule. The kernels on CUDA under a scheduler:
``tests/gpu/test_execution_cuda.py::test_the_table_says_what_steps_under_a_scheduler``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import tiny_mixtral
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import DataLoader

from lightning_ep import ExpertParallelStrategy, MoEConfig, moe_layers
from lightning_ep.execution.adamw import KERNEL_ADAMW, TORCH_ADAMW
from lightning_ep.optim import AdamW

STEPS = 3
LR = 1e-3


class Module(LightningModule):
    """A tiny Mixtral whose ``configure_optimizers`` builds ``optimizer`` (and a halving ``LambdaLR``
    unless ``loop`` is ``"plain"``), with hooks that record each step."""

    def __init__(self, optimizer: str, loop: str) -> None:
        super().__init__()
        self.optimizer_kind, self.loop = optimizer, loop
        self.automatic_optimization = loop != "manual"
        self.model: torch.nn.Module | None = None
        self.calls: list[str] = []
        self.bias_moves = 0
        self.built: tuple[torch.optim.Optimizer, object] | None = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = tiny_mixtral(num_local_experts=8)

    def configure_optimizers(self):
        optimizer: torch.optim.Optimizer
        if self.optimizer_kind == "lightning_ep":
            optimizer = AdamW(self.parameters(), lr=LR)
        else:
            optimizer = torch.optim.AdamW(self.parameters(), lr=LR, fused=True)
        optimizer.register_step_pre_hook(lambda *_: self.calls.append("pre"))
        optimizer.register_step_post_hook(lambda *_: self.calls.append("post"))
        if self.loop == "plain":
            self.built = (optimizer, vars(optimizer).get("step"))
            return optimizer
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
        self.built = (optimizer, vars(optimizer).get("step"))  # the scheduler's wrapper of the bound step
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def training_step(self, batch: torch.Tensor, batch_idx: int):
        self._biases_before = [layer.gate.expert_bias.clone() for layer in moe_layers(self.model)]
        loss = self.model(input_ids=batch, labels=batch).loss
        if self.automatic_optimization:
            return loss
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        self.lr_schedulers().step()
        return None

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        after = [layer.gate.expert_bias for layer in moe_layers(self.model)]
        self.bias_moves += all(not torch.equal(a, b) for a, b in zip(after, self._biases_before, strict=True))


@pytest.mark.parametrize("loop", ["plain", "scheduler", "manual"])
@pytest.mark.parametrize("optimizer", ["torch", "lightning_ep"])
def test_step_hooks_fire_and_balanced_biases_move(single_process, optimizer: str, loop: str) -> None:
    module = Module(optimizer, loop)
    strategy = ExpertParallelStrategy(1, moe=MoEConfig(moe_load_balancing="balanced"), process_group_backend="gloo")
    trainer = Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=STEPS, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    data = torch.randint(0, 128, (2 * STEPS, 16), generator=torch.Generator().manual_seed(0))
    trainer.fit(module, DataLoader(data, batch_size=2))
    if dist.is_initialized():
        dist.destroy_process_group()

    assert module.built is not None
    built, wrapped_step = module.built
    assert strategy.optimizers == [built]
    assert type(built) is (AdamW if optimizer == "lightning_ep" else torch.optim.AdamW)
    assert vars(built).get("step") is wrapped_step, "the step the scheduler wrapped is the one that runs"
    assert (wrapped_step is None) == (loop == "plain")
    assert module.calls == ["pre", "post"] * STEPS
    assert module.bias_moves == STEPS, "the strategy's post-hook moved the balanced biases at every step"
    assert all(torch.count_nonzero(layer.gate.expert_bias) > 0 for layer in moe_layers(module.model))
    assert built.param_groups[0]["lr"] == (LR if loop == "plain" else LR * 0.5**STEPS)
    # The table reports the optimizer as built: on CPU lightning_ep.optim.AdamW steps with torch's kernels.
    assert strategy.resolved is not None
    assert strategy.resolved.environment.optimizers == (KERNEL_ADAMW if optimizer == "lightning_ep" else TORCH_ADAMW,)
    assert not strategy.resolved.fused_adamw
    assert ("fused_adamw", "off", "auto: off on CPU") in [
        (c.name, c.value, c.reason) for c in strategy.resolved.choices
    ]
    if isinstance(built, AdamW):
        assert built.kernel_launches == 0


class ClippedModule(Module):
    """``Module`` recording the gradients' total norm before and after Lightning clips them."""

    def __init__(self, optimizer: str) -> None:
        super().__init__(optimizer, "scheduler")
        self.norms: list[tuple[float, float]] = []

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        before = _grad_norm(self)
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        self.norms.append((before, _grad_norm(self)))


def _grad_norm(module: LightningModule) -> float:
    grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in module.parameters()]
    return float(torch.linalg.vector_norm(torch.stack([g.float().norm() for g in grads if g is not None])))


@pytest.mark.parametrize("optimizer", ["torch", "lightning_ep"])
def test_bf16_mixed_clips_with_a_fused_optimizer(single_process, optimizer: str) -> None:
    """Lightning's bf16 ``MixedPrecision`` refuses ``gradient_clip_val`` for fused optimizers (a guard
    for fp16's loss scale, which bf16 does not have); under the strategy the gradients are clipped."""
    clip = 1e-3
    module = ClippedModule(optimizer)
    strategy = ExpertParallelStrategy(1, moe=MoEConfig(moe_load_balancing="balanced"), process_group_backend="gloo")
    trainer = Trainer(
        accelerator="cpu", devices=1, strategy=strategy, precision="bf16-mixed", gradient_clip_val=clip,
        max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    data = torch.randint(0, 128, (2 * STEPS, 16), generator=torch.Generator().manual_seed(0))
    trainer.fit(module, DataLoader(data, batch_size=2))
    if dist.is_initialized():
        dist.destroy_process_group()

    assert len(module.norms) == STEPS
    for before, after in module.norms:
        assert before > 10 * clip, "the gradients must be larger than the bound for the test to show clipping"
        assert after == pytest.approx(clip, rel=1e-3), (before, after)  # clip_grad_norm_'s 1e-6 epsilon
