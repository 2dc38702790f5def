"""On CUDA: the fast dispatch paths equal their references, and one MoE layer's forward + backward
makes at most one device-to-host synchronisation (none without expert parallelism).

The CPU twin of the equality checks is ``tests/unit/test_fast_paths.py``. Syncs are counted with
``torch.cuda.set_sync_debug_mode("warn")``, which warns once per synchronising CUDA call
(``.item()``, ``.tolist()``, ``torch.bincount``'s read of the maximum, blocking copies).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import count_syncs, rel_err
from torch import nn

from lightning_ep.moe import GroupedExperts, MoEConfig, MoELayer, TopKRouter
from lightning_ep.moe.dispatch.rows import (
    count_ids,
    gather_rows,
    inverse_permutation,
    sort_by_expert,
    weighted_unsort,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CUDA = torch.device("cuda")


def _ids(num_tokens: int, top_k: int, num_experts: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device=CUDA).manual_seed(seed)
    scores = torch.rand(num_tokens, num_experts, generator=g, device=CUDA)
    scores[:, -1] = -1.0  # one idle expert
    return torch.topk(scores, top_k, dim=-1).indices


def _layer(num_experts=16, hidden=128, inter=64, top_k=4, dtype=torch.bfloat16, seed=0) -> MoELayer:
    g = torch.Generator(device=CUDA).manual_seed(seed)
    gate = torch.randn(num_experts, hidden, generator=g, device=CUDA, dtype=dtype) * hidden**-0.5
    w1 = torch.randn(num_experts, 2 * inter, hidden, generator=g, device=CUDA, dtype=dtype) * 0.05
    w2 = torch.randn(num_experts, hidden, inter, generator=g, device=CUDA, dtype=dtype) * 0.05
    return MoELayer(
        TopKRouter(nn.Parameter(gate), top_k=top_k, mode="none"),
        GroupedExperts(nn.Parameter(w1), nn.Parameter(w2), F.silu),
        MoEConfig(moe_load_balancing="none"),
    ).train()


# ---------------------------------------------------------------- equality with the references


@pytest.mark.parametrize("num_experts", [128, 256, 40000])  # sort keys narrowed to uint8, int16, int32
def test_counts_and_order_equal_bincount_and_argsort_on_cuda(num_experts):
    ids = _ids(4096, 8, num_experts, seed=1)
    order, counts = sort_by_expert(ids, num_experts)
    flat = ids.reshape(-1)
    assert torch.equal(order, torch.argsort(flat, stable=True))
    assert torch.equal(counts, torch.bincount(flat, minlength=num_experts))
    assert torch.equal(count_ids(ids, num_experts), torch.bincount(flat, minlength=num_experts))
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=CUDA)
    assert torch.equal(inverse_permutation(order), inverse)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_permutation_gathers_equal_index_select_on_cuda(dtype):
    T, K, E, H = 1024, 8, 64, 256
    ids = _ids(T, K, E, seed=2)
    order, _ = sort_by_expert(ids, E)
    g = torch.Generator(device=CUDA).manual_seed(3)
    x = torch.randn(T, H, generator=g, device=CUDA).to(dtype)
    w = torch.softmax(torch.randn(T, K, generator=g, device=CUDA), -1).to(dtype)
    scale = torch.randn(T * K, 1, generator=g, device=CUDA).to(dtype)
    up = torch.randn(T, H, generator=g, device=CUDA)

    def run(fast: bool):
        xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        if fast:
            x_NH = gather_rows(xr, order, K)
            out = weighted_unsort(x_NH * scale, inverse_permutation(order), order, wr)
        else:
            x_NH = xr.index_select(0, torch.div(order, K, rounding_mode="floor"))
            inverse = torch.empty_like(order)
            inverse[order] = torch.arange(order.numel(), device=CUDA)
            y = (x_NH * scale).index_select(0, inverse).view(T, K, H)
            out = torch.bmm(wr.unsqueeze(1), y).squeeze(1)
        (out.float() * up).sum().backward()
        return out, xr.grad, wr.grad

    fast, ref = run(True), run(False)
    assert torch.equal(fast[0], ref[0])
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert rel_err(fast[1], ref[1]) < tol
    assert rel_err(fast[2], ref[2]) < tol


def test_cuda_layer_equals_the_cpu_float64_loop():
    layer = _layer(dtype=torch.bfloat16)
    x = torch.randn(512, 128, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    up = torch.randn(512, 128, device=CUDA, dtype=torch.bfloat16)
    (layer(x) * up).sum().backward()

    ref = _layer(dtype=torch.bfloat16)
    cpu = MoELayer(
        TopKRouter(nn.Parameter(ref.gate.weight.detach().double().cpu()), top_k=4, mode="none"),
        GroupedExperts(
            nn.Parameter(ref.experts.gate_up_proj.detach().double().cpu()),
            nn.Parameter(ref.experts.down_proj.detach().double().cpu()),
            F.silu,
            use_grouped_mm=False,
        ),
        MoEConfig(moe_load_balancing="none"),
    ).train()
    xc = x.detach().double().cpu().requires_grad_(True)
    out_c = cpu(xc)
    (out_c * up.double().cpu()).sum().backward()
    assert rel_err(layer(x.detach()).cpu(), out_c) < 2e-2
    assert rel_err(x.grad.cpu(), xc.grad) < 3e-2
    assert rel_err(layer.experts.gate_up_proj.grad.cpu(), cpu.experts.gate_up_proj.grad) < 3e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("T", "K", "H"), [(4096, 8, 2048), (2048, 2, 4096), (33, 3, 200)])
def test_fused_combine_equals_the_torch_fallback_on_cuda(dtype, T, K, H):
    pytest.importorskip("triton", reason="Triton is not installed")
    from lightning_ep.moe.dispatch import combine

    assert combine.fused_combine_available(torch.empty(1, device=CUDA))
    ids = _ids(T, K, 16, seed=T)
    order, _ = sort_by_expert(ids, 16)
    inverse = inverse_permutation(order)
    g = torch.Generator(device=CUDA).manual_seed(6)
    y = torch.randn(T * K, H, generator=g, device=CUDA).to(dtype)
    w = torch.softmax(torch.randn(T, K, generator=g, device=CUDA), dim=-1)  # fp32, as the router gives
    up = torch.randn(T, H, generator=g, device=CUDA).to(dtype)
    poison = torch.full((T * K, H), float("nan"), device=CUDA, dtype=dtype)
    results = []
    for fused in (True, False):
        yr, wr = y.clone().requires_grad_(True), w.clone().requires_grad_(True)
        if fused:
            out = combine._FusedCombine.apply(yr, wr, inverse)
        else:
            out = combine._TorchCombine.apply(yr, wr, inverse, order)
        out.backward(up)
        results.append((out, yr.grad, wr.grad))
    (out_f, gy_f, gw_f), (out_t, gy_t, gw_t) = results
    # bf16: the kernel multiplies by the fp32 weights, the fallback by their bf16 rounding.
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert not torch.isnan(gy_f).any() and not torch.isnan(out_f).any() and poison.isnan().all()
    assert rel_err(out_f, out_t) < tol
    assert rel_err(gy_f, gy_t) < tol
    assert rel_err(gw_f, gw_t) < tol
    assert gw_f.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("J", "R", "H"), [(65536, 8192, 2048), (1000, 7, 4096), (33, 50, 200)])
def test_segment_sum_kernel_equals_index_add_bitwise_on_cuda(dtype, J, R, H):
    pytest.importorskip("triton", reason="Triton is not installed")
    from lightning_ep.moe.dispatch import dedup

    assert dedup._triton() is not None
    g = torch.Generator(device=CUDA).manual_seed(J)
    src = torch.randn(J, H, generator=g, device=CUDA).to(dtype)
    index = torch.randint(0, R, (J,), generator=g, device=CUDA)  # R=50 > J=33 leaves rows empty
    for out_dtype in (torch.float32, dtype):
        fused = dedup.segment_sum(src, index, R, out_dtype)
        reference = torch.zeros(R, H, device=CUDA).index_put_((index,), src.float(), accumulate=True)
        # The reference in the kernel's order: one row at a time, ascending j (index_put_ may reorder).
        ordered = dedup.segment_sum(src.cpu(), index.cpu(), R, out_dtype)
        assert torch.equal(fused.cpu(), ordered), out_dtype
        assert rel_err(fused.float(), reference) < (1e-2 if out_dtype == torch.bfloat16 else 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("N", "I"), [(4096, 768), (1000, 14336), (33, 100)])
def test_fused_swiglu_equals_torch_on_cuda(dtype, N, I):  # noqa: E741
    pytest.importorskip("triton", reason="Triton is not installed")
    from lightning_ep.moe.kernels import swiglu

    assert swiglu.fused_swiglu_available(torch.empty(1, device=CUDA))
    g = torch.Generator(device=CUDA).manual_seed(7)
    h = (torch.randn(N, 2 * I, generator=g, device=CUDA) * 3).to(dtype)
    up = torch.randn(N, I, generator=g, device=CUDA).to(dtype)
    results = []
    for fused in (True, False):
        hr = h.clone().requires_grad_(True)
        a = swiglu._FusedSwiGLU.apply(hr, None) if fused else F.silu(hr[:, :I]) * hr[:, I:]
        a.backward(up)
        results.append((a, hr.grad))
    (a_f, g_f), (a_t, g_t) = results
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5  # bf16: one rounding against two or three
    assert not a_f.isnan().any() and not g_f.isnan().any()
    assert rel_err(a_f, a_t) < tol
    assert rel_err(g_f, g_t) < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("T", "K", "H"), [(4096, 8, 2048), (2048, 2, 4096), (33, 3, 200)])
def test_sum_copies_kernel_equals_the_ordered_fp32_sum_bitwise_on_cuda(dtype, T, K, H):
    pytest.importorskip("triton", reason="Triton is not installed")
    from lightning_ep.moe.dispatch import combine

    ids = _ids(T, K, 16, seed=T)
    order, _ = sort_by_expert(ids, 16)
    inverse = inverse_permutation(order)
    x = torch.randn(T * K, H, generator=torch.Generator(device=CUDA).manual_seed(8), device=CUDA).to(dtype)
    fused = combine.sum_copies(x, inverse, K)
    copies = x.index_select(0, inverse).view(T, K, H).float()
    ordered = torch.zeros(T, H, device=CUDA)
    for k in range(K):  # the kernel's order: k ascending, in fp32, one rounding
        ordered += copies[:, k]
    assert fused.dtype == dtype and torch.equal(fused, ordered.to(dtype))
    assert rel_err(fused.float(), copies.double().sum(1)) < (1e-2 if dtype == torch.bfloat16 else 1e-6)


@pytest.mark.parametrize("scale", [1.0, 0.5])
@pytest.mark.parametrize(("N", "I"), [(4096, 768), (33, 100)])
def test_swiglu_backward_kernel_writes_scaled_copies_bitwise_on_cuda(scale, N, I):  # noqa: E741
    pytest.importorskip("triton", reason="Triton is not installed")
    from lightning_ep.moe.kernels import swiglu

    g = torch.Generator(device=CUDA).manual_seed(9)
    h = (torch.randn(N, 2 * I, generator=g, device=CUDA) * 3).bfloat16()
    up = torch.randn(N, I, generator=g, device=CUDA).bfloat16()
    hr = h.clone().requires_grad_(True)
    a = swiglu._FusedSwiGLU.apply(hr, None)
    a.backward(up)
    grad_h, scaled_grad_h, scaled_a = swiglu.swiglu_backward(h, up, F.silu, scale)
    assert torch.equal(grad_h, hr.grad)  # the same gradient as the autograd kernel
    assert torch.equal(scaled_a, a.detach() * scale)  # a recomputed exactly as the forward computes it
    assert torch.equal(scaled_grad_h, hr.grad * scale)
    assert (scaled_grad_h is grad_h) == (scale == 1.0)
    # A row limit (a static plan's padding past the GEMMs' last offset): the rows before it the same bits.
    rows = torch.tensor([N * 2 // 3], device=CUDA, dtype=torch.int32)
    live = int(rows)
    limited = swiglu.swiglu_backward(h, up, F.silu, scale, rows)
    for got, want in zip(limited, (grad_h, scaled_grad_h, scaled_a), strict=True):
        assert torch.equal(got[:live], want[:live])
    assert torch.equal(swiglu.swiglu(h, F.silu, rows)[:live], a.detach()[:live])


@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_grouped_mlp_equals_autograd_of_its_gemms_on_cuda(monkeypatch, scale):
    from lightning_ep.moe.experts import grouped as experts_module

    L, H, I, N = 16, 512, 256, 4096  # noqa: E741
    g = torch.Generator(device=CUDA).manual_seed(10)
    w1 = (torch.randn(L, 2 * I, H, generator=g, device=CUDA) * 0.05).bfloat16()
    w2 = (torch.randn(L, H, I, generator=g, device=CUDA) * 0.05).bfloat16()
    x = torch.randn(N, H, generator=g, device=CUDA).bfloat16()
    up = torch.randn(N, H, generator=g, device=CUDA).bfloat16()
    counts = torch.full((L,), N // L, device=CUDA)
    counts[3], counts[4] = 0, 2 * (N // L)  # one idle expert
    results = []
    for fold in (True, False):
        monkeypatch.setattr(experts_module, "fold_grad_scale", lambda *args, fold=fold: fold)
        experts = GroupedExperts(nn.Parameter(w1.clone()), nn.Parameter(w2.clone()), F.silu, use_grouped_mm=True)
        experts.grad_scale = scale
        xr = x.clone().requires_grad_(True)
        out = experts(xr, counts)
        out.backward(up)
        results.append((out, xr.grad, experts.gate_up_proj.grad, experts.down_proj.grad))
    for got, want in zip(*results, strict=True):
        assert not got.isnan().any() and rel_err(got, want) < 1e-6
    assert results[0][2][3].abs().max() == 0 and results[0][3][3].abs().max() == 0


# ---------------------------------------------------------------- host syncs


def _fwd_bwd(layer: MoELayer):
    x = torch.randn(2048, 128, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)

    def step() -> None:
        layer(x).backward(grad)

    return step


def test_local_layer_makes_no_host_sync():
    step = _fwd_bwd(_layer())
    step()  # warm-up: library handles, allocator
    assert count_syncs(step) == 0


@pytest.fixture
def one_rank_nccl_group():
    """A one-process NCCL group: the expert-parallel dispatchers run their full code path."""
    if dist.is_initialized():
        pytest.skip("a process group already exists")
    device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("dispatcher", "syncs"), [("all_to_all", 1), ("all_to_all_dedup", 1), ("all_gather", 2)])
def test_expert_parallel_layer_makes_at_most_one_host_sync(one_rank_nccl_group, dispatcher, syncs):
    """One host read per layer (the split sizes); the all-gather dispatcher also reads every rank's token
    count, once per model call (here the layer is called alone: once per call of it)."""
    from lightning_ep.moe.dispatch.all_gather import AllGatherDispatcher
    from lightning_ep.moe.dispatch.all_to_all import AllToAllDispatcher
    from lightning_ep.moe.dispatch.dedup import DedupAllToAllDispatcher

    layer = _layer()
    if dispatcher == "all_gather":
        layer.dispatcher = AllGatherDispatcher(layer.num_experts, one_rank_nccl_group)
    else:
        kind = DedupAllToAllDispatcher if dispatcher == "all_to_all_dedup" else AllToAllDispatcher
        layer.dispatcher = kind(layer.num_experts, one_rank_nccl_group)
    step = _fwd_bwd(layer)
    step()
    assert count_syncs(step) == syncs


@pytest.mark.parametrize(("counts", "per_expert"), [([9000, 0, 12000, 11000], True), ([300] * 16, False)])
def test_experts_pick_per_expert_gemms_for_large_experts(counts, per_expert):
    # With host counts, use_grouped_mm=None runs one cuBLAS GEMM per expert once an average
    # expert's first GEMM reaches per_expert_min_gflop (here 2 x 8000 x 4096 x 1024 = 67 GFLOP
    # against 2.5); the result equals the forced per-expert path bitwise and the grouped GEMM within
    # bf16 round-off.
    g = torch.Generator(device=CUDA).manual_seed(0)
    L, H, I = len(counts), 1024, 2048  # noqa: E741
    w1 = torch.randn(L, 2 * I, H, generator=g, device=CUDA).bfloat16() * 0.05
    w2 = torch.randn(L, H, I, generator=g, device=CUDA).bfloat16() * 0.05
    x = torch.randn(sum(counts), H, generator=g, device=CUDA).bfloat16()
    up = torch.randn(sum(counts), H, generator=g, device=CUDA).bfloat16()
    counts_L = torch.tensor(counts, device=CUDA)

    def run(use_grouped_mm, host):
        weights = nn.Parameter(w1.clone()), nn.Parameter(w2.clone())
        experts = GroupedExperts(*weights, F.silu, use_grouped_mm=use_grouped_mm)
        experts.grad_scale = 0.5
        xr = x.clone().requires_grad_(True)
        out = experts(xr, counts_L, host)
        (out.float() * up).sum().backward()
        return experts, [out, xr.grad, experts.gate_up_proj.grad, experts.down_proj.grad]

    auto, got = run(None, counts)
    assert auto.prefers_per_expert(x, counts, auto.gate_up_proj) is per_expert
    _, forced = run(False if per_expert else True, counts)
    for a, b in zip(got, forced, strict=True):
        assert torch.equal(a, b)
    _, grouped = run(True, None)
    for a, b in zip(got, grouped, strict=True):
        assert rel_err(a, b) < 1e-2
    if per_expert:
        assert torch.all(got[2][1] == 0) and torch.all(got[3][1] == 0)  # the idle expert


@pytest.mark.parametrize("numel", [1, 4095, 4096 * 3 + 17])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_widening_kernel_equals_torch_cast_bitwise_on_cuda(dtype, numel):
    from lightning_ep.moe.kernels.cast import widen, widen_with_kernel

    g = torch.Generator(device=CUDA).manual_seed(numel)
    x = (torch.randn(numel, generator=g, device=CUDA) * 100).to(dtype)
    x[0] = float("inf")
    assert torch.equal(widen_with_kernel(x), x.float())
    assert torch.equal(widen(x.view(1, -1), torch.float32), x.float().view(1, -1))
