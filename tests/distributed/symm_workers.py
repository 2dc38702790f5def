"""Workers for the symmetric-memory dispatch tests (imported by spawned processes).

On the CPU (gloo) only the refusal runs; on 2 GPUs (NCCL, ``tests/gpu/test_symm_dispatch_cuda.py``)
the dispatcher is compared with the all-to-all dispatcher bit for bit.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from conftest import count_syncs  # tests/ is on sys.path under pytest, also in spawned workers

from lightning_ep.moe import MoEConfig
from lightning_ep.moe.dispatch.rows import block_of_rows
from lightning_ep.moe.dispatch.select import make_dispatcher
from lightning_ep.moe.layer_execution import LayerExecution

SYMMETRIC = LayerExecution(exchange="symmetric_memory")

NUM_EXPERTS = 16
#: (name, dtype, tokens on rank 0 / rank 1, hidden, top_k, skew): an uneven split, a hidden size that is
#: not a multiple of the kernels' block, a rank that receives nothing, a rank without tokens.
CASES = [
    ("uniform", torch.float32, (48, 48), 128, 4, False),
    ("uneven", torch.bfloat16, (70, 33), 1100, 2, False),
    ("one rank idle", torch.bfloat16, (40, 24), 64, 3, True),
    ("no tokens here", torch.float32, (0, 20), 256, 2, False),
]


def run_gloo_rejects(rank: int, world: int) -> None:
    """A gloo group gets a clear error when the dispatcher is built, before any token moves."""
    try:
        make_dispatcher(MoEConfig(), NUM_EXPERTS, dist.group.WORLD, SYMMETRIC)
    except ValueError as error:
        assert (
            "Execution(exchange='symmetric_memory') needs CUDA GPUs in an NCCL process group, got the 'gloo' "
            in str(error)
        ), error
        assert "use exchange='collective'" in str(error), error
    else:
        raise AssertionError("make_dispatcher accepted exchange='symmetric_memory' on gloo")


def _ids(tokens: int, top_k: int, rank: int, skew: bool) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(10 + rank)
    scores = torch.rand(tokens, NUM_EXPERTS, generator=g, device="cuda")
    scores[:, 3] = -1.0  # an expert nobody picks
    if skew:  # everything to rank 0's experts: rank 1 receives no row
        scores[:, NUM_EXPERTS // 2 :] = -2.0
    return torch.topk(scores, top_k, dim=-1).indices


def _row_scales(scale_L: torch.Tensor, counts_L: torch.Tensor, rows: int) -> torch.Tensor:
    """Each row's expert's scale; rows past the counts (a padded plan) take the last expert's."""
    ends_L = torch.cumsum(counts_L, 0)
    return scale_L[block_of_rows(ends_L, torch.arange(rows, device=ends_L.device))]


def _case_inputs(
    rank: int, dtype: torch.dtype, T: int, hidden: int, top_k: int, skew: bool
) -> tuple[torch.Tensor, ...]:
    """One case's tokens, routing, weights and upstream gradient on this rank."""
    g = torch.Generator(device="cuda").manual_seed(rank)
    x_TH = torch.randn(T, hidden, generator=g, device="cuda").to(dtype)
    ids_TK = _ids(T, top_k, rank, skew)
    weights_TK = torch.rand(T, top_k, generator=g, device="cuda")
    return x_TH, ids_TK, weights_TK, torch.randn(T, hidden, generator=g, device="cuda")


def _run(dispatcher, x_TH, ids_TK, weights_TK, scale_E, upstream_TH) -> list[torch.Tensor]:
    """Dispatch, a per-expert nonlinear map (each expert its own scale), combine, backward.

    The gradients compared are the leaves' and the experts' output's: a reduction of the latter
    per expert (``repeat_interleave``'s backward) adds with atomics, in no fixed order."""
    x_TH = x_TH.detach().requires_grad_(True)
    weights_TK = weights_TK.detach().requires_grad_(True)
    dispatched = dispatcher.dispatch(x_TH, ids_TK, weights_TK)
    x_MH = dispatched.x_MH
    L = dispatcher.num_local_experts
    local = scale_E[dist.get_rank() * L : (dist.get_rank() + 1) * L]
    y_MH = torch.tanh(x_MH) * _row_scales(local, dispatched.counts_L, x_MH.shape[0])[:, None].to(x_MH.dtype)
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
        dispatched = dispatcher.dispatch(h_TH, ids_TK, weights_TK)
        x_MH = dispatched.x_MH
        scale_M = _row_scales(local, dispatched.counts_L, x_MH.shape[0])
        h_TH = h_TH + dispatcher.combine(torch.tanh(x_MH) * scale_M[:, None].to(x_MH.dtype), weights_TK, dispatched)
        outs.append(h_TH.detach())
    (h_TH.float() * upstream_TH).sum().backward()
    return [*outs, x_TH.grad, *(w.grad for w in weights)]


def run_symm_matches_all_to_all(rank: int, world: int) -> None:
    """Rows, outputs and every gradient equal the all-to-all dispatcher's, bit for bit: fp32 and
    bf16, uneven tokens per rank, a hidden size that is not a multiple of the kernels' block, a rank
    that receives nothing, and a workspace that grows; one host sync per forward + backward."""
    from lightning_ep.moe.dispatch.all_to_all import AllToAllDispatcher
    from lightning_ep.moe.dispatch.static.symm_pull import SymmetricWorkspace
    from lightning_ep.moe.dispatch.static.symmetric import SymmetricMemoryDispatcher

    group = dist.group.WORLD
    a2a = AllToAllDispatcher(NUM_EXPERTS, group)
    symm = make_dispatcher(MoEConfig(), NUM_EXPERTS, group, SYMMETRIC)
    assert isinstance(symm, SymmetricMemoryDispatcher)
    cases = [*CASES, ("grows", torch.bfloat16, (1024, 1500), 1024, 4, False)]
    workspace = None
    scale_E = torch.linspace(0.5, 2.0, NUM_EXPERTS, device="cuda")
    for name, dtype, tokens, hidden, top_k, skew in cases:
        x_TH, ids_TK, weights_TK, upstream_TH = _case_inputs(rank, dtype, tokens[rank], hidden, top_k, skew)
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


def run_static_plan_matches_all_to_all(rank: int, world: int) -> None:
    """With a row budget (``LayerExecution(row_budget=...)``) the symmetric-memory plan is static:
    the received rows (the first ``M`` of the ``R`` padded ones), outputs and every gradient equal the
    all-to-all dispatcher's bit for bit, with no host sync at all; a layer over budget raises (before
    the next dispatch and at ``raise_if_over_budget``), and tokens over budget are refused up front."""
    from lightning_ep.moe.dispatch.all_to_all import AllToAllDispatcher
    from lightning_ep.moe.dispatch.static.symmetric import SymmetricMemoryDispatcher

    group = dist.group.WORLD
    a2a = AllToAllDispatcher(NUM_EXPERTS, group)
    budget = 4096
    static = make_dispatcher(
        MoEConfig(), NUM_EXPERTS, group, LayerExecution(exchange="symmetric_memory", row_budget=budget)
    )
    assert isinstance(static, SymmetricMemoryDispatcher) and static.budget is not None
    scale_E = torch.linspace(0.5, 2.0, NUM_EXPERTS, device="cuda")
    cases = [*CASES, ("large", torch.bfloat16, (1024, 1500), 1024, 2, False)]  # top-2: within the budget
    for name, dtype, tokens, hidden, top_k, skew in cases:
        x_TH, ids_TK, weights_TK, upstream_TH = _case_inputs(rank, dtype, tokens[rank], hidden, top_k, skew)
        want = _run(a2a, x_TH, ids_TK, weights_TK, scale_E, upstream_TH)
        got = _run(static, x_TH, ids_TK, weights_TK, scale_E, upstream_TH)
        _assert_padded_equal(got, want, budget, (name, hidden, rank))
        syncs = count_syncs(lambda: _run(static, x_TH, ids_TK, weights_TK, scale_E, upstream_TH))  # noqa: B023
        assert syncs == 0, (name, syncs)
        static.raise_if_over_budget()  # within budget: nothing to raise

    # The plan through torch.compile (MoELayer.compile_routing does this): the same bits, no sync.
    static.compile_plan()
    name, dtype, tokens, hidden, top_k, skew = cases[1]
    x_TH, ids_TK, weights_TK, upstream_TH = _case_inputs(rank, dtype, tokens[rank], hidden, top_k, skew)
    want = _run(a2a, x_TH, ids_TK, weights_TK, scale_E, upstream_TH)
    got = _run(static, x_TH, ids_TK, weights_TK, scale_E, upstream_TH)
    M = want[0].shape[0]
    got[0], got[4] = got[0][:M], got[4][:M]
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), ("compiled plan", i, rank)
    assert count_syncs(lambda: _run(static, x_TH, ids_TK, weights_TK, scale_E, upstream_TH)) == 0

    # Four chained layers, forward then backward, against the all-to-all dispatcher.
    T, hidden = 512, 256
    g = torch.Generator(device="cuda").manual_seed(rank)
    x_TH = torch.randn(T, hidden, generator=g, device="cuda").to(torch.bfloat16)
    ids_list = [_ids(T, 2, rank, True), _ids(T, 1, rank + 7, False), _ids(T, 4, rank + 3, False)]
    weights_list = [torch.rand(T, ids.shape[1], generator=g, device="cuda") for ids in ids_list]
    upstream_TH = torch.randn(T, hidden, generator=g, device="cuda")
    want = _run_chain(a2a, x_TH, ids_list, weights_list, scale_E, upstream_TH)
    got = _run_chain(static, x_TH, ids_list, weights_list, scale_E, upstream_TH)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), ("chain", i, rank, (a.float() - b.float()).abs().max())

    # Over budget: skewed routing sends rank 0 all 2 x 300 x 2 = 1200 rows, over a budget of 1000.
    tight = make_dispatcher(
        MoEConfig(), NUM_EXPERTS, group, LayerExecution(exchange="symmetric_memory", row_budget=1000)
    )
    T, hidden = 300, 128
    x_TH = torch.randn(T, hidden, generator=g, device="cuda").to(torch.bfloat16)
    ids_TK, weights_TK = _ids(T, 2, rank, True), torch.rand(T, 2, generator=g, device="cuda")
    upstream_TH = torch.randn(T, hidden, generator=g, device="cuda")
    over = (
        "sent 1200 rows to the experts of expert-parallel rank 0 in one layer, over the row budget "
        "Execution(row_budget=1000)"
    )
    out = _run(tight, x_TH, ids_TK, weights_TK, scale_E, upstream_TH)[1]
    assert torch.isfinite(out).all()  # the excess is left out, nothing is read out of bounds
    try:
        tight.raise_if_over_budget()
    except RuntimeError as error:
        assert over in str(error) and "left out of that layer's output" in str(error), error
    else:
        raise AssertionError("raise_if_over_budget let 1200 rows pass a budget of 1000")
    _run(tight, x_TH, ids_TK, weights_TK, scale_E, upstream_TH)
    torch.cuda.synchronize()  # the note has landed on both ranks: the next dispatch raises on both
    try:
        tight.dispatch(x_TH, ids_TK, weights_TK)
    except RuntimeError as error:
        assert over in str(error), error
    else:
        raise AssertionError("the next dispatch did not report the excess")
    # Tokens past the budget are refused before any work.
    try:
        ids = torch.zeros(1001, 2, dtype=torch.long, device="cuda")
        tight.dispatch(torch.zeros(1001, hidden, device="cuda"), ids, torch.ones(1001, 2, device="cuda"))
    except ValueError as error:
        assert "Execution(row_budget=1000) is below this rank's 1001 tokens; with exchange='symmetric_memory'" in str(
            error
        ), error
    else:
        raise AssertionError("1001 tokens passed a budget of 1000")


def run_step_checks_stop_an_over_budget_step(rank: int, world: int) -> None:
    """Watched by ``StepChecks.watch_budgets`` without a model (no budget fallback to run a forward
    again), the budget is checked before the optimizer step, not at the dispatches: a model whose
    routing sends one rank more rows than the row budget raises there, on every rank (its second
    layer's dispatch does not), with no optimizer step taken; within budget nothing is raised."""
    from lightning.pytorch import LightningModule
    from workers import BATCH, SEQ, _skew_router, micro_batch, tiny_mixtral

    import lightning_ep
    from lightning_ep.strategy.step_checks import StepChecks

    device = torch.device("cuda", rank)
    mesh = lightning_ep.init_mesh(world, device_type="cuda")
    tokens = BATCH * SEQ
    for budget, skew in ((4 * tokens, False), (3 * tokens, True)):  # skewed: rank 0 receives 2 x 2 x tokens rows
        model = tiny_mixtral().to(device=device, dtype=torch.bfloat16)
        execution = LayerExecution(exchange="symmetric_memory", row_budget=budget)
        lightning_ep.transform(model, MoEConfig(moe_load_balancing="none"), mesh=mesh, execution=execution)
        lightning_ep.shard_model(model, mesh)
        if skew:
            _skew_router(model)
        layers = lightning_ep.moe_layers(model)
        checks = StepChecks(check_finite=False, log_losses=False)
        checks.watch_budgets(layers)  # no model: nothing reruns (the strategy passes its model)
        assert all(layer.dispatcher.budget.raise_at_dispatch is False for layer in layers)
        ids = micro_batch(0, rank).to(device)
        model(input_ids=ids, labels=ids).loss.backward()
        checks.after_forward(layers, LightningModule(), device)
        try:
            checks.before_optimizer_step(None)
        except RuntimeError as error:
            assert skew, error
            assert f"sent {4 * tokens} rows to the experts of expert-parallel rank 0" in str(error), error
            assert f"over the row budget Execution(row_budget={budget})" in str(error), error
        else:
            assert not skew, "an over-budget step reached the optimizer step"


def run_padded_matches_all_to_all(rank: int, world: int) -> None:
    """The padded all-to-all (``Execution(row_budget=...)``) on NCCL: the received rows (the first
    ``M`` of the ``R`` padded ones), outputs and every gradient equal the all-to-all dispatcher's bit
    for bit, with no host sync; a skewed case over a tight budget is noted, not raised. Runs on one
    GPU (a group of one: the exchange, plan and budget bookkeeping on CUDA) and on two."""
    from lightning_ep.moe.dispatch.all_to_all import AllToAllDispatcher
    from lightning_ep.moe.dispatch.static.padded import PaddedAllToAllDispatcher

    group = dist.group.WORLD
    a2a = AllToAllDispatcher(NUM_EXPERTS, group)
    padded = PaddedAllToAllDispatcher(NUM_EXPERTS, group, 4096)
    scale_E = torch.linspace(0.5, 2.0, NUM_EXPERTS, device="cuda")
    for name, dtype, tokens, hidden, top_k, skew in CASES:
        x_TH, ids_TK, weights_TK, upstream_TH = _case_inputs(rank, dtype, tokens[rank], hidden, top_k, skew)
        want = _run(a2a, x_TH, ids_TK, weights_TK, scale_E, upstream_TH)
        got = _run(padded, x_TH, ids_TK, weights_TK, scale_E, upstream_TH)
        _assert_padded_equal(got, want, 4096, (name, hidden, rank))
        syncs = count_syncs(lambda: _run(padded, x_TH, ids_TK, weights_TK, scale_E, upstream_TH))  # noqa: B023
        assert syncs == 0, (name, syncs)
        assert padded.budget.take_excess() is None, name
    tight = PaddedAllToAllDispatcher(NUM_EXPERTS, group, 8 * world)
    x_TH, ids_TK, weights_TK, upstream_TH = _case_inputs(rank, torch.bfloat16, 40, 64, 3, True)
    _run(tight, x_TH, ids_TK, weights_TK, scale_E, upstream_TH)
    loads = tight.budget.take_excess()
    assert loads is not None and loads[0] > 8 * world, loads


def _assert_padded_equal(got: list[torch.Tensor], want: list[torch.Tensor], rows: int, case: tuple) -> None:
    """``_run``'s results on a plan padded to ``rows`` received rows equal the dynamic plan's bit for
    bit: the first ``M`` received rows (the rest is padding) and everything else whole."""
    name, hidden, rank = case
    M = want[0].shape[0]
    assert got[0].shape == (rows, hidden), (name, got[0].shape)
    got[0], got[4] = got[0][:M], got[4][:M]
    labels = ["x_MH", "out", "grad x", "grad weights", "grad y_MH", "counts_L"]
    for label, a, b in zip(labels, got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, (name, label, a.shape, b.shape)
        assert torch.equal(a, b), (name, label, rank, (a.float() - b.float()).abs().max())
