"""``keep_dense_local``: a one-rank world's dense parameters, used in place instead of through FSDP2.

With one rank in all, FSDP2 has nothing to gather or reduce, yet each step it still copies every
dense parameter into its all-gather buffer and out before forward, and the gradients into a reduce
buffer and out after backward (in ``bf16-mixed`` through torch's element-wise copy loop).
``keep_dense_local`` gives the same numbers without those copies:

- Each dense parameter becomes a DTensor on the one-rank mesh (``Shard(0)``), so checkpoints,
  clipping, the optimizer and ``check_all_sharded`` see what they see under FSDP2.
- During the model's forward, each slot holds a plain ``nn.Parameter`` standing for its DTensor: the
  local tensor itself in its own dtype, or in another compute dtype (``bf16-mixed``) a kept buffer
  refreshed by one fused cast per forward.
- As backward accumulates each stand-in's gradient, a hook hands it to the DTensor (as a view, or
  cast to its dtype): the gradient FSDP2's reduction over one rank would give, bit for bit, and
  accumulated the same way over several backwards.
- Floating inputs of the root and the given units are cast to the compute dtype, as FSDP2's
  ``MixedPrecisionPolicy(cast_forward_inputs=True)`` casts them.

Costs: one fused cast of the dense parameters per forward in ``bf16-mixed``, with their bf16 copy
held between steps; a few microseconds of host time per parameter per step. A module called on its
own, outside the model's forward, sees DTensors (as under FSDP2).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.utils import _apply_to_tensors

_STATE = "_lightning_ep_single_rank"


class _LocalParameters:
    """The stand-ins of one model's dense DTensor parameters, swapped into its slots around forward."""

    def __init__(self, slots: list[list[tuple[nn.Module, str]]], compute_dtype: torch.dtype | None) -> None:
        self.slots = slots  # per DTensor parameter: every (module, name) holding it (tied weights: several)
        self.compute_dtype = compute_dtype
        self.params: list[DTensor] = [module._parameters[name] for module, name in (s[0] for s in slots)]  # type: ignore[misc]
        self.stand_ins: list[nn.Parameter | None] = [None] * len(slots)
        self.swapped = False

    def swap_in(self, _module: nn.Module, _args: Any) -> None:
        if self.swapped:  # a nested call of the root: the stand-ins are in place already
            return
        casts: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        for i, slots in enumerate(self.slots):
            module, name = slots[0]
            param = module._parameters[name]
            assert isinstance(param, DTensor), f"{name} of {type(module).__name__} is no longer a DTensor"
            self.params[i] = param
            local = param._local_tensor
            stand_in = self._stand_in(i, param, local)
            if stand_in.dtype != local.dtype:
                casts[0].append(stand_in.data)
                casts[1].append(local)
            for module, name in slots:
                module._parameters[name] = stand_in
        if casts[0]:
            with torch.no_grad():
                torch._foreach_copy_(casts[0], casts[1])
        self.swapped = True

    def _stand_in(self, i: int, param: DTensor, local: torch.Tensor) -> nn.Parameter:
        """The kept stand-in of parameter ``i``, rebuilt when its DTensor was replaced or moved."""
        dtype = self.compute_dtype if self.compute_dtype is not None and local.is_floating_point() else local.dtype
        stand_in = self.stand_ins[i]
        if dtype == local.dtype:
            fresh = stand_in is None or stand_in.data_ptr() != local.data_ptr() or stand_in.shape != local.shape
        else:
            fresh = stand_in is None or stand_in.dtype != dtype or stand_in.shape != local.shape
            fresh = fresh or stand_in.device != local.device  # type: ignore[union-attr]
        if fresh or stand_in.requires_grad != param.requires_grad:  # type: ignore[union-attr]
            data = local if dtype == local.dtype else torch.empty_like(local, dtype=dtype)
            stand_in = nn.Parameter(data, requires_grad=param.requires_grad)
            if param.requires_grad:  # through a weak reference: the hook lives in C++, out of gc's sight
                stand_in.register_post_accumulate_grad_hook(functools.partial(_hand_over, weakref.ref(self), i))
            self.stand_ins[i] = stand_in
        return stand_in  # type: ignore[return-value]

    def swap_out(self, _module: nn.Module, _args: Any, _output: Any) -> None:
        for param, slots in zip(self.params, self.slots, strict=True):
            for module, name in slots:
                module._parameters[name] = param  # type: ignore[assignment]
        self.swapped = False

    def hand_over(self, i: int, stand_in: torch.Tensor) -> None:
        """Move ``stand_in``'s accumulated gradient onto DTensor ``i`` (its dtype), accumulating there."""
        grad = stand_in.grad
        stand_in.grad = None
        if grad is None:
            return
        param = self.params[i]
        grad = grad.to(param.dtype)
        if param.grad is None:
            param.grad = DTensor(grad, param._spec, requires_grad=False)  # type: ignore[call-arg]
        else:
            param.grad._local_tensor.add_(grad)  # type: ignore[attr-defined]


def _hand_over(state: weakref.ref[_LocalParameters], i: int, stand_in: torch.Tensor) -> None:
    local = state()
    if local is not None:
        local.hand_over(i, stand_in)


def keep_dense_local(
    model: nn.Module, mesh: DeviceMesh, *, compute_dtype: torch.dtype | None = None, units: Sequence[nn.Module] = ()
) -> nn.Module:
    """Make every parameter of ``model`` (whose forward reads the weights) that is not a DTensor yet one
    on the one-rank ``mesh`` and let the forward use it in place (see the module docstring).
    Idempotent. ``compute_dtype``: FSDP2's ``MixedPrecisionPolicy.param_dtype`` (``None``: each
    parameter's own); ``units``: the modules FSDP2 would have made units of (decoder layers, head).
    """
    if mesh.size() != 1:
        raise ValueError(
            f"keep_dense_local needs a one-rank mesh (it has {mesh.size()} ranks); shard with FSDP2 instead."
        )
    if hasattr(model, _STATE):
        return model
    converted: dict[int, DTensor] = {}
    slots: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is None or isinstance(param, DTensor):
                continue
            key = id(param)
            if key not in converted:
                placement = Shard(0) if param.ndim else Replicate()
                local = DTensor.from_local(param.detach(), mesh, [placement], run_check=False)
                converted[key] = nn.Parameter(local, requires_grad=param.requires_grad)  # type: ignore[assignment]
                slots[key] = []
            module._parameters[name] = converted[key]  # type: ignore[assignment]
            slots[key].append((module, name))
    state = _LocalParameters(list(slots.values()), compute_dtype)
    model.register_forward_pre_hook(state.swap_in)
    model.register_forward_hook(state.swap_out, always_call=True)
    if compute_dtype is not None:
        cast = functools.partial(_cast_inputs, compute_dtype)
        for unit in {id(u): u for u in (model, *units)}.values():
            unit.register_forward_pre_hook(cast, with_kwargs=True)
    setattr(model, _STATE, state)
    return model


def _cast_inputs(dtype: torch.dtype, _module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and torch.is_floating_point(x) and x.dtype != dtype:
            return x.to(dtype)
        return x

    return _apply_to_tensors(cast, args), _apply_to_tensors(cast, kwargs)


def is_kept_local(model: nn.Module) -> bool:
    """Whether ``keep_dense_local`` manages ``model``'s dense parameters."""
    return hasattr(model, _STATE)


__all__ = ["is_kept_local", "keep_dense_local"]
