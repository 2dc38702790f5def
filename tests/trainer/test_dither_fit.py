"""``ExpertParallelStrategy(dither_master_weights=True)`` through the real Trainer on one CPU process:
under ``bf16-mixed`` the masters loaded from bf16 leave the grid at setup, the first step's loss is
the undithered run's bit for bit (the bf16 weights are the same), and other precisions are refused."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
from conftest import tiny_mixtral
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import DataLoader

from lightning_ep import ExpertParallelStrategy
from lightning_ep.parallel.dither import on_bf16_grid

STEPS = 3


class Module(LightningModule):
    """A tiny Mixtral whose weights are a bf16 checkpoint's (``on_grid``) or fp32 ones."""

    def __init__(self, on_grid: bool = True) -> None:
        super().__init__()
        self.on_grid = on_grid
        self.model: torch.nn.Module | None = None
        self.losses: list[float] = []
        self.masters_at_start: dict[str, torch.Tensor] = {}

    def configure_model(self) -> None:
        if self.model is None:
            self.model = tiny_mixtral()
            with torch.no_grad():
                for p in self.model.parameters():
                    p.copy_(p.to(torch.bfloat16).float() if self.on_grid else p * (1 + 1e-6 * torch.rand_like(p)))

    def on_fit_start(self) -> None:
        self.masters_at_start = {n: p.to_local().detach().clone() for n, p in self.named_parameters()}

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss
        self.losses.append(float(loss))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _fit(dither: bool, precision: str = "bf16-mixed", on_grid: bool = True) -> Module:
    module = Module(on_grid)
    trainer = Trainer(
        accelerator="cpu", devices=1, precision=precision, max_steps=STEPS, logger=False,
        strategy=ExpertParallelStrategy(1, dither_master_weights=dither, process_group_backend="gloo"),
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    data = torch.randint(0, 128, (2 * STEPS, 16), generator=torch.Generator().manual_seed(0))
    try:
        trainer.fit(module, DataLoader(data, batch_size=2))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return module


def test_dithered_masters_keep_the_first_step(single_process, caplog: pytest.LogCaptureFixture) -> None:
    plain = _fit(dither=False)
    with caplog.at_level(logging.INFO):
        dithered = _fit(dither=True)
    assert "fp32 master weights loaded from bf16" in caplog.text and "moved inside their bf16 rounding" in caplog.text
    assert dithered.losses[0] == plain.losses[0]  # the same bf16 weights in the first forward
    for name, master in dithered.masters_at_start.items():
        undithered = plain.masters_at_start[name]
        assert on_bf16_grid(undithered) and not on_bf16_grid(master), name
        assert torch.equal(master.to(torch.bfloat16), undithered.to(torch.bfloat16)), name


def test_nothing_on_the_grid_is_said(single_process) -> None:
    with pytest.warns(UserWarning, match="no trainable fp32 parameter holds bf16 values"):
        module = _fit(dither=True, on_grid=False)
    assert len(module.losses) == STEPS


@pytest.mark.parametrize("precision", ["bf16-true", "32-true"])
def test_other_precisions_are_refused(precision: str) -> None:
    message = rf"only bf16-mixed reads them through, but the Trainer's precision is '{precision}'"
    with pytest.raises(ValueError, match=message):
        Trainer(
            accelerator="cpu", devices=1, precision=precision,
            strategy=ExpertParallelStrategy(1, dither_master_weights=True, process_group_backend="gloo"),
        )  # fmt: skip


def test_a_non_bool_is_refused() -> None:
    with pytest.raises(TypeError, match=r"dither_master_weights='yes'\): pass True or False"):
        ExpertParallelStrategy(1, dither_master_weights="yes")  # type: ignore[arg-type]
