"""Run by ``tests/unit/test_dispatch_symm.py`` under Triton's CPU interpreter (``TRITON_INTERPRET=1``):
the symmetric-memory pull kernels and ``copy_live_rows`` (``lightning_ep.moe.dispatch.static.symm_pull``)
against torch references.

The ranks of a group are emulated in one process: each has a plain CPU buffer laid out like a
``SymmetricWorkspace`` (same regions, same offsets), and the kernels get the buffers' addresses as
the pointer table, exactly as they get the mapped peer buffers on CUDA. Three ranks, a hidden size
of two kernel blocks with a masked tail, a rank without tokens, an expert nobody picks; then a
static plan padded to a row budget below the busiest rank's rows.
"""

import types

import torch

from lightning_ep.moe.dispatch.rows import inverse_permutation, sort_by_expert
from lightning_ep.moe.dispatch.static import symm_pull
from lightning_ep.moe.dispatch.static.symmetric import plan_pulls

D, E, K, H = 3, 12, 3, 1100  # two blocks of 1024 per row, the second masked
L = E // D
tokens = [5, 8, 0]  # the last rank has no tokens
g = torch.Generator().manual_seed(0)
ranks = []
for T in tokens:
    scores = torch.rand(T, E, generator=g)
    scores[:, 2] = -1.0  # an expert nobody picks
    ids = torch.topk(scores, K, dim=-1).indices
    order, counts = sort_by_expert(ids, E)
    ranks.append(
        {
            "ids": ids,
            "order": order,
            "counts": counts,
            "plan": None,
            "x": torch.randn(T, H, generator=g),
            "w": torch.rand(T, K, generator=g),
            "g": torch.randn(T, H, generator=g),
        }
    )
counts_DE = torch.stack([r["counts"] for r in ranks])
rows = [int(counts_DE[:, r * L : (r + 1) * L].sum()) for r in range(D)]
for r, rank in enumerate(ranks):
    rank["plan"] = plan_pulls(counts_DE, r, L, rank["ids"], inverse_permutation(rank["order"]), rows[r])
sizes = symm_pull.region_sizes(max(tokens), max(rows), K, H, 4)
at = symm_pull.offsets({name: symm_pull.align(n) for name, n in sizes.items()})
buffers = [torch.zeros(at["total"], dtype=torch.uint8) for _ in range(D)]
ws = types.SimpleNamespace(bases=torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64))


def region(r, name, n, dtype):
    return buffers[r][at[name] : at[name] + n * dtype.itemsize].view(dtype)


def pair_of(m_src, m_pos):
    """(source rank, flat pair) of each received row."""
    return [(s, int(ranks[s]["order"][p])) for s, p in zip(m_src.tolist(), m_pos.tolist(), strict=True)]


# Dispatch: every rank offers its tokens and sorted pairs; every rank pulls its experts' rows.
for r, rank in enumerate(ranks):
    region(r, "tokens", rank["x"].numel(), torch.float32).copy_(rank["x"].reshape(-1))
    region(r, "order", rank["order"].numel(), torch.int32).copy_(rank["order"].to(torch.int32))
x_M, y_M = [], []
for r, rank in enumerate(ranks):
    src_M, pos_M = rank["plan"][:2]
    out = torch.full((rows[r], H), float("nan"))
    symm_pull.pull_rows(ws, at["tokens"], at["order"], src_M, pos_M, out, K)
    want = [ranks[s]["x"][p // K] for s, p in pair_of(src_M, pos_M)]
    assert torch.equal(out, torch.stack(want) if want else out), r
    x_M.append(out)
    y_M.append(torch.tanh(out) * (r + 1))

# Combine: every rank offers its experts' rows; a token's rank pulls its K rows, weighted.
for r in range(D):
    region(r, "rows", y_M[r].numel(), torch.float32).copy_(y_M[r].reshape(-1))
for s, rank in enumerate(ranks):
    src_TK, row_TK = rank["plan"][2:]
    for weights in (rank["w"], None):
        out = torch.full((tokens[s], H), float("nan"))
        symm_pull.pull_sum(ws, at["rows"], src_TK, row_TK, weights, out)
        want = torch.zeros(tokens[s], H)
        for k in range(K):
            y = (
                torch.stack([y_M[d][i] for d, i in zip(src_TK[:, k].tolist(), row_TK[:, k].tolist(), strict=True)])
                if tokens[s]
                else want
            )
            want = want + (weights[:, k : k + 1] * y if weights is not None else y)
        torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)

# Combine backward: every rank offers the output's gradient, its sorted pairs and weights; the
# experts' rank computes each row's gradient and its weight's; the token's rank pulls the latter.
for r, rank in enumerate(ranks):
    region(r, "tokens", rank["g"].numel(), torch.float32).copy_(rank["g"].reshape(-1))
    region(r, "order", rank["order"].numel(), torch.int32).copy_(rank["order"].to(torch.int32))
    region(r, "weights", rank["w"].numel(), torch.float32).copy_(rank["w"].reshape(-1))
for r, rank in enumerate(ranks):
    src_M, pos_M = rank["plan"][:2]
    grad_y = torch.full((rows[r], H), float("nan"))
    grad_w = region(r, "grad_w", rows[r], torch.float32)
    symm_pull.pull_combine_backward(ws, at, src_M, pos_M, y_M[r], grad_y, grad_w, K)
    for m, (s, p) in enumerate(pair_of(src_M, pos_M)):
        g_row = ranks[s]["g"][p // K]
        torch.testing.assert_close(grad_y[m], ranks[s]["w"].reshape(-1)[p] * g_row, rtol=0, atol=0)
        torch.testing.assert_close(grad_w[m], (g_row * y_M[r][m]).sum(), rtol=1e-5, atol=1e-5)
for s, rank in enumerate(ranks):
    src_TK, row_TK = rank["plan"][2:]
    N = src_TK.numel()
    out = torch.full((N, 1), float("nan"))
    symm_pull.pull_sum(ws, at["grad_w"], src_TK.view(N, 1), row_TK.view(N, 1), None, out)
    want = [
        region(d, "grad_w", rows[d], torch.float32)[i]
        for d, i in zip(src_TK.reshape(-1).tolist(), row_TK.reshape(-1).tolist(), strict=True)
    ]
    assert torch.equal(out.view(-1), torch.stack(want) if want else out.view(-1)), s

# A static plan with budget B below the busiest rank's rows: padding rows (source -1) are neither
# read nor written (they stay NaN), the kept rows are the exact plan's first B, and the pairs past
# the budget (row -1) add nothing. Every region a kernel must not read holds NaN.
B = max(rows) - 2
assert min(rows) < B
padded = [
    plan_pulls(counts_DE, r, L, rank["ids"], inverse_permutation(rank["order"]), B, padded=True)
    for r, rank in enumerate(ranks)
]
for r, rank in enumerate(ranks):
    region(r, "tokens", rank["x"].numel(), torch.float32).copy_(rank["x"].reshape(-1))
    region(r, "order", rank["order"].numel(), torch.int32).copy_(rank["order"].to(torch.int32))
for r in range(D):
    src_M, pos_M = padded[r][:2]
    live = src_M >= 0
    assert int(live.sum()) == min(rows[r], B)
    out = torch.full((B, H), float("nan"))
    symm_pull.pull_rows(ws, at["tokens"], at["order"], src_M, pos_M, out, K)
    assert torch.equal(out[live], x_M[r][:B][live[: rows[r]]] if rows[r] else out[live]), r
    assert torch.isnan(out[~live]).all(), r
    y_pad = torch.full((B, H), float("nan"))
    y_pad[live] = y_M[r][: int(live.sum())]
    # Offered by copy_live_rows: the live rows copied, the padding rows' region left as it was.
    offered = region(r, "rows", B * H, torch.float32).view(B, H)
    offered.fill_(float("nan"))
    symm_pull.copy_live_rows(offered, torch.where(live[:, None], y_pad, -7.0), src_M)
    assert torch.equal(offered[live], y_pad[live]) and offered[~live].isnan().all(), r
for s, rank in enumerate(ranks):
    src_TK, row_TK = padded[s][2:]
    out = torch.full((tokens[s], H), float("nan"))
    symm_pull.pull_sum(ws, at["rows"], src_TK, row_TK, rank["w"], out)
    want = torch.zeros(tokens[s], H)
    for t in range(tokens[s]):
        for k in range(K):
            d, i = int(src_TK[t, k]), int(row_TK[t, k])
            if i >= 0:
                want[t] += rank["w"][t, k] * y_M[d][i]
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
for r, rank in enumerate(ranks):
    region(r, "tokens", rank["g"].numel(), torch.float32).copy_(rank["g"].reshape(-1))
    region(r, "weights", rank["w"].numel(), torch.float32).copy_(rank["w"].reshape(-1))
for r in range(D):
    src_M, pos_M = padded[r][:2]
    live = src_M >= 0
    y_pad = torch.full((B, H), float("nan"))
    y_pad[live] = y_M[r][: int(live.sum())]
    grad_y = torch.full((B, H), float("nan"))
    grad_w = region(r, "grad_w", B, torch.float32)
    grad_w.fill_(float("nan"))
    symm_pull.pull_combine_backward(ws, at, src_M, pos_M, y_pad, grad_y, grad_w, K)
    assert torch.isnan(grad_y[~live]).all() and torch.isnan(grad_w[~live]).all(), r
    for m, (s, p) in enumerate(pair_of(src_M[live], pos_M[live])):
        g_row = ranks[s]["g"][p // K]
        torch.testing.assert_close(grad_y[m], ranks[s]["w"].reshape(-1)[p] * g_row, rtol=0, atol=0)
        torch.testing.assert_close(grad_w[m], (g_row * y_M[r][m]).sum(), rtol=1e-5, atol=1e-5)
print("ok")
