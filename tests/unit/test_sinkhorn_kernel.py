"""The fused Sinkhorn kernels (``lightning_ep.moe.kernels.sinkhorn``) against the torch version of
``router.sinkhorn_log``, run by Triton's CPU interpreter (a fresh interpreter: the flag is read at
import). The CUDA twin is ``tests/gpu/test_sinkhorn_cuda.py``."""

from __future__ import annotations

from conftest import run_in_triton_interpreter

_CHECK = """
import torch
from lightning_ep.moe.kernels import sinkhorn
from lightning_ep.moe.routing import router

# (T, E, iterations): one block (kept in registers), several blocks (read again each iteration),
# experts not a power of two, partials combined in one load and in two (71 blocks, 64 per load).
for T, E, iterations in [(1, 4, 1), (7, 8, 3), (100, 128, 30), (300, 60, 5), (5000, 128, 2), (9000, 128, 2)]:
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(T)) * 4
    ref = router.sinkhorn_log(logits, iterations)  # the torch version (a CPU tensor)
    got = sinkhorn.sinkhorn_log_fused(logits, iterations, programs=1)  # the interpreter runs programs in turn
    err = (got - ref).abs().max().item()
    assert err < 2e-5, (T, E, iterations, err)
    k = min(2, E)
    assert torch.equal(torch.topk(got, k).indices, torch.topk(ref, k).indices), (T, E, iterations)
    # Columns sum to T / E, rows to about 1, as the torch version's.
    assert torch.allclose(got.exp().sum(0), torch.full((E,), T / E), rtol=1e-4), (T, E)

# Padded rows (router.sinkhorn_log's valid_T): out of the column sums, their own scores -inf; a block
# of padding only, and padding spread over the rows.
for T, E, pad in [(100, 16, slice(60, None)), (300, 60, slice(None, None, 3))]:
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(E)) * 4
    valid = torch.ones(T, dtype=torch.bool)
    valid[pad] = False
    ref = router.sinkhorn_log(logits, 10, valid)
    got = sinkhorn.sinkhorn_log_fused(logits, 10, valid, programs=1)
    assert torch.equal(got[~valid], ref[~valid]) and bool(torch.isneginf(got[~valid]).all()), (T, E)
    err = (got[valid] - ref[valid]).abs().max().item()
    assert err < 2e-5, (T, E, err)
    n = int(valid.sum())
    assert torch.allclose(got[valid].exp().sum(0), torch.full((E,), n / E), rtol=1e-4), (T, E)
print("ok")
"""


def test_fused_sinkhorn_equals_torch_in_the_triton_interpreter() -> None:
    run_in_triton_interpreter("-c", _CHECK, timeout=600)
