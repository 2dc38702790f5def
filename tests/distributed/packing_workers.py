"""Packed rows against their documents run separately: the batches, the references and the gloo worker.

Imported by spawned processes and by ``tests/unit/test_packing.py``. A packed batch is transformers'
own ``DataCollatorWithFlattening`` over a few documents of different lengths: one row, ``position_ids``
restarting at 0 per document, ``labels`` with -100 at each document's first token, no
``attention_mask``. Every model is a tiny fp32 model of a supported family (``families_workers``) whose
``config.use_cache`` is on, as Hugging Face's default is; GPT-OSS gets a sliding window of 4, shorter
than its documents, so that its sliding-window layers mask within each document too, and DeepSeek-V3
as many key-value heads as query heads, as its multi-head latent attention needs.

Two references, each equal to the packed row by definition:

- **Each document alone** (``separate``): every document its own call of one unpadded row on the
  untouched Hugging Face model. The packed loss is the mean over the labelled tokens of all documents
  (``n - 1`` per document of ``n`` tokens), hence the per-document losses weighted by ``n - 1``; so are
  the gradients. It holds where routing is per token and adds no loss (``CONFIG``: ``"none"``, both
  coefficients 0), since the transformed layers then compute the Hugging Face block.
- **The documents as one padded batch** (``padded_batch``): one row per document, right-padded, with an
  ``attention_mask``, on the same transformed model. Its real tokens are exactly the packed row's and
  padding is not data (invariant 7), so every statistic of a call's set of tokens (``tokens_per_expert``,
  the aux and z losses, Sinkhorn) is the packed row's too, whereas separate calls would route other sets
  (the aux loss of a union of tokens is not the mean of its parts' losses).

fp32 throughout: the packed row and its references sum the same terms in other orders (one masked
attention over the row against one per document, reductions over tokens in another order), so they
agree to round-off, about 1e-7 relative; ``RTOL`` (1e-5) is asserted, token counts exactly.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from families_workers import CONFIG, RTOL, VOCAB, full, rel_err, tiny_family
from torch import nn

import lightning_ep
from lightning_ep import MoEConfig

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "glm4_moe", "gpt_oss")
#: How many masks each family's forward builds, hence how often transformers reads the positions back
#: to look for packed documents: a full and a sliding-window one for GPT-OSS and Qwen2-MoE.
MASKS = {family: 2 if family in ("gpt_oss", "qwen2_moe") else 1 for family in FAMILIES}
#: Document lengths of each rank's packed row (rank 0 is the one-process tests' row): the ranks hold
#: different numbers of tokens, 24 and 31.
LENGTHS = ((5, 11, 8), (9, 4, 12, 6))
#: Balancing with both losses on, for the statistics compared with the padded batch.
AUX = MoEConfig(moe_load_balancing="aux_loss", moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.01)


def tiny(family: str, seed: int = 0, **overrides: Any) -> nn.Module:
    """The tiny fp32 model of ``family`` in train mode, ``config.use_cache=True`` (GPT-OSS: sliding window 4),
    with the config fields ``overrides``."""
    overrides = {
        **{
            "gpt_oss": {"sliding_window": 4},
            # Hugging Face's MLA gives keys and values all the query heads; with fewer key-value heads
            # (families_workers' 2) its SDPA call fails as soon as a mask is passed (packed or padded).
            "deepseek_v3": {"num_key_value_heads": 4},
        }.get(family, {}),
        **overrides,
    }
    if family == "mixtral":
        from conftest import tiny_mixtral

        model = tiny_mixtral(seed, **overrides)
    else:
        model = tiny_family(family, seed, **overrides)
    model.config.use_cache = True
    return model.float().train()


def documents(rank: int = 0) -> list[list[int]]:
    """``rank``'s documents: random tokens of the lengths ``LENGTHS[rank]``."""
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in LENGTHS[rank]]


def packed_batch(docs: list[list[int]]) -> dict[str, torch.Tensor]:
    """transformers' ``DataCollatorWithFlattening`` over ``docs``: ``input_ids``, ``labels``, ``position_ids``."""
    from transformers import DataCollatorWithFlattening

    batch = DataCollatorWithFlattening(return_tensors="pt")([{"input_ids": doc} for doc in docs])
    assert set(batch) == {"input_ids", "labels", "position_ids"}, set(batch)
    return dict(batch)


def padded_batch(docs: list[list[int]]) -> dict[str, torch.Tensor]:
    """One right-padded row per document, ``attention_mask`` 0 and ``labels`` -100 at padding."""
    ids = torch.zeros(len(docs), max(map(len, docs)), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, doc in enumerate(docs):
        ids[row, : len(doc)] = torch.tensor(doc)
        mask[row, : len(doc)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.where(mask.bool(), ids, -100)}


def run(model: nn.Module, batch: dict[str, torch.Tensor], scale: float = 1.0) -> dict[str, Any]:
    """One forward and backward of ``model`` on ``batch`` (loss times ``scale``); the loss, the full
    gradients accumulated so far and the MoE layers' statistics of this call."""
    loss = model(**batch).loss
    (loss * scale).backward()
    layers = lightning_ep.moe_layers(model)
    return {
        "loss": loss.detach(),
        "grads": grads(model),
        "counts": [layer.tokens_per_expert.clone() for layer in layers],
        "aux": [layer.aux_loss.detach().clone() for layer in layers],
        "z": [layer.z_loss.detach().clone() for layer in layers],
    }


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: full(p.grad).clone() for n, p in model.named_parameters() if p.grad is not None}


def separate(model: nn.Module, docs: list[list[int]], scale: float = 1.0) -> torch.Tensor:
    """Each document alone through ``model`` (one unpadded row, no cache), backward of the packed row's
    loss (times ``scale``) written as their labelled-token-weighted mean; returns that loss."""
    labelled = sum(len(doc) - 1 for doc in docs)
    total = torch.zeros(())
    for doc in docs:
        ids = torch.tensor([doc])
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss * (len(doc) - 1) / labelled
        (loss * scale).backward()
        total += loss.detach()
    return total


def assert_close(tag: str, ours: dict[str, Any], reference: dict[str, Any], stats: bool = True) -> None:
    """Loss and every gradient to ``RTOL``; with ``stats``, equal token counts and aux/z losses to ``RTOL``."""
    assert rel_err(ours["loss"], reference["loss"]) <= RTOL, (tag, "loss", ours["loss"], reference["loss"])
    assert ours["grads"].keys() == reference["grads"].keys() and ours["grads"], (tag, "gradient names")
    for name, grad in ours["grads"].items():
        assert rel_err(grad, reference["grads"][name]) <= RTOL, (tag, name, rel_err(grad, reference["grads"][name]))
    if stats:
        assert ours["counts"], (tag, "no MoE layer")
        for i, (a, b) in enumerate(zip(ours["counts"], reference["counts"], strict=True)):
            assert torch.equal(a, b), (tag, "tokens_per_expert", i, a, b)
        for name in ("aux", "z"):
            for i, (a, b) in enumerate(zip(ours[name], reference[name], strict=True)):
                assert rel_err(a, b) <= RTOL, (tag, name, i, a, b)


def check_packing_degree2(rank: int, world: int, family: str, compiled: bool) -> None:
    """At expert-parallel degree 2, each rank training on its own packed row:

    - ``CONFIG`` (per-token routing, no router loss): the loss averaged over ranks and every full
      gradient equal data parallelism of the untouched model on each rank's documents, each alone;
    - ``AUX``: equal data parallelism of the one-process transformed model on each rank's documents as
      one padded batch, and this rank's token counts and aux and z losses equal that model's on this
      rank's padded batch (the ranks see their own tokens, as in data parallelism).
    """
    docs = [documents(r) for r in range(world)]
    mesh = lightning_ep.init_mesh(2, device_type="cpu")
    for config in (CONFIG, AUX):
        tag = f"{family} rank {rank} compiled={compiled} {config.moe_load_balancing}"
        untouched = tiny(family)
        model = lightning_ep.transform(copy.deepcopy(untouched), config, mesh=mesh)
        lightning_ep.shard_model(model, mesh)
        if compiled:
            from lightning_ep.parallel.compile import compile_for_training
            from lightning_ep.parallel.fsdp import decoder_blocks

            compile_for_training(model, decoder_blocks(model), backend="aot_eager")
            model.config.use_cache = True  # compile_for_training turned it off; packing must not depend on it
        ours = run(model, packed_batch(docs[rank]))
        mean_loss = ours["loss"].clone()
        dist.all_reduce(mean_loss)
        ours["loss"] = mean_loss / world

        reference: dict[str, Any] = {"loss": torch.zeros(())}
        if config is CONFIG:
            for r in range(world):
                reference["loss"] += separate(untouched, docs[r], scale=1 / world) / world
            reference["grads"] = grads(untouched)
            assert_close(tag, ours, reference, stats=False)
            continue
        one_process = lightning_ep.transform(untouched, config)
        for layer in lightning_ep.moe_layers(one_process):
            layer.loss_scale = 1.0 / world  # the reference accumulates `world` micro-batches
        for r in range(world):
            result = run(one_process, padded_batch(docs[r]), scale=1 / world)
            reference["loss"] += result["loss"] / world
            if r == rank:
                reference.update(counts=result["counts"], aux=result["aux"], z=result["z"])
        reference["grads"] = grads(one_process)
        assert_close(tag, ours, reference)


def run_packing(rank: int, world: int, families: list[str], compiled: bool) -> None:
    for family in families:
        check_packing_degree2(rank, world, family, compiled)


class _Documents(torch.utils.data.Dataset):
    """One sample: a rank's documents, which ``packed_batch`` collates into its packed row."""

    def __init__(self, rank: int) -> None:
        self.docs = documents(rank)

    def __len__(self) -> int:
        return 1

    def __getitem__(self, i: int) -> list[list[int]]:
        return self.docs


def fit_one_step(module: Any, strategy: Any, rank: int, devices: int) -> None:
    """One ``Trainer.fit`` step of ``module`` on ``rank``'s packed row, on the CPU."""
    from lightning.pytorch import Trainer

    trainer = Trainer(
        accelerator="cpu", devices=devices, max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False, strategy=strategy,
    )  # fmt: skip
    trainer.fit(module, torch.utils.data.DataLoader(_Documents(rank), batch_size=None, collate_fn=packed_batch))


def packed_module(family: str) -> Any:
    """A LightningModule that builds ``tiny(family)`` in ``configure_model``, trains on packed rows with
    SGD at learning rate 0, and keeps its last loss and its full gradients before the optimizer step."""
    from lightning.pytorch import LightningModule

    class Packed(LightningModule):
        def configure_model(self) -> None:
            if not hasattr(self, "model"):
                self.model = tiny(family)

        def training_step(self, batch: dict[str, torch.Tensor], _: int) -> torch.Tensor:
            self.loss = self.model(**batch).loss
            return self.loss

        def on_before_optimizer_step(self, _optimizer: Any) -> None:
            self.grads = grads(self.model)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.0)

    return Packed()


def check_strategy_degree2(rank: int, world: int, port: int) -> None:
    """``ExpertParallelStrategy(2)`` in a Trainer on the harness's two processes (the environment
    ``torchrun`` gives its workers; Lightning finds the process group already made): one step on each
    rank's packed row gives the loss averaged over ranks and the gradients of data parallelism of the
    documents each alone on the untouched model."""
    import os

    from lightning_ep import Execution, ExpertParallelStrategy

    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), NODE_RANK="0",
        GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_RUN_ID="packing",
    )  # fmt: skip
    module = packed_module("mixtral")
    strategy = ExpertParallelStrategy(2, moe=CONFIG, execution=Execution(compile=False), process_group_backend="gloo")
    fit_one_step(module, strategy, rank, world)
    mean_loss = module.loss.detach().clone()
    dist.all_reduce(mean_loss)
    untouched = tiny("mixtral")
    reference = {"loss": sum(separate(untouched, documents(r), scale=1 / world) / world for r in range(world))}
    reference["grads"] = grads(untouched)
    assert module.model.config.use_cache is True
    assert_close(f"strategy rank {rank}", {"loss": mean_loss / world, "grads": module.grads}, reference, False)
