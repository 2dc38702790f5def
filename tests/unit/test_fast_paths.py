"""Every fast path of the dispatch hot path against its reference path, on the CPU.

The fast paths (``lightning_ep.moe.dispatch.base``): counts per expert by binary search instead of
``torch.bincount`` (which reads the maximum back to the host on CUDA); permutation gathers whose
backward is a gather by the inverse permutation instead of ``index_select``'s zero-fill plus
scatter-add. The references below are the straightforward implementations they replaced. The same
checks run on CUDA in ``tests/gpu/test_fast_paths_cuda.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import rel_err, run_in_triton_interpreter
from torch import nn

from lightning_ep.moe import GroupedExperts, MoEConfig, MoELayer, TopKRouter
from lightning_ep.moe.dispatch.rows import (
    block_of_rows,
    count_ids,
    expert_counts,
    gather_rows,
    inverse_permutation,
    narrow_keys,
    permute_rows,
    sort_by_expert,
    weighted_unsort,
)

# ---------------------------------------------------------------- references


def reference_sort_by_expert(expert_ids_TK: torch.Tensor, num_experts: int):
    flat = expert_ids_TK.reshape(-1)
    return torch.argsort(flat, stable=True), torch.bincount(flat, minlength=num_experts)


def reference_inverse(order: torch.Tensor) -> torch.Tensor:
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel())
    return inverse


def reference_gather_rows(x_TH: torch.Tensor, order_N: torch.Tensor, top_k: int) -> torch.Tensor:
    return x_TH.index_select(0, torch.div(order_N, top_k, rounding_mode="floor"))


def reference_weighted_unsort(y_NH, order_N, weights_TK):
    num_tokens, top_k = weights_TK.shape
    y_TKH = y_NH.index_select(0, reference_inverse(order_N)).view(num_tokens, top_k, -1)
    return torch.bmm(weights_TK.to(y_TKH.dtype).unsqueeze(1), y_TKH).squeeze(1)


def _ids(num_tokens: int, top_k: int, num_experts: int, seed: int) -> torch.Tensor:
    """Distinct experts per token (as top-k gives), with some experts left idle."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(num_tokens, num_experts, generator=g)
    if num_experts > top_k:
        scores[:, -1] = -1.0  # the last expert never chosen: a zero count
    return torch.topk(scores, top_k, dim=-1).indices


# ---------------------------------------------------------------- counts and orders


@pytest.mark.parametrize(("num_tokens", "top_k", "num_experts"), [(1, 1, 1), (37, 2, 8), (64, 8, 128)])
def test_sort_and_counts_equal_argsort_and_bincount(num_tokens, top_k, num_experts):
    ids = _ids(num_tokens, top_k, num_experts, seed=num_tokens)
    order, counts = sort_by_expert(ids, num_experts)
    ref_order, ref_counts = reference_sort_by_expert(ids, num_experts)
    assert torch.equal(order, ref_order)
    assert torch.equal(counts, ref_counts)
    assert counts.dtype == torch.int64
    assert counts[-1] == (num_tokens if num_experts == 1 else 0)
    assert torch.equal(count_ids(ids, num_experts), ref_counts)


@pytest.mark.parametrize(
    ("bound", "dtype"), [(1, torch.uint8), (255, torch.uint8), (256, torch.int16), (40000, torch.int32)]
)
def test_narrowed_sort_keys_give_the_int64_order(bound, dtype):
    # Many ties (a stable sort must keep them in place) and the bound itself among the keys.
    keys = torch.randint(0, bound + 1, (5000,), generator=torch.Generator().manual_seed(bound))
    keys[::7] = bound
    narrow = narrow_keys(keys, bound)
    assert narrow.dtype == dtype and torch.equal(narrow.long(), keys)
    assert torch.equal(torch.sort(narrow, stable=True).indices, torch.sort(keys, stable=True).indices)
    if bound < 1000:  # expert_counts on the narrowed sorted keys: searches for the bound too
        counts = torch.bincount(keys, minlength=bound + 1)[:-1]
        assert torch.equal(expert_counts(torch.sort(narrow).values, bound), counts)


def test_expert_counts_with_a_trailing_overflow_key():
    # The all-gather dispatcher sorts keys 0..L with L meaning "another rank's expert".
    keys = torch.tensor([3, 0, 3, 1, 3, 0])
    assert torch.equal(expert_counts(torch.sort(keys).values, 4), torch.tensor([2, 1, 0, 3]))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_block_of_rows_equals_repeat_interleave_then_pads_with_the_last_block(dtype):
    """Blocks of sizes 3, 0, 2, 0, 4 (empty ones included), then 3 padding rows."""
    sizes = torch.tensor([3, 0, 2, 0, 4], dtype=dtype)
    rows = torch.arange(12, dtype=dtype)
    got = block_of_rows(torch.cumsum(sizes, 0).to(dtype), rows)
    want = torch.repeat_interleave(torch.arange(5), sizes.long())
    assert torch.equal(got[:9], want)
    assert torch.equal(got[9:], torch.full((3,), 4))


def test_inverse_permutation_equals_index_put():
    order = torch.randperm(101, generator=torch.Generator().manual_seed(0))
    assert torch.equal(inverse_permutation(order), reference_inverse(order))


# ---------------------------------------------------------------- gathers and their gradients


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_gather_rows_and_unsort_equal_index_select_with_gradients(dtype):
    T, K, E, H = 29, 3, 8, 16
    ids = _ids(T, K, E, seed=1)
    order, _ = sort_by_expert(ids, E)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(T, H, generator=g).to(dtype)
    w = torch.softmax(torch.randn(T, K, generator=g), dim=-1).to(dtype)
    up = torch.randn(T, H, generator=g).to(dtype)
    scale = torch.randn(T * K, 1, generator=g).to(dtype)  # makes the K copies' gradients differ

    def run(fast: bool):
        xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        if fast:
            x_NH = gather_rows(xr, order, K)
            out = weighted_unsort(x_NH * scale, inverse_permutation(order), order, wr)
        else:
            x_NH = reference_gather_rows(xr, order, K)
            out = reference_weighted_unsort(x_NH * scale, order, wr)
        (out.float() * up.float()).sum().backward()
        return x_NH, out, xr.grad, wr.grad

    fast, ref = run(True), run(False)
    # Forward gathers are exact; gradients differ only by the order of additions (bf16: rounding).
    assert torch.equal(fast[0], ref[0])
    assert torch.equal(fast[1], ref[1])
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-12 if dtype == torch.float64 else 1e-6
    assert rel_err(fast[2], ref[2]) < tol
    assert rel_err(fast[3], ref[3]) < tol


def test_permute_rows_gradient_is_the_inverse_gather():
    perm = torch.randperm(17, generator=torch.Generator().manual_seed(3))
    x = torch.randn(17, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: permute_rows(t, perm, inverse_permutation(perm)), (x,))
    y = permute_rows(x, perm, inverse_permutation(perm))
    assert torch.equal(y, x.index_select(0, perm))


# ---------------------------------------------------------------- the whole layer


def _naive_moe(x, gate_w, w1, w2, top_k):
    """Token by token: softmax -> top-k -> renormalise -> sum of weighted SwiGLU experts."""
    probs = torch.softmax(x.float() @ gate_w.float().t(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    inter = w2.shape[-1]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(top_k):
            e = ids[t, k]
            h = F.silu(x[t] @ w1[e, :inter].t()) * (x[t] @ w1[e, inter:].t())
            out[t] = out[t] + weights[t, k].to(x.dtype) * (h @ w2[e].t())
    return out


@pytest.mark.parametrize("use_grouped_mm", [None, False])
def test_layer_fast_path_equals_token_by_token_reference(use_grouped_mm):
    T, H, I, E, K = 24, 16, 8, 8, 2  # noqa: E741 (shape letters)
    g = torch.Generator().manual_seed(4)
    gate_w = torch.randn(E, H, generator=g) * 0.3
    w1 = torch.randn(E, 2 * I, H, generator=g) * 0.2
    w2 = torch.randn(E, H, I, generator=g) * 0.2
    x = torch.randn(T, H, generator=g)
    layer = MoELayer(
        TopKRouter(nn.Parameter(gate_w.clone()), top_k=K, mode="none"),
        GroupedExperts(nn.Parameter(w1.clone()), nn.Parameter(w2.clone()), F.silu, use_grouped_mm=use_grouped_mm),
        MoEConfig(moe_load_balancing="none", moe_z_loss_coeff=0.0),
    )
    xl = x.clone().requires_grad_(True)
    out = layer(xl)
    xr = x.clone().requires_grad_(True)
    w1r, w2r = w1.clone().requires_grad_(True), w2.clone().requires_grad_(True)
    ref = _naive_moe(xr, gate_w, w1r, w2r, K)
    up = torch.randn(T, H, generator=g)
    (out * up).sum().backward()
    (ref * up).sum().backward()
    assert rel_err(out, ref) < 1e-5
    assert rel_err(xl.grad, xr.grad) < 1e-5
    assert rel_err(layer.experts.gate_up_proj.grad, w1r.grad) < 1e-5
    assert rel_err(layer.experts.down_proj.grad, w2r.grad) < 1e-5


# ---------------------------------------------------------------- the fused combine kernel


_INTERPRETER_CHECK = """
import torch
from lightning_ep.moe.dispatch import combine
from lightning_ep.moe.dispatch.rows import inverse_permutation, sort_by_expert

def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()

for T, K, H in [(37, 2, 100), (16, 8, 2048), (5, 1, 1024)]:
    g = torch.Generator().manual_seed(T)
    ids = torch.topk(torch.rand(T, 8, generator=g), K, dim=-1).indices
    order, _ = sort_by_expert(ids, 8)
    inverse = inverse_permutation(order)
    y = torch.randn(T * K, H, generator=g)
    w = torch.softmax(torch.randn(T, K, generator=g), dim=-1)
    up = torch.randn(T, H, generator=g)
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
    assert rel(out_f, out_t) < 1e-6 and rel(gy_f, gy_t) < 1e-6 and rel(gw_f, gw_t) < 1e-5, (T, K, H)
    assert gw_f.dtype == w.dtype
print("ok")
"""


def test_fused_combine_kernel_equals_torch_fallback_in_the_triton_interpreter():
    """The Triton kernel, run by Triton's CPU interpreter (a fresh interpreter, since the flag is
    read at import), against the torch fallback, float32."""
    run_in_triton_interpreter("-c", _INTERPRETER_CHECK)


_SWIGLU_CHECK = """
import torch
from lightning_ep.moe.kernels import swiglu

def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()

for N, I in [(7, 100), (33, 768), (3, 1536)]:
    g = torch.Generator().manual_seed(N)
    h = torch.randn(N, 2 * I, generator=g) * 3
    up = torch.randn(N, I, generator=g)
    results = []
    for fused in (True, False):
        hr = h.clone().requires_grad_(True)
        a = swiglu._FusedSwiGLU.apply(hr, None) if fused else torch.nn.functional.silu(hr[:, :I]) * hr[:, I:]
        a.backward(up)
        results.append((a, hr.grad))
    (a_f, g_f), (a_t, g_t) = results
    assert rel(a_f, a_t) < 1e-6 and rel(g_f, g_t) < 1e-6, (N, I, rel(a_f, a_t), rel(g_f, g_t))

    # A row limit: the rows before it as without one, the rows from it on neither read nor written.
    swiglu.fused_swiglu_available = lambda h: True  # the interpreter runs the kernels on CPU tensors
    kernels = swiglu._triton()
    for live in (0, N // 2, N):
        rows = torch.tensor([live], dtype=torch.int64 if live % 2 else torch.int32)
        a_l = swiglu.swiglu(h, torch.nn.functional.silu, rows)
        grad_l, scaled_l, sa_l = swiglu.swiglu_backward(h, up, torch.nn.functional.silu, 0.5, rows)
        assert torch.equal(a_l[:live], a_f.detach()[:live]) and torch.equal(grad_l[:live], g_f[:live])
        assert torch.equal(scaled_l[:live], g_f[:live] * 0.5) and torch.equal(sa_l[:live], a_f.detach()[:live] * 0.5)
        out = torch.full((N, I), float("nan"))
        poisoned = h.clone()
        poisoned[live:] = float("inf")
        kernels.forward[(N, -(-I // swiglu._BLOCK))](poisoned, out, rows, I=I, BLOCK=swiglu._BLOCK, LIMITED=True)
        assert torch.equal(out[:live], a_f.detach()[:live]) and out[live:].isnan().all()
print("ok")
"""


def test_fused_swiglu_kernel_equals_torch_in_the_triton_interpreter():
    """The SwiGLU kernel, run by Triton's CPU interpreter, against ``silu(gate) * up``, float32."""
    run_in_triton_interpreter("-c", _SWIGLU_CHECK)


def test_swiglu_dispatch_on_cpu_is_the_torch_expression():
    from transformers.activations import ACT2FN

    from lightning_ep.moe.kernels.swiglu import is_silu, swiglu

    assert is_silu(F.silu) and is_silu(nn.SiLU()) and not is_silu(F.gelu)
    assert is_silu(ACT2FN["silu"]) and not is_silu(ACT2FN["gelu"])  # what the Mixtral adapter passes
    h = torch.randn(5, 16, dtype=torch.float64)
    assert torch.equal(swiglu(h, F.silu), F.silu(h[:, :8]) * h[:, 8:])
    assert torch.equal(swiglu(h, F.gelu), F.gelu(h[:, :8]) * h[:, 8:])


def test_swiglu_row_limit_must_be_one_integer_on_the_rows_device() -> None:
    """The fused kernels' row limit (``swiglu(..., rows)``): a one-element int32 / int64 tensor on
    ``h``'s device, else an error naming what came; ``None`` passes ``h`` as the unused pointer."""
    from lightning_ep.moe.kernels.swiglu import _limit

    h = torch.zeros(4, 16)
    assert _limit(None, h) is h
    for good in (torch.tensor([3], dtype=torch.int32), torch.tensor([3])):
        assert _limit(good, h) is good
    for bad in (torch.tensor([3.0]), torch.tensor([1, 2]), torch.tensor([], dtype=torch.int64)):
        with pytest.raises(ValueError, match="swiglu: rows must be a one-element int32 or int64 tensor on cpu"):
            _limit(bad, h)
