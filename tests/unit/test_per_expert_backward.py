"""The experts' backward as one GEMM per expert: the weight gradients of fp32 master weights written
in fp32 by the GEMM (no bf16 rounding, no widening), and the backward of a grouped forward run per
expert on counts copied to the host during the forward (``CountsOnHost``), each against a hand
computation from the very operands the GEMMs multiply, in float64.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import rel_err
from torch import nn

from lightning_ep.moe import GroupedExperts, MoEConfig, MoELayer, TopKRouter
from lightning_ep.moe.experts.mlp import GROUPED_MM, grouped_mlp
from lightning_ep.moe.experts.segments import CountsOnHost, segment_linear
from lightning_ep.moe.kernels.swiglu import swiglu_backward
from lightning_ep.moe.layer_execution import LayerExecution

H, I, E = 64, 32, 8  # noqa: E741 (shape letters, as in lightning_ep.moe)
COUNTS = [5, 0, 3, 8, 1, 0, 7, 4]  # experts 1 and 5 receive no row
IDLE = [1, 5]
# (weights' dtype, GEMMs' dtype): fp32 throughout, bf16-mixed's fp32 masters in bf16 GEMMs, bf16 throughout.
DTYPES = [(torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16)]


def _weights(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(E, 2 * I, H, generator=g) * 0.1
    w2 = torch.randn(E, H, I, generator=g) * 0.1
    return w1.to(dtype), w2.to(dtype)


def _rows(dtype, seed, width=H, rows=None):
    return torch.randn(rows or sum(COUNTS), width, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _per_expert(a: torch.Tensor, b: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """``a[rows of e].T @ b[rows of e]`` per expert, in float64 (zero for an expert without rows)."""
    out = torch.zeros(len(counts), a.shape[1], b.shape[1], dtype=torch.float64)
    for e, (a_e, b_e) in enumerate(zip(torch.split(a, counts), torch.split(b, counts), strict=True)):
        out[e] = a_e.double().t() @ b_e.double()
    return out


def _weight_grad_check(got: torch.Tensor, want64: torch.Tensor, dtype: torch.dtype) -> None:
    """fp32: the GEMM's own accumulation of exact bf16 products, fp32 round-off from float64; bf16:
    one rounding of it."""
    assert got.dtype == dtype
    assert rel_err(got, want64) < (1e-6 if dtype == torch.float32 else 2**-8)
    assert torch.count_nonzero(got[IDLE]) == 0  # idle experts: zero, not missing


@pytest.mark.parametrize(("weight_dtype", "gemm_dtype"), DTYPES)
@pytest.mark.parametrize("scale", [1.0, 0.3])
def test_segment_linear_writes_the_weight_gradient_in_the_weights_dtype(weight_dtype, gemm_dtype, scale):
    w, _ = _weights(weight_dtype)
    x, upstream = _rows(gemm_dtype, 3), _rows(gemm_dtype, 4, width=2 * I)
    xs, ws = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    out = segment_linear(xs, ws, COUNTS, scale, gemm_dtype if gemm_dtype != weight_dtype else None)
    out.backward(upstream)

    w_c = w.to(gemm_dtype)
    want = torch.cat([rows @ w_c[e].t() for e, rows in enumerate(torch.split(x, COUNTS))])
    assert torch.equal(out, want)  # the same GEMMs on the cast weight
    want_x = torch.cat([g @ w_c[e] for e, g in enumerate(torch.split(upstream, COUNTS))])
    assert torch.equal(xs.grad, want_x)
    _weight_grad_check(ws.grad, scale * _per_expert(upstream, x, COUNTS), weight_dtype)


def _hand_backward(x, counts, w1_c, w2_c, upstream, scale):
    """The grouped forward's ``h`` and, from it, the per-expert backward step by step: the input
    gradient (the same GEMMs) and the weights' gradients in float64."""
    offsets = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    h = GROUPED_MM(x, w1_c.transpose(-2, -1), offs=offsets)
    grad_NI = torch.cat([g @ w2_c[e] for e, g in enumerate(torch.split(upstream, counts))])
    grad_NF, scaled_grad_NF, scaled_a_NI = swiglu_backward(h, grad_NI, F.silu, scale, offsets[-1:])
    grad_x = torch.cat([g @ w1_c[e] for e, g in enumerate(torch.split(grad_NF, counts))])
    return grad_x, _per_expert(scaled_grad_NF, x, counts), _per_expert(upstream, scaled_a_NI, counts)


def _grouped_mlp_run(x, counts, w1, w2, upstream, scale, gemm_dtype, later):
    offsets = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    xr, w1r, w2r = (t.clone().requires_grad_(True) for t in (x, w1, w2))
    out = grouped_mlp(xr, offsets, w1r, w2r, F.silu, scale, gemm_dtype, later)
    out.backward(upstream)
    return out, xr.grad, w1r.grad, w2r.grad


@pytest.mark.parametrize(("weight_dtype", "gemm_dtype"), DTYPES)
@pytest.mark.parametrize("scale", [1.0, 0.5, 0.3])
def test_grouped_forward_with_a_per_expert_backward_equals_the_hand_computation(weight_dtype, gemm_dtype, scale):
    w1, w2 = _weights(weight_dtype)
    x, upstream = _rows(gemm_dtype, 3), _rows(gemm_dtype, 4)
    later = CountsOnHost(torch.tensor(COUNTS))
    out, gx, g1, g2 = _grouped_mlp_run(x, COUNTS, w1, w2, upstream, scale, gemm_dtype, later)
    grouped = _grouped_mlp_run(x, COUNTS, w1, w2, upstream, scale, gemm_dtype, None)

    assert torch.equal(out, grouped[0])  # the forward is the grouped one
    want_x, want_1, want_2 = _hand_backward(x, COUNTS, w1.to(gemm_dtype), w2.to(gemm_dtype), upstream, scale)
    assert torch.equal(gx, want_x)
    _weight_grad_check(g1, want_1, weight_dtype)
    _weight_grad_check(g2, want_2, weight_dtype)
    # Against the grouped backward: fp32 round-off in fp32; in bf16 GEMMs the grouped gradients are
    # rounded to bf16 (and widened back for fp32 masters), the per-expert ones only where the weights are bf16.
    tol = 1e-5 if gemm_dtype == torch.float32 else 2**-8
    for name, a, b in zip(("x", "gate_up_proj", "down_proj"), (gx, g1, g2), grouped[1:], strict=True):
        assert a.dtype == b.dtype, name
        assert rel_err(a, b) < tol, name


def test_per_expert_backward_zeroes_the_padding_rows_input_gradient():
    """Rows past the counts (a static plan's padding) get a zero input gradient, whatever they hold."""
    w1, w2 = _weights(torch.float32)
    pad = 5
    x = torch.cat([_rows(torch.float32, 3), torch.full((pad, H), float("nan"))])
    upstream = _rows(torch.float32, 4, rows=sum(COUNTS) + pad)
    _, gx, g1, g2 = _grouped_mlp_run(x, COUNTS, w1, w2, upstream, 0.5, None, CountsOnHost(torch.tensor(COUNTS)))
    assert torch.equal(gx[-pad:], torch.zeros(pad, H))
    assert torch.isfinite(g1).all() and torch.isfinite(g2).all()


@pytest.mark.parametrize("frozen", ["w1", "w2", "both"])
def test_per_expert_backward_with_frozen_weights(frozen):
    w1, w2 = _weights(torch.float32)
    offsets = torch.cumsum(torch.tensor(COUNTS), 0).to(torch.int32)
    x, upstream = _rows(torch.float32, 3).requires_grad_(True), _rows(torch.float32, 4)
    w1r = w1.clone().requires_grad_(frozen not in ("w1", "both"))
    w2r = w2.clone().requires_grad_(frozen not in ("w2", "both"))
    grouped_mlp(x, offsets, w1r, w2r, F.silu, 0.5, None, CountsOnHost(torch.tensor(COUNTS))).backward(upstream)
    assert (w1r.grad is None) == (frozen in ("w1", "both"))
    assert (w2r.grad is None) == (frozen in ("w2", "both"))
    assert x.grad is not None


def test_counts_on_host_are_a_copy():
    counts = torch.tensor(COUNTS)
    later = CountsOnHost(counts)
    counts.zero_()
    assert later.get() == COUNTS


# ---------------------------------------------------------------- through GroupedExperts


def _experts_run(w1, w2, x, counts, upstream, *, large: bool, monkeypatch, compute_dtype=None):
    experts = GroupedExperts(nn.Parameter(w1.clone()), nn.Parameter(w2.clone()), F.silu)
    experts.compute_dtype = compute_dtype
    experts.grad_scale = 0.5
    monkeypatch.setattr(GroupedExperts, "_large_for", lambda self, x_NH, w_first: large)
    xr = x.clone().requires_grad_(True)
    out = experts(xr, torch.tensor(counts))
    out.backward(upstream)
    return experts, [out, xr.grad, experts.gate_up_proj.grad, experts.down_proj.grad]


def test_grouped_experts_leave_the_backward_to_per_expert_gemms_for_large_experts(monkeypatch):
    """bf16-mixed with the experts outside FSDP2: fp32 masters, bf16 rows. Experts large enough for
    per-expert GEMMs, without host counts in the forward (one process): grouped forward, per-expert
    backward with fp32 weight gradients; small ones: the grouped backward, widened."""
    w1, w2 = _weights(torch.float32)
    x, upstream = _rows(torch.bfloat16, 3), _rows(torch.bfloat16, 4)
    mixed = dict(monkeypatch=monkeypatch, compute_dtype=torch.bfloat16)
    _, large = _experts_run(w1, w2, x, COUNTS, upstream, large=True, **mixed)
    _, small = _experts_run(w1, w2, x, COUNTS, upstream, large=False, **mixed)
    assert torch.equal(large[0], small[0])
    want_x, want_1, want_2 = _hand_backward(x, COUNTS, w1.bfloat16(), w2.bfloat16(), upstream, 0.5)
    assert torch.equal(large[1], want_x)
    _weight_grad_check(large[2], want_1, torch.float32)
    _weight_grad_check(large[3], want_2, torch.float32)
    for grad in small[2:]:  # the grouped GEMM's bf16 gradient, widened
        assert grad.dtype == torch.float32 and torch.equal(grad, grad.bfloat16().float())
    assert not torch.equal(large[2], large[2].bfloat16().float())


def test_counts_for_backward_only_where_it_applies(monkeypatch):
    w1, w2 = _weights(torch.float32)
    experts = GroupedExperts(nn.Parameter(w1), nn.Parameter(w2), F.silu)
    x, counts = torch.zeros(sum(COUNTS), H), torch.tensor(COUNTS)
    assert experts.counts_for_backward(x, counts, w1) is None  # CPU: the grouped GEMMs are measured faster there
    monkeypatch.setattr(GroupedExperts, "_large_for", lambda self, x_NH, w_first: True)
    assert isinstance(experts.counts_for_backward(x, counts, w1), CountsOnHost)
    with torch.no_grad():
        assert experts.counts_for_backward(x, counts, w1) is None  # no backward to come
    experts.host_counts_in_backward = False
    assert experts.counts_for_backward(x, counts, w1) is None


def test_large_experts_rule_needs_cuda_and_use_grouped_mm_none():
    w1, w2 = _weights(torch.float32)
    experts = GroupedExperts(nn.Parameter(w1), nn.Parameter(w2), F.silu)
    experts.per_expert_min_gflop = 0.0
    assert not experts._large_for(torch.zeros(4, H), w1)  # the CPU
    x_meta = torch.empty(4096, H, device="meta")
    assert not GroupedExperts(nn.Parameter(w1), nn.Parameter(w2), F.silu)._large_for(x_meta, w1)


@pytest.mark.parametrize("graphs", [False, True])
def test_moe_layer_keeps_counts_off_the_host_under_cuda_graphs(graphs):
    w1, w2 = _weights(torch.float32)
    experts = GroupedExperts(nn.Parameter(w1), nn.Parameter(w2), F.silu)
    gate = TopKRouter(nn.Parameter(torch.zeros(E, H)), top_k=2, mode="none")
    layer = MoELayer(gate, experts, MoEConfig(moe_load_balancing="none"))
    assert experts.host_counts_in_backward  # the default LayerExecution: no graphs
    layer.set_execution(LayerExecution(cuda_graphs=graphs))
    assert experts.host_counts_in_backward is not graphs
