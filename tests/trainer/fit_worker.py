"""One training run for the Trainer-level tests, launched as ``torchrun --nproc-per-node N fit_worker.py``.

``--reference`` runs the one-process reference instead (plain torch, no Trainer): the unsharded
model on every rank's micro-batch in turn, losses and gradients averaged, like data parallelism.
Rank 0 writes ``{"losses": [mean loss over ranks per step], ...}`` as JSON to ``--out``. A worker
ends by itself when its launcher dies (``processes.exit_when_parent_dies``).
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
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import lightning_ep
from lightning_ep import ExpertParallelStrategy, MoEConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for processes.py
from processes import exit_when_parent_dies

VOCAB = 128
SEQ = 16


EXPERTS = 8


def model_config():
    from transformers import MixtralConfig

    return MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=EXPERTS,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )


def build_model():
    from transformers import MixtralForCausalLM

    torch.manual_seed(0)
    return MixtralForCausalLM(model_config()).float()


class Tokens(Dataset):
    """``n`` fixed random sequences; sample ``i`` is the same in every run."""

    def __init__(self, n: int) -> None:
        self.data = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(7))

    def __len__(self) -> int:
        return self.data.shape[0]

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i]


def build_beside(value_head: bool, frozen_copy: bool) -> tuple[torch.nn.Module | None, torch.nn.Module | None]:
    """A value head (``nn.Linear(H, 1)``, seeded) and a frozen second MoE model (``build_model``'s
    weights), the parts of an RL or DPO fine-tune that sit beside the trained model."""
    torch.manual_seed(1)
    head = torch.nn.Linear(64, 1) if value_head else None
    frozen = build_model().requires_grad_(False) if frozen_copy else None
    return head, frozen


def training_loss(model, batch, head, frozen) -> torch.Tensor:
    """The model's loss, plus the value head's ``mean(v^2)`` on the last hidden states and a squared
    distance of the logits to the frozen model's, when there are those."""
    out = model(input_ids=batch, labels=batch, output_hidden_states=head is not None)
    loss = out.loss
    if head is not None:
        loss = loss + head(out.hidden_states[-1]).pow(2).mean()
    if frozen is not None:
        with torch.no_grad():
            reference = frozen(input_ids=batch).logits
        loss = loss + 0.1 * (out.logits - reference).pow(2).mean()
    return loss


class Module(LightningModule):
    def __init__(
        self, lr: float, pretrained: str | None = None, value_head: bool = False, frozen_copy: bool = False
    ) -> None:
        super().__init__()
        self.lr = lr
        self.pretrained = pretrained
        self.beside = (value_head, frozen_copy)
        self.model: torch.nn.Module | None = None
        self.value_head: torch.nn.Module | None = None
        self.frozen: torch.nn.Module | None = None
        self.losses: list[float] = []
        self.aux_losses: list[list[float]] = []  # per micro-batch: each MoE layer's aux loss, mean over ranks
        self.poison_step = -1
        self.poisoned = False
        self.pre_transform: MoEConfig | None = None  # transform the model in configure_model, as a user may
        self.record_balance = False
        self.loads: list[dict] = []  # per micro-batch: the step it belongs to, tokens per expert summed over ranks
        self.biases: list[dict] = []  # after each micro-batch: global_step, every layer's "balanced" bias

    def configure_model(self) -> None:
        if self.model is None and self.pretrained is not None:
            from lightning_ep.models.pretrained import from_pretrained

            # On the meta device; the strategy shards it and each rank reads its slices from the folder.
            # The folder's config.json records dtype float32 (build_model's), so the model comes out fp32.
            self.model = from_pretrained(self.pretrained)
            dtypes = {p.dtype for p in self.model.parameters()}
            assert dtypes == {torch.float32}, f"{self.pretrained} gives {dtypes}, the reference is fp32"
        elif self.model is None:
            self.model = build_model()
        if self.pre_transform is not None:
            lightning_ep.transform(self.model, self.pre_transform)
        if any(self.beside) and self.value_head is None and self.frozen is None:
            self.value_head, self.frozen = build_beside(*self.beside)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        if self.global_step == self.poison_step and dist.get_rank() == 1 and not self.poisoned:
            # Rank 1 feeds infinities into the second MoE layer, in one micro-batch only (the first
            # of the step under accumulation): every rank must stop with an error.
            self.poisoned = True
            layer = lightning_ep.moe_layers(self.model)[1]

            def poison(module: torch.nn.Module, args: tuple) -> tuple:
                handle.remove()
                return (args[0] * float("inf"),)

            handle = layer.register_forward_pre_hook(poison)
        loss = training_loss(self.model, batch, self.value_head, self.frozen)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        self.losses.append(mean.item() / dist.get_world_size())
        aux = torch.stack([layer.aux_loss for layer in lightning_ep.moe_layers(self.model)])
        dist.all_reduce(aux)
        self.aux_losses.append((aux / dist.get_world_size()).tolist())
        if self.record_balance:
            load = torch.stack([layer.tokens_per_expert for layer in lightning_ep.moe_layers(self.model)])
            dist.all_reduce(load)
            self.loads.append({"step": self.global_step, "load": load.tolist()})
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if self.record_balance:
            biases = [layer.gate.selection_bias.tolist() for layer in lightning_ep.moe_layers(self.model)]
            self.biases.append({"step": self.global_step, "biases": biases})

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, eps=1e-6, foreach=False)


class ManualModule(Module):
    """Manual optimization: ``manual_backward`` per batch, ``opt.step()`` every ``accumulate`` batches."""

    def __init__(self, lr: float, accumulate: int, pretrained: str | None = None) -> None:
        super().__init__(lr, pretrained)
        self.automatic_optimization = False
        self.accumulate = accumulate

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        optimizer = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss / self.accumulate)
        if (batch_idx + 1) % self.accumulate == 0:
            optimizer.step()
            optimizer.zero_grad()
        return loss


class SaveAt(Callback):
    """Save a checkpoint after each optimizer step in ``steps``, to ``path`` (``{step}`` is filled in)."""

    def __init__(self, steps: list[int], path: str) -> None:
        self.steps, self.path = steps, path
        self.done: set[int] = set()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step in self.steps and step not in self.done:
            self.done.add(step)
            trainer.save_checkpoint(self.path.format(step=step))


def slow_down_saves_from(step_holder: dict, from_step: int, seconds: float) -> None:
    """Make sharded saves at ``global_step >= from_step`` hang after writing (the test kills us)."""
    import time

    import lightning.pytorch.strategies.model_parallel as mp

    original = mp._distributed_checkpoint_save

    def slow(converted_state, path):
        original(converted_state, path)
        if step_holder["trainer"].global_step >= from_step:
            print(f"SAVING {path}", flush=True)
            time.sleep(seconds)

    mp._distributed_checkpoint_save = slow


def moe_config(mode: str) -> MoEConfig:
    return MoEConfig(moe_load_balancing=mode, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)


def run_trainer(args: argparse.Namespace) -> dict:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    moe = moe_config(args.mode)
    strategy = ExpertParallelStrategy(
        args.degree,
        replicate_degree=args.replicate,
        moe=moe,
        save_distributed_checkpoint=not args.full_checkpoint,
        allow_moe_config_change=tuple(args.allow.split(",")) if args.allow else (),
        deterministic=args.deterministic,
        activation_checkpointing=args.activation_checkpointing,
        execution=lightning_ep.Execution(
            compile=True if args.compile else "auto",
            single_rank_fsdp=False if args.single_rank_fsdp == "off" else "auto",
            token_dedup=True if args.token_dedup else "auto",
        ),
        process_group_backend="gloo",
        timeout=timedelta(seconds=120),
        moe_model=args.moe_model,
    )
    save_steps = [int(s) for s in str(args.save_at).split(",")]
    callbacks = [SaveAt(save_steps, args.save_to)] if args.save_to else []
    logger = CSVLogger(args.log_dir, name="run") if args.log_dir else False
    trainer = Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        precision=args.precision,
        max_steps=args.steps,
        accumulate_grad_batches=1 if args.manual else args.accumulate,
        gradient_clip_val=args.clip,
        logger=logger,
        callbacks=callbacks,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=True,
    )
    if args.manual:
        module: Module = ManualModule(args.lr, args.accumulate, pretrained=args.pretrained)
    else:
        module = Module(args.lr, pretrained=args.pretrained, value_head=args.value_head, frozen_copy=args.frozen_copy)
    module.poison_step = args.poison_step
    module.pre_transform = moe_config(args.pre_transform) if args.pre_transform else None
    module.record_balance = args.mode == "balanced"
    if args.slow_save_from is not None:
        slow_down_saves_from({"trainer": trainer}, args.slow_save_from, 600.0)
    data = DataLoader(Tokens(args.samples), batch_size=args.batch, shuffle=False, drop_last=True)
    trainer.fit(module, data, ckpt_path=args.resume)
    checkpointed = getattr(module.model, "is_activation_checkpointing", None)  # transformers 5.23 on
    if checkpointed is None:
        checkpointed = getattr(module.model, "is_gradient_checkpointing", False)
    kept = [bool(layer.keep_all_to_all and not layer._kept) for layer in lightning_ep.moe_layers(module.model)]
    from torch._dynamo.utils import counters

    from lightning_ep.parallel.compile import is_compiled
    from lightning_ep.parallel.fsdp import decoder_blocks

    return {
        "compiled_blocks": sum(is_compiled(block) for block in decoder_blocks(module.model)),
        "compiled_graphs": counters["stats"]["unique_graphs"],
        "losses": module.losses,
        "aux_losses": module.aux_losses,
        "loads": module.loads,
        "biases": module.biases,
        "global_step": trainer.global_step,
        "has_expert_bias": [hasattr(layer.gate, "expert_bias") for layer in lightning_ep.moe_layers(module.model)],
        "degree": strategy.degree,
        "checkpointed": bool(checkpointed),
        "keep_all_to_all": bool(kept) and all(kept),  # set on every layer, nothing left pending
        "fsdp": _fsdp_settings(module.model, decoder_blocks(module.model)[0]),
        "weights_sha256": _weights_digest(module.model),
        **_beside_results(module.value_head, module.frozen),
    }


def _fsdp_settings(model: torch.nn.Module, block: torch.nn.Module) -> dict:
    """What FSDP2 does with ``block``: whether it frees the gathered parameters after forward, and
    the dtype it reduces gradients in (``None``: the parameters' compute dtype); ``{"in_place": True}``
    where the dense parameters skip FSDP2 (``lightning_ep.parallel.single_rank``)."""
    from lightning_ep.parallel.single_rank import is_kept_local

    if is_kept_local(model):
        return {"in_place": True}
    group = block._get_fsdp_state()._fsdp_param_group  # type: ignore[operator]
    reduce = group.mp_policy.reduce_dtype
    return {"reshard_after_forward": group.post_forward_mesh_info is not None, "reduce_dtype": str(reduce)}


def _weights_digest(model: torch.nn.Module) -> str:
    """SHA-256 of every parameter's full value, in order (bitwise equality of two runs' weights)."""
    import hashlib

    from torch.distributed.tensor import DTensor

    digest = hashlib.sha256()
    for _, p in sorted(model.named_parameters()):
        full = p.full_tensor() if isinstance(p, DTensor) else p
        digest.update(full.detach().float().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _beside_results(head: torch.nn.Module | None, frozen: torch.nn.Module | None) -> dict:
    """The value head's weight after training (gathered whole) and whether the frozen model kept its
    own blocks and plain tensors, for runs that have them."""
    from torch.distributed.tensor import DTensor

    results: dict = {}
    if head is not None:
        weight = head.weight
        results["head_sharded"] = isinstance(weight, DTensor)
        weight = weight.full_tensor() if isinstance(weight, DTensor) else weight
        results["head_weight"] = weight.detach().flatten().tolist()
    if frozen is not None:
        results["frozen_untouched"] = not lightning_ep.moe_layers(frozen) and not any(
            isinstance(p, DTensor) for p in frozen.parameters()
        )
    return results


def run_reference(args: argparse.Namespace) -> dict:
    """The unsharded model, every rank's micro-batch in turn (DistributedSampler order, no shuffle)."""
    world, steps, batch = args.world, args.steps, args.batch
    model = lightning_ep.transform(build_model(), MoEConfig(moe_load_balancing=args.mode, moe_aux_loss_coeff=0.01))
    for layer in lightning_ep.moe_layers(model):
        layer.loss_scale = 1.0 / world
    model.train()
    head, frozen = build_beside(args.value_head, args.frozen_copy)
    params = [*model.parameters(), *(head.parameters() if head is not None else [])]
    optimizer = torch.optim.AdamW(params, lr=args.lr, eps=1e-6, foreach=False)
    dataset = Tokens(args.samples)
    batches_per_epoch = len(dataset) // world // batch
    losses = []
    for step in range(steps):
        epoch, i = divmod(step, batches_per_epoch)
        optimizer.zero_grad()
        total = 0.0
        for r in range(world):
            # What Lightning's DistributedSampler (shuffle=True, seed=0) gives rank r this epoch.
            sampler = DistributedSampler(dataset, num_replicas=world, rank=r, shuffle=True, seed=0)
            sampler.set_epoch(epoch)
            ids = dataset.data[list(sampler)[i * batch : (i + 1) * batch]]
            loss = training_loss(model, ids, head, frozen) / world
            loss.backward()
            total += loss.item()
        if args.clip:
            torch.nn.utils.clip_grad_norm_(params, args.clip)
        optimizer.step()
        losses.append(total)
    return {"losses": losses, **_beside_results(head, frozen)}


def main() -> None:
    global EXPERTS
    exit_when_parent_dies()
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--reference", action="store_true")
    parser.add_argument("--world", type=int, default=4, help="ranks the reference emulates")
    parser.add_argument("--degree", default="2")
    parser.add_argument("--replicate", type=int, default=1)
    parser.add_argument("--mode", default="none")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--samples", type=int, default=16, help="dataset size (epoch = samples / world / batch)")
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--clip", type=float, default=None)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--full-checkpoint", action="store_true")
    parser.add_argument(
        "--activation-checkpointing", nargs="?", const=True, default=False, help="bare: True; or keep_all_to_all"
    )
    parser.add_argument("--save-at", default="2", help="comma-separated optimizer steps")
    parser.add_argument("--slow-save-from", type=int, default=None)
    parser.add_argument("--poison-step", type=int, default=-1)
    parser.add_argument("--deterministic", action="store_true")
    parser.add_argument("--compile", action="store_true", help="Execution(compile=True)")
    parser.add_argument(
        "--single-rank-fsdp", choices=["auto", "off"], default="auto", help="Execution(single_rank_fsdp=)"
    )
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--save-to", default=None)
    parser.add_argument("--manual", action="store_true", help="manual optimization; opt.step() every --accumulate")
    parser.add_argument("--token-dedup", action="store_true", help="Execution(token_dedup=True)")
    parser.add_argument("--pre-transform", default=None, help="configure_model transforms with this balancing mode")
    parser.add_argument("--allow", default=None, help="comma-separated allow_moe_config_change")
    parser.add_argument("--resume", default=None)
    parser.add_argument("--log-dir", default=None)
    parser.add_argument("--pretrained", default=None, help="fine-tune from this save_pretrained folder")
    parser.add_argument("--value-head", action="store_true", help="a trainable nn.Linear beside the model")
    parser.add_argument("--frozen-copy", action="store_true", help="a frozen second MoE model beside the model")
    parser.add_argument("--moe-model", default=None, help="ExpertParallelStrategy(moe_model=...)")
    args = parser.parse_args()
    args.degree = args.degree if args.degree == "auto" else int(args.degree)
    EXPERTS = args.experts
    result = run_reference(args) if args.reference else run_trainer(args)
    if int(os.environ.get("RANK", "0")) == 0:
        Path(args.out).write_text(json.dumps(result))
    # Done: leave without interpreter finalization, where a gloo worker thread still holding a finished
    # FSDP2 all-gather's tensors can abort the process (pytorch/pytorch#190489; see tests/distributed/harness.py).
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
