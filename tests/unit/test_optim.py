"""``lightning_ep.optim.AdamW`` on CPU: torch's fused AdamW bit for bit (every tensor takes
``torch._fused_adamw_`` here), its state dict interchangeable with ``torch.optim.AdamW``'s, its
refusals, its step hooks and schedulers; the Triton kernel under Triton's CPU interpreter against
torch's fused AdamW. The kernel on CUDA, bit for bit: ``tests/gpu/test_optim_cuda.py``."""

from __future__ import annotations

import pytest
import torch
from conftest import run_in_triton_interpreter
from torch import nn

from lightning_ep.optim import AdamW


def _params(seed: int = 0, dtype: torch.dtype = torch.float32) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(33, 17), (64,), (3, 5, 7), (2, 64, 16)]
    return [nn.Parameter((torch.randn(s, generator=g) * 0.02).to(dtype)) for s in shapes]


def _grads(params: list[nn.Parameter], seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(p.shape, generator=g) * 1e-3).to(p.dtype) for p in params]


def _run(make, params: list[nn.Parameter], steps: int, lrs: list[float] | None = None) -> torch.optim.Optimizer:
    optimizer = make(params)
    for i in range(steps):
        for p, grad in zip(params, _grads(params, 100 + i), strict=True):
            p.grad = grad
        if lrs is not None:
            optimizer.param_groups[0]["lr"] = lrs[i]
        optimizer.step()
    return optimizer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("weight_decay", "maximize"), [(0.01, False), (0.0, False), (0.1, True)])
def test_equals_torch_fused_adamw_bit_for_bit_on_cpu(dtype: torch.dtype, weight_decay: float, maximize: bool) -> None:
    """Two parameter groups (the second with its own lr and betas), an lr changed between steps."""

    def groups(params: list[nn.Parameter]) -> list[dict]:
        return [{"params": params[:2]}, {"params": params[2:], "lr": 3e-3, "betas": (0.8, 0.95)}]

    kwargs = {"weight_decay": weight_decay, "maximize": maximize}
    ours, theirs = _params(dtype=dtype), _params(dtype=dtype)
    lrs = [1e-3, 1e-3, 5e-4, 2e-4]
    a = _run(lambda ps: AdamW(groups(ps), **kwargs), ours, 4, lrs)
    b = _run(lambda ps: torch.optim.AdamW(groups(ps), fused=True, **kwargs), theirs, 4, lrs)
    for p, q in zip(ours, theirs, strict=True):
        assert torch.equal(p, q)
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(a.state[p][key], b.state[q][key]), key


def _resume(saved: dict, make, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """``params`` (as left by the run that saved) stepped twice more by ``make`` from ``saved``."""
    optimizer = make(params)
    optimizer.load_state_dict(saved)
    for i in (2, 3):
        for p, grad in zip(params, _grads(params, 100 + i), strict=True):
            p.grad = grad
        optimizer.step()
    return optimizer


def test_state_dict_moves_between_torch_adamw_and_this_one() -> None:
    """Two steps by one optimizer, two by the other from its state dict: torch's fused AdamW's four
    steps, bit for bit, both ways round. A state saved by torch's AdamW without ``fused`` (its
    steps CPU tensors) resumes here too, its steps moved to the parameters' device."""
    straight = _params()
    _run(lambda ps: torch.optim.AdamW(ps, fused=True), straight, 4)
    for first, then in ((lambda ps: torch.optim.AdamW(ps, fused=True), AdamW), (AdamW, torch.optim.AdamW)):
        params = _params()
        saved = _run(first, params, 2).state_dict()
        _resume(saved, then, params)
        assert all(torch.equal(p, q) for p, q in zip(params, straight, strict=True))

    params = _params()
    saved = _run(lambda ps: torch.optim.AdamW(ps), params, 2).state_dict()
    assert saved["state"][0]["step"].dtype == torch.float32 and saved["param_groups"][0]["fused"] is None
    resumed = _resume(saved, AdamW, params)
    assert all(group["fused"] and group["foreach"] is None for group in resumed.param_groups)
    assert all(resumed.state[p]["step"].item() == 4 for p in params)
    for p, q in zip(params, straight, strict=True):  # two unfused steps: rounded otherwise
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-8)


def test_closure_and_parameters_without_gradients() -> None:
    params = _params()
    optimizer = AdamW(params)
    before = [p.detach().clone() for p in params]

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = params[0].square().sum()
        loss.backward()
        return loss

    loss = optimizer.step(closure)
    assert loss is not None and loss.item() > 0
    assert not torch.equal(params[0], before[0])
    assert all(torch.equal(p, q) for p, q in zip(params[1:], before[1:], strict=True))
    assert set(optimizer.state) == {params[0]}


def test_step_hooks_and_a_scheduler_work_as_with_torch() -> None:
    """A ``torch.optim.Optimizer`` like torch's: step pre- and post-hooks fire on every step, also
    once an LR scheduler has wrapped ``step``, whose ``lr`` the update uses; the same bits as torch's
    fused AdamW under the same schedule. Through the Trainer: ``tests/trainer/test_step_hooks.py``."""
    ours, theirs = _params(), _params()
    optimizers = [AdamW(ours, lr=1e-2), torch.optim.AdamW(theirs, lr=1e-2, fused=True)]
    calls: list[str] = []
    optimizers[0].register_step_pre_hook(lambda *_: calls.append("pre"))
    optimizers[0].register_step_post_hook(lambda *_: calls.append("post"))
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda step: 0.5**step) for o in optimizers]
    for step in range(3):
        for params in (ours, theirs):
            for p, grad in zip(params, _grads(params, 100 + step), strict=True):
                p.grad = grad
        for optimizer, scheduler in zip(optimizers, schedulers, strict=True):
            optimizer.step()
            scheduler.step()
    assert calls == ["pre", "post"] * 3
    assert optimizers[0].param_groups[0]["lr"] == 1e-2 * 0.5**3
    assert all(torch.equal(p, q) for p, q in zip(ours, theirs, strict=True))
    assert optimizers[0].kernel_launches == 0  # CPU: every tensor through torch._fused_adamw_


def test_copies_keep_the_settings() -> None:
    """``copy.deepcopy`` and pickling go through torch's ``__getstate__``, which keeps only the groups,
    the state and the defaults; this class's own settings travel with them."""
    import copy

    optimizer = AdamW(_params(), min_kernel_numel=4096)
    optimizer.kernel_launches = 3
    twin = copy.deepcopy(optimizer)
    assert (twin.min_kernel_numel, twin.kernel_launches) == (4096, 3)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"lr": torch.tensor(1e-3)}, TypeError, "takes lr as float"),
        ({"betas": (torch.tensor(0.9), torch.tensor(0.999))}, TypeError, "takes betas as float"),
        ({"min_kernel_numel": 0}, ValueError, "min_kernel_numel must be a positive int .* got 0"),
        ({"min_kernel_numel": 2.5}, ValueError, "min_kernel_numel must be a positive int .* got 2.5"),
    ],
)
def test_refuses_what_it_does_not_take(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        AdamW(_params(), **kwargs)


@pytest.mark.parametrize(
    ("group", "match"),
    [
        ({"amsgrad": True}, r"does not take amsgrad=True; use torch.optim.AdamW\(amsgrad=True\)"),
        ({"capturable": True}, "does not take capturable=True"),
        ({"foreach": True}, "is always fused, got foreach=True"),
        ({"fused": False}, "is always fused, got foreach=None, fused=False"),
        ({"decoupled_weight_decay": False}, r"decouples its weight decay .* use torch.optim.Adam\(fused=True\)"),
    ],
)
def test_refuses_parameter_group_options_it_does_not_take(group: dict, match: str) -> None:
    params = _params()
    optimizer = AdamW(params[:2])
    with pytest.raises(ValueError, match=match):
        optimizer.add_param_group({"params": params[2:], **group})
    saved = torch.optim.AdamW(params[:2], amsgrad=True).state_dict()
    with pytest.raises(ValueError, match="does not take amsgrad=True"):
        optimizer.load_state_dict(saved)
    saved = torch.optim.Adam(params[:2], fused=True).state_dict()
    with pytest.raises(ValueError, match="got decoupled_weight_decay=False"):
        optimizer.load_state_dict(saved)


_INTERPRETER_CHECK = """
import torch
from torch import nn
from lightning_ep import optim

def rel(x, y):
    return ((x.double() - y.double()).norm() / y.double().norm()).item()

optim.kernel_available = lambda p: True  # the interpreter runs the kernel on CPU tensors
g = torch.Generator().manual_seed(0)
shapes = [(1000, 37), (4096,), (3, 5, 7), (2500,)]
for weight_decay, maximize in ((0.01, False), (0.0, True)):
    start = [torch.randn(s, generator=g) * 0.02 for s in shapes]
    ours = [nn.Parameter(x.clone()) for x in start]
    fused = [nn.Parameter(x.clone()) for x in start]
    exact = [nn.Parameter(x.double()) for x in start]
    # Betas that are powers of two: the interpreter rounds a fused multiply-add twice (product, then
    # sum), which with 0.999 cancels to a 1e-4 error in exp_avg_sq; with these both roundings are exact.
    kwargs = dict(lr=1e-3, betas=(0.5, 0.25), weight_decay=weight_decay, maximize=maximize)
    a = optim.AdamW(ours, min_kernel_numel=100, **kwargs)
    b = torch.optim.AdamW(fused, fused=True, **kwargs)
    c = torch.optim.AdamW(exact, foreach=False, **kwargs)  # float64: the reference
    for step in range(5):
        for p, q, r in zip(ours, fused, exact):
            r.grad = torch.randn(p.shape, generator=g, dtype=torch.float64) * 1e-5  # eps: 0.1% of the update
            p.grad, q.grad = r.grad.float(), r.grad.float()
        a.step()
        b.step()
        c.step()
    assert len(a.state) == len(b.state) == 4
    for p, q, r, x in zip(ours, fused, exact, start):
        if p.numel() < 100:  # torch._fused_adamw_ itself
            assert torch.equal(p, q) and torch.equal(a.state[p]["exp_avg_sq"], b.state[q]["exp_avg_sq"])
            continue
        # Against float64: the change of the parameter, both moments, to float32's rounding (a wrong
        # term, eps or a bias correction, is off by 1e-4 or more).
        assert rel(p - x, r - x) < 1e-6, (p.shape, rel(p - x, r - x))
        for key in ("exp_avg", "exp_avg_sq"):
            assert rel(a.state[p][key], c.state[r][key]) < 1e-6, (p.shape, key)
        assert torch.equal(a.state[p]["step"], b.state[q]["step"])
print("ok")
"""


def test_adamw_kernel_equals_torch_fused_in_the_triton_interpreter() -> None:
    """The Triton kernel, run by Triton's CPU interpreter (a fresh interpreter: the flag is read at
    import), against torch's AdamW in float64, float32, five steps; the tensors below
    ``min_kernel_numel`` through ``torch._fused_adamw_``."""
    run_in_triton_interpreter("-c", _INTERPRETER_CHECK)
