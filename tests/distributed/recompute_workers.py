"""Worker for ``test_keep_all_to_all.py``: activation checkpointing with and without keeping the
all-to-all exchanges (imported by spawned processes)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from workers import full, micro_batch, rel_err, tiny_mixtral

import lightning_ep
from lightning_ep import LayerExecution, MoEConfig
from lightning_ep.moe.routing.rng import in_backward
from lightning_ep.strategy.arguments import enable_checkpointing


def _step(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, int]]:
    """One forward + backward; counts the all-to-alls issued in forward and while autograd runs."""
    calls = {"forward": 0, "backward": 0}
    original = dist.all_to_all_single

    def counted(*args, **kwargs):
        calls["backward" if in_backward() else "forward"] += 1
        return original(*args, **kwargs)

    dist.all_to_all_single = counted
    try:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    finally:
        dist.all_to_all_single = original
    return loss.detach(), calls


def run_keep_all_to_all(
    rank: int, world: int, shuffle: bool, device: str = "cpu", model_type: str = "mixtral", dedup: bool = False
) -> None:
    """Degree 2, every decoder layer checkpointed: keeping the exchanges gives bitwise the loss and
    gradients of recomputing them (on CUDA within 1e-5: attention's backward need not be
    deterministic), and the recomputation issues no forward exchange (only the backward's two per
    layer); every kept exchange is consumed. With the token shuffle, its own exchanges are still
    recomputed. ``dedup``: the deduplicated dispatch (one more exchange forward: the positions)."""
    if device == "cuda":
        device = f"cuda:{rank}"
        torch.backends.cuda.matmul.allow_tf32 = False
    if model_type == "mixtral":
        base = tiny_mixtral(router_jitter_noise=0.1).to(device)
    else:  # a family with shared experts: they also run inside the (replayed) exchange's window
        from families_workers import tiny_family

        base = tiny_family(model_type).to(device)
    config = MoEConfig(moe_load_balancing="aux_loss", global_token_shuffle=shuffle)
    results = []
    for keep in (False, True):
        model = copy.deepcopy(base)
        enable_checkpointing(model, True)
        mesh = lightning_ep.init_mesh(2, device_type=torch.device(device).type)
        lightning_ep.transform(model, config, mesh=mesh, execution=LayerExecution(token_dedup=dedup))
        lightning_ep.shard_model(model, mesh)
        model.train()
        layers = lightning_ep.moe_layers(model)
        for layer in layers:
            layer.keep_all_to_all = keep
        for step in range(2):
            loss, calls = _step(model, micro_batch(step, rank).to(device))
            n = len(layers)
            shuffles = 2 * n if shuffle else 0  # shuffle + unshuffle, recomputed either way
            # Forward: counts, (positions,) rows, combine per layer. Backward: the reverse of rows
            # and combine, plus, without keeping, the recomputation's forward exchanges.
            forward = 4 if dedup else 3
            assert calls["forward"] == forward * n + shuffles, (keep, calls)
            assert calls["backward"] == (2 if keep else 2 + forward) * n + 2 * shuffles, (keep, calls)
            assert all(not layer._kept for layer in layers), "a kept exchange was never replayed"
        grads = {name: full(p.grad) for name, p in model.named_parameters()}
        results.append((loss, grads))
    (loss_a, grads_a), (loss_b, grads_b) = results
    for name, (a, b) in {"loss": (loss_a, loss_b), **{n: (g, grads_b[n]) for n, g in grads_a.items()}}.items():
        if device == "cpu":
            assert torch.equal(a, b), name
        else:
            assert rel_err(a, b) <= 1e-5, (name, rel_err(a, b))
