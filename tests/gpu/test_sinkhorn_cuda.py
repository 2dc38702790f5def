"""The fused Sinkhorn kernels on CUDA: the torch version's scores and choices, no host sync, one node
in a compiled routing graph. The CPU twin is ``tests/unit/test_sinkhorn_kernel.py``."""

from __future__ import annotations

import pytest
import torch
from conftest import count_syncs

from lightning_ep.moe.kernels import sinkhorn
from lightning_ep.moe.routing import router

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize(
    ("tokens", "experts", "programs"),
    # One program per block; more blocks than streaming multiprocessors; blocks shared unevenly.
    [(8192, 128, None), (8192, 8, None), (777, 60, None), (65536, 64, None), (8192, 128, 5), (100, 16, 1)],
)
def test_fused_sinkhorn_equals_torch_on_cuda(tokens: int, experts: int, programs: int | None) -> None:
    logits = torch.randn(tokens, experts, device="cuda", generator=torch.Generator("cuda").manual_seed(0)) * 3
    assert sinkhorn.fused_sinkhorn_available(logits)
    got = sinkhorn.sinkhorn_log_fused(logits, 30, programs=programs)
    original = sinkhorn.fused_sinkhorn_available
    router.fused_sinkhorn_available = lambda x: False  # the torch version, on the same tensor
    try:
        ref = router.sinkhorn_log(logits, 30)
    finally:
        router.fused_sinkhorn_available = original
    assert (got - ref).abs().max().item() < 5e-5
    top = min(8, experts)
    agree = (torch.topk(got, top).indices.sort(-1).values == torch.topk(ref, top).indices.sort(-1).values).all(-1)
    assert agree.float().mean().item() > 0.999  # a near-tie may round the other way, rarely
    assert count_syncs(lambda: sinkhorn.sinkhorn_log_fused(logits, 30, programs=programs)) == 0
    # The grid barrier leaves no race: repeated launches give the same bits.
    for _ in range(20):
        assert torch.equal(sinkhorn.sinkhorn_log_fused(logits, 30, programs=programs), got)


@pytest.mark.parametrize("padding", ["tail", "scattered"])
def test_fused_sinkhorn_with_padding_equals_torch_on_cuda(padding: str) -> None:
    """Padded rows (``valid_T``) in the same launch: out of the column sums, their scores ``-inf``,
    the real rows' scores the torch version's; no host sync, eager and compiled the same bits."""
    tokens, experts = 8192, 128
    logits = torch.randn(tokens, experts, device="cuda", generator=torch.Generator("cuda").manual_seed(2)) * 3
    valid = torch.ones(tokens, dtype=torch.bool, device="cuda")
    if padding == "tail":
        valid[6000:] = False
    else:
        valid[torch.randperm(tokens, device="cuda", generator=torch.Generator("cuda").manual_seed(3))[:2000]] = False
    got = router.sinkhorn_log(logits, 30, valid)
    original = router.fused_sinkhorn_available
    router.fused_sinkhorn_available = lambda x: False
    try:
        ref = router.sinkhorn_log(logits, 30, valid)
    finally:
        router.fused_sinkhorn_available = original
    assert torch.equal(got[~valid], ref[~valid]) and bool(torch.isneginf(got[~valid]).all())
    assert (got[valid] - ref[valid]).abs().max().item() < 5e-5
    assert count_syncs(lambda: router.sinkhorn_log(logits, 30, valid)) == 0
    torch._dynamo.reset()
    assert torch.equal(torch.compile(router.sinkhorn_log, fullgraph=True)(logits, 30, valid), got)


def test_compiled_sinkhorn_calls_the_fused_kernels() -> None:
    """Under ``torch.compile`` (the automatic compile covers the routing) the launch is kept whole as
    the operator ``lightning_ep::sinkhorn_log``: the eager kernels' bits, and none of the traced torch
    iterations' log-sum-exp kernels."""
    torch._dynamo.reset()
    logits = torch.randn(4096, 128, device="cuda", generator=torch.Generator("cuda").manual_seed(1)) * 3
    compiled = torch.compile(router.sinkhorn_log, fullgraph=True)
    assert torch.equal(compiled(logits, 30), sinkhorn.sinkhorn_log_fused(logits, 30))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        compiled(logits, 30)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert any("sinkhorn" in name for name in kernels), kernels
    assert not any("logsumexp" in name for name in kernels), kernels
