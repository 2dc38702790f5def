"""Fine-tune a Hugging Face MoE model with expert parallelism, from the command line (LightningCLI).

The default config trains a tiny Mixtral from scratch on the byte-level corpus shipped in
``examples/data`` with 4 CPU processes at expert-parallel degree 2, then exports the result to a
Hugging Face folder:

    python examples/finetune.py fit --config examples/configs/cpu_tiny.yaml

``examples/configs/gpu_mixtral.yaml`` shows the GPU layout (bf16, degree 8, activation
checkpointing) for a real Mixtral folder. ``examples/configs/cpu_tiny_lora.yaml`` trains LoRA
adapters (PEFT's ``LoraConfig``, on attention and experts) instead of every weight, and exports the
adapter in PEFT's format beside the merged model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader, Dataset

import lightning_ep  # noqa: F401  (registers strategy="expert_parallel")
from lightning_ep.optim import AdamW

HERE = Path(__file__).resolve().parent


class ByteCorpus(Dataset):
    """Non-overlapping windows of ``seq_len`` bytes of a UTF-8 text file (vocabulary: 256 bytes)."""

    def __init__(self, path: str | Path, seq_len: int) -> None:
        data = torch.frombuffer(bytearray(Path(path).read_bytes()), dtype=torch.uint8).long()
        self.windows = data[: len(data) // seq_len * seq_len].view(-1, seq_len)

    def __len__(self) -> int:
        return self.windows.shape[0]

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.windows[index]


class TextDataModule(LightningDataModule):
    """Byte-level language modelling data from one text file."""

    def __init__(
        self, path: str = str(HERE / "data" / "tiny_corpus.txt"), seq_len: int = 64, batch_size: int = 4
    ) -> None:
        super().__init__()
        self.path = path
        self.seq_len = seq_len
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        # Lightning adds a DistributedSampler with the strategy's ranks: every rank gets its own data.
        return DataLoader(ByteCorpus(self.path, self.seq_len), batch_size=self.batch_size, shuffle=True, drop_last=True)


class MoECausalLM(LightningModule):
    """A Hugging Face causal LM with MoE blocks, trained with unchanged Lightning code.

    Args:
        model: keyword arguments of a ``MixtralConfig`` to train from scratch, or ``None``.
        pretrained: a Hugging Face folder (``save_pretrained`` output) to fine-tune; each rank reads
            only its own slices of the weights.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
        lora: keyword arguments of a ``peft.LoraConfig`` (e.g. ``r``, ``target_modules``,
            ``target_parameters``): the model is wrapped by ``peft.get_peft_model`` and only the
            adapters train. ``None``: full fine-tuning.
    """

    def __init__(
        self,
        model: dict[str, Any] | None = None,
        pretrained: str | None = None,
        lr: float = 3e-3,
        weight_decay: float = 0.0,
        lora: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if (model is None) == (pretrained is None):
            raise ValueError("MoECausalLM: pass exactly one of `model` (a MixtralConfig dict) or `pretrained`.")
        self.save_hyperparameters()
        self.model: torch.nn.Module | None = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        if self.hparams.pretrained:
            from lightning_ep.models.pretrained import from_pretrained

            self.model = from_pretrained(self.hparams.pretrained)
        else:
            from transformers import MixtralConfig, MixtralForCausalLM

            self.model = MixtralForCausalLM(MixtralConfig(**self.hparams.model))
        if self.hparams.lora:
            from peft import LoraConfig, get_peft_model

            self.model = get_peft_model(self.model, LoraConfig(**self.hparams.lora))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # torch's fused AdamW, bit for bit, with one Triton kernel per large CUDA tensor (torch's kernels on the CPU).
        trainable = [p for p in self.parameters() if p.requires_grad]  # with LoRA: the adapters only
        return AdamW(trainable, lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)


class ExportHF(Callback):
    """At the end of fit, save a checkpoint and export it to a Hugging Face folder (``hf``; a LoRA
    run: the adapter merged in), and for a LoRA run the adapter in PEFT's format (``adapter``) and
    the base model it adapts (``base``)."""

    def __init__(self, dirpath: str = "runs/tiny") -> None:
        self.dirpath = Path(dirpath)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        from lightning_ep.models.hf_io import export_hf

        checkpoint = self.dirpath / "last.ckpt"
        trainer.save_checkpoint(checkpoint)
        export_hf(pl_module.model, self.dirpath / "hf", hf_config_or_folder=pl_module.model.config)
        if pl_module.hparams.get("lora"):
            from lightning_ep.models.lora_export import export_lora_adapter

            # The frozen base (trained from scratch here) and the adapter, for PeftModel.from_pretrained.
            config = pl_module.model.config
            export_hf(pl_module.model, self.dirpath / "base", hf_config_or_folder=config, merge_lora=False)
            export_lora_adapter(pl_module.model, self.dirpath / "adapter", hf_config_or_folder=config)
            if trainer.is_global_zero:
                print(f"LoRA adapter (PEFT format): {self.dirpath / 'adapter'}, its base: {self.dirpath / 'base'}")
        if trainer.is_global_zero:
            print(f"checkpoint: {checkpoint}\nHugging Face export: {self.dirpath / 'hf'}")


def main() -> None:
    LightningCLI(MoECausalLM, TextDataModule, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
