"""On CUDA: large experts without host counts in the forward (one process) run the grouped GEMMs in
forward with no host sync and one cuBLAS GEMM per expert in backward, on the counts copied to the
host meanwhile; fp32 master weights get their gradients from those GEMMs in fp32. Checked against a
float64 hand computation from the same operands, and against the grouped backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import count_syncs, rel_err
from torch import nn

from lightning_ep.moe import GroupedExperts
from lightning_ep.moe.experts.mlp import GROUPED_MM
from lightning_ep.moe.kernels.swiglu import swiglu_backward

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CUDA = torch.device("cuda")
COUNTS = [9000, 0, 12000, 11000]  # an average expert's first GEMM: 2 x 8000 x 4096 x 1024 = 67 GFLOP
H, I = 1024, 2048  # noqa: E741


def _operands(weight_dtype: torch.dtype):
    g = torch.Generator(device=CUDA).manual_seed(0)
    w1 = (torch.randn(len(COUNTS), 2 * I, H, generator=g, device=CUDA) * 0.05).to(weight_dtype)
    w2 = (torch.randn(len(COUNTS), H, I, generator=g, device=CUDA) * 0.05).to(weight_dtype)
    x = torch.randn(sum(COUNTS), H, generator=g, device=CUDA).bfloat16()
    up = torch.randn(sum(COUNTS), H, generator=g, device=CUDA).bfloat16()
    return w1, w2, x, up


def _experts(w1, w2, use_grouped_mm=None) -> GroupedExperts:
    experts = GroupedExperts(nn.Parameter(w1.clone()), nn.Parameter(w2.clone()), F.silu, use_grouped_mm=use_grouped_mm)
    experts.grad_scale = 0.5
    if w1.dtype == torch.float32:
        experts.compute_dtype = torch.bfloat16  # bf16-mixed with the experts outside FSDP2
    return experts


def _run(experts: GroupedExperts, x, up):
    xr = x.clone().requires_grad_(True)
    out = experts(xr, torch.tensor(COUNTS, device=CUDA))
    out.backward(up)
    return [out, xr.grad, experts.gate_up_proj.grad, experts.down_proj.grad]


def _hand(x, w1_c, w2_c, up, scale):
    """The grouped forward's ``h``, then the backward per expert with weight gradients in float64."""
    offsets = torch.tensor(COUNTS, device=CUDA).cumsum(0).to(torch.int32)
    h = GROUPED_MM(x, w1_c.transpose(-2, -1), offs=offsets)
    grad_NI = torch.cat([g @ w2_c[e] for e, g in enumerate(torch.split(up, COUNTS)) if COUNTS[e]])
    _, scaled_grad_NF, scaled_a_NI = swiglu_backward(h, grad_NI, F.silu, scale, offsets[-1:])
    grads = []
    for a, b in ((scaled_grad_NF, x), (up, scaled_a_NI)):
        out = torch.zeros(len(COUNTS), a.shape[1], b.shape[1], dtype=torch.float64, device=CUDA)
        for e, (a_e, b_e) in enumerate(zip(torch.split(a, COUNTS), torch.split(b, COUNTS), strict=True)):
            out[e] = a_e.double().t() @ b_e.double()
        grads.append(out)
    return grads


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_large_experts_run_their_backward_per_expert_without_a_host_sync_in_forward(weight_dtype):
    w1, w2, x, up = _operands(weight_dtype)
    experts = _experts(w1, w2)
    assert experts.counts_for_backward(x, torch.tensor(COUNTS, device=CUDA), w1) is not None
    got = _run(experts, x, up)
    grouped = _run(_experts(w1, w2, use_grouped_mm=True), x, up)  # forced: grouped in backward too

    assert torch.equal(got[0], grouped[0])  # the forward is the grouped one
    assert rel_err(got[1], grouped[1]) < 2**-8  # per-expert against grouped input-gradient GEMMs
    for have, want64, ref in zip(got[2:], _hand(x, w1.bfloat16(), w2.bfloat16(), up, 0.5), grouped[2:], strict=True):
        assert have.dtype == weight_dtype
        # fp32 masters: the GEMMs' fp32 accumulation over ~10,000 rows itself (1.3e-5 seen; rounding to
        # bf16 would be ~4e-3); bf16 weights: one rounding of it.
        assert rel_err(have, want64) < (5e-5 if weight_dtype == torch.float32 else 2**-8)
        assert rel_err(have, ref) < 2**-8
        assert torch.count_nonzero(have[1]) == 0  # the idle expert
    if weight_dtype == torch.float32:
        assert not torch.equal(got[2], got[2].bfloat16().float())  # not rounded to bf16

    x_grad, counts_L = x.clone().requires_grad_(True), torch.tensor(COUNTS, device=CUDA)

    def forward() -> None:
        experts(x_grad, counts_L)

    assert count_syncs(forward) == 0


def test_fp32_masters_with_small_experts_get_fp32_gradients_from_the_grouped_kernel():
    """Below ``per_expert_min_gflop`` the backward stays grouped: the input gradient is the bf16
    weights' bit for bit, and fp32 masters get their gradients from the Triton kernel in fp32, the
    float64 product of the GEMMs' operands to fp32 round-off (not rounded to bf16)."""
    g = torch.Generator(device=CUDA).manual_seed(0)
    w1 = torch.randn(8, 128, 64, generator=g, device=CUDA) * 0.05
    w2 = torch.randn(8, 64, 64, generator=g, device=CUDA) * 0.05
    x = torch.randn(96, 64, generator=g, device=CUDA).bfloat16()
    up = torch.randn(96, 64, generator=g, device=CUDA).bfloat16()
    counts = torch.tensor([12, 0, 20, 12, 4, 12, 24, 12], device=CUDA)
    runs = []
    for weights, dtype in (((w1, w2), torch.bfloat16), ((w1.bfloat16(), w2.bfloat16()), None)):
        experts = GroupedExperts(*(nn.Parameter(w.clone()) for w in weights), F.silu)
        experts.compute_dtype, experts.grad_scale = dtype, 0.5
        assert experts.counts_for_backward(x, counts, weights[0]) is None
        xr = x.clone().requires_grad_(True)
        out = experts(xr, counts)
        out.backward(up)
        runs.append([out, xr.grad, experts.gate_up_proj.grad, experts.down_proj.grad])
    (mixed, bf16) = runs
    assert torch.equal(mixed[0], bf16[0]) and torch.equal(mixed[1], bf16[1])
    split = counts.tolist()
    offsets = counts.cumsum(0).to(torch.int32)
    h = GROUPED_MM(x, w1.bfloat16().transpose(-2, -1), offs=offsets)
    grad_NI = GROUPED_MM(up, w2.bfloat16(), offs=offsets)
    _, scaled_grad_NF, scaled_a_NI = swiglu_backward(h, grad_NI, F.silu, 0.5, offsets[-1:])
    for have, low, (a, b) in zip(mixed[2:], bf16[2:], ((scaled_grad_NF, x), (up, scaled_a_NI)), strict=True):
        want = torch.stack([a_e.double().t() @ b_e.double() for a_e, b_e in zip(a.split(split), b.split(split))])
        assert have.dtype == torch.float32
        assert rel_err(have, want) < 1e-6  # fp32 accumulation over 24 rows at most
        assert rel_err(have, low) < 2**-8  # the bf16 weights' gradient: one bf16 rounding of it
        assert not torch.equal(have, have.bfloat16().float())
        assert torch.count_nonzero(have[1]) == 0  # the idle expert


@pytest.mark.parametrize("scale", [1.0, 0.5, 0.3])
def test_segment_linear_writes_fp32_weight_gradients_scaled_by_the_gemm(scale):
    """The per-expert path with host counts (degree 2 and up): ``addmm(..., out_dtype=float32)`` with
    ``alpha = grad_scale`` on bf16 operands gives the float64 product to fp32 round-off."""
    from lightning_ep.moe.experts.segments import segment_linear

    w1, _, x, _ = _operands(torch.float32)
    g = torch.Generator(device=CUDA).manual_seed(1)
    up = torch.randn(sum(COUNTS), 2 * I, generator=g, device=CUDA).bfloat16()
    ws = w1.clone().requires_grad_(True)
    segment_linear(x, ws, COUNTS, scale, torch.bfloat16).backward(up)
    want = torch.zeros(ws.shape, dtype=torch.float64, device=CUDA)
    for e, (g_e, x_e) in enumerate(zip(torch.split(up, COUNTS), torch.split(x, COUNTS), strict=True)):
        want[e] = scale * (g_e.double().t() @ x_e.double())
    assert ws.grad.dtype == torch.float32
    assert rel_err(ws.grad, want) < 5e-5  # fp32 accumulation over ~10,000 rows; bf16 rounding: ~4e-3
    assert torch.count_nonzero(ws.grad[1]) == 0
