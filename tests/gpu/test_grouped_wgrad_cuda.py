"""On CUDA: the grouped weight-gradient kernel (``lightning_ep.moe.kernels.grouped_wgrad``) against a
float64 product per group and against ``torch._grouped_mm``'s bf16 gradient, in both tile
configurations; no host sync, and a CUDA graph replay that follows new offsets on the device."""

from __future__ import annotations

import pytest
import torch
from conftest import count_syncs, rel_err

from lightning_ep.moe.experts.mlp import GROUPED_MM
from lightning_ep.moe.kernels import grouped_wgrad

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CUDA = torch.device("cuda")
COUNTS = [0, 700, 513, 0, 64, 1, 900, 0]  # idle groups first, inside and last; one row; uneven


def _operands(dtype: torch.dtype, m: int, k: int, padding: int = 40):
    g = torch.Generator(device=CUDA).manual_seed(0)
    rows = sum(COUNTS) + padding
    a = torch.randn(rows, m, generator=g, device=CUDA).to(dtype)
    b = torch.randn(rows, k, generator=g, device=CUDA).to(dtype)
    a[sum(COUNTS) :], b[sum(COUNTS) :] = float("nan"), float("nan")  # padding past the last offset: never read
    return a, b, torch.tensor(COUNTS, device=CUDA).cumsum(0).to(torch.int32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("config", ["CONFIG", "LARGE_CONFIG"])
@pytest.mark.parametrize(("m", "k"), [(384, 512), (200, 136)])  # tile multiples; widths off the tiles
def test_kernel_gives_the_float64_product_to_fp32_round_off(dtype, config, m, k):
    a, b, offsets = _operands(dtype, m, k)
    assert grouped_wgrad.grouped_weight_grad_available(a, b)
    out = grouped_wgrad.grouped_weight_grad(a, b, offsets, getattr(grouped_wgrad, config))
    assert out.dtype == torch.float32 and out.shape == (len(COUNTS), m, k)
    reference = GROUPED_MM(a.t(), b, offs=offsets)  # torch's grouped GEMM, rounded to dtype
    start = 0
    for e, count in enumerate(COUNTS):
        if count == 0:
            assert torch.count_nonzero(out[e]) == 0
            continue
        want = a[start : start + count].double().t() @ b[start : start + count].double()
        start += count
        # fp32 accumulation over at most 900 exact products (5e-7 seen); bf16 rounding is ~2e-3.
        assert rel_err(out[e], want) < 5e-6, (e, rel_err(out[e], want))
        assert rel_err(out[e], reference[e]) < 2**-8
    assert not torch.equal(out, out.bfloat16().float())


def test_kernel_reads_offsets_on_the_device_inside_a_cuda_graph():
    """No host sync; a captured launch replayed after the offsets changed in place computes the new
    groups (what the MoE layers' CUDA graphs rely on)."""
    a, b, offsets = _operands(torch.bfloat16, 256, 128)
    assert count_syncs(lambda: grouped_wgrad.grouped_weight_grad(a, b, offsets)) == 0
    static = offsets.clone()
    grouped_wgrad.grouped_weight_grad(a, b, static)  # compiled before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = grouped_wgrad.grouped_weight_grad(a, b, static)
    moved = torch.tensor([100, 0, 1000, 0, 0, 500, 0, 578], device=CUDA).cumsum(0).to(torch.int32)
    static.copy_(moved)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, grouped_wgrad.grouped_weight_grad(a, b, moved))
    assert torch.count_nonzero(out[1]) == 0 and rel_err(out[0], a[:100].double().t() @ b[:100].double()) < 5e-6
