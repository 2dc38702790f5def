"""The declarative adapter table and the generic code that applies it.

A ``MoEFamily`` says, for one Hugging Face model family, which block class is the sparse MoE
block, where its router and expert weights live (paths relative to the block), and which config
fields give top-k, expert count, activation and jitter. ``build_layer`` turns one block into a
``MoELayer`` that adopts the block's own ``Parameter`` objects.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_ep.moe.config import MoEConfig
from lightning_ep.moe.experts import GroupedExperts
from lightning_ep.moe.layer import MoELayer
from lightning_ep.moe.router import TopKRouter


@dataclass(frozen=True, kw_only=True)
class MoEFamily:
    """How one Hugging Face family maps onto ``MoELayer``.

    Attributes:
        name: family name shown in messages.
        model_types: ``config.model_type`` values this adapter serves.
        block_classes: class names of the sparse MoE block to replace.
        router_weight: path of the gate weight ``[E, H]`` inside the block.
        gate_up_proj: path of ``[E, 2I, H]``.
        down_proj: path of ``[E, H, I]``.
        top_k: config field with the experts per token.
        activation: config field with the activation name (an ``ACT2FN`` key).
        jitter: config field with the multiplicative router jitter, or ``None``.
        normalize_weights: config field (or a fixed bool) deciding top-k renormalisation.
        disk_renames: ``(in memory, on disk)`` substring pairs that turn a state-dict key into its
            name in ``save_pretrained`` files, as transformers' ``WeightRenaming`` does.
        disk_gate_up_proj: per-expert on-disk keys relative to the block (``{e}`` = expert index)
            whose rows, stacked in this order, are expert ``e`` of ``gate_up_proj`` ``[E, 2I, H]``;
            empty when checkpoints store the fused tensor.
        disk_down_proj: the same for ``down_proj`` ``[E, H, I]``.
    """

    name: str
    model_types: tuple[str, ...]
    block_classes: tuple[str, ...]
    router_weight: str = "gate.weight"
    gate_up_proj: str = "experts.gate_up_proj"
    down_proj: str = "experts.down_proj"
    top_k: str = "num_experts_per_tok"
    activation: str = "hidden_act"
    jitter: str | None = None
    normalize_weights: str | bool = True
    disk_renames: tuple[tuple[str, str], ...] = ()
    disk_gate_up_proj: tuple[str, ...] = ()
    disk_down_proj: tuple[str, ...] = ()

    def build_layer(self, block: nn.Module, hf_config: Any, config: MoEConfig, layer_index: int) -> MoELayer:
        """A ``MoELayer`` computing what ``block`` computes, sharing its parameters."""
        from transformers.activations import ACT2FN

        normalize = self.normalize_weights
        if isinstance(normalize, str):
            normalize = bool(getattr(hf_config, normalize))
        gate = TopKRouter(
            block.get_parameter(self.router_weight),
            top_k=int(getattr(hf_config, self.top_k)),
            mode=config.moe_load_balancing,
            normalize_weights=normalize,
            router_dtype=getattr(torch, config.router_dtype),
            sinkhorn_iterations=config.sinkhorn_iterations,
        )
        experts = GroupedExperts(
            block.get_parameter(self.gate_up_proj),
            block.get_parameter(self.down_proj),
            ACT2FN[getattr(hf_config, self.activation)],
        )
        jitter = float(getattr(hf_config, self.jitter) or 0.0) if self.jitter else 0.0
        return MoELayer(gate, experts, config, jitter_noise=jitter, layer_index=layer_index)


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
    hf_config = getattr(model, "config", None)
    model_type = getattr(hf_config, "model_type", None)
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
    from lightning_ep.models import mixtral  # noqa: F401
