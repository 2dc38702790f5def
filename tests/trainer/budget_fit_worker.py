"""One Trainer fit at degree 2 on gloo whose first MoE layer is routed past its row budget on some
steps (``test_budget_fallback.py``). Writes per rank the losses, what was logged, the budgets and
the final local weights.

    python tests/forkrun.py --nproc-per-node=2 --master-port=P tests/trainer/budget_fit_worker.py \
        --out DIR --row-budget {none,auto,24}
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import DataLoader, Dataset

import lightning_ep
from lightning_ep import Execution, ExpertParallelStrategy, MoEConfig
from lightning_ep.moe.routing.router import Routing

SKEWED_STEPS = (1, 3)  # optimizer steps whose first MoE layer sends every token to experts 0 and 1


class Batches(Dataset):
    """Token ids with right padding: sample ``i`` has ``10 + 3 * (i % 4)`` real tokens of 16."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 128, (16,), generator=torch.Generator().manual_seed(i))
        mask = (torch.arange(16) < 10 + 3 * (i % 4)).long()
        return {"input_ids": ids, "attention_mask": mask, "labels": torch.where(mask.bool(), ids, -100)}


class Module(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model: torch.nn.Module | None = None
        self.losses: list[float] = []

    def configure_model(self) -> None:
        from transformers import MixtralConfig, MixtralForCausalLM

        if self.model is not None:
            return
        torch.manual_seed(0)
        config = MixtralConfig(
            vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, attention_dropout=0.1,
            router_jitter_noise=0.1,
        )  # fmt: skip
        self.model = MixtralForCausalLM(config)

    def on_fit_start(self) -> None:
        lightning_ep.moe_layers(self.model)[0].gate.register_forward_hook(self._skew)

    def _skew(self, gate, _inputs, routing: Routing) -> Routing:
        if self.global_step not in SKEWED_STEPS:
            return routing
        ids = torch.zeros_like(routing.expert_ids_TK)
        ids[:, 1] = 1  # experts 0 and 1: both on expert-parallel rank 0
        return Routing(routing.logits_TE, routing.probs_TE, ids, routing.weights_TK)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        self.log_dict({"calls": 1.0}, on_step=False, on_epoch=True, reduce_fx="sum")
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, foreach=False)


def main() -> None:
    from lightning.pytorch.callbacks import Callback

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--row-budget", default="none")
    args = parser.parse_args()
    budget = {"none": None, "auto": "auto"}.get(args.row_budget, None)
    if args.row_budget not in ("none", "auto"):
        budget = int(args.row_budget)
    logged: list[dict[str, float]] = []

    class KeepLogged(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            logged.append({k: float(v) for k, v in trainer.callback_metrics.items()})

    strategy = ExpertParallelStrategy(
        degree=2, moe=MoEConfig(moe_load_balancing="balanced"), execution=Execution(row_budget=budget)
    )
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=4, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[KeepLogged()],
    )  # fmt: skip
    module = Module()
    trainer.fit(module, DataLoader(Batches(), batch_size=2))
    rank = dist.get_rank()
    layers = lightning_ep.moe_layers(module.model)
    result = {
        "losses": module.losses,
        "logged": logged,
        "epoch": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "dispatchers": [type(layer.dispatcher).__name__ for layer in layers],
        "budgets": [getattr(getattr(layer.dispatcher, "budget", None), "budget", None) for layer in layers],
    }
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    weights = {n: (p.to_local() if hasattr(p, "to_local") else p).detach() for n, p in module.model.named_parameters()}
    torch.save(weights, os.path.join(args.out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main()
