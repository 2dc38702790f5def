"""The symmetric-memory dispatch's index plan (``dispatch_symm.plan_pulls``), on the CPU.

The pulls themselves need CUDA GPUs of one node (``tests/gpu/test_symm_dispatch_cuda.py``); their
indices are plain tensors, so here D ranks are emulated in one process: each rank's pulls are
done with ``index_select`` on the other ranks' tensors, and compared with the all-to-all
dispatcher's row order (expert-major, then source rank, then the source's stable sorted order).
"""

from __future__ import annotations

import pytest
import torch
from conftest import run_in_triton_interpreter

from lightning_ep.moe.config import MoEConfig
from lightning_ep.moe.dispatch.rows import inverse_permutation, sort_by_expert
from lightning_ep.moe.dispatch.static.symm_pull import REGIONS, SymmetricWorkspace, align, offsets, region_sizes
from lightning_ep.moe.dispatch.static.symmetric import RowBudget, plan_pulls, sort_pairs, static_plan
from lightning_ep.moe.layer_execution import LayerExecution


def _ranks(tokens: list[int], num_experts: int, top_k: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    ranks = []
    for T in tokens:
        scores = torch.rand(T, num_experts, generator=g)
        scores[:, 1] = -1.0  # an expert nobody picks
        ids = torch.topk(scores, top_k, dim=-1).indices
        order, counts = sort_by_expert(ids, num_experts)
        x = torch.randn(T, 8, generator=g, dtype=torch.float64)
        w = torch.rand(T, top_k, generator=g, dtype=torch.float64)
        ranks.append(
            {"ids": ids, "order": order, "inverse": inverse_permutation(order), "counts": counts, "x": x, "w": w}
        )
    return ranks


@pytest.mark.parametrize(
    ("tokens", "num_experts", "top_k"),
    [([6, 9, 0], 12, 3), ([16, 16], 8, 2), ([5, 1, 7, 3], 16, 4), ([11], 4, 2)],
)
def test_plan_pulls_reads_the_all_to_all_order(tokens: list[int], num_experts: int, top_k: int) -> None:
    D = len(tokens)
    L = num_experts // D
    ranks = _ranks(tokens, num_experts, top_k, seed=D * 100 + num_experts)
    counts_DE = torch.stack([r["counts"] for r in ranks])
    plans = []
    for rank in range(D):
        rows = int(counts_DE[:, rank * L : (rank + 1) * L].sum())
        plans.append(plan_pulls(counts_DE, rank, L, ranks[rank]["ids"], ranks[rank]["inverse"], rows))

    received = []
    for rank, (src_M, pos_M, _, _) in enumerate(plans):
        # What the all-to-all dispatcher hands this rank's experts, built by hand.
        want_rows, want_expert = [], []
        for e in range(rank * L, (rank + 1) * L):
            for s in range(D):
                for pair in ranks[s]["order"].tolist():
                    if ranks[s]["ids"].reshape(-1)[pair] == e:
                        want_rows.append(ranks[s]["x"][pair // top_k])
                        want_expert.append(e)
        # The pull: row m is token order_s[pos[m]] // K of rank s = src[m].
        got = (
            torch.stack(
                [
                    ranks[s]["x"][ranks[s]["order"][p] // top_k]
                    for s, p in zip(src_M.tolist(), pos_M.tolist(), strict=True)
                ]
            )
            if src_M.numel()
            else torch.empty(0, 8, dtype=torch.float64)
        )
        want = torch.stack(want_rows) if want_rows else torch.empty(0, 8, dtype=torch.float64)
        assert torch.equal(got, want)
        assert src_M.dtype == pos_M.dtype == torch.int32
        # The experts: scale each row by its expert id + 1.
        received.append(got * (torch.tensor(want_expert, dtype=torch.float64) + 1)[:, None])

    for s, (_, _, src_TK, row_TK) in enumerate(plans):
        # The combine pull: sum_k w[t, k] * y_d[row[t, k]] with d = src[t, k].
        x, w, ids = ranks[s]["x"], ranks[s]["w"], ranks[s]["ids"]
        rows = [
            [received[d][r] for d, r in zip(ds, rs, strict=True)]
            for ds, rs in zip(src_TK.tolist(), row_TK.tolist(), strict=True)
        ]
        got = (
            torch.stack([sum(wk * yk for wk, yk in zip(w[t], rows[t], strict=True)) for t in range(len(rows))])
            if rows
            else x
        )
        want = x * (w * (ids + 1)).sum(1, keepdim=True)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
        assert torch.equal(src_TK, (ids // L).to(torch.int32))


def test_pulls_and_rows_are_inverse_maps() -> None:
    """Every pair of every rank is received exactly once, at the row its sender computed."""
    tokens, num_experts, top_k = [13, 4, 9], 6, 2
    D, L = len(tokens), num_experts // len(tokens)
    ranks = _ranks(tokens, num_experts, top_k, seed=7)
    counts_DE = torch.stack([r["counts"] for r in ranks])
    plans = [
        plan_pulls(counts_DE, r, L, ranks[r]["ids"], ranks[r]["inverse"], int(counts_DE[:, r * L : (r + 1) * L].sum()))
        for r in range(D)
    ]
    seen = set()
    for d, (src_M, pos_M, _, _) in enumerate(plans):
        for m, (s, p) in enumerate(zip(src_M.tolist(), pos_M.tolist(), strict=True)):
            pair = int(ranks[s]["order"][p])
            assert int(plans[s][2].reshape(-1)[pair]) == d
            assert int(plans[s][3].reshape(-1)[pair]) == m
            seen.add((s, pair))
    assert len(seen) == sum(tokens) * top_k


def _plans(ranks: list[dict], counts_DE: torch.Tensor, L: int, budget: int | None) -> list[tuple]:
    D = counts_DE.shape[0]
    plans = []
    for r in range(D):
        rows = int(counts_DE[:, r * L : (r + 1) * L].sum()) if budget is None else budget
        plans.append(plan_pulls(counts_DE, r, L, ranks[r]["ids"], ranks[r]["inverse"], rows, padded=budget is not None))
    return plans


@pytest.mark.parametrize("slack", [0, 7])
def test_padded_plan_is_the_exact_plan_plus_padding(slack: int) -> None:
    """With a budget at or above every rank's rows, the static plan holds the exact plan's indices,
    then padding rows of source -1; the senders' rows are the same."""
    tokens, num_experts, top_k = [13, 4, 9], 6, 2
    L = num_experts // len(tokens)
    ranks = _ranks(tokens, num_experts, top_k, seed=11)
    counts_DE = torch.stack([r["counts"] for r in ranks])
    exact = _plans(ranks, counts_DE, L, None)
    budget = max(p[0].numel() for p in exact) + slack
    padded = _plans(ranks, counts_DE, L, budget)
    for (src, pos, src_TK, row_TK), (psrc, ppos, psrc_TK, prow_TK) in zip(exact, padded, strict=True):
        M = src.numel()
        assert psrc.shape == ppos.shape == (budget,)
        assert torch.equal(psrc[:M], src) and torch.equal(ppos[:M], pos)
        assert torch.all(psrc[M:] == -1)
        assert torch.equal(psrc_TK, src_TK) and torch.equal(prow_TK, row_TK)
        assert psrc.dtype == ppos.dtype == prow_TK.dtype == torch.int32


def test_padded_plan_over_budget_leaves_out_the_same_pairs_on_both_sides() -> None:
    """A rank whose experts receive more rows than the budget keeps its first ``budget`` rows; the
    senders mark exactly the pairs past it (row -1), so no pull reads a row that was not kept."""
    tokens, num_experts, top_k = [16, 16], 4, 2
    D, L = len(tokens), num_experts // len(tokens)
    ranks = _ranks(tokens, num_experts, top_k, seed=5)
    for r in ranks:  # every pair of token 0..11 to rank 0's experts (0 and 1): rank 0 gets more rows
        r["ids"][:12] = torch.tensor([0, 1])
        r["order"], r["counts"] = sort_by_expert(r["ids"], num_experts)
        r["inverse"] = inverse_permutation(r["order"])
    counts_DE = torch.stack([r["counts"] for r in ranks])
    exact = _plans(ranks, counts_DE, L, None)
    budget = 40
    assert exact[0][0].numel() > budget >= exact[1][0].numel()
    padded = _plans(ranks, counts_DE, L, budget)
    assert torch.equal(padded[0][0], exact[0][0][:budget]) and torch.equal(padded[0][1], exact[0][1][:budget])
    for s in range(D):
        src_TK, row_TK = exact[s][2], exact[s][3]
        kept = row_TK < budget
        assert torch.equal(padded[s][3], torch.where(kept, row_TK, -1))
        assert torch.equal(padded[s][2], src_TK)
    dropped = sum(int((p[3] == -1).sum()) for p in padded)
    assert dropped == exact[0][0].numel() - budget


def test_static_plan_compiled_gives_the_same_integers() -> None:
    """``compile_plan`` swaps in ``torch.compile`` of the pair sort and the static plan; on emulated
    ranks (one over budget, one padded) the compiled functions return exactly the eager integers."""
    tokens, num_experts, top_k, budget = [24, 24], 8, 2, 40
    L = num_experts // len(tokens)
    ranks = _ranks(tokens, num_experts, top_k, seed=3)
    ranks[0]["ids"][:16] = torch.tensor([0, 1])  # rank 0's experts get more than the budget
    compiled_sort, compiled_plan = torch.compile(sort_pairs), torch.compile(static_plan)
    sorted_eager = [sort_pairs(r["ids"], num_experts) for r in ranks]
    sorted_compiled = [compiled_sort(r["ids"], num_experts) for r in ranks]
    for eager, compiled in zip(sorted_eager, sorted_compiled, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(eager, compiled, strict=True))
    counts_DE = torch.stack([counts for _, counts, _ in sorted_eager])
    for r, (order, _, inverse) in enumerate(sorted_eager):
        eager = static_plan(counts_DE, r, L, ranks[r]["ids"], order, inverse, budget)
        compiled = compiled_plan(counts_DE, r, L, ranks[r]["ids"], order, inverse, budget)
        for i, (a, b) in enumerate(zip(eager, compiled, strict=True)):
            assert a.dtype == b.dtype and torch.equal(a, b), (r, i)
        loads = eager[-1]
        assert int(eager[5].sum()) == min(int(loads[r]), budget)
    assert int(loads.max()) > budget  # the over-budget case ran


def test_row_budget_raises_once_an_excess_is_seen() -> None:
    """``RowBudget`` keeps the running maximum of the rows per rank; at or under the budget nothing
    happens, over it the error names the rank, the loads and the consequence, then starts afresh."""
    budget = RowBudget(10)
    budget.check(wait=True)  # nothing noted yet
    budget.note(torch.tensor([4, 10]))
    budget.check(wait=False)
    budget.note(torch.tensor([12, 3]))
    pattern = (
        r"sent 12 rows to the experts of expert-parallel rank 0 in one layer, over the row budget "
        r"Execution\(row_budget=10\) \(loads per rank: \[12, 10\]\).*raise the row budget if memory allows.*"
        r"the rows past it were left out of that layer's output"
    )
    with pytest.raises(RuntimeError, match=pattern):
        budget.check(wait=False)
    budget.check(wait=True)  # reset: the excess is reported once
    budget.note(torch.tensor([1, 2]))
    budget.check(wait=True)


def test_region_sizes() -> None:
    sizes = region_sizes(tokens=100, rows=333, top_k=8, hidden=72, element_size=2)
    assert sizes == {"tokens": 100 * 72 * 2, "rows": 333 * 72 * 2, "order": 3200, "weights": 3200, "grad_w": 333 * 4}
    assert tuple(sizes) == REGIONS
    at = offsets({name: align(n) for name, n in sizes.items()})
    assert at == {"tokens": 0, "rows": 14592, "order": 62720, "weights": 66048, "grad_w": 69376, "total": 70912}


def test_workspace_region_refuses_a_tensor_larger_than_its_region() -> None:
    """A region is a view of its own bytes only: a tensor that would spill into the next region (an
    exchange larger than the buffer was sized for) is an error, not a silent overwrite."""
    ws = SymmetricWorkspace(None, torch.device("cpu"))  # type: ignore[arg-type]  # no group: region() is host-only
    ws.sizes = {name: align(n) for name, n in region_sizes(4, 6, 2, 8, 2).items()}
    ws.at = offsets(ws.sizes)
    ws.buffer = torch.zeros(ws.at["total"], dtype=torch.uint8)
    rows = ws.region("rows", (6, 8), torch.bfloat16)
    assert rows.data_ptr() == ws.buffer.data_ptr() + ws.at["rows"] and rows.shape == (6, 8)
    assert ws.region("rows", (8, 8), torch.float32).numel() == 64  # 256 bytes: the aligned region, exactly
    too_big = r"region 'rows' holds 256 bytes, but a \[9, 8\] torch.float32 tensor needs 288"
    with pytest.raises(RuntimeError, match=too_big):
        ws.region("rows", (9, 8), torch.float32)


@pytest.mark.parametrize(
    ("kwargs", "shown"),
    [
        ({"moe_all_to_all_dispatcher": False}, "moe_all_to_all_dispatcher=False"),
        ({"capacity_factor": 1.0}, "capacity_factor=1.0"),
    ],
)
def test_symmetric_memory_replaces_only_the_dropless_all_to_all(kwargs: dict, shown: str) -> None:
    symm = LayerExecution(exchange="symmetric_memory")
    with pytest.raises(
        ValueError, match=r"Execution\(exchange='symmetric_memory', .*\) changes the dropless all-to-all"
    ):
        symm.check(MoEConfig(**kwargs), 2)
    with pytest.raises(ValueError, match=shown):
        LayerExecution(exchange="symmetric_memory", row_budget=64).check(MoEConfig(**kwargs), 2)
    symm.check(MoEConfig(), 2)


def test_symmetric_memory_execution_values_are_checked() -> None:
    with pytest.raises(ValueError, match=r"token_dedup=True deduplicates the dynamic collective all-to-all"):
        LayerExecution(exchange="symmetric_memory", token_dedup=True)
    with pytest.raises(ValueError, match=r"LayerExecution\(exchange='nvlink'\): pass 'collective' or"):
        LayerExecution(exchange="nvlink")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"the symmetric-memory exchange takes an int"):
        LayerExecution(exchange="symmetric_memory", row_budget="auto")
    with pytest.raises(ValueError, match=r"LayerExecution\(row_budget=0\): pass an int >= 1, 'auto' or None"):
        LayerExecution(exchange="symmetric_memory", row_budget=0)
    with pytest.raises(ValueError, match=r"degree=1"):  # no exchange at degree 1
        LayerExecution(exchange="symmetric_memory").check(MoEConfig(), 1)


def test_pull_kernels_in_the_triton_interpreter() -> None:
    """The pull kernels, run by Triton's CPU interpreter on emulated ranks' buffers, against torch
    (``symm_interpreter_check.py``): the dispatch's rows, the weighted and plain sums, the combine
    backward's row and weight gradients."""
    from pathlib import Path

    run_in_triton_interpreter(str(Path(__file__).with_name("symm_interpreter_check.py")))
