"""On one GPU, in a real Trainer run with the progress bar and a logger writing every step: the MoE
losses the strategy logs are CPU tensors, so Lightning's batch-end handling (the progress bar's
``.item()`` of every ``prog_bar=True`` value, the logger's conversion) never waits for the GPU.
``torch.cuda.set_sync_debug_mode("error")`` between a batch's end and the next batch's start turns
any such wait into an error."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from conftest import tiny_mixtral_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_logged_moe_losses_never_make_the_host_wait(single_process: None, tmp_path: Path) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger
    from transformers import MixtralForCausalLM

    from lightning_ep import ExpertParallelStrategy, MoEConfig

    class Module(pl.LightningModule):
        def configure_model(self) -> None:
            if not hasattr(self, "model"):
                torch.manual_seed(0)
                self.model = MixtralForCausalLM(tiny_mixtral_config(hidden_size=128, intermediate_size=64))

        def training_step(self, batch: torch.Tensor, _: int) -> torch.Tensor:
            return self.model(input_ids=batch, labels=batch, use_cache=False).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)

    class NoWaitBetweenSteps(pl.Callback):
        """Sync debug mode "error" from a batch's end (before Lightning reads the logged values) to
        the next batch's start; records the devices of the MoE values Lightning holds."""

        def __init__(self) -> None:
            self.devices: set[str] = set()
            self.pbar: list[dict] = []

        def on_train_batch_start(self, trainer: pl.Trainer, *_: object) -> None:
            torch.cuda.set_sync_debug_mode("default")
            if trainer.global_step:
                self.pbar.append(dict(trainer.progress_bar_metrics))

        def on_train_batch_end(self, trainer: pl.Trainer, *_: object) -> None:
            metrics = trainer.callback_metrics
            self.devices |= {v.device.type for k, v in metrics.items() if k.startswith("moe/")}
            torch.cuda.set_sync_debug_mode("error")

    watch = NoWaitBetweenSteps()
    strategy = ExpertParallelStrategy(1, moe=MoEConfig(moe_load_balancing="aux_loss"))
    trainer = pl.Trainer(
        accelerator="gpu", devices=1, strategy=strategy, precision="bf16-mixed", max_steps=4,
        log_every_n_steps=1, logger=CSVLogger(tmp_path, name="run"), callbacks=[watch],
        enable_checkpointing=False, enable_model_summary=False,
    )  # fmt: skip
    data = torch.randint(0, 128, (16, 32), generator=torch.Generator().manual_seed(1))
    try:
        trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=4, pin_memory=True))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert watch.devices == {"cpu"}
    assert watch.pbar and all(isinstance(p["moe/aux_loss"], float) and p["moe/aux_loss"] > 0 for p in watch.pbar)
    rows = list(csv.DictReader((tmp_path / "run" / "version_0" / "metrics.csv").open()))
    assert [int(r["step"]) for r in rows] == [0, 1, 2, 3]
    assert all(float(r["moe/aux_loss"]) > 0 and float(r["moe/z_loss"]) > 0 for r in rows)
