"""``AdamW``: ``torch.optim.AdamW(fused=True)``, bit for bit, with each large CUDA tensor updated by
one Triton kernel at the memory's rate.

Why: the optimizer step streams every expert weight, its gradient and both moments once per step
(14 bytes per bf16 parameter). torch's fused kernel walks its tensors in chunks of 65,536 elements,
at most 320 chunks per launch, each launch a partial wave of the GPU, well below the memory's rate;
one launch per large tensor, its grid covering the tensor, comes close to it (``docs/performance.md``,
"Optimizer").

The kernel computes what ``torch._fused_adamw_`` computes, in the same order, with the same fused
multiply-adds and correctly rounded divisions and square roots, and takes the bias corrections'
powers from torch (``torch._foreach_pow``). Tensors it does not take (below ``min_kernel_numel``
elements, off CUDA, float64, without Triton, or under a ``GradScaler``) go through
``torch._fused_adamw_`` itself. The state and state dict are torch's, so checkpoints move freely
between this class and ``torch.optim.AdamW``.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor

from lightning_ep.moe.experts.grouped import local_tensor
from lightning_ep.moe.kernels.lazy_triton import lazy_kernels

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch without distributed
    DTensor = None  # type: ignore[assignment,misc]

_BLOCK = 1024  # elements per program; 4 warps (the fastest of the sizes swept on an H200)
_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class Hyper:
    """One parameter group's AdamW settings, as torch's fused kernel takes them."""

    lr: float
    beta1: float
    beta2: float
    weight_decay: float
    eps: float
    maximize: bool
    decay: bool  # weight decay applied: torch tests its float32 value against 0

    @classmethod
    def of(cls, group: dict[str, Any]) -> Hyper:
        beta1, beta2 = group["betas"]
        decay = torch.tensor(group["weight_decay"], dtype=torch.float32).item() != 0
        return cls(float(group["lr"]), beta1, beta2, group["weight_decay"], group["eps"], group["maximize"], decay)


class AdamW(torch.optim.AdamW):
    """``torch.optim.AdamW(..., fused=True)`` with the large tensors' update in one kernel each.

    Same arguments, defaults and results as torch's fused AdamW (bit for bit on CUDA, tested),
    except: ``lr`` and ``betas`` are floats (an LR scheduler changes ``lr`` as a float), and
    ``amsgrad``, ``capturable``, ``differentiable`` and ``foreach`` are not taken; use
    ``torch.optim.AdamW`` for those. ``min_kernel_numel``: the size from which a tensor gets a kernel
    launch of its own; smaller ones, and any the kernel cannot take, are updated by
    ``torch._fused_adamw_`` in its few launches. DTensor parameters (FSDP2, expert parallelism) are
    updated through their local shards when gradient and parameter share one placement.

    Hooks, LR schedulers and Lightning's optimizer wrapper work as with torch's class.
    ``kernel_launches`` counts the Triton kernel launches of this optimizer's steps so far (one per
    tensor it took, per step), so a run can check that the kernel ran.
    """

    DEFAULT_MIN_KERNEL_NUMEL = 1 << 20

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        maximize: bool = False,
        min_kernel_numel: int = DEFAULT_MIN_KERNEL_NUMEL,
    ) -> None:
        if not isinstance(min_kernel_numel, int) or isinstance(min_kernel_numel, bool) or min_kernel_numel < 1:
            raise ValueError(
                f"AdamW: min_kernel_numel must be a positive int (the tensor size from which a tensor gets a "
                f"kernel launch of its own), got {min_kernel_numel!r}."
            )
        self.min_kernel_numel = min_kernel_numel
        self.kernel_launches = 0
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, maximize=maximize, fused=True)

    def __getstate__(self) -> dict[str, Any]:
        """torch's (defaults, groups, state) and this class's own settings, so copies and pickles step alike."""
        return {
            **super().__getstate__(),
            "min_kernel_numel": self.min_kernel_numel,
            "kernel_launches": self.kernel_launches,
        }

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's, then the options this class does not take refused, naming the fix."""
        super().add_param_group(param_group)
        _check_group(self.param_groups[-1])

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's; a state saved by ``torch.optim.AdamW`` without ``fused`` loads too (its steps
        are moved to the parameters' devices, as torch does for a fused optimizer)."""
        for group in state_dict["param_groups"]:
            _check_group({**group, "fused": True, "foreach": None})
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            group.update(fused=True, foreach=None)
            for p in group["params"]:
                state = self.state.get(p)
                if state and "step" in state:
                    state["step"] = state["step"].to(device=p.device, dtype=torch.float32)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One AdamW step of every parameter with a gradient; ``closure`` as in torch."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if getattr(self, "grad_scale", None) is not None or getattr(self, "found_inf", None) is not None:
            # A GradScaler hands the fused optimizer its scale: torch's kernels unscale and skip.
            super().step()
            return loss
        for group in self.param_groups:
            self._step_group(group)
        return loss

    def _step_group(self, group: dict[str, Any]) -> None:
        # (param, grad, exp_avg, exp_avg_sq, step) of each parameter, for the Triton kernel or for torch's
        big: list[tuple[Tensor, ...]] = []
        rest: list[tuple[Tensor, ...]] = []
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("lightning_ep.optim.AdamW does not support sparse gradients.")
            state = self.state[p]
            if not state:  # as torch's fused AdamW lays its state out
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            row = (p, p.grad, state["exp_avg"], state["exp_avg_sq"], state["step"])
            (big if self._kernel_takes(*row[:4]) else rest).append(row)
        if not big and not rest:
            return
        hyper = Hyper.of(group)
        if rest:
            params, grads, exp_avgs, exp_avg_sqs, steps = (list(tensors) for tensors in zip(*rest))
            torch_fused_adamw(params, grads, exp_avgs, exp_avg_sqs, steps, hyper)
        if big:
            steps = [row[4] for row in big]
            torch._foreach_add_(steps, 1)
            powers1 = torch._foreach_pow(hyper.beta1, steps)
            powers2 = torch._foreach_pow(hyper.beta2, steps)
            for (p, grad, exp_avg, exp_avg_sq, _), power1, power2 in zip(big, powers1, powers2, strict=True):
                adamw_kernel_step(p, grad, exp_avg, exp_avg_sq, power1, power2, hyper)
            self.kernel_launches += len(big)

    def _kernel_takes(self, p: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor) -> bool:
        """Whether ``p``'s update runs in the Triton kernel: a CUDA tensor (or DTensor shard) of
        ``min_kernel_numel`` elements or more, with gradient and moments alike, all contiguous."""
        if not kernel_available(p):
            return False
        if DTensor is not None and isinstance(p, DTensor):
            for t in (grad, exp_avg, exp_avg_sq):
                if not (isinstance(t, DTensor) and t.placements == p.placements and t.device_mesh == p.device_mesh):
                    return False
        tensors = [local_tensor(t) for t in (p, grad, exp_avg, exp_avg_sq)]
        if tensors[0].numel() < self.min_kernel_numel:
            return False
        return all(t.dtype == p.dtype and t.is_contiguous() and t.shape == tensors[0].shape for t in tensors)


def _check_group(group: dict[str, Any]) -> None:
    """Refuse, with the fix, a parameter group's options this class does not take."""
    for key in ("lr", "betas"):
        values = group[key] if key == "betas" else (group[key],)
        if any(isinstance(v, Tensor) for v in values):
            raise TypeError(
                f"lightning_ep.optim.AdamW takes {key} as float(s), got a Tensor; pass floats, or use "
                f"torch.optim.AdamW(fused=True) for a Tensor {key}."
            )
    for key in ("amsgrad", "capturable", "differentiable"):
        if group.get(key):
            raise ValueError(
                f"lightning_ep.optim.AdamW does not take {key}=True; use torch.optim.AdamW({key}=True) for that "
                "parameter group."
            )
    if group.get("decoupled_weight_decay", True) is False:
        raise ValueError(
            "lightning_ep.optim.AdamW decouples its weight decay (AdamW), got decoupled_weight_decay=False in a "
            "parameter group (a state saved by torch.optim.Adam?); use torch.optim.Adam(fused=True) for that."
        )
    if group.get("foreach") or not group.get("fused"):
        raise ValueError(
            f"lightning_ep.optim.AdamW is always fused, got foreach={group.get('foreach')!r}, "
            f"fused={group.get('fused')!r} in a parameter group; leave both unset."
        )


def kernel_available(p: Tensor) -> bool:
    """Whether the Triton kernel can update ``p`` (CUDA, bf16 / fp16 / fp32, Triton importable)."""
    return p.is_cuda and p.dtype in _KERNEL_DTYPES and _triton() is not None


def torch_fused_adamw(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    steps: list[Tensor],
    hyper: Hyper,
) -> None:
    """What ``torch.optim.AdamW(fused=True)`` runs for these tensors: per device and dtype, the steps
    counted up, then ``torch._fused_adamw_``."""
    grouped = torch.optim.Optimizer._group_tensors_by_device_and_dtype(
        [params, grads, exp_avgs, exp_avg_sqs, steps]  # type: ignore[list-item]
    )
    for lists, _ in grouped.values():
        device_params, device_grads, device_exp_avgs, device_exp_avg_sqs, device_steps = cast(list[list[Tensor]], lists)
        torch._foreach_add_(device_steps, 1)
        torch._fused_adamw_(
            device_params,
            device_grads,
            device_exp_avgs,
            device_exp_avg_sqs,
            [],
            device_steps,
            lr=hyper.lr,
            beta1=hyper.beta1,
            beta2=hyper.beta2,
            weight_decay=hyper.weight_decay,
            eps=hyper.eps,
            amsgrad=False,
            maximize=hyper.maximize,
        )


def adamw_kernel_step(
    p: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, power1: Tensor, power2: Tensor, hyper: Hyper
) -> None:
    """One AdamW update of ``p``, ``exp_avg`` and ``exp_avg_sq`` in place, in one kernel launch, given
    ``beta1 ** step`` and ``beta2 ** step`` as one-element float32 tensors. The tensors (or their
    DTensors' local shards) must be contiguous, of one shape and one dtype."""
    kernels = _triton()
    p, grad, exp_avg, exp_avg_sq = (local_tensor(t) for t in (p, grad, exp_avg, exp_avg_sq))
    count = p.numel()
    if count == 0:
        return
    kernels.adamw[(-(-count // _BLOCK),)](
        p,
        grad,
        exp_avg,
        exp_avg_sq,
        power1,
        power2,
        count,
        hyper.lr,
        hyper.beta1,
        hyper.beta2,
        hyper.weight_decay,
        hyper.eps,
        DECAY=hyper.decay,
        MAXIMIZE=hyper.maximize,
        BLOCK=_BLOCK,
        num_warps=4,
    )


def _build_kernels(triton: Any, tl: Any) -> Any:
    @triton.jit
    def adamw(
        p_ptr,
        g_ptr,
        m_ptr,
        v_ptr,
        power1_ptr,
        power2_ptr,
        count,
        lr,
        beta1,
        beta2,
        weight_decay,
        eps,
        DECAY: tl.constexpr,
        MAXIMIZE: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # torch's fused AdamW (ATen's fused_adam_utils.cuh, ADAMW mode) step by step, in fp32: the
        # same fused multiply-adds, correctly rounded divisions and square roots, one rounding at
        # each store. The scalars arrive as fp32, as torch casts them.
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < count
        bias_correction1 = 1.0 - tl.load(power1_ptr)
        bias_correction2_sqrt = tl.sqrt_rn(1.0 - tl.load(power2_ptr))
        step_size = tl.math.div_rn(lr, bias_correction1)
        p = tl.load(p_ptr + offs, mask=mask).to(tl.float32)
        g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
        m = tl.load(m_ptr + offs, mask=mask).to(tl.float32)
        v = tl.load(v_ptr + offs, mask=mask).to(tl.float32)
        if MAXIMIZE:
            g = -g
        if DECAY:
            p = tl.fma(-(lr * weight_decay), p, p)
        m = tl.fma(beta1, m, tl.fma(-beta1, g, g))
        g2 = g * g
        v = tl.fma(beta2, v, tl.fma(-beta2, g2, g2))
        denom = tl.math.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
        p = p - tl.math.div_rn(step_size * m, denom)
        tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty), mask=mask)
        tl.store(m_ptr + offs, m.to(m_ptr.dtype.element_ty), mask=mask)
        tl.store(v_ptr + offs, v.to(v_ptr.dtype.element_ty), mask=mask)

    return types.SimpleNamespace(adamw=adamw)


_triton = lazy_kernels(_build_kernels)
