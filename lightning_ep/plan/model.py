"""``ModelShape``: what the planner needs to know of a Hugging Face MoE model, counted exactly.

The model is built on the ``meta`` device from its config, and every parameter is listed with its
global shape and whether it is an expert weight or a dense one, as ``lightning_ep.transform`` reads
them through the family adapters of ``lightning_ep.models``.

Legend: H hidden size, E experts, K experts per token, F expert width (``moe_intermediate_size``),
V vocabulary.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_ep.models.registry import FAMILIES, MoEFamily, find_moe_blocks, supported_model_types


@dataclass(frozen=True)
class ParamInfo:
    """One parameter of the model: its name, global shape, whether it is an expert weight (dim 0 the
    expert count) and whether it trains."""

    name: str
    shape: tuple[int, ...]
    expert: bool
    trainable: bool = True

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class AttentionShape:
    """Widths per token of one attention block (elements), for the activation estimate: ``heads`` query
    heads; ``q``, ``k``, ``v`` the widths attention reads (after RoPE), ``o`` its output's; per-head
    ``qk_head_dim`` and ``v_head_dim`` (for the FLOPs); ``norm_widths`` of the norms inside attention
    (Qwen3's ``q_norm``, DeepSeek's ``q_a_layernorm``); ``linear_inputs``: the projections reading the
    block's normalised input (each casts it separately under autocast)."""

    heads: int
    q: int
    k: int
    v: int
    o: int
    qk_head_dim: int
    v_head_dim: int
    norm_widths: tuple[int, ...] = ()
    linear_inputs: int = 3


@dataclass(frozen=True)
class ModelShape:
    """A Hugging Face MoE model's parameters and widths, from its config alone.

    Attributes:
        model_type: ``config.model_type``.
        params: every parameter (tied weights once), in ``named_parameters`` order.
        hidden, vocab, layers: H, V and the number of decoder layers.
        moe_layers: decoder layers whose MLP is a MoE block.
        num_experts, top_k, expert_width: E, K, F (of the MoE blocks).
        shared_width: total width of the shared experts of one MoE block (0: none).
        dense_width: width of the dense MLP of the other decoder layers (0: none).
        expert_biases: the experts carry per-expert biases (GPT-OSS).
        attention: widths of one attention block.
        tied_embeddings: the output projection shares the input embedding's weight.
        buffer_bytes: bytes of every buffer (RoPE tables, selection biases), as built.
    """

    model_type: str
    params: tuple[ParamInfo, ...]
    hidden: int
    vocab: int
    layers: int
    moe_layers: int
    num_experts: int
    top_k: int
    expert_width: int
    shared_width: int
    dense_width: int
    expert_biases: bool
    attention: AttentionShape
    tied_embeddings: bool
    buffer_bytes: int

    @property
    def transposed_experts(self) -> bool:
        """The expert weights are ``[E, in, out]`` (GPT-OSS's interleaved layout, the one family whose
        experts carry biases), not ``[E, out, in]``."""
        return self.expert_biases

    @property
    def total_params(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def expert_params(self) -> int:
        return sum(p.numel for p in self.params if p.expert)

    @property
    def dense_params(self) -> int:
        return self.total_params - self.expert_params

    @property
    def embedding_params(self) -> int:
        """The input embedding (a lookup: no FLOPs)."""
        return self.vocab * self.hidden

    @property
    def active_params(self) -> int:
        """Parameters one token multiplies with: the dense ones but the input embedding (the output
        projection counts, tied or not), and ``K / E`` of the experts."""
        dense = self.dense_params - (0 if self.tied_embeddings else self.embedding_params)
        return dense + self.expert_params * self.top_k // self.num_experts

    def flops_per_token(self, seq: int) -> float:
        """Training FLOPs per token (forward + backward): ``6 x active parameters`` plus causal
        attention, ``3 * seq * heads * (qk_head_dim + v_head_dim)`` per layer (``Q K^T`` and ``A V``,
        halved by the causal mask, times 3 for the backward), as ``benchmarks/_common.py`` counts."""
        a = self.attention
        return 6.0 * self.active_params + 3.0 * self.layers * seq * a.heads * (a.qk_head_dim + a.v_head_dim)


def load_config(source: Any) -> Any:
    """A ``transformers.PretrainedConfig`` from a config object, a ``config.json`` path, a folder
    holding one, or a dict; ``ValueError`` naming the source and the fix."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(source, PretrainedConfig):
        return source
    if isinstance(source, dict):
        fields = dict(source)
    else:
        path = Path(source)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ValueError(
                f"config={str(source)!r}: no such file; pass a Hugging Face config.json or a folder holding one."
            )
        try:
            fields = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise ValueError(f"config={str(source)!r} is not valid JSON ({error}); pass a config.json.") from None
    model_type = fields.pop("model_type", None)
    if not isinstance(model_type, str):
        raise ValueError(
            f"config={source!r} has no 'model_type'; add it (e.g. \"mixtral\") or pass a transformers config object."
        )
    try:
        return AutoConfig.for_model(model_type, **fields)
    except ValueError as error:
        raise ValueError(f"config={source!r}: {error}") from None


def model_shape(config: Any) -> ModelShape:
    """Count the model of ``config`` (as ``load_config`` takes it) on the ``meta`` device; ``ValueError``
    when the model type has no adapter in ``lightning_ep.models``, or no MoE block."""
    from transformers import AutoModelForCausalLM

    hf_config = load_config(config)
    supported_model_types()  # loads the adapters
    family = FAMILIES.get(hf_config.model_type)
    if family is None:
        raise ValueError(
            f"model_type={hf_config.model_type!r} is not a supported MoE family; supported: {sorted(FAMILIES)}."
        )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    blocks = find_moe_blocks(model, family)
    if not blocks:
        raise ValueError(
            f"model_type={hf_config.model_type!r}: the config builds no {family.block_classes} block; check "
            "num_experts / first_k_dense_replace / mlp_only_layers."
        )
    expert_ids = _expert_param_ids(blocks, family)
    params = tuple(
        ParamInfo(name, tuple(p.shape), id(p) in expert_ids)
        for name, p in model.named_parameters(remove_duplicate=True)
    )
    first = blocks[0][1]
    gate_up = first.get_parameter(family.gate_up_proj)
    down = first.get_parameter(family.down_proj)
    num_experts = gate_up.shape[0]
    # gate_up is [E, 2F, H] ("gate_up") or [E, H, 2F] ("interleaved"); down's non-hidden dim is F.
    hidden = int(hf_config.hidden_size)
    expert_width = down.shape[2] if family.expert_layout == "gate_up" else down.shape[1]
    layers = _decoder_layers(model)
    embedding = model.get_input_embeddings()
    head = model.get_output_embeddings()
    tied = head is not None and embedding is not None and head.weight is embedding.weight
    return ModelShape(
        model_type=hf_config.model_type,
        params=params,
        hidden=hidden,
        vocab=int(hf_config.vocab_size),
        layers=len(layers),
        moe_layers=len(blocks),
        num_experts=int(num_experts),
        top_k=int(getattr(hf_config, family.top_k)),
        expert_width=int(expert_width),
        shared_width=_down_width(first.get_submodule(family.shared_experts)) if family.shared_experts else 0,
        dense_width=_dense_width(layers, {id(b) for _, b in blocks}),
        expert_biases=family.expert_layout == "interleaved",
        attention=_attention_shape(hf_config, layers[0]),
        tied_embeddings=bool(tied),
        buffer_bytes=sum(b.numel() * b.element_size() for b in model.buffers()),
    )


#: The projections LoRA adapts (this library's recipe: the README's, ``benchmarks/bench_step.py``'s ``+lora``).
LORA_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
#: The expert weights it adapts, and that ``frozen_experts`` keeps quantized.
EXPERT_WEIGHTS = ("experts.gate_up_proj", "experts.down_proj")


def with_lora(shape: ModelShape, rank: int) -> ModelShape:
    """``shape`` under LoRA of ``rank``: every parameter frozen, adapters on the attention projections
    (PEFT's ``lora_A [r, in]``, ``lora_B [out, r]``) and on both expert weights (``A [E, r, in]``,
    ``B [E, out, r]``, sharded with the experts), which train."""
    params: list[ParamInfo] = []
    for p in shape.params:
        params.append(replace(p, trainable=False))
        stem = p.name.removesuffix(".weight")
        if not p.expert and len(p.shape) == 2 and stem.rpartition(".")[2] in LORA_ATTENTION:
            out, inner = p.shape
            params.append(ParamInfo(f"{stem}.lora_A.weight", (rank, inner), expert=False))
            params.append(ParamInfo(f"{stem}.lora_B.weight", (out, rank), expert=False))
        elif p.expert and p.name.endswith(EXPERT_WEIGHTS):
            experts, out, inner = p.shape
            params.append(ParamInfo(f"{p.name}_lora_A", (experts, rank, inner), expert=True))
            params.append(ParamInfo(f"{p.name}_lora_B", (experts, out, rank), expert=True))
    return replace(shape, params=tuple(params))


def _expert_param_ids(blocks: list[tuple[str, nn.Module]], family: MoEFamily) -> set[int]:
    # As parallel.expert.expert_parameters: the experts module's own parameters whose dim 0 is E.
    ids = set()
    for _, block in blocks:
        experts = block.get_submodule(family.gate_up_proj.rpartition(".")[0])
        num_experts = block.get_parameter(family.gate_up_proj).shape[0]
        for p in experts.parameters(recurse=False):
            if p.ndim >= 1 and p.shape[0] == num_experts:
                ids.add(id(p))
    return ids


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    lists: list[nn.ModuleList] = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        raise ValueError(f"{type(model).__name__} has no nn.ModuleList of decoder layers.")
    longest = max(range(len(lists)), key=lambda i: len(lists[i]))
    return list(lists[longest])


def _down_width(module: nn.Module) -> int:
    down = getattr(module, "down_proj", None)
    return int(down.in_features) if isinstance(down, nn.Linear) else 0


def _dense_width(layers: list[nn.Module], moe_ids: set[int]) -> int:
    for layer in layers:
        mlp = getattr(layer, "mlp", None)
        if mlp is not None and id(mlp) not in moe_ids:
            return _down_width(mlp)
    return 0


def _attention_shape(hf_config: Any, layer: nn.Module) -> AttentionShape:
    heads = int(hf_config.num_attention_heads)
    attn = getattr(layer, "self_attn", None)
    norms: list[int] = []
    if getattr(hf_config, "kv_lora_rank", None):  # DeepSeek multi-head latent attention
        qk = int(hf_config.qk_nope_head_dim) + int(hf_config.qk_rope_head_dim)
        v = int(hf_config.v_head_dim)
        q_lora = getattr(hf_config, "q_lora_rank", None)
        if q_lora:
            norms.append(int(q_lora))
        norms.append(int(hf_config.kv_lora_rank))
        return AttentionShape(heads, heads * qk, heads * qk, heads * v, heads * v, qk, v, tuple(norms), 2)
    head_dim = int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads)
    kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    q, kv = heads * head_dim, kv_heads * head_dim
    if attn is not None and hasattr(attn, "q_norm"):
        norms += [q, kv]
    return AttentionShape(heads, q, kv, kv, q, head_dim, head_dim, tuple(norms), 3)
