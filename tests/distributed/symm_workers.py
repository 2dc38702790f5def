"""Workers for the symmetric-memory dispatch tests (imported by spawned processes).

On the CPU (gloo) only the refusal runs; on 2 GPUs (NCCL, ``tests/gpu/test_symm_dispatch_cuda.py``)
the dispatcher is compared with the all-to-all dispatcher bit for bit.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from conftest import count_syncs  # tests/ is on sys.path under pytest, also in spawned workers

from lightning_ep.moe import MoEConfig
from lightning_ep.moe.dispatchers import make_dispatcher

NUM_EXPERTS = 16


def run_gloo_rejects(rank: int, world: int) -> None:
    """A gloo group gets a clear error when the dispatcher is built, before any token moves."""
    config = MoEConfig(symmetric_memory_dispatch=True)
    try:
        make_dispatcher(config, NUM_EXPERTS, dist.group.WORLD)
    except ValueError as error:
        assert "needs CUDA GPUs in an NCCL process group, got the 'gloo' backend" in str(error), error
        assert "symmetric_memory_dispatch=False" in str(error), error
    else:
        raise AssertionError("make_dispatcher accepted symmetric_memory_dispatch on gloo")


def _ids(tokens: int, top_k: int, rank: int, skew: bool) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(10 + rank)
    scores = torch.rand(tokens, NUM_EXPERTS, generator=g, device="cuda")
    scores[:, 3] = -1.0  # an expert nobody picks
    if skew:  # everything to rank 0's experts: rank 1 receives no row
        scores[:, NUM_EXPERTS // 2 :] = -2.0
    return torch.topk(scores, top_k, dim=-1).indices


def _run(dispatcher, x_TH, ids_TK, weights_TK, scale_E, upstream_TH) -> list[torch.Tensor]:
    """Dispatch, a per-expert nonlinear map (each expert its own scale), combine, backward.

    The gradients compared are the leaves' and the experts' output's: a reduction of the latter
    per expert (``repeat_interleave``'s backward) adds with atomics, in no fixed order."""
    x_TH = x_TH.detach().requires_grad_(True)
    weights_TK = weights_TK.detach().requires_grad_(True)
    dispatched = dispatcher.dispatch(x_TH, ids_TK)
    x_MH = dispatched.x_MH
    L = dispatcher.num_local_experts
    local = scale_E[dist.get_rank() * L : (dist.get_rank() + 1) * L]
    scale_M = torch.repeat_interleave(local, dispatched.counts_L, output_size=x_MH.shape[0])
    y_MH = torch.tanh(x_MH) * scale_M[:, None].to(x_MH.dtype)
    y_MH.retain_grad()
    out_TH = dispatcher.combine(y_MH, weights_TK, dispatched)
    (out_TH.float() * upstream_TH).sum().backward()
    return [x_MH.detach(), out_TH.detach(), x_TH.grad, weights_TK.grad, y_MH.grad, dispatched.counts_L]


def _run_chain(dispatcher, x_TH, ids_list, weights_list, scale_E, upstream_TH) -> list[torch.Tensor]:
    """Several layers in a row, each feeding the next, then one backward through all of them:
    the exchanges of different layers (different row counts) follow each other as in a model."""
    x_TH = x_TH.detach().requires_grad_(True)
    h_TH, outs = x_TH, []
    L = dispatcher.num_local_experts
    local = scale_E[dist.get_rank() * L : (dist.get_rank() + 1) * L]
    weights = [w.detach().requires_grad_(True) for w in weights_list]
    for ids_TK, weights_TK in zip(ids_list, weights, strict=True):
        dispatched = dispatcher.dispatch(h_TH, ids_TK)
        x_MH = dispatched.x_MH
        scale_M = torch.repeat_interleave(local, dispatched.counts_L, output_size=x_MH.shape[0])
        h_TH = h_TH + dispatcher.combine(torch.tanh(x_MH) * scale_M[:, None].to(x_MH.dtype), weights_TK, dispatched)
        outs.append(h_TH.detach())
    (h_TH.float() * upstream_TH).sum().backward()
    return [*outs, x_TH.grad, *(w.grad for w in weights)]


def run_symm_matches_all_to_all(rank: int, world: int) -> None:
    """Rows, outputs and every gradient equal the all-to-all dispatcher's, bit for bit: fp32 and
    bf16, uneven tokens per rank, a hidden size that is not a multiple of the kernels' block, a rank
    that receives nothing, and a workspace that grows; one host sync per forward + backward."""
    from lightning_ep.moe.dispatch_ep import AllToAllDispatcher
    from lightning_ep.moe.dispatch_symm import SymmetricMemoryDispatcher
    from lightning_ep.moe.symm_pull import SymmetricWorkspace

    group = dist.group.WORLD
    a2a = AllToAllDispatcher(NUM_EXPERTS, group)
    symm = make_dispatcher(MoEConfig(symmetric_memory_dispatch=True), NUM_EXPERTS, group)
    assert isinstance(symm, SymmetricMemoryDispatcher)
    cases = [  # (name, dtype, tokens on rank 0 / rank 1, hidden, top_k, skew)
        ("uniform", torch.float32, (48, 48), 128, 4, False),
        ("uneven", torch.bfloat16, (70, 33), 1100, 2, False),
        ("one rank idle", torch.bfloat16, (40, 24), 64, 3, True),
        ("grows", torch.bfloat16, (1024, 1500), 1024, 4, False),
        ("no tokens here", torch.float32, (0, 20), 256, 2, False),
    ]
    workspace = None
    for name, dtype, tokens, hidden, top_k, skew in cases:
        T = tokens[rank]
        g = torch.Generator(device="cuda").manual_seed(rank)
        x_TH = torch.randn(T, hidden, generator=g, device="cuda").to(dtype)
        ids_TK = _ids(T, top_k, rank, skew)
        weights_TK = torch.rand(T, top_k, generator=g, device="cuda")
        scale_E = torch.linspace(0.5, 2.0, NUM_EXPERTS, device="cuda")
        upstream_TH = torch.randn(T, hidden, generator=g, device="cuda")
        want = _run(a2a, x_TH, ids_TK, weights_TK, scale_E, upstream_TH)
        before = workspace.at["total"] if workspace is not None else 0
        got = _run(symm, x_TH, ids_TK, weights_TK, scale_E, upstream_TH)
        workspace = SymmetricWorkspace.of(group, x_TH.device)
        labels = ["x_MH", "out", "grad x", "grad weights", "grad y_MH", "counts_L"]
        for label, a, b in zip(labels, got, want, strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape, (name, label, a.shape, b.shape)
            assert torch.equal(a, b), (name, label, rank, (a.float() - b.float()).abs().max())
        if skew and rank == 1:
            assert got[0].shape[0] == 0
        if name == "grows":
            assert workspace.at["total"] > before, (before, workspace.at["total"])
        syncs = count_syncs(lambda: _run(symm, x_TH, ids_TK, weights_TK, scale_E, upstream_TH))  # noqa: B023
        assert syncs == 1, (name, syncs)

    # Four layers whose row counts differ a lot (skewed, top-1, top-4, uniform), forward then backward.
    T, hidden = 512, 256
    g = torch.Generator(device="cuda").manual_seed(rank)
    x_TH = torch.randn(T, hidden, generator=g, device="cuda").to(torch.bfloat16)
    ids_list = [
        _ids(T, 2, rank, True),
        _ids(T, 1, rank + 7, False),
        _ids(T, 4, rank + 3, False),
        _ids(T, 2, rank, False),
    ]
    weights_list = [torch.rand(T, ids.shape[1], generator=g, device="cuda") for ids in ids_list]
    upstream_TH = torch.randn(T, hidden, generator=g, device="cuda")
    want = _run_chain(a2a, x_TH, ids_list, weights_list, scale_E, upstream_TH)
    for _ in range(3):
        got = _run_chain(symm, x_TH, ids_list, weights_list, scale_E, upstream_TH)
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert torch.equal(a, b), ("chain", i, rank, (a.float() - b.float()).abs().max())
