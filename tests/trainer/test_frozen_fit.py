"""Frozen expert weights kept in FP8 through the real Trainer on one CPU process, read from a bf16
folder built on the meta device (``from_pretrained``): under ``bf16-true``, which casts the whole
model to bf16, the stored bytes and the fp32 block scales stay exactly ``quantize_fp8``'s of the
folder's weights, and two steps train the router."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from conftest import tiny_mixtral
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import DataLoader

from lightning_ep import ExpertParallelStrategy
from lightning_ep.moe.experts.frozen import FrozenExpertWeight
from lightning_ep.moe.quantized import quantize_fp8


class FromFolder(LightningModule):
    def __init__(self, folder: Path) -> None:
        super().__init__()
        self.folder = folder
        self.model: torch.nn.Module | None = None
        self.stored: dict[str, dict[str, torch.Tensor]] = {}
        self.losses: list[float] = []

    def configure_model(self) -> None:
        from lightning_ep.models.pretrained import from_pretrained

        if self.model is None:
            self.model = from_pretrained(self.folder)
            for name, p in self.model.named_parameters():
                p.requires_grad_(".gate." in name)  # the routers train, every expert is frozen

    def on_train_start(self) -> None:
        for name, m in self.named_modules():
            if isinstance(m, FrozenExpertWeight):
                self.stored[name.removeprefix("model.")] = {k: v.clone() for k, v in m.stored().items()}

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss  # type: ignore[misc]
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)


def test_bf16_true_keeps_the_fp8_scales_in_fp32(tmp_path: Path, single_process) -> None:
    source = tiny_mixtral().to(torch.bfloat16)
    source.save_pretrained(tmp_path / "bf16")
    module = FromFolder(tmp_path / "bf16")
    trainer = Trainer(
        accelerator="cpu", devices=1, precision="bf16-true", max_steps=2, logger=False,
        strategy=ExpertParallelStrategy(1, frozen_experts="fp8", process_group_backend="gloo"),
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    data = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))
    try:
        trainer.fit(module, DataLoader(data, batch_size=2))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert len(module.stored) == 2 * source.config.num_hidden_layers and len(module.losses) == 2
    for name, stored in module.stored.items():
        # ``model.layers.0.mlp.experts.gate_up_proj``: Mixtral's w1 and w3 fused as transformers fuses them.
        data, scale_inv = quantize_fp8(source.get_parameter(name).detach())
        assert stored["scale_inv"].dtype == torch.float32, name
        assert torch.equal(stored["scale_inv"], scale_inv), name
        assert torch.equal(stored["data"], data.view(torch.uint8)), name
