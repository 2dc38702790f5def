"""The token-weighted objective's first optimizer step, through the Trainer or on one process.

``forkrun.py --nproc-per-node 2 token_weighted_worker.py --out OUT``: ``ExpertParallelStrategy``
at degree 2 on 2 gloo ranks, ``accumulate_grad_batches=2``, a ``TokenWeightedDataLoader`` of 2
rows per micro-batch (Lightning's distributed sampler, shuffled with seed 0) and
``training_step`` returning ``self.model(**batch).loss``. Rank 0 saves every parameter's full
gradient just before the first optimizer step (``OUT.pt``) and each micro-batch's labelled tokens
and ``num_items_in_batch`` (``OUT.json``).

``--reference``: the same step on one process, written out by hand. The cross-entropy part is the
gradient of the sum of the per-token losses over the step's labelled tokens divided by their count,
from one forward of the step's 8 rows; the MoE aux and z losses are each micro-batch's own on each
rank's tokens, weighted ``1 / (accumulate_grad_batches * world)`` (their mean over the step's
micro-batches and ranks, as without token weighting). Also saved: the cross-entropy part alone,
and the gradient of the per-micro-batch-mean objective, which the test uses to show that what it
compares is sensitive to both.
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
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.utils.data import Dataset, DistributedSampler

import lightning_ep
from lightning_ep import ExpertParallelStrategy, MoEConfig
from lightning_ep.data import TokenWeightedDataLoader, count_loss_tokens

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for processes.py
sys.path.insert(0, str(Path(__file__).resolve().parent))  # fit_worker's model
from fit_worker import VOCAB, build_model
from processes import exit_when_parent_dies

SEQ = 16
WORLD, ACCUMULATE, BATCH = 2, 2, 2
MOE = MoEConfig(moe_load_balancing="aux_loss", moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)
# Per row: (real tokens, first labelled position, last labelled position + 1); positions past the
# real tokens are padding (attention_mask 0, label -100). Rows 0, 4 and 6 label position 0, which
# the shifted loss never predicts. Under Lightning's sampler the micro-batches get 30 and 2 labelled
# tokens on rank 0, 13 and 3 on rank 1.
ROWS = [(6, 0, 6), (16, 15, 16), (10, 9, 10), (16, 8, 16), (16, 0, 16), (16, 14, 16), (13, 0, 2), (16, 1, 16)]


class LabelledRows(Dataset):
    """``ROWS`` as dict samples: ``input_ids``, ``attention_mask`` and ``labels``, all ``[SEQ]``."""

    def __init__(self) -> None:
        ids = torch.randint(0, VOCAB, (len(ROWS), SEQ), generator=torch.Generator().manual_seed(3))
        self.samples = []
        for row, (real, start, stop) in enumerate(ROWS):
            mask = (torch.arange(SEQ) < real).long()
            labels = torch.full((SEQ,), -100)
            labels[start:stop] = ids[row, start:stop]
            self.samples.append({"input_ids": ids[row] * mask, "attention_mask": mask, "labels": labels})

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.samples[i]


def micro_batches(dataset: LabelledRows) -> list[list[dict[str, torch.Tensor]]]:
    """``[rank][micro-batch]``: what Lightning's sampler (``shuffle=True``, seed 0, epoch 0) gives each rank."""
    out = []
    for rank in range(WORLD):
        order = list(DistributedSampler(dataset, num_replicas=WORLD, rank=rank, shuffle=True, seed=0))
        rows = [[dataset[i] for i in order[m * BATCH : (m + 1) * BATCH]] for m in range(ACCUMULATE)]
        out.append([{k: torch.stack([s[k] for s in ss]) for k in ss[0]} for ss in rows])
    return out


class Module(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model: torch.nn.Module | None = None
        self.seen: list[tuple[int, float]] = []

    def configure_model(self) -> None:
        if self.model is None:
            self.model = build_model()

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.seen.append((int(count_loss_tokens(batch)), float(batch["num_items_in_batch"])))
        return self.model(**batch).loss

    def train_dataloader(self) -> TokenWeightedDataLoader:
        return TokenWeightedDataLoader(
            LabelledRows(), batch_size=BATCH, accumulate_grad_batches=self.trainer.accumulate_grad_batches
        )

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class SaveGradients(Callback):
    """Every parameter's full gradient before the first optimizer step, saved by rank 0."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        from torch.distributed.tensor import DTensor

        grads = {}
        for name, p in pl_module.model.named_parameters():
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            grads[name] = g.detach().clone()
        if trainer.is_global_zero:
            torch.save(grads, self.path)


def run_trainer(out: Path) -> None:
    strategy = ExpertParallelStrategy(
        2, moe=MOE, process_group_backend="gloo", timeout=timedelta(seconds=120), log_moe_losses=False
    )
    trainer = Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=strategy,
        precision="32-true",
        max_steps=1,
        accumulate_grad_batches=ACCUMULATE,
        logger=False,
        callbacks=[SaveGradients(str(out.with_suffix(".pt")))],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = Module()
    trainer.fit(module)
    seen: list = [None] * WORLD
    dist.all_gather_object(seen, module.seen)
    if trainer.is_global_zero:
        out.with_suffix(".json").write_text(json.dumps({"seen": seen}))


def run_reference(out: Path) -> None:
    model = lightning_ep.transform(build_model(), MOE).train()
    steps = micro_batches(LabelledRows())
    rows = {k: torch.cat([b[k] for rank in steps for b in rank]) for k in ("input_ids", "attention_mask", "labels")}

    def gradients() -> dict[str, torch.Tensor]:
        grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        return grads

    def cross_entropy_sum(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        targets = batch["labels"][:, 1:]  # position t predicts token t + 1
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum")

    def set_router_loss_scale(scale: float) -> None:
        for layer in lightning_ep.moe_layers(model):
            layer.loss_scale = scale

    # The cross-entropy: one forward of the step's rows, sum over its labelled tokens / their count.
    count = int((rows["labels"][:, 1:] != -100).sum())
    set_router_loss_scale(0.0)
    (cross_entropy_sum(rows) / count).backward()
    cross_entropy = gradients()
    # The router losses of each rank's micro-batch, weighted 1 / (accumulate * world).
    set_router_loss_scale(1.0 / (ACCUMULATE * WORLD))
    for rank in steps:
        for batch in rank:
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            (logits * 0).sum().backward()  # only the attached aux and z losses give gradients
    router = gradients()
    # The per-micro-batch mean objective with the same router losses, for contrast.
    for rank in steps:
        for batch in rank:
            n = int((batch["labels"][:, 1:] != -100).sum())
            (cross_entropy_sum(batch) / n / (ACCUMULATE * WORLD)).backward()
    mean_objective = gradients()
    torch.save(
        {
            "token_weighted": {k: cross_entropy[k] + router[k] for k in cross_entropy},
            "cross_entropy": cross_entropy,
            "mean_objective": {k: mean_objective[k] for k in cross_entropy},
            "counts": [[int(count_loss_tokens(b)) for b in rank] for rank in steps],
        },
        out.with_suffix(".pt"),
    )


def main() -> None:
    exit_when_parent_dies()
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--reference", action="store_true")
    args = parser.parse_args()
    out = Path(args.out)
    if args.reference:
        run_reference(out)
    else:
        run_trainer(out)
    if dist.is_initialized():  # as fit_worker.py: no interpreter finalization under gloo
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
