"""What a transformed model keeps of Hugging Face's behaviour: Hugging Face code still reaches the
modules that replace a MoE block (``TopKRouter``, the routed experts) in four ways, each kept working:

- **Weight init.** The model's ``_init_weights(module)`` recognises Hugging Face's classes only. Each
  replacing module keeps an empty *shell* of the module it replaced (same class and attributes, no
  tensors), and ``_init_weights`` is wrapped to run Hugging Face's own code on the shell with our
  parameters lent to it: the very same initialisation, in the same order.
- **Router logits.** ``output_router_logits=True`` hooks the router class, which is gone; each
  ``MoELayer`` passes its ``[T, E]`` logits through an identity module (``MoELayer.router_logits``)
  carrying the same hook, so ``outputs.router_logits`` and Hugging Face's ``aux_loss`` come back.
- **Experts implementation.** ``transform`` sets ``config._experts_implementation = "lightning_ep"``
  (registered with transformers' ``ExpertsInterface``). After ``model.set_experts_implementation``
  with one of transformers' names (``"eager"``, ``"grouped_mm"``, ...) the layers run that on their
  own weights (one process, dropless; refused under expert parallelism or a capacity).
- **Expert parallelism.** transformers' own (``DistributedConfig(ep_size=...)``) cannot be combined
  with this library's: refused with the fix, before or after ``transform``.
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from lightning_ep.moe.dispatch.base import LocalDispatcher
from lightning_ep.moe.experts.frozen import FrozenExpertWeight
from lightning_ep.moe.layer import MoELayer

_ROUTER_LOGITS = "router_logits"


class Replaced:
    """The Hugging Face module a module of this library replaced, as an empty shell: its class and plain
    attributes, no parameters or buffers. ``lent`` fills it with a module's own tensors for one call."""

    def __init__(self, module: nn.Module) -> None:
        shell = module.__class__.__new__(module.__class__)
        # Its submodules stay (e.g. an activation module; no tensors of ours).
        shell.__dict__.update(module.__dict__, _parameters={}, _buffers={}, _modules=dict(module._modules))
        self.shell = shell

    @contextmanager
    def lent(self, owner: nn.Module) -> Iterator[nn.Module]:
        """The shell holding ``owner``'s own parameters and buffers (same names) for the duration."""
        shell = self.shell
        shell._parameters.update(owner._parameters)
        shell._buffers.update(owner._buffers)
        try:
            yield shell
        finally:
            shell._parameters.clear()
            shell._buffers.clear()


def keep_replaced(ours: nn.Module, theirs: nn.Module) -> None:
    """Record on ``ours`` (a router or experts module of this library) the Hugging Face module it replaces."""
    ours.replaces = Replaced(theirs)  # type: ignore[assignment]  # a plain attribute: not an nn.Module


#: The name under which this library's experts appear in ``config._experts_implementation`` (and in
#: transformers' ``ExpertsInterface``, so that ``set_experts_implementation`` accepts it back).
EXPERTS_IMPLEMENTATION = "lightning_ep"


def keep_hf_behaviour(model: nn.Module) -> None:
    """Wrap ``_init_weights`` of every Hugging Face model in ``model``, let the layers follow
    ``config._experts_implementation`` (set to ``"lightning_ep"`` here) and hook their router logits
    (see the module docstring). Idempotent."""
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    for module in model.modules():
        wrapped = getattr(getattr(module, "_init_weights", None), "__func__", None) is _init_weights
        if hasattr(type(module), "_init_weights") and not wrapped:
            # A bound method, so that a deep copy of the model rebinds it to the copy.
            module._init_weights = types.MethodType(_init_weights, module)  # type: ignore[assignment]
    _follow_experts_implementation(model, layers)
    recorders = getattr(type(model), "_can_record_outputs", None) or {}
    if _ROUTER_LOGITS in recorders:
        _hook_router_logits(layers)
    _warn_about_two_balancing_losses(model, layers)


def _init_weights(self: nn.Module, module: nn.Module) -> None:
    """The model's own ``_init_weights``, run on the shell of the Hugging Face module that ``module``
    replaced (when it replaced one), then this library's extra state reset."""
    init = type(self)._init_weights  # type: ignore[attr-defined]
    replaced = getattr(module, "replaces", None)
    if not isinstance(replaced, Replaced):
        init(self, module)
        return
    if any(isinstance(m, FrozenExpertWeight) for m in module.children()):
        return  # weights kept quantized: models.init.init_moe_weights fills them, one expert at a time
    with replaced.lent(module) as shell:
        init(self, shell)
    with torch.no_grad():
        for name in ("expert_bias", "pending_load"):  # "balanced"-mode state of TopKRouter
            buffer = module._buffers.get(name)
            if buffer is not None:
                buffer.zero_()


def _follow_experts_implementation(model: nn.Module, layers: list[MoELayer]) -> None:
    """Name this library's experts in the config and give each layer a ``TransformersExperts`` that
    runs the implementation the config names whenever it is another one."""
    config: Any = getattr(model, "config", None)
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError:  # pragma: no cover - another transformers layout
        return
    if config is None or not hasattr(config, "_experts_implementation"):
        return
    if EXPERTS_IMPLEMENTATION not in ExpertsInterface._global_mapping:
        ExpertsInterface.register(EXPERTS_IMPLEMENTATION, _only_inside_moe_layers)
    config._experts_implementation = EXPERTS_IMPLEMENTATION
    for layer in layers:
        replaced = getattr(layer.experts, "replaces", None)
        if isinstance(replaced, Replaced) and hasattr(replaced.shell, "config"):
            layer.hf_experts = TransformersExperts(replaced)


def _only_inside_moe_layers(experts: nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
    raise RuntimeError(
        f"experts_implementation={EXPERTS_IMPLEMENTATION!r} runs inside lightning_ep's MoE layers, but "
        f"{type(experts).__name__} is a transformers experts module that lightning_ep.transform did not replace; "
        "transform the model, or pick one of transformers' implementations for it."
    )


class TransformersExperts:
    """transformers' experts forward of the shell ``replaced``, on a ``RoutedExperts`` module's weights:
    ``(experts, x_TH, ids_TK, weights_TK) -> [T, H]``, dropless, all experts on this process. Active
    while ``config._experts_implementation`` names one of transformers' implementations."""

    def __init__(self, replaced: Replaced) -> None:
        self.replaced = replaced

    @property
    def implementation(self) -> str:
        config: Any = self.replaced.shell.config
        return config._experts_implementation

    def active(self) -> bool:
        """Whether the config names one of transformers' implementations."""
        return self.implementation != EXPERTS_IMPLEMENTATION

    def check_runs_in(self, layer: MoELayer) -> None:
        """Refuse transformers' implementations (dropless, every expert) on a layer that splits its experts
        or bounds them by a capacity, and on experts with LoRA adapters, which they would leave out."""
        said = (
            f"MoE layer {layer.layer_index}: the model's config._experts_implementation is {self.implementation!r}, "
            "one of transformers' implementations, which"
        )
        fix = "Call model.set_experts_implementation('lightning_ep') to use lightning_ep's experts."
        if getattr(layer.experts, "lora_scaling", None):
            raise ValueError(f"{said} would compute the experts without their LoRA adapters. {fix}")
        if any(isinstance(m, FrozenExpertWeight) for m in layer.experts.children()):
            raise ValueError(f"{said} cannot read expert weights kept quantized (frozen_experts). {fix}")
        if not isinstance(layer.dispatcher, LocalDispatcher):
            raise ValueError(
                f"{said} compute every expert on one process without a capacity; this layer's dispatch is "
                f"{type(layer.dispatcher).__name__}. {fix}"
            )

    def __call__(
        self, experts: nn.Module, x_TH: torch.Tensor, expert_ids_TK: torch.Tensor, weights_TK: torch.Tensor
    ) -> torch.Tensor:
        with self.replaced.lent(experts) as shell:
            return shell(x_TH, expert_ids_TK, weights_TK)

    def __repr__(self) -> str:
        return f"TransformersExperts({self.implementation!r})"


def _hook_router_logits(layers: list[MoELayer]) -> None:
    """Install transformers' output-capturing hook for ``router_logits`` on each layer's logits tap."""
    try:
        from transformers.utils.output_capturing import _active_collector, install_output_capuring_hook
    except ImportError:  # pragma: no cover - another transformers layout
        warnings.warn(
            "lightning_ep.transform: this transformers version has no output-capturing hooks to attach to; "
            "output_router_logits=True will return no router logits for the MoE layers.",
            stacklevel=3,
        )
        return

    def collecting() -> bool:
        # Under torch.compile transformers keeps its collector in a plain global once it set it while
        # tracing; a ContextVar cannot be traced, and a graph traced without it collects nothing.
        if torch.compiler.is_compiling() and not _active_collector.compiling:
            return False
        collected = _active_collector.get()
        return collected is not None and _ROUTER_LOGITS in collected

    for layer in layers:
        tap = layer.router_logits
        if not tap._forward_hooks:
            install_output_capuring_hook(tap, _ROUTER_LOGITS, 0)
            tap.wanted = collecting


def _warn_about_two_balancing_losses(model: nn.Module, layers: list[MoELayer]) -> None:
    config: Any = getattr(model, "config", None)
    coef = getattr(config, "router_aux_loss_coef", 0.0) or 0.0
    if not (layers and getattr(config, "output_router_logits", False) and coef > 0):
        return
    moe = layers[0].config
    warnings.warn(
        f"lightning_ep.transform: config.output_router_logits=True, so transformers adds its own load-balancing loss "
        f"(router_aux_loss_coef={coef}) to the loss it returns with labels, on top of MoEConfig's own "
        f"(moe_load_balancing={moe.moe_load_balancing!r}, moe_aux_loss_coeff={moe.moe_aux_loss_coeff}). Set "
        "config.output_router_logits=False to balance with MoEConfig alone.",
        stacklevel=3,
    )


def refuse_transformers_expert_parallelism(model: nn.Module) -> None:
    """Raise if transformers' own expert parallelism was applied to ``model`` (before ``transform``)."""
    distributed = getattr(getattr(model, "config", None), "distributed_config", None)
    ep_size = getattr(distributed, "ep_size", 1) or 1
    applied = [name for name, m in model.named_modules() if getattr(m, "_is_expert_parallel", False)]
    if ep_size > 1 or applied:
        where = f"config.distributed_config has ep_size={ep_size}" if ep_size > 1 else f"it sharded {applied[0]}"
        raise ValueError(
            f"transform(model): transformers' own expert parallelism is applied to this model ({where}); it "
            "cannot be combined with lightning_ep's. Load the model without DistributedConfig(ep_size=...) and let "
            "lightning_ep.transform(model, mesh=...) or ExpertParallelStrategy split the experts."
        )
