"""Fine-tune a Hugging Face MoE model with expert parallelism, from the command line (LightningCLI).

The default config trains a tiny Mixtral from scratch on the byte-level corpus shipped in
``examples/data`` with 4 CPU processes at expert-parallel degree 2, then exports the result to a
Hugging Face folder:

    python examples/finetune.py fit --config examples/configs/cpu_tiny.yaml

``examples/configs/gpu_mixtral.yaml`` shows the GPU layout for a real Mixtral folder on one node
(``bf16-true``, so that Mixtral-8x7B's states fit 8 GPUs of 80 GB, with torchao's stochastic-rounding
AdamW so that small updates are not rounded away; degree 8, activation checkpointing). For a real
fine-tune (a tokenizer, chat data, a schedule, weight-decay groups) see ``examples/chat_finetune.py``.
``examples/configs/cpu_tiny_lora.yaml`` trains LoRA
adapters (PEFT's ``LoraConfig``, on attention and experts) instead of every weight, and exports the
adapter in PEFT's format beside the merged model.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

import lightning_ep
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
        optimizer: ``"adamw"``: ``lightning_ep.optim.AdamW`` (torch's fused AdamW). ``"adamw_sr"``:
            torchao's AdamW with bf16 stochastic rounding, for ``precision="bf16-true"``: bf16
            weights round an update below half their last bit away, at fine-tuning learning rates
            most of them; stochastic rounding lands them on average (``pip install torchao``).
    """

    def __init__(
        self,
        model: dict[str, Any] | None = None,
        pretrained: str | None = None,
        lr: float = 3e-3,
        weight_decay: float = 0.0,
        lora: dict[str, Any] | None = None,
        optimizer: str = "adamw",
    ) -> None:
        super().__init__()
        if (model is None) == (pretrained is None):
            raise ValueError("MoECausalLM: pass exactly one of `model` (a MixtralConfig dict) or `pretrained`.")
        if optimizer not in ("adamw", "adamw_sr"):
            raise ValueError(f"MoECausalLM(optimizer={optimizer!r}): choose 'adamw' or 'adamw_sr'.")
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
        if self.hparams.optimizer == "adamw_sr":
            try:
                from torchao.optim import _AdamW
            except ImportError as err:
                raise ImportError(
                    "MoECausalLM(optimizer='adamw_sr') needs torchao (pip install torchao); or train in "
                    "precision='bf16-mixed' with optimizer='adamw'."
                ) from err
            hyper = {"lr": self.hparams.lr, "weight_decay": self.hparams.weight_decay}
            return _AdamW(trainable, **hyper, bf16_stochastic_round=True)
        return AdamW(trainable, lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)


class StepProgressBar(TQDMProgressBar):
    """A progress bar in optimizer steps out of ``max_steps``, with the losses logged to it.

    Lightning's bar counts the batches of each epoch and titles itself ``Epoch {epoch}/{max_epochs - 1}``:
    a run bounded by ``max_steps`` leaves ``max_epochs`` at -1, hence ``Epoch 2/-2``. This one shows
    ``step 40/60`` across epochs and leaves out the logger's version (``v_num``). Without a ``max_steps``
    it is Lightning's bar.
    """

    @override
    def init_train_tqdm(self) -> Tqdm:
        if self.trainer.max_steps <= 0:
            return super().init_train_tqdm()
        return Tqdm(
            desc="step",
            total=self.trainer.max_steps,
            initial=self.trainer.global_step,  # a resumed run starts where it stopped
            position=2 * self.process_position,
            disable=self.is_disabled,
            leave=True,
            dynamic_ncols=True,
            file=sys.stdout,
            smoothing=0,
            bar_format=self.BAR_FORMAT,
        )

    @override
    def on_train_epoch_start(self, trainer: Trainer, *args: Any) -> None:
        if trainer.max_steps <= 0:
            super().on_train_epoch_start(trainer, *args)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.max_steps <= 0:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            return
        step = trainer.global_step  # optimizer steps: under gradient accumulation, fewer than batches
        if self._should_update(step, self.train_progress_bar.total):
            self.train_progress_bar.n = step
            self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module))  # refreshes the bar

    @override
    def get_metrics(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        return metrics


class ExportHF(Callback):
    """At the end of fit, save a checkpoint and export it to a Hugging Face folder (``hf``; a LoRA
    run: the adapter merged in), and for a LoRA run the adapter in PEFT's format (``adapter``) and
    the base model it adapts (``base``). Rank 0 then prints where the checkpoint, the exports, the
    logger's ``metrics.csv`` and ``MoEMonitor``'s plots are."""

    def __init__(self, dirpath: str = "runs/tiny") -> None:
        self.dirpath = Path(dirpath)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        from lightning_ep.models.hf_io import export_hf

        checkpoint = self.dirpath / "last.ckpt"
        # weights_only=False: a checkpoint to resume from (optimizer and loop states too).
        trainer.save_checkpoint(checkpoint, weights_only=False)
        lines = [f"checkpoint: {checkpoint}", f"Hugging Face export: {self.dirpath / 'hf'}"]
        export_hf(pl_module.model, self.dirpath / "hf", hf_config_or_folder=pl_module.model.config)
        if pl_module.hparams.get("lora"):
            from lightning_ep.models.lora_export import export_lora_adapter

            # The frozen base (trained from scratch here) and the adapter, for PeftModel.from_pretrained.
            config = pl_module.model.config
            export_hf(pl_module.model, self.dirpath / "base", hf_config_or_folder=config, merge_lora=False)
            export_lora_adapter(pl_module.model, self.dirpath / "adapter", hf_config_or_folder=config)
            lines.append(f"LoRA adapter (PEFT format): {self.dirpath / 'adapter'}, its base: {self.dirpath / 'base'}")
        log_dir = trainer.log_dir  # a broadcast: every rank asks
        if log_dir is not None and isinstance(trainer.logger, CSVLogger):
            lines.append(f"metrics: {Path(log_dir) / 'metrics.csv'}")
        if log_dir is not None and any(isinstance(c, lightning_ep.MoEMonitor) and c.plots for c in trainer.callbacks):
            lines.append(f"expert-load plots: {Path(log_dir) / 'moe'}")
        if trainer.is_global_zero:
            print("\n".join(lines))


def main() -> None:
    LightningCLI(MoECausalLM, TextDataModule, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
