"""A 2-step fit with ``MoEMonitor``, CSVLogger and TensorBoardLogger, launched as
``torchrun --nproc-per-node 2 monitor_fit_worker.py --root DIR``.

Rank 0 writes ``DIR/expected.json``: each step's token counts per layer and expert, summed over
ranks by a separate callback (its own all-reduce at the end of fit), to check the logged values.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from torch.utils.data import DataLoader

import lightning_ep
from lightning_ep import ExpertParallelStrategy, MoEConfig, MoEMonitor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for processes.py
from processes import exit_when_parent_dies

BATCH, SEQ, VOCAB = 2, 16, 128


def build_model() -> torch.nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    return MixtralForCausalLM(config).float()


class Module(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model: torch.nn.Module | None = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = build_model()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Recorder(Callback):
    """Every step's ``tokens_per_expert`` of every layer, summed over ranks at the end of fit."""

    def __init__(self) -> None:
        self.steps: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.steps.append(torch.stack([layer.tokens_per_expert for layer in lightning_ep.moe_layers(pl_module)]))

    def on_train_end(self, trainer, pl_module) -> None:
        counts = torch.stack(self.steps)
        dist.all_reduce(counts)
        self.result = {"counts": counts.tolist(), "tokens_per_step": dist.get_world_size() * BATCH * SEQ}


def main() -> None:
    exit_when_parent_dies()
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    root = Path(parser.parse_args().root)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    strategy = ExpertParallelStrategy(
        2, moe=MoEConfig(moe_load_balancing="aux_loss"), process_group_backend="gloo", timeout=timedelta(seconds=120)
    )
    recorder = Recorder()
    trainer = Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_steps=2,
        logger=[CSVLogger(root, name="csv"), TensorBoardLogger(root, name="tb")],
        callbacks=[recorder, MoEMonitor(every_n_steps=1, heatmap_every_n_steps=1)],
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    tokens = torch.randint(0, VOCAB, (32, SEQ), generator=torch.Generator().manual_seed(7))
    trainer.fit(Module(), DataLoader(tokens, batch_size=BATCH, drop_last=True))
    if trainer.is_global_zero:
        (root / "expected.json").write_text(json.dumps(recorder.result))


if __name__ == "__main__":
    main()
