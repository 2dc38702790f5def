"""``GroupedExperts``: a 1-expert MoE against a dense SwiGLU FFN by hand, the grouped-GEMM path
against the per-expert loop, zero (not missing) gradients for idle experts, and the error messages.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from conftest import rel_err
from torch import nn

from lightning_ep.moe import GroupedExperts, MoEConfig, MoELayer, TopKRouter
from lightning_ep.moe.experts.grouped import grouped_mm_supported

H, I, E = 64, 32, 8  # noqa: E741 (shape letters, as in lightning_ep.moe)
COUNTS = [5, 0, 3, 8, 1, 0, 7, 4]  # experts 1 and 5 receive no row
IDLE = [1, 5]


def _weights(num_experts=E, hidden=H, inter=I, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(num_experts, 2 * inter, hidden, generator=g) * 0.1
    w2 = torch.randn(num_experts, hidden, inter, generator=g) * 0.1
    return w1.to(dtype), w2.to(dtype)


def _experts(w1, w2, use_grouped_mm):
    return GroupedExperts(nn.Parameter(w1.clone()), nn.Parameter(w2.clone()), F.silu, use_grouped_mm=use_grouped_mm)


# ---------------------------------------------------------------- one expert = a dense FFN


@pytest.mark.parametrize("use_grouped_mm", [None, False])
def test_single_expert_top1_equals_dense_swiglu(use_grouped_mm):
    w1, w2 = _weights(num_experts=1)
    gate = TopKRouter(nn.Parameter(torch.randn(1, H) * 0.1), top_k=1, mode="none")
    experts = _experts(w1, w2, use_grouped_mm)
    layer = MoELayer(gate, experts, MoEConfig(moe_load_balancing="none", moe_z_loss_coeff=0.0))
    x = torch.randn(2, 12, H, generator=torch.Generator().manual_seed(1), requires_grad=True)
    upstream = torch.randn(2, 12, H, generator=torch.Generator().manual_seed(2))
    out = layer(x)
    (out * upstream).sum().backward()

    # By hand: down(silu(gate(x)) * up(x)), routing weight exactly 1.
    xr = x.detach().clone().requires_grad_(True)
    w_gate = w1[0, :I].clone().requires_grad_(True)
    w_up = w1[0, I:].clone().requires_grad_(True)
    w_down = w2[0].clone().requires_grad_(True)
    dense = (F.silu(xr @ w_gate.t()) * (xr @ w_up.t())) @ w_down.t()
    (dense * upstream).sum().backward()

    assert out.shape == x.shape
    assert rel_err(out, dense) < 1e-6
    assert rel_err(x.grad, xr.grad) < 1e-6
    assert rel_err(experts.gate_up_proj.grad[0], torch.cat([w_gate.grad, w_up.grad])) < 1e-6
    assert rel_err(experts.down_proj.grad[0], w_down.grad) < 1e-6
    assert torch.all(layer.tokens_per_expert == 24)
    assert gate.weight.grad.abs().max() < 1e-6  # weight is 1 whatever the logits


# ---------------------------------------------------------------- grouped GEMM vs loop


def _run(experts: GroupedExperts, x: torch.Tensor, counts: list[int], upstream: torch.Tensor):
    x = x.clone().requires_grad_(True)
    out = experts(x, torch.tensor(counts))
    (out.float() * upstream).sum().backward()
    return out, x.grad, experts.gate_up_proj.grad, experts.down_proj.grad


@pytest.mark.parametrize("grouped", [None, True])
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_grouped_matches_loop(grouped, dtype, tol):
    w1, w2 = _weights(dtype=dtype)
    n = sum(COUNTS)
    x = torch.randn(n, H, generator=torch.Generator().manual_seed(3)).to(dtype)
    upstream = torch.randn(n, H, generator=torch.Generator().manual_seed(4))
    assert grouped_mm_supported(x, w1, w2)  # the grouped path really runs
    got = _run(_experts(w1, w2, grouped), x, COUNTS, upstream)
    want = _run(_experts(w1, w2, False), x, COUNTS, upstream)
    for name, a, b in zip(("out", "x.grad", "gate_up_proj.grad", "down_proj.grad"), got, want, strict=True):
        assert a.dtype == b.dtype == dtype, name
        assert rel_err(a, b) < tol, name


def test_loop_matches_per_expert_hand_computation():
    w1, w2 = _weights()
    x = torch.randn(sum(COUNTS), H, generator=torch.Generator().manual_seed(3))
    out = _experts(w1, w2, False)(x, torch.tensor(COUNTS))
    rows = []
    for e, chunk in enumerate(torch.split(x, COUNTS)):
        rows.append((F.silu(chunk @ w1[e, :I].t()) * (chunk @ w1[e, I:].t())) @ w2[e].t())
    assert rel_err(out, torch.cat(rows)) < 1e-6


@pytest.mark.parametrize("grouped", [None, True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_idle_expert_gets_zero_gradient(grouped, dtype):
    w1, w2 = _weights(dtype=dtype)
    x = torch.randn(sum(COUNTS), H, generator=torch.Generator().manual_seed(3)).to(dtype)
    _, _, g1, g2 = _run(_experts(w1, w2, grouped), x, COUNTS, torch.ones(sum(COUNTS), H))
    assert g1 is not None and g2 is not None
    assert g1.shape == w1.shape and g2.shape == w2.shape
    for e in range(E):
        if e in IDLE:
            assert torch.count_nonzero(g1[e]) == 0 and torch.count_nonzero(g2[e]) == 0
        else:
            assert torch.count_nonzero(g1[e]) > 0 and torch.count_nonzero(g2[e]) > 0


@pytest.mark.parametrize("grouped", [None, False])
def test_unrouted_expert_in_a_layer_gets_zero_gradient(grouped):
    # Feature 0 is constant 1 and expert 7's weight on it is very negative: nobody picks expert 7.
    weight = torch.randn(E, H, generator=torch.Generator().manual_seed(0)) * 0.1
    weight[7, 0] = -50.0
    w1, w2 = _weights()
    experts = _experts(w1, w2, grouped)
    layer = MoELayer(
        TopKRouter(nn.Parameter(weight), top_k=2, mode="none"),
        experts,
        MoEConfig(moe_load_balancing="none"),
    )
    x = torch.randn(32, H, generator=torch.Generator().manual_seed(1))
    x[:, 0] = 1.0
    layer(x).square().sum().backward()
    assert layer.tokens_per_expert[7] == 0
    assert experts.gate_up_proj.grad is not None and experts.down_proj.grad is not None
    assert torch.count_nonzero(experts.gate_up_proj.grad[7]) == 0
    assert torch.count_nonzero(experts.down_proj.grad[7]) == 0
    assert torch.count_nonzero(experts.gate_up_proj.grad[:7]) > 0


def test_all_rows_to_one_expert_and_empty_input():
    w1, w2 = _weights()
    for grouped in (None, False):
        experts = _experts(w1, w2, grouped)
        x = torch.randn(6, H, generator=torch.Generator().manual_seed(3))
        counts = [0, 0, 6, 0, 0, 0, 0, 0]
        expected = (F.silu(x @ w1[2, :I].t()) * (x @ w1[2, I:].t())) @ w2[2].t()
        assert rel_err(experts(x, torch.tensor(counts)), expected) < 1e-5
        assert experts(torch.zeros(0, H), torch.zeros(E, dtype=torch.int64)).shape == (0, H)


@pytest.mark.parametrize("grouped", [None, False])
@pytest.mark.parametrize(
    ("scale", "rows"),
    [
        (0.25, 28),  # a power of two, 2 N H < the weights' elements: the rows' gradients are scaled
        (0.25, 400),  # more rows than weight elements: the weights' gradients are scaled
        (0.3, 28),  # not a power of two: the weights' gradients, whatever the sizes
    ],
)
def test_grad_scale_scales_weight_gradients_only(grouped, scale, rows):
    counts = [rows // E] * (E - 1) + [rows - (rows // E) * (E - 1)]
    w1, w2 = _weights()
    x = torch.randn(rows, H, generator=torch.Generator().manual_seed(3))
    upstream = torch.randn(rows, H, generator=torch.Generator().manual_seed(4))
    out, gx, g1, g2 = _run(_experts(w1, w2, grouped), x, counts, upstream)
    scaled = _experts(w1, w2, grouped)
    scaled.grad_scale = scale
    out_s, gx_s, g1_s, g2_s = _run(scaled, x, counts, upstream)
    assert torch.equal(out_s, out)
    assert torch.equal(gx_s, gx)  # the activations' gradient is not scaled
    if scale != 0.25:
        # Not a power of two: the per-expert GEMMs scale the weight gradient inside the GEMM
        # (``alpha``), the grouped path (``grouped_mlp``) scales ``grad_h`` and ``a`` before the
        # weight-gradient GEMMs: fp32 rounding apart from scaling the unscaled gradients.
        for got, want in ((g1_s, g1 * scale), (g2_s, g2 * scale)):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * want.abs().max().item())
    else:
        # Bitwise: a power-of-two factor commutes with rounding.
        assert torch.equal(g1_s, g1 * scale) and torch.equal(g2_s, g2 * scale)


@pytest.mark.parametrize("grouped", [None, False])
def test_compute_dtype_casts_weights_and_returns_gradients_in_their_dtype(grouped):
    w1, w2 = _weights()
    x = torch.randn(sum(COUNTS), H, generator=torch.Generator().manual_seed(3)).bfloat16()
    upstream = torch.randn(sum(COUNTS), H, generator=torch.Generator().manual_seed(4))
    reference = _run(_experts(w1.bfloat16(), w2.bfloat16(), grouped), x, COUNTS, upstream)
    mixed = _experts(w1, w2, grouped)
    mixed.compute_dtype = torch.bfloat16
    got = _run(mixed, x, COUNTS, upstream)
    assert got[0].dtype == torch.bfloat16 and got[2].dtype == torch.float32
    for want, have in zip(reference[:2], got[:2], strict=True):
        assert torch.equal(have, want)  # output and input gradient: what FSDP2's param_dtype=bf16 computes
    for want, have in zip(reference[2:], got[2:], strict=True):
        if grouped is None:  # on CPU the grouped GEMM's bf16 gradient, widened: FSDP2's bits (CUDA: tests/gpu)
            assert torch.equal(have, want.float())
        else:  # the per-expert GEMMs write fp32 from their accumulator: bf16 rounding apart, and unrounded
            assert rel_err(have, want) < 2**-8
            assert not torch.equal(have, have.bfloat16().float())


# ---------------------------------------------------------------- grouped_mm support and errors


def test_grouped_mm_supported_rules():
    w1, w2 = _weights()
    x = torch.zeros(4, H)
    assert grouped_mm_supported(x, w1, w2)
    assert grouped_mm_supported(x.bfloat16(), w1.bfloat16(), w2.bfloat16())
    assert not grouped_mm_supported(x.double(), w1.double(), w2.double())  # dtype
    assert not grouped_mm_supported(x, w1.bfloat16(), w2)  # mixed dtypes
    b1, b2 = _weights(hidden=60, dtype=torch.bfloat16)  # 60 bf16 = 120 bytes: not 16-byte aligned
    assert not grouped_mm_supported(torch.zeros(4, 60, dtype=torch.bfloat16), b1, b2)


@pytest.mark.parametrize(("hidden", "dtype"), [(60, torch.bfloat16), (62, torch.float32)])
def test_use_grouped_mm_true_refuses_unaligned(hidden, dtype):
    w1, w2 = _weights(num_experts=4, hidden=hidden, dtype=dtype)
    experts = _experts(w1, w2, True)
    x = torch.randn(10, hidden).to(dtype)
    expected = (
        f"use_grouped_mm=True but grouped_mm cannot run for dtype {dtype} on cpu with weights "
        f"(4, 64, {hidden}); use_grouped_mm=None falls back to a loop."
    )
    with pytest.raises(RuntimeError, match=re.escape(expected)):
        experts(x, torch.tensor([3, 0, 5, 2]))
    # use_grouped_mm=None falls back to the loop: the very same numbers as use_grouped_mm=False.
    fallback = _experts(w1, w2, None)(x, torch.tensor([3, 0, 5, 2]))
    assert torch.equal(fallback, _experts(w1, w2, False)(x, torch.tensor([3, 0, 5, 2])))


def test_use_grouped_mm_true_refuses_float64():
    w1, w2 = _weights(dtype=torch.float64)
    with pytest.raises(RuntimeError, match=re.escape("grouped_mm cannot run for dtype torch.float64 on cpu")):
        _experts(w1, w2, True)(torch.zeros(sum(COUNTS), H, dtype=torch.float64), torch.tensor(COUNTS))


def test_weights_must_be_3d():
    w1, w2 = _weights()
    expected = "expert weights must be 3-D, got gate_up_proj (64, 64) and down_proj (8, 64, 32)."
    with pytest.raises(ValueError, match=re.escape(expected)):
        GroupedExperts(nn.Parameter(w1[0]), nn.Parameter(w2), F.silu)


@pytest.mark.parametrize(
    ("down_shape", "needed"),
    [((8, 64, 16), (8, 64, 32)), ((4, 64, 32), (8, 64, 32)), ((8, 32, 32), (8, 64, 32))],
)
def test_mismatched_weight_shapes(down_shape, needed):
    w1, _ = _weights()
    expected = f"expert weights do not match: gate_up_proj (8, 64, 64) needs down_proj {needed}, got {down_shape}."
    with pytest.raises(ValueError, match=re.escape(expected)):
        GroupedExperts(nn.Parameter(w1), nn.Parameter(torch.zeros(down_shape)), F.silu)


def test_odd_gate_up_rows_refused():
    expected = "gate_up_proj (8, 63, 64) must stack gate and up rows: its dim 1 must be even."
    with pytest.raises(ValueError, match=re.escape(expected)):
        GroupedExperts(nn.Parameter(torch.zeros(8, 63, 64)), nn.Parameter(torch.zeros(8, 64, 31)), F.silu)


def test_counts_for_wrong_number_of_experts():
    w1, w2 = _weights()
    with pytest.raises(RuntimeError, match=re.escape("got token counts for 4 experts, but 8 are held here.")):
        _experts(w1, w2, None)(torch.zeros(4, H), torch.tensor([1, 1, 1, 1]))


def test_layer_refuses_gate_expert_mismatch():
    w1, w2 = _weights(num_experts=4)
    gate = TopKRouter(nn.Parameter(torch.zeros(E, H)), top_k=2, mode="none")
    with pytest.raises(ValueError, match=re.escape("the gate routes to 8 experts but experts holds 4.")):
        MoELayer(gate, _experts(w1, w2, None), MoEConfig())


def test_experts_adopt_parameters():
    w1, w2 = nn.Parameter(_weights()[0]), nn.Parameter(_weights()[1])
    experts = GroupedExperts(w1, w2, F.silu)
    assert experts.gate_up_proj is w1 and experts.down_proj is w2
    assert experts.num_experts == E
    assert list(experts.state_dict()) == ["gate_up_proj", "down_proj"]


# ---------------------------------------------------------------- the per-expert GEMMs


@pytest.mark.parametrize("grad_scale", [1.0, 0.5])
def test_segment_linear_equals_one_linear_per_expert(grad_scale):
    from lightning_ep.moe.experts.segments import segment_linear

    w1, _ = _weights()
    x = torch.randn(sum(COUNTS), H, generator=torch.Generator().manual_seed(3))
    upstream = torch.randn(sum(COUNTS), 2 * I, generator=torch.Generator().manual_seed(4))
    xs, ws = x.clone().requires_grad_(True), w1.clone().requires_grad_(True)
    out = segment_linear(xs, ws, COUNTS, grad_scale)
    (out * upstream).t().sum(0).sum().backward()  # a non-contiguous gradient reaches backward

    xr, wr = x.clone().requires_grad_(True), w1.clone().requires_grad_(True)
    want = torch.cat([F.linear(rows, wr[e]) for e, rows in enumerate(torch.split(xr, COUNTS))])
    (want * upstream).sum().backward()
    assert rel_err(out, want) < 1e-6
    assert rel_err(xs.grad, xr.grad) < 1e-6
    assert rel_err(ws.grad, wr.grad * grad_scale) < 1e-6
    assert torch.all(ws.grad[IDLE] == 0)  # experts without rows: zero, not garbage


def test_counts_host_must_describe_the_rows():
    w1, w2 = _weights()
    x = torch.randn(sum(COUNTS), H)
    wrong = [*COUNTS[:-1], COUNTS[-1] + 1]
    with pytest.raises(RuntimeError, match=re.escape(f"counts_host {wrong} must give the rows of each of the 8")):
        _experts(w1, w2, False)(x, torch.tensor(COUNTS), wrong)


@pytest.mark.parametrize("grouped", [None, False])
def test_padding_rows_past_the_counts_are_left_out(grouped):
    """Rows past the counts' sum (a symmetric-memory dispatch padded to its row budget) never reach
    the outputs of the real rows or the weights' gradients, whatever they hold: the grouped GEMMs
    stop at the last offset, the per-expert loop gives them zero rows."""
    w1, w2 = _weights()
    n, pad = sum(COUNTS), 6
    x = torch.randn(n, H, generator=torch.Generator().manual_seed(3))
    upstream = torch.randn(n + pad, H, generator=torch.Generator().manual_seed(4))
    want = _run(_experts(w1, w2, grouped), x, COUNTS, upstream[:n])
    x_padded = torch.cat([x, torch.full((pad, H), float("nan"))])
    got = _run(_experts(w1, w2, grouped), x_padded, COUNTS, upstream)
    assert got[0].shape == (n + pad, H)
    assert torch.equal(got[0][:n], want[0])
    for name, a, b in zip(("gate_up_proj.grad", "down_proj.grad"), got[2:], want[2:], strict=True):
        assert torch.equal(a, b), name
    assert torch.equal(got[1][:n], want[1])
    if grouped is False:
        assert torch.equal(got[0][n:], torch.zeros(pad, H))


def test_host_counts_keep_the_grouped_gemm_off_cuda():
    # The per-expert choice is measured on CUDA only: on the CPU, host counts change nothing.
    w1, w2 = _weights()
    experts = _experts(w1, w2, None)
    x = torch.randn(sum(COUNTS) * 512, H)
    counts = [c * 512 for c in COUNTS]
    experts.per_expert_min_gflop = 0.0  # whatever the size
    assert not experts.prefers_per_expert(x, counts, experts.gate_up_proj)
    assert torch.equal(experts(x, torch.tensor(counts), counts), experts(x, torch.tensor(counts)))


# ---------------------------------------------------------------- the grouped MLP with the scale folded in


def _grouped_run(monkeypatch, fold, w1, w2, x, counts, upstream, *, scale=1.0, act_fn=F.silu, frozen=()):
    """``GroupedExperts`` on the grouped GEMM, with ``grouped_mlp`` (``fold``) or plain autograd."""
    from lightning_ep.moe.experts import grouped as experts_module

    monkeypatch.setattr(experts_module, "fold_grad_scale", lambda *args: fold)
    experts = GroupedExperts(nn.Parameter(w1.clone()), nn.Parameter(w2.clone()), act_fn, use_grouped_mm=True)
    experts.grad_scale = scale
    for name in frozen:
        getattr(experts, name).requires_grad_(False)
    xr = x.clone().requires_grad_(True)
    out = experts(xr, torch.tensor(counts))
    out.backward(upstream)
    return [out, xr.grad, experts.gate_up_proj.grad, experts.down_proj.grad]


@pytest.mark.parametrize("act_fn", [F.silu, F.gelu])
@pytest.mark.parametrize("scale", [1.0, 0.5, 0.3])
def test_grouped_mlp_equals_autograd_of_its_gemms(monkeypatch, act_fn, scale):
    w1, w2 = _weights()
    x = torch.randn(sum(COUNTS), H, generator=torch.Generator().manual_seed(3))
    upstream = torch.randn(sum(COUNTS), H, generator=torch.Generator().manual_seed(4))
    got = _grouped_run(monkeypatch, True, w1, w2, x, COUNTS, upstream, scale=scale, act_fn=act_fn)
    want = _grouped_run(monkeypatch, False, w1, w2, x, COUNTS, upstream, scale=scale, act_fn=act_fn)
    for name, g, w in zip(("out", "x", "gate_up_proj", "down_proj"), got, want, strict=True):
        if scale == 0.3 and name in ("gate_up_proj", "down_proj"):
            # Scaled before the one rounding of grad_h and a, not after the GEMM: fp32 rounding apart.
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6 * w.abs().max().item())
        else:
            assert torch.equal(g, w), name  # a power of two commutes with rounding
    for grad in got[2:]:
        assert torch.equal(grad[IDLE], torch.zeros_like(grad[IDLE]))  # idle experts: zero, not missing


@pytest.mark.parametrize("frozen", [("gate_up_proj",), ("down_proj",), ("gate_up_proj", "down_proj")])
def test_grouped_mlp_with_frozen_weights(monkeypatch, frozen):
    w1, w2 = _weights()
    x = torch.randn(sum(COUNTS), H, generator=torch.Generator().manual_seed(3))
    upstream = torch.randn(sum(COUNTS), H, generator=torch.Generator().manual_seed(4))
    got = _grouped_run(monkeypatch, True, w1, w2, x, COUNTS, upstream, scale=0.5, frozen=frozen)
    want = _grouped_run(monkeypatch, False, w1, w2, x, COUNTS, upstream, scale=0.5, frozen=frozen)
    for g, w in zip(got, want, strict=True):
        assert (g is None) == (w is None) and (g is None or torch.equal(g, w))


def test_grouped_mlp_keeps_h_and_not_a(monkeypatch):
    """The forward saves x, h and the weights, not the SwiGLU output a (N x I elements fewer)."""
    w1, w2 = _weights()
    x = torch.randn(sum(COUNTS), H, generator=torch.Generator().manual_seed(3))
    saved = {}
    for fold in (True, False):
        from lightning_ep.moe.experts import grouped as experts_module

        monkeypatch.setattr(experts_module, "fold_grad_scale", lambda *args, fold=fold: fold)
        experts = _experts(w1, w2, True)
        experts.grad_scale = 0.5
        numels: list[int] = []

        def pack(t: torch.Tensor, numels: list[int] = numels) -> torch.Tensor:
            numels.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            experts(x.clone().requires_grad_(True), torch.tensor(COUNTS))
        saved[fold] = sum(n for n in numels if n > E)  # leave out the offsets
    rows = sum(COUNTS)
    assert saved[True] == rows * H + rows * 2 * I + w1.numel() + w2.numel()
    # Autograd keeps a for the second GEMM, and here on the CPU (unfused SwiGLU) silu(gate) too.
    assert saved[False] - saved[True] == 2 * rows * I


def test_fold_grad_scale_needs_rows_in_the_gemm_dtype_and_no_autocast_to_another():
    from lightning_ep.moe.experts.grouped import fold_grad_scale

    x = torch.zeros(2, 8)
    assert fold_grad_scale(x, torch.float32)
    assert not fold_grad_scale(x, torch.bfloat16)  # fp32 rows, bf16 GEMMs
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not fold_grad_scale(x, torch.float32)  # autocast would cast the GEMMs to bf16
        assert fold_grad_scale(x.bfloat16(), torch.bfloat16)  # bf16-mixed: nothing left to cast
