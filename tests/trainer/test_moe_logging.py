"""In one CPU process through the Trainer: the MoE losses the strategy logs reach the loggers at
their cadence (``log_every_n_steps``), the per-layer values consistent with the sums, and
``lightning_ep.optim.AdamW`` steps there as ``torch.optim.AdamW(fused=True)``, bit for bit."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import tiny_mixtral
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from lightning_ep import ExpertParallelStrategy, MoEConfig
from lightning_ep.moe.experts.grouped import local_tensor
from lightning_ep.optim import AdamW


class Module(LightningModule):
    def __init__(self, optimizer: type) -> None:
        super().__init__()
        self.optimizer = optimizer
        self.model = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = tiny_mixtral()

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        if self.optimizer is AdamW:
            return AdamW(self.parameters(), lr=1e-3)
        return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)


def _fit(tmp_path: Path, optimizer: type) -> tuple[Module, list[dict[str, str]], list[torch.Tensor]]:
    module = Module(optimizer)
    strategy = ExpertParallelStrategy(1, moe=MoEConfig(moe_load_balancing="aux_loss"), process_group_backend="gloo")
    trainer = Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=5, log_every_n_steps=2,
        logger=CSVLogger(tmp_path, name="run"), enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    data = torch.randint(0, 128, (10, 16), generator=torch.Generator().manual_seed(0))
    trainer.fit(module, DataLoader(data, batch_size=2))
    weights = [local_tensor(p).detach().clone() for p in module.parameters()]
    if dist.is_initialized():
        dist.destroy_process_group()
    rows = list(csv.DictReader((tmp_path / "run" / "version_0" / "metrics.csv").open()))
    return module, rows, weights


def test_moe_losses_reach_the_loggers_and_adamw_matches_torch(single_process, tmp_path: Path) -> None:
    module, rows, weights = _fit(tmp_path / "ours", AdamW)
    # Steps 1 and 3 (0-based) are the ones log_every_n_steps=2 writes: every key there, the per-layer
    # values summing to the totals.
    assert [int(r["step"]) for r in rows] == [1, 3], rows
    layers = len(module.model.model.layers)
    for row in rows:
        for loss in ("aux_loss", "z_loss"):
            per_layer = [float(row[f"moe/layer_{i}/{loss}"]) for i in range(layers)]
            assert all(v > 0 for v in per_layer), row
            assert abs(sum(per_layer) - float(row[f"moe/{loss}"])) < 1e-5 * float(row[f"moe/{loss}"]), row
    # Logged every step (progress bar, callbacks): the last step's values (4, not a logging step).
    metrics = module.trainer.callback_metrics
    assert float(metrics["moe/aux_loss"]) != pytest.approx(float(rows[-1]["moe/aux_loss"]))
    assert "moe/layer_0/aux_loss" in metrics

    # lightning_ep.optim.AdamW through the Trainer: torch's fused AdamW, the same numbers.
    _, torch_rows, torch_weights = _fit(tmp_path / "torch", torch.optim.AdamW)
    assert rows == torch_rows
    assert all(torch.equal(a, b) for a, b in zip(weights, torch_weights, strict=True))
