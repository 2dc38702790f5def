"""``lightning_ep.optim.AdamW`` on one GPU: bit for bit ``torch.optim.AdamW(fused=True)``, with the
large tensors in the Triton kernel, the small ones in ``torch._fused_adamw_``; FSDP2's DTensors
through their local shards; a ``GradScaler``'s fp16 step through torch's kernels."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))

from harness import spawn

from lightning_ep.optim import AdamW

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CUDA = torch.device("cuda")
# Sizes off the kernel's block, one of 4,096 (the threshold used below), one under it, a 3-d expert-like weight.
SHAPES = [(1000, 37), (4096,), (3, 5, 7), (8191,), (8, 96, 64), (70_000,)]


def _params(dtype: torch.dtype, seed: int = 0) -> list[nn.Parameter]:
    g = torch.Generator(device=CUDA).manual_seed(seed)
    return [nn.Parameter((torch.randn(s, generator=g, device=CUDA) * 0.02).to(dtype)) for s in SHAPES]


def _set_grads(pairs: list[tuple[nn.Parameter, nn.Parameter]], g: torch.Generator, tiny: bool) -> None:
    for p, q in pairs:
        grad = torch.randn(p.shape, generator=g, device=CUDA) * 1e-3
        if tiny:  # magnitudes down to float32's subnormals in grad * grad, and below
            grad = grad * torch.exp2(-torch.randint(0, 140, p.shape, generator=g, device=CUDA).float())
        p.grad = torch.empty_like(p).copy_(grad)  # the parameter's layout, as autograd makes it
        q.grad = p.grad.clone()


def _assert_same(a: torch.optim.Optimizer, b: torch.optim.Optimizer, ours: list, theirs: list, what: str) -> None:
    for i, (p, q) in enumerate(zip(ours, theirs, strict=True)):
        assert torch.equal(p, q), (what, i, (p.float() - q.float()).abs().max())
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(a.state[p][key], b.state[q][key]), (what, i, key)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("tiny", [False, True])
def test_equals_torch_fused_adamw_bit_for_bit(dtype: torch.dtype, tiny: bool) -> None:
    """Twelve steps, two parameter groups (the second with its own betas, weight decay and
    ``maximize``), lr changed between steps; every tensor in the kernel (``min_kernel_numel=1``),
    or only those of 4,096 elements and more (the rest in ``torch._fused_adamw_``)."""
    for min_kernel_numel in (1, 4096):
        ours, theirs = _params(dtype), _params(dtype)

        def groups(params: list[nn.Parameter]) -> list[dict]:
            return [
                {"params": params[:3]},
                {"params": params[3:], "betas": (0.8, 0.95), "weight_decay": 0.1, "maximize": True},
            ]

        a = AdamW(groups(ours), lr=1e-3, min_kernel_numel=min_kernel_numel)
        b = torch.optim.AdamW(groups(theirs), lr=1e-3, fused=True)
        assert sum(a._kernel_takes(p, p, p, p) for p in ours) == (6 if min_kernel_numel == 1 else 5)
        g = torch.Generator(device=CUDA).manual_seed(1)
        for step in range(12):
            for optimizer in (a, b):
                optimizer.param_groups[0]["lr"] = 1e-3 * 0.9**step
            _set_grads(list(zip(ours, theirs, strict=True)), g, tiny)
            a.step()
            b.step()
            _assert_same(a, b, ours, theirs, f"{dtype} min_kernel_numel={min_kernel_numel} step {step}")
        assert a.kernel_launches == 12 * (6 if min_kernel_numel == 1 else 5)


def test_tensors_the_kernel_does_not_take_go_through_torch() -> None:
    """A non-contiguous parameter and a float64 one take ``torch._fused_adamw_``; results as torch's."""
    base = torch.randn(64, 128, device=CUDA)
    ours = [nn.Parameter(base.t()), nn.Parameter(torch.randn(5000, device=CUDA, dtype=torch.float64))]
    theirs = [nn.Parameter(p.detach().clone()) for p in ours]
    theirs[0] = nn.Parameter(base.clone().t())
    a, b = AdamW(ours, min_kernel_numel=1), torch.optim.AdamW(theirs, fused=True)
    assert not any(a._kernel_takes(p, p, p, p) for p in ours)
    g = torch.Generator(device=CUDA).manual_seed(2)
    for _ in range(3):
        _set_grads(list(zip(ours, theirs, strict=True)), g, False)
        a.step()
        b.step()
    _assert_same(a, b, ours, theirs, "fallback")


def test_grad_scaler_steps_through_torch_fused_kernels() -> None:
    """fp16 with a ``GradScaler``: the scaler hands the optimizer its scale (``grad_scale``), so the
    step is torch's fused one, which unscales in its kernel; the same bits, skipped steps included."""
    ours, theirs = _params(torch.float32), _params(torch.float32)
    a, b = AdamW(ours, min_kernel_numel=1), torch.optim.AdamW(theirs, fused=True)
    scalers = [torch.amp.GradScaler("cuda", init_scale=2.0**16), torch.amp.GradScaler("cuda", init_scale=2.0**16)]
    for step in range(4):
        for params, optimizer, scaler in ((ours, a, scalers[0]), (theirs, b, scalers[1])):
            optimizer.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = sum((p.float() * (step + 1)).sum() for p in params)
            scaler.scale(loss * (float("inf") if step == 2 else 1.0)).backward()  # step 2 overflows
            scaler.step(optimizer)
            scaler.update()
        _assert_same(a, b, ours, theirs, f"scaled step {step}")
    assert a.state[ours[0]]["step"].item() == 3  # the overflowing step skipped


def _fsdp_worker(rank: int, world: int) -> None:
    """FSDP2 on a one-rank mesh: parameters, gradients and moments are DTensors; the kernel updates
    their local shards, bit for bit as torch's fused AdamW updates the DTensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cuda", (world,))
    models, optimizers = [], []
    for make in (lambda ps: AdamW(ps, min_kernel_numel=1024), lambda ps: torch.optim.AdamW(ps, fused=True)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)).to(CUDA, torch.bfloat16)
        fully_shard(model, mesh=mesh)
        models.append(model)
        optimizers.append(make(model.parameters()))
    params = [list(m.parameters()) for m in models]
    assert all(isinstance(p, DTensor) for p in params[0])
    for step in range(5):
        x = torch.randn(32, 64, device=CUDA, generator=torch.Generator(device=CUDA).manual_seed(step))
        for model, optimizer in zip(models, optimizers, strict=True):
            model(x.to(torch.bfloat16)).float().square().mean().backward()
            if step == 0 and optimizer is optimizers[0]:
                takes = [optimizer._kernel_takes(p, p.grad, p, p) for p in params[0]]  # type: ignore[attr-defined]
                assert takes == [True, False, True, False], takes  # the weights; the biases are small
            optimizer.step()
            optimizer.zero_grad()
        _assert_same(optimizers[0], optimizers[1], params[0], params[1], f"fsdp step {step}")


def test_fsdp2_dtensors_update_through_their_local_shards() -> None:
    spawn(_fsdp_worker, 1, backend="nccl")
