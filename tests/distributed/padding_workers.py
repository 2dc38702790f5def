"""Worker bodies for ragged and padded batches under expert parallelism (imported by spawned processes).

Every rank feeds a micro-batch of its own length (``LENGTHS[rank]`` positions, 2 sequences) and,
with ``padded``, an ``attention_mask`` whose padding differs per rank. The reference is data
parallelism of the unsharded model: the one-process model on every rank's micro-batch in turn,
losses and gradients averaged over ranks.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from workers import full, rel_err, tiny_mixtral

import lightning_ep
from lightning_ep import LayerExecution, MoEConfig
from lightning_ep.parallel.balance import update_expert_biases

LENGTHS = (16, 13, 10, 7)
RTOL = 1e-5


@dataclass(frozen=True)
class RaggedCase:
    degree: int = 2
    mode: str = "none"
    all_to_all: bool = True
    shuffle: bool = False
    capacity: float | None = None
    policy: str = "probs"
    dedup: bool = False  # LayerExecution.token_dedup
    padded: bool = False
    steps: int = 2

    def config(self) -> MoEConfig:
        return MoEConfig(
            moe_load_balancing=self.mode,  # type: ignore[arg-type]
            moe_all_to_all_dispatcher=self.all_to_all,
            global_token_shuffle=self.shuffle,
            capacity_factor=self.capacity,
            drop_policy=self.policy,  # type: ignore[arg-type]
            moe_aux_loss_coeff=0.01,
            moe_z_loss_coeff=0.001,
        )

    def execution(self) -> LayerExecution:
        """How the expert-parallel model's layers run (the reference runs on one process, locally)."""
        return LayerExecution(token_dedup=self.dedup)


def micro_batch(step: int, rank: int, padded: bool, pad_seed: int | None = None) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s micro-batch at ``step``: 2 sequences of ``LENGTHS[rank]`` tokens; with ``padded``,
    the second is right-padded after ``length - 3 - rank`` tokens (the pads hold token 0, or random
    tokens drawn from ``pad_seed``)."""
    length = LENGTHS[rank % len(LENGTHS)]
    ids = torch.randint(0, 128, (2, length), generator=torch.Generator().manual_seed(1000 * step + rank))
    batch = {"input_ids": ids, "labels": ids.clone()}
    if padded:
        mask = torch.ones_like(ids)
        mask[1, length - 3 - rank :] = 0
        fill = torch.zeros_like(ids)
        if pad_seed is not None:
            fill = torch.randint(0, 128, ids.shape, generator=torch.Generator().manual_seed(pad_seed + rank))
        batch = {
            "input_ids": torch.where(mask.bool(), ids, fill),
            "attention_mask": mask,
            "labels": torch.where(mask.bool(), ids, -100),
        }
    return batch


def run_ragged(rank: int, world: int, cases: list[RaggedCase]) -> None:
    for case in cases:
        _run_ragged(rank, world, case)


def _run_ragged(rank: int, world: int, case: RaggedCase) -> None:
    """``case.steps`` AdamW steps under ``transform`` + ``shard_model`` against the reference."""
    base = tiny_mixtral()
    config = case.config()
    ref = lightning_ep.transform(copy.deepcopy(base), replace(config, global_token_shuffle=False))
    model = copy.deepcopy(base)
    mesh = lightning_ep.init_mesh(case.degree, device_type="cpu")
    lightning_ep.transform(model, config, mesh=mesh, execution=case.execution())
    lightning_ep.shard_model(model, mesh)
    for layer in lightning_ep.moe_layers(ref):
        layer.loss_scale = 1.0 / world  # the reference accumulates `world` micro-batches
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-6, foreach=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6, foreach=False)
    ref_names = dict(ref.named_parameters())
    tag = f"{case} rank {rank}"
    for step in range(case.steps):
        opt_ref.zero_grad()
        ref_loss = 0.0
        for r in range(world):
            loss = ref(**micro_batch(step, r, case.padded)).loss / world
            loss.backward()
            ref_loss += loss.item()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf"))
        update_expert_biases(ref)

        opt.zero_grad()
        loss = model(**micro_batch(step, rank, case.padded)).loss
        loss.backward()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        assert abs(mean.item() / world - ref_loss) <= RTOL * abs(ref_loss), (tag, step, mean.item() / world, ref_loss)
        norm = lightning_ep.clip_grad_norm_(model.parameters(), float("inf"))
        assert abs(norm.item() - ref_norm.item()) <= RTOL * ref_norm.item(), (tag, step, norm.item(), ref_norm.item())
        for name, p in model.named_parameters():
            err = rel_err(full(p.grad), ref_names[name].grad)
            assert err <= RTOL, (tag, step, name, err)
        if case.capacity is not None:
            dropped = torch.tensor(sum(int(layer.tokens_dropped) for layer in lightning_ep.moe_layers(model)))
            dist.all_reduce(dropped)
            assert int(dropped) > 0, (tag, "the capacity must bind for the comparison to mean anything")
        update_expert_biases(model)
        opt_ref.step()
        opt.step()
    for name, p in model.named_parameters():
        assert rel_err(full(p.detach()), ref_names[name].detach()) <= RTOL, (tag, "after AdamW", name)
    for name, buffer in model.named_buffers():
        if name.endswith("expert_bias"):
            assert torch.equal(buffer, ref.get_buffer(name)), (tag, name)


def run_pad_content(rank: int, world: int, cases: list[RaggedCase]) -> None:
    """Under expert parallelism, two batches that differ only in the content of padded positions (on
    every rank) give bitwise-equal loss, gradients, counts and drops."""
    for case in cases:
        results = []
        for pad_seed in (None, 7):
            model = tiny_mixtral()
            mesh = lightning_ep.init_mesh(case.degree, device_type="cpu")
            lightning_ep.transform(model, case.config(), mesh=mesh, execution=case.execution())
            lightning_ep.shard_model(model, mesh)
            out = model(**micro_batch(0, rank, padded=True, pad_seed=pad_seed))
            out.loss.backward()
            layers = lightning_ep.moe_layers(model)
            results.append(
                (
                    out.loss.detach(),
                    {n: p.grad.to_local().clone() for n, p in model.named_parameters() if isinstance(p, DTensor)},
                    [(layer.tokens_per_expert.clone(), layer.tokens_dropped.clone()) for layer in layers],
                )
            )
        (loss_a, grads_a, counts_a), (loss_b, grads_b, counts_b) = results
        tag = f"{case} rank {rank}"
        assert torch.equal(loss_a, loss_b), (tag, loss_a, loss_b)
        for name in grads_a:
            assert torch.equal(grads_a[name], grads_b[name]), (tag, name)
        for (ca, da), (cb, db) in zip(counts_a, counts_b, strict=True):
            assert torch.equal(ca, cb) and torch.equal(da, db), tag


def run_router_logits(rank: int, world: int, shuffle: bool) -> None:
    """``output_router_logits=True`` under expert parallelism (with the token shuffle undone) returns
    each layer's logits of this rank's positions, as the untouched one-process model gives them."""
    import warnings

    reference = tiny_mixtral(output_router_logits=True)
    model = copy.deepcopy(reference)
    mesh = lightning_ep.init_mesh(2, device_type="cpu")
    config = MoEConfig(moe_load_balancing="none", global_token_shuffle=shuffle)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' aux loss beside ours
        lightning_ep.transform(model, config, mesh=mesh)
    lightning_ep.shard_model(model, mesh)
    batch = micro_batch(0, rank, padded=True)
    ours, theirs = model(**batch), reference(**batch)
    real = batch["attention_mask"].reshape(-1).bool()
    assert len(ours.router_logits) == len(theirs.router_logits) == 2
    for a, b in zip(ours.router_logits, theirs.router_logits, strict=True):
        assert a.shape == b.shape and rel_err(a[real], b[real]) < RTOL, (rank, shuffle)
        assert torch.all(a[~real] == 0)
    assert rel_err(ours.aux_loss, theirs.aux_loss) < RTOL
