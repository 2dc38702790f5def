"""Chat fine-tuning of a Hugging Face MoE model with expert parallelism, from the command line (LightningCLI).

    python examples/chat_finetune.py fit --config examples/configs/cpu_chat.yaml

The CPU config trains a tiny Mixtral from scratch on the conversations shipped in
``examples/data/chat.jsonl`` (written by ``examples/data/make_chat_data.py``), on 2 CPU processes at
expert-parallel degree 2, in about a minute on 2 cores. ``examples/configs/gpu_chat.yaml`` fine-tunes
a real Qwen-MoE (or Mixtral) folder in ``bf16-mixed`` with that folder's tokenizer.

What a chat fine-tune needs, each a few lines here:

- a tokenizer with a chat template: the folder's own (``--data.tokenizer FOLDER``) or, without one,
  a small byte-level BPE built once from the conversations with the ``tokenizers`` library and saved
  as a Hugging Face tokenizer (``<work_dir>/tokenizer``, the same bytes each time); its template marks
  the assistant's turns with ``{% generation %}``;
- the conversations read by Hugging Face ``datasets`` from JSONL, with a held-out validation split;
- labels on the assistant's tokens only (-100 elsewhere), from the template's ``{% generation %}``
  marks, or for a template without them from the rendered prefixes of each assistant turn;
- packing: ``DataCollatorWithFlattening`` concatenates a micro-batch's conversations into one row
  whose ``position_ids`` restart at each conversation;
- the token-weighted objective (``lightning_ep.data.TokenWeightedDataLoader``): each optimizer step
  is the mean cross-entropy over all of the step's assistant tokens, whatever micro-batch and rank
  they fell on (``--data.objective micro_batch_mean`` for Lightning's mean of micro-batch means);
- AdamW with parameter groups (``lightning_ep.param_groups.weight_decay_groups``: no decay on norms,
  biases and routers), a linear warm-up and a cosine decay;
- validation on the held-out conversations (the mean loss per assistant token), and at the end a
  Hugging Face export with the tokenizer that ``AutoModelForCausalLM.from_pretrained`` and the chat
  template generate from.
"""

from __future__ import annotations

import json
import math
import re
from functools import partial
from pathlib import Path
from typing import Any, Literal

import torch
from finetune import StepProgressBar  # noqa: F401  (the configs name it: a progress bar in optimizer steps)
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from lightning_ep.data import TokenWeightedDataLoader, count_loss_tokens
from lightning_ep.optim import AdamW
from lightning_ep.param_groups import weight_decay_groups

HERE = Path(__file__).resolve().parent
SPECIAL_TOKENS = ["<|pad|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
# Each turn is <|role|>content<|end|>; the assistant's content and its <|end|> are what it learns to say.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|assistant|>' }}{% generation %}{{- message['content'] + '<|end|>' }}{% endgeneration %}"
    "{%- else %}"
    "{{- '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>' }}{%- endif %}"
)
_GENERATION_MARK = re.compile(r"{%-?\s*generation\s*-?%}")


def build_tokenizer(conversations: str | Path, out_dir: str | Path, vocab_size: int = 512) -> Any:
    """Train a byte-level BPE of ``vocab_size`` tokens (``SPECIAL_TOKENS`` included, digits kept one
    per token) on the message texts of a JSONL of conversations, and save it to ``out_dir`` as a
    Hugging Face fast tokenizer with ``CHAT_TEMPLATE``. The same file gives the same tokenizer.
    Returns the ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    lines = Path(conversations).read_text().splitlines()
    texts = [m["content"] for line in lines if line.strip() for m in json.loads(line)["messages"]]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|end|>", pad_token="<|pad|>", chat_template=CHAT_TEMPLATE
    )
    tokenizer.save_pretrained(out_dir)
    return tokenizer


def assistant_labels(tokenizer: Any, messages: list[dict[str, str]]) -> dict[str, list[int]]:
    """``input_ids`` of the chat-templated conversation and ``labels``: the assistant's tokens, -100
    elsewhere. A template with ``{% generation %}`` marks says which tokens those are; for another
    template, assistant turn ``i`` is what rendering ``messages[: i + 1]`` adds to rendering
    ``messages[:i]`` with the generation prompt (so its header is not a label)."""

    def ids(part: list[dict[str, str]], prompt: bool = False) -> list[int]:
        rendered = tokenizer.apply_chat_template(part, tokenize=True, return_dict=True, add_generation_prompt=prompt)
        return list(rendered["input_ids"])

    if _GENERATION_MARK.search(tokenizer.chat_template or ""):
        rendered = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        input_ids = list(rendered["input_ids"])
        labels = [t if keep else -100 for t, keep in zip(input_ids, rendered["assistant_masks"], strict=True)]
        return {"input_ids": input_ids, "labels": labels}
    input_ids = ids(messages)
    labels = [-100] * len(input_ids)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start, through = len(ids(messages[:i], prompt=True)), ids(messages[: i + 1])
        if input_ids[: len(through)] != through or start > len(through):
            raise ValueError(
                "assistant_labels: this chat template does not render a conversation's beginning as a prefix "
                "of the whole, so the assistant's tokens cannot be found; use a template with {% generation %} "
                "marks (transformers' return_assistant_tokens_mask)."
            )
        labels[start : len(through)] = input_ids[start : len(through)]
    return {"input_ids": input_ids, "labels": labels}


class ChatData(LightningDataModule):
    """Conversations from a JSONL file, tokenized with assistant-only labels and packed.

    Args:
        path: JSONL, one ``{"messages": [{"role": ..., "content": ...}, ...]}`` per line.
        tokenizer: a Hugging Face tokenizer folder with a chat template (the model folder's), or
            ``None`` to build a BPE of ``vocab_size`` tokens from ``path`` into ``<work_dir>/tokenizer``
            (once: a later run reuses it).
        work_dir: where the built tokenizer and the ``datasets`` cache go.
        vocab_size: the built tokenizer's size.
        batch_size: conversations per micro-batch, packed into one row.
        max_length: conversations longer than this many tokens are left out.
        val_fraction: the share of conversations held out for validation (a fixed split).
        objective: ``"token_weighted"``: each optimizer step's loss is the sum over its assistant tokens
            (all micro-batches and ranks) divided by their count; ``"micro_batch_mean"``: the mean of the
            micro-batches' per-token means (Lightning's default, data parallelism's semantics).
    """

    def __init__(
        self,
        path: str = str(HERE / "data" / "chat.jsonl"),
        tokenizer: str | None = None,
        work_dir: str = "runs/chat",
        vocab_size: int = 512,
        batch_size: int = 8,
        max_length: int = 256,
        val_fraction: float = 0.1,
        objective: Literal["token_weighted", "micro_batch_mean"] = "token_weighted",
    ) -> None:
        super().__init__()
        self.path = path
        self.tokenizer_dir = Path(tokenizer) if tokenizer else Path(work_dir) / "tokenizer"
        self.build = tokenizer is None
        self.cache_dir = str(Path(work_dir) / "datasets")
        self.vocab_size = vocab_size
        self.batch_size = batch_size
        self.max_length = max_length
        self.val_fraction = val_fraction
        self.objective = objective
        self.tokenizer: Any = None
        self.splits: Any = None

    def prepare_data(self) -> None:  # once per machine, before setup on every process
        from datasets import disable_progress_bars, load_dataset

        disable_progress_bars()
        if self.build and not (self.tokenizer_dir / "tokenizer.json").is_file():
            build_tokenizer(self.path, self.tokenizer_dir, self.vocab_size)
        load_dataset("json", data_files=self.path, split="train", cache_dir=self.cache_dir)

    def setup(self, stage: str) -> None:
        from datasets import disable_progress_bars, load_dataset
        from transformers import AutoTokenizer

        disable_progress_bars()
        if self.splits is not None:
            return
        self.tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_dir)
        conversations = load_dataset("json", data_files=self.path, split="train", cache_dir=self.cache_dir)
        tokenized = conversations.map(
            lambda row: assistant_labels(self.tokenizer, row["messages"]),
            remove_columns=[c for c in conversations.column_names if c != "messages"],
            keep_in_memory=True,
        )
        tokenized = tokenized.filter(lambda row: len(row["input_ids"]) <= self.max_length, keep_in_memory=True)
        self.splits = tokenized.train_test_split(test_size=self.val_fraction, seed=0, keep_in_memory=True)

    def train_dataloader(self) -> DataLoader:
        from transformers import DataCollatorWithFlattening

        # Lightning gives either loader a distributed sampler: every rank reads its own conversations.
        kwargs: dict[str, Any] = dict(
            batch_size=self.batch_size, shuffle=True, drop_last=True, collate_fn=DataCollatorWithFlattening()
        )
        if self.objective == "micro_batch_mean":
            return DataLoader(self.splits["train"], **kwargs)
        return TokenWeightedDataLoader(
            self.splits["train"], accumulate_grad_batches=self.trainer.accumulate_grad_batches, **kwargs
        )

    def val_dataloader(self) -> DataLoader:
        from transformers import DataCollatorWithFlattening

        return DataLoader(self.splits["test"], batch_size=self.batch_size, collate_fn=DataCollatorWithFlattening())


def warmup_cosine(step: int, *, warmup: int, total: int, min_ratio: float) -> float:
    """The learning rate's factor at optimizer step ``step``: linear from ``1 / warmup`` to 1 over the
    first ``warmup`` steps, then a cosine down to ``min_ratio`` at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class ChatLM(LightningModule):
    """A Hugging Face MoE causal LM trained on chat batches; the loss is the model's own.

    Args:
        model: a tiny model to train from scratch: ``model_type`` (default ``"mixtral"``) and the
            fields of its config; the vocabulary and special tokens come from the tokenizer.
        pretrained: a Hugging Face folder to fine-tune instead (each rank reads only its slices).
        lr: peak AdamW learning rate.
        weight_decay: AdamW weight decay of the matrices (none on norms, biases and routers).
        betas: AdamW betas.
        warmup_steps: linear warm-up steps; a cosine decay to ``min_lr_ratio * lr`` follows.
        min_lr_ratio: the learning rate's final fraction.
    """

    def __init__(
        self,
        model: dict[str, Any] | None = None,
        pretrained: str | None = None,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 10,
        min_lr_ratio: float = 0.1,
    ) -> None:
        super().__init__()
        if (model is None) == (pretrained is None):
            raise ValueError("ChatLM: pass exactly one of `model` (a tiny config dict) or `pretrained` (a folder).")
        self.save_hyperparameters()
        self.model: torch.nn.Module | None = None
        self._step_losses: dict[int, torch.Tensor] = {}  # this step's micro-batch losses, by batch index
        self.val_history: list[tuple[int, float]] = []  # (optimizer step, held-out loss per token)

    def configure_model(self) -> None:
        if self.model is not None:
            return
        tokenizer = self.trainer.datamodule.tokenizer
        if self.hparams.pretrained:
            from lightning_ep.models.pretrained import from_pretrained

            self.model = from_pretrained(self.hparams.pretrained)
        else:
            from transformers import AutoConfig, AutoModelForCausalLM

            fields = {"model_type": "mixtral", **self.hparams.model}
            config = AutoConfig.for_model(
                fields.pop("model_type"),
                vocab_size=len(tokenizer),
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
                bos_token_id=None,
                **fields,
            )
            self.model = AutoModelForCausalLM.from_config(config)
        if len(tokenizer) > self.model.config.vocab_size:
            raise ValueError(
                f"ChatLM: the tokenizer has {len(tokenizer)} tokens, the model's vocabulary "
                f"{self.model.config.vocab_size}; use the model folder's own tokenizer (--data.tokenizer FOLDER)."
            )

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        # With the token-weighted loader the batch holds num_items_in_batch, and the model's loss is
        # this micro-batch's share of the step's mean over all its assistant tokens (lightning_ep.data).
        loss = self.model(**batch).loss
        self._step_losses[batch_idx] = loss.detach()  # by index: a step the strategy runs again is kept once
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # The step's loss: Lightning's mean over the micro-batches, then the mean over ranks.
        step_loss = torch.stack(list(self._step_losses.values())).sum() / self.trainer.accumulate_grad_batches
        self._step_losses.clear()
        self.log("train_loss", self.trainer.strategy.reduce(step_loss, reduce_op="mean"), prog_bar=True)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        # Weighted by the batch's assistant tokens: the epoch's value is the mean loss per assistant token.
        loss = self.model(**batch).loss
        self.log("val_loss", loss, batch_size=int(count_loss_tokens(batch)), sync_dist=True, prog_bar=True)

    def on_validation_end(self) -> None:
        self.val_history.append((self.global_step, float(self.trainer.callback_metrics["val_loss"])))

    def configure_optimizers(self) -> dict[str, Any]:
        # After the strategy replaced and sharded the MoE blocks: the groups hold the sharded parameters.
        optimizer = AdamW(
            weight_decay_groups(self.model, self.hparams.weight_decay), lr=self.hparams.lr, betas=self.hparams.betas
        )
        schedule = partial(
            warmup_cosine,
            warmup=self.hparams.warmup_steps,
            total=int(self.trainer.estimated_stepping_batches),
            min_ratio=self.hparams.min_lr_ratio,
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class ChatExport(Callback):
    """At the end of fit, export the model and the tokenizer to ``<dirpath>/hf``; rank 0 then prints
    the held-out loss before and after training, where the export and the metrics are, and the
    export's greedy answers to the last user turn of ``samples`` held-out conversations (0: none;
    on GPU the export is too large to load again on the host)."""

    def __init__(self, dirpath: str = "runs/chat", samples: int = 3) -> None:
        self.dirpath = Path(dirpath)
        self.samples = samples

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        from lightning_ep.models.hf_io import export_hf

        assert isinstance(pl_module, ChatLM)
        data = trainer.datamodule
        out = self.dirpath / "hf"
        source = pl_module.hparams.pretrained or pl_module.model.config
        export_hf(pl_module.model, out, hf_config_or_folder=source)
        log_dir = trainer.log_dir  # a broadcast: every rank asks
        if not trainer.is_global_zero:
            return
        data.tokenizer.save_pretrained(out)
        history = pl_module.val_history
        lines = []
        if history:
            (first_step, first), (last_step, last) = history[0], history[-1]
            lines.append(
                f"held-out loss per assistant token: {first:.3f} at step {first_step} -> {last:.3f} at step {last_step}"
            )
        lines.append(f"Hugging Face export (model, tokenizer, chat template): {out}")
        if log_dir is not None and isinstance(trainer.logger, CSVLogger):
            lines.append(f"metrics: {Path(log_dir) / 'metrics.csv'}")
        if self.samples:
            lines.append("held-out conversations, answered by the export (greedy):")
            held_out = data.splits["test"].select(range(min(self.samples, len(data.splits["test"]))))
            lines += answers(out, [row["messages"] for row in held_out])
        print("\n".join(lines))


def answers(folder: Path, conversations: list[list[dict[str, str]]]) -> list[str]:
    """The exported model's greedy reply to each conversation's last user turn (the conversation up
    to its last assistant turn, chat-templated by the exported tokenizer), beside the reference."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    lines = []
    for messages in conversations:
        prompt = tokenizer.apply_chat_template(
            messages[:-1], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        with torch.no_grad():
            reply = model.generate(prompt, max_new_tokens=24, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        said = tokenizer.decode(reply[0, prompt.shape[1] :], skip_special_tokens=True)
        lines += [f"  user: {messages[-2]['content']}", f"  model: {said}", f"  reference: {messages[-1]['content']}"]
    return lines


def main() -> None:
    LightningCLI(ChatLM, ChatData, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
