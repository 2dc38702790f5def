"""A fine-tune from a published folder through the Trainer, launched as
``torchrun --nproc-per-node N published_fit_worker.py FOLDER REFERENCE OUT PRECISION [FORMAT]``.

``configure_model`` builds the model with ``lightning_ep.models.pretrained.from_pretrained(FOLDER)``
on the meta device; the strategy transforms it, shards it at degree 2 and reads each rank's blocks.
At the start of training every full parameter is compared with ``REFERENCE`` (transformers' own
dequantized load, fp32); then two steps train. Rank 0 writes the parameters found equal and not,
the losses, and each rank's warnings about ignored weights to ``OUT`` (JSON). With ``FORMAT``, the
routed experts are frozen and kept in that format (``frozen_experts``) at degree 1, each rank holding
half of every expert's bytes; their dequantized values are compared too.
"""

from __future__ import annotations

import json
import sys
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import DataLoader

from lightning_ep import ExpertParallelStrategy, MoEConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for processes.py
from processes import exit_when_parent_dies


class FromFolder(LightningModule):
    def __init__(self, folder: str, reference: str, frozen: str | None = None) -> None:
        super().__init__()
        self.folder, self.reference, self.frozen = folder, reference, frozen
        self.model: torch.nn.Module | None = None
        self.equal: list[str] = []
        self.differ: list[str] = []
        self.losses: list[float] = []

    def configure_model(self) -> None:
        from lightning_ep.models.pretrained import from_pretrained

        if self.model is None:
            self.model = from_pretrained(self.folder)
            if self.frozen:  # the routed experts stay frozen, kept in the strategy's frozen_experts format
                for name, p in self.model.named_parameters():
                    p.requires_grad_(not name.endswith(("experts.gate_up_proj", "experts.down_proj")))

    def on_train_start(self) -> None:
        from lightning_ep.moe.experts.frozen import FrozenExpertWeight

        state = torch.load(self.reference)
        for name, p in self.model.named_parameters():  # type: ignore[union-attr]
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            (self.equal if torch.equal(full.detach(), state[name]) else self.differ).append(name)
        for name, m in self.model.named_modules():  # type: ignore[union-attr]
            if isinstance(m, FrozenExpertWeight):  # at degree 1 every expert is local (its bytes gathered)
                (self.equal if torch.equal(m.dequantize(torch.float32), state[name]) else self.differ).append(name)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss  # type: ignore[misc]
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    exit_when_parent_dies()
    folder, reference, out, precision = sys.argv[1:5]
    frozen = sys.argv[5] if len(sys.argv) > 5 else None  # a frozen_experts format: degree 1, the bytes split
    torch.manual_seed(0)
    tokens = torch.randint(0, 128, (8, 16))
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ExpertParallelStrategy(
            degree=1 if frozen else 2, moe=MoEConfig(moe_load_balancing="none"), process_group_backend="gloo",
            timeout=timedelta(seconds=120), frozen_experts=frozen,  # type: ignore[arg-type]
        ),
        max_steps=2,
        precision=precision,  # type: ignore[arg-type]
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    module = FromFolder(folder, reference, frozen)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, DataLoader(tokens, batch_size=2))
    ignored = [str(w.message) for w in caught if "load_pretrained_sharded: ignored" in str(w.message)]
    per_rank: list = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, ignored)
    if dist.get_rank() == 0:
        result = {"equal": module.equal, "differ": module.differ, "losses": module.losses, "ignored": per_rank}
        Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
