"""The declarative adapter table (``MoEFamily`` per Hugging Face family) and the generic code that
applies it: ``MoEFamily.build_layer`` turns one block into a ``MoELayer`` that adopts the block's own
``Parameter`` objects, buffers and shared-expert modules.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from lightning_ep.models.hf_compat import keep_replaced
from lightning_ep.moe.config import MoEConfig
from lightning_ep.moe.experts.grouped import GroupedExperts, RoutedExperts
from lightning_ep.moe.experts.lora import ExpertLoRA, LoRAGroupedExperts
from lightning_ep.moe.experts.variants import InterleavedGLUExperts
from lightning_ep.moe.layer import MoELayer
from lightning_ep.moe.routing.router import Scoring, TopKRouter

ExpertLayout = Literal["gate_up", "interleaved"]


@dataclass(frozen=True, kw_only=True)
class MoEFamily:
    """How one Hugging Face family maps onto ``MoELayer``.

    Paths are relative to the block; the other ``str`` fields name fields of ``model.config``
    (``None``: the family has no such field, the neutral value is used).

    Attributes:
        name: family name shown in messages.
        model_types: ``config.model_type`` values this adapter serves.
        block_classes: class names of the sparse MoE block to replace (dense MLPs of the same model
            are other classes and stay).
        router_weight: path of the gate weight ``[E, H]``, in a direct child of the block.
        router_bias: path of the gate's logit bias ``[E]`` (GPT-OSS).
        score_correction_bias: path of the selection-only bias buffer ``[E]`` (DeepSeek-V3).
        top_k, n_group, topk_group, routed_scaling_factor, jitter: experts per token, expert groups and
            groups kept per token (group-limited top-k), the combine weights' factor, router jitter.
        normalize_weights: config field (or a fixed bool) deciding top-k renormalisation.
        expert_layout: ``"gate_up"``: ``gate_up_proj [E, 2I, H]`` (gate rows first) and
            ``down_proj [E, H, I]`` with an ``ACT2FN`` ``activation`` (``GroupedExperts``);
            ``"interleaved"``: GPT-OSS's ``gate_up_proj [E, H, 2I]`` (interleaved columns),
            ``down_proj [E, I, H]``, biases at ``<path>_bias`` and the clamped SwiGLU
            (``InterleavedGLUExperts``), whose ``swiglu_alpha`` and ``swiglu_limit`` are read from
            the experts module (which holds them in every transformers version; the config field is recent).
        gate_up_proj, down_proj: paths of the fused gate/up weight and the down weight.
        shared_experts: name of the block's dense shared-expert child, added to every token's output.
        shared_experts_gate: name of the child giving the shared experts' sigmoid gate logit (Qwen2-MoE).
        layer_class: the ``MoELayer`` class to build (GPT-OSS's returns a pair).
    """

    name: str
    model_types: tuple[str, ...]
    block_classes: tuple[str, ...]
    router_weight: str = "gate.weight"
    router_bias: str | None = None
    score_correction_bias: str | None = None
    scoring: Scoring = "softmax"
    top_k: str = "num_experts_per_tok"
    normalize_weights: str | bool = True
    n_group: str | None = None
    topk_group: str | None = None
    routed_scaling_factor: str | None = None
    jitter: str | None = None
    expert_layout: ExpertLayout = "gate_up"
    gate_up_proj: str = "experts.gate_up_proj"
    down_proj: str = "experts.down_proj"
    activation: str = "hidden_act"
    swiglu_alpha: str = "experts.alpha"
    swiglu_limit: str = "experts.limit"
    shared_experts: str | None = None
    shared_experts_gate: str | None = None
    layer_class: type[MoELayer] = MoELayer

    def __post_init__(self) -> None:
        if not self.router_name or "." in self.router_name:
            raise ValueError(
                f"MoEFamily(router_weight={self.router_weight!r}): the router must be a direct child of the "
                "block, e.g. 'gate.weight'."
            )

    @property
    def router_name(self) -> str:
        """The router's child name in the block (``gate``; GPT-OSS: ``router``)."""
        return self.router_weight.rpartition(".")[0]

    def build_layer(
        self,
        block: nn.Module,
        hf_config: Any,
        config: MoEConfig,
        layer_index: int,
        adapters: Mapping[str, ExpertLoRA] | None = None,
    ) -> MoELayer:
        """A ``MoELayer`` computing what ``block`` computes, sharing its parameters and buffers;
        ``adapters``: LoRA on the expert weights (``LoRAGroupedExperts``; the ``"gate_up"`` layout only)."""
        gate = TopKRouter(
            block.get_parameter(self.router_weight),
            top_k=int(_field(hf_config, self.top_k, None)),
            mode=config.moe_load_balancing,
            normalize_weights=bool(_field(hf_config, self.normalize_weights, None)),
            router_dtype=getattr(torch, config.router_dtype),
            sinkhorn_iterations=config.sinkhorn_iterations,
            scoring=self.scoring,
            bias=block.get_parameter(self.router_bias) if self.router_bias else None,
            e_score_correction_bias=(
                block.get_buffer(self.score_correction_bias) if self.score_correction_bias else None
            ),
            n_group=int(_field(hf_config, self.n_group, 1) or 1),
            topk_group=int(_field(hf_config, self.topk_group, 1) or 1),
            scaling_factor=float(_field(hf_config, self.routed_scaling_factor, 1.0) or 1.0),
        )
        keep_replaced(gate, block.get_submodule(self.router_name))
        experts = self._experts_of(block, hf_config, adapters or {})
        keep_replaced(experts, block.get_submodule(self.gate_up_proj.rpartition(".")[0]))
        roles = {"shared_experts": self.shared_experts, "shared_experts_gate": self.shared_experts_gate}
        names = {"gate": self.router_name} | {role: child for role, child in roles.items() if child is not None}
        shared = {role: block.get_submodule(child) for role, child in names.items() if role != "gate"}
        jitter = float(_field(hf_config, self.jitter, 0.0) or 0.0)
        layer = self.layer_class(
            gate, experts, config, jitter_noise=jitter, layer_index=layer_index, child_names=names, **shared
        )
        # The block's child order, so that state_dict() lists the keys exactly as before.
        order = {name: i for i, name in enumerate(block._modules)}
        layer._modules = dict(sorted(layer._modules.items(), key=lambda item: order.get(item[0], len(order))))
        return layer

    def _experts_of(self, block: nn.Module, hf_config: Any, adapters: Mapping[str, ExpertLoRA]) -> RoutedExperts:
        if adapters and self.expert_layout != "gate_up":
            raise ValueError(
                f"transform(model): {self.name}'s experts ({self.expert_layout!r} layout, with biases) carry LoRA "
                f"adapters on {sorted(adapters)}, and lightning_ep carries expert LoRA for the [E, out, in] layout "
                "(Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3) only; leave the experts out of "
                "LoraConfig(target_parameters=...) for this family."
            )
        if self.expert_layout == "interleaved":
            return InterleavedGLUExperts(
                block.get_parameter(self.gate_up_proj),
                block.get_parameter(self.gate_up_proj + "_bias"),
                block.get_parameter(self.down_proj),
                block.get_parameter(self.down_proj + "_bias"),
                alpha=float(_attribute(block, self.swiglu_alpha)),
                limit=float(_attribute(block, self.swiglu_limit)),
            )
        from transformers.activations import ACT2FN

        act_fn = ACT2FN[_field(hf_config, self.activation, None)]
        gate_up_proj, down_proj = block.get_parameter(self.gate_up_proj), block.get_parameter(self.down_proj)
        if adapters:
            return LoRAGroupedExperts(gate_up_proj, down_proj, act_fn, adapters)
        return GroupedExperts(gate_up_proj, down_proj, act_fn)


def _attribute(block: nn.Module, path: str) -> Any:
    """The plain attribute at ``path`` (``"child.name"``) of ``block``, or a clear error."""
    owner, _, name = path.rpartition(".")
    module = block.get_submodule(owner) if owner else block
    if not hasattr(module, name):
        raise ValueError(
            f"transform(model): {type(module).__name__} has no attribute {name!r}, which this family's adapter "
            "reads; check that the installed transformers supports this model."
        )
    return getattr(module, name)


def _field(hf_config: Any, field: str | bool | None, default: Any) -> Any:
    """``hf_config.<field>``; a bool is a fixed value; ``None`` (no such field) gives ``default``. A named
    field the config lacks is an error without a default: guessing could change the math."""
    if field is None:
        return default
    if isinstance(field, bool):
        return field
    if hasattr(hf_config, field):
        return getattr(hf_config, field)
    if default is not None:
        return default
    raise ValueError(
        f"transform(model): {type(hf_config).__name__} has no field {field!r}, which this family's adapter "
        "needs; check that the installed transformers supports this model."
    )


FAMILIES: dict[str, MoEFamily] = {}


def register(family: MoEFamily) -> MoEFamily:
    """Add ``family`` to the table, keyed by each of its model types."""
    for model_type in family.model_types:
        FAMILIES[model_type] = family
    return family


def supported_model_types() -> list[str]:
    _load_adapters()
    return sorted(FAMILIES)


def family_for(model: nn.Module) -> MoEFamily:
    """The adapter for ``model.config.model_type``; a clear error when there is none."""
    _load_adapters()
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in FAMILIES:
        raise ValueError(
            f"transform(model): model_type={model_type!r} ({type(model).__name__}) is not a supported MoE "
            f"family; supported: {sorted(FAMILIES)}. Pass a Hugging Face model of one of them, or set "
            f"MoEConfig(smp_moe=False) to train the model's own blocks without expert parallelism."
        )
    return FAMILIES[model_type]


def find_moe_blocks(model: nn.Module, family: MoEFamily) -> list[tuple[str, nn.Module]]:
    """``(qualified name, block)`` of every sparse MoE block of ``family`` in ``model``, in order."""
    return [(name, m) for name, m in model.named_modules() if type(m).__name__ in family.block_classes]


def replace_module(root: nn.Module, qualified_name: str, new: nn.Module) -> None:
    """Put ``new`` where ``qualified_name`` points inside ``root``."""
    parent_name, _, child = qualified_name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, new)


def _load_adapters() -> None:
    # Importing an adapter module registers it.
    from lightning_ep.models import deepseek_v3, gpt_oss, mixtral, olmoe, qwen2_moe, qwen3_moe  # noqa: F401


@dataclass(frozen=True)
class MoEShape:
    """What a Hugging Face MoE model's MoE layers look like, transformed or not (``None`` where a model of
    an unsupported family does not say), for the checkpoint record (``RECORDED``), ``degree="auto"``
    and the execution choices. ``expert_elements``: the largest routed expert's gate/up weight
    elements (``2I x H``; meta tensors too), 0 without one.
    """

    RECORDED: ClassVar[tuple[str, ...]] = ("model_type", "num_experts", "top_k", "num_moe_layers")

    model_type: str | None = None
    num_experts: int | None = None
    top_k: int | None = None
    num_moe_layers: int | None = None
    expert_elements: int = 0

    @classmethod
    def of(cls, model: nn.Module) -> MoEShape:
        hf_config = getattr(model, "config", None)
        model_type = getattr(hf_config, "model_type", None)
        weights = [p.shape for name, p in model.named_parameters() if name.endswith("gate_up_proj") and p.ndim == 3]
        elements = max((shape[1] * shape[2] for shape in weights), default=0)
        layers = [m for m in model.modules() if isinstance(m, MoELayer)]
        if layers:
            return cls(model_type, layers[0].num_experts, layers[0].top_k, len(layers), elements)
        supported_model_types()  # loads the adapters into FAMILIES
        family = FAMILIES.get(model_type) if model_type is not None else None
        blocks = find_moe_blocks(model, family) if family is not None else []
        if family is None or not blocks:
            return cls(model_type, expert_elements=elements)
        top_k = getattr(hf_config, family.top_k, None)
        try:
            experts = int(blocks[0][1].get_parameter(family.gate_up_proj).shape[0])
        except AttributeError:  # a PEFT ParamWrapper holds the experts: read its base weight, [E, ...]
            experts = int(weights[0][0])
        return cls(model_type, experts, None if top_k is None else int(top_k), len(blocks), elements)

    def record(self) -> dict[str, Any]:
        """The entries a checkpoint records (``RECORDED``)."""
        return {name: getattr(self, name) for name in self.RECORDED}
