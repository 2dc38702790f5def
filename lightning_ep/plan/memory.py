"""Per-rank memory of one training step: parameters, gradients, AdamW states (exact), activations,
exchange buffers and FSDP2's gathered copies (estimated), and the peak they add up to.

What the strategy holds, and so what is counted:

- Sharding (``parallel.fsdp.shard_model``): a dense parameter is split on dim 0 over the
  ``S = W / R`` shard ranks as ``torch.chunk`` splits it (rank 0 holds the most); an expert weight
  keeps its ``E / d`` experts and, when FSDP2 wraps the experts (``R x edp > 1``), is split on dim 1
  over the ``edp`` ranks.
- Precision: ``32-true`` and ``bf16-mixed`` keep fp32 parameters (``bf16-mixed`` computes in bf16,
  FSDP2 gathering bf16 copies), ``bf16-true`` bf16 ones; gradients and AdamW's two moments take the
  parameters' dtype, plus a 0-dim fp32 ``step`` per parameter tensor.
- Lightning zeroes gradients after the forward, so the previous step's gradients are alive through
  it: at the loss the rank holds the states, those gradients, every layer's saved activations and
  the logits.
- Activation checkpointing (per decoder layer): a layer keeps only its input until backward;
  ``"keep_all_to_all"`` also keeps each MoE layer's exchanged rows (``(M + T K) x H`` elements).

The activation widths per token come from reading the modules' forward passes
(``layer_activation_bytes``). Rows per rank ``M``: ``T K`` in the expected (balanced) case;
``d T min(K, E / d)`` in the dropless worst case (every token of the EP group chooses this rank's
experts); ``E C`` with a capacity ``C = ceil(T K / E x capacity_factor)`` per (rank, expert).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Literal

from lightning_ep.moe.experts.frozen import FORMATS, GROUPS
from lightning_ep.moe.quantized import FP8_BLOCK
from lightning_ep.plan.layouts import Layout
from lightning_ep.plan.model import EXPERT_WEIGHTS, ModelShape, ParamInfo, with_lora

Precision = Literal["32-true", "bf16-mixed", "bf16-true"]
Checkpointing = bool | Literal["keep_all_to_all"]
PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")
_FP32 = 4
_STEP_BYTES = 4  # AdamW's 0-dim fp32 ``step`` per parameter tensor


@dataclass(frozen=True, kw_only=True)
class Workload:
    """What one rank trains on each step.

    Attributes:
        micro_batch: sequences per rank per step; seq: tokens per sequence.
        precision, activation_checkpointing: Lightning's ``precision`` and the strategy's argument.
        capacity_factor: ``MoEConfig.capacity_factor`` (``None``: dropless).
        lora_rank: ``0`` trains every parameter; ``r`` trains LoRA adapters of rank ``r`` only
            (``model.with_lora``: attention projections and both expert weights).
        frozen_experts: the strategy's argument: the frozen expert weights' format under LoRA.
        fp8_block: FP8's rows and columns per scale for ``frozen_experts="fp8"``: 128 x 128, or the
            block of the folder the weights are kept from (``models.pretrained.published_fp8_block``).
    """

    micro_batch: int = 1
    seq: int = 4096
    precision: Precision = "bf16-mixed"
    activation_checkpointing: Checkpointing = False
    capacity_factor: float | None = None
    lora_rank: int = 0
    frozen_experts: Literal["fp8", "mxfp4", "nf4"] | None = None
    fp8_block: tuple[int, int] = FP8_BLOCK

    def __post_init__(self) -> None:
        for name in ("micro_batch", "seq"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Workload({name}={value!r}): pass an int >= 1.")
        if self.precision not in PRECISIONS:
            raise ValueError(f"Workload(precision={self.precision!r}): choose one of {list(PRECISIONS)}.")
        if not (isinstance(self.activation_checkpointing, bool) or self.activation_checkpointing == "keep_all_to_all"):
            raise ValueError(
                f"Workload(activation_checkpointing={self.activation_checkpointing!r}): pass True, False or "
                "'keep_all_to_all'."
            )
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"Workload(capacity_factor={self.capacity_factor!r}): pass a float > 0, or None.")
        if isinstance(self.lora_rank, bool) or not isinstance(self.lora_rank, int) or self.lora_rank < 0:
            raise ValueError(f"Workload(lora_rank={self.lora_rank!r}): pass 0 (a full fine-tune) or a rank >= 1.")
        block = self.fp8_block
        if not (isinstance(block, tuple) and len(block) == 2 and all(type(b) is int and b >= 1 for b in block)):
            raise ValueError(f"Workload(fp8_block={block!r}): pass (rows, cols), two ints >= 1.")
        if self.frozen_experts is not None and (self.frozen_experts not in FORMATS or not self.lora_rank):
            raise ValueError(
                f"Workload(frozen_experts={self.frozen_experts!r}): pass one of {list(FORMATS)} with a lora_rank >= 1 "
                "(the experts are frozen under LoRA), or None."
            )

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq

    @property
    def param_bytes(self) -> int:
        return 2 if self.precision == "bf16-true" else _FP32

    @property
    def compute_bytes(self) -> int:
        return _FP32 if self.precision == "32-true" else 2


@dataclass(frozen=True)
class RankParams:
    """Elements and tensors one rank holds after sharding."""

    dense: int
    experts: int
    tensors: int

    @property
    def total(self) -> int:
        return self.dense + self.experts


@dataclass(frozen=True, kw_only=True)
class RankMemory:
    """Bytes on one rank (rank 0, which holds the largest shards). ``activations`` and ``total``: the
    case the plan is judged by (expected, or the capacity when set); ``*_worst``: the dropless worst
    case. ``peak_phase`` names where the peak falls."""

    params: int
    grads: int
    optimizer: int
    activations: int
    activations_worst: int
    exchange: int
    gathered: int
    total: int
    total_worst: int
    peak_phase: str

    def as_dict(self) -> dict[str, int | str]:
        return {name: value for name, value in asdict(self).items() if name != "peak_phase"}


def _chunk(n: int, parts: int, index: int) -> int:
    """Rows of ``torch.chunk(rows=n, parts)[index]`` (0 past the last chunk), as FSDP2 shards."""
    size = math.ceil(n / parts) if n else 0
    return max(0, min(size, n - index * size)) if size else 0


def local_numel(param: ParamInfo, layout: Layout, rank: int = 0) -> int:
    """Elements of ``param`` that ``rank`` holds once the strategy has sharded the model."""
    if not param.shape:
        return 1
    rest = param.numel // param.shape[0] if param.shape[0] else 0
    if not param.expert:
        return _chunk(param.shape[0], layout.shard, rank % layout.shard) * rest
    local_experts = param.shape[0] // layout.degree
    if not layout.experts_sharded or len(param.shape) < 2:
        return local_experts * rest
    inner = rest // param.shape[1] if param.shape[1] else 0
    return local_experts * _chunk(param.shape[1], layout.edp, layout.coordinates(rank)[1]) * inner


def rank_params(shape: ModelShape, layout: Layout, rank: int = 0) -> RankParams:
    """Dense and expert elements, and parameter tensors, on ``rank``."""
    dense = sum(local_numel(p, layout, rank) for p in shape.params if not p.expert)
    experts = sum(local_numel(p, layout, rank) for p in shape.params if p.expert)
    return RankParams(dense, experts, len(shape.params))


def trained(shape: ModelShape, workload: Workload) -> ModelShape:
    """``shape`` as ``workload`` trains it: under LoRA (``lora_rank``) with its adapters, the rest frozen."""
    return with_lora(shape, workload.lora_rank) if workload.lora_rank else shape


def _frozen_bytes(param: ParamInfo, shape: ModelShape, layout: Layout, workload: Workload, rank: int | None) -> int:
    """Bytes of a frozen expert weight ``[E, R, C]`` kept in ``workload.frozen_experts`` on ``rank``,
    scales included: its ``E / d`` experts, dim 1 of each stored buffer split over the expert-data-parallel
    ranks as FSDP2 splits the trainable weights (``FrozenExpertWeight.shard_rows_``); ``rank=None``:
    those experts whole."""
    experts, rows, cols = param.shape
    index = layout.coordinates(rank)[1] if rank is not None else 0
    parts = layout.edp if rank is not None else 1
    fmt = workload.frozen_experts
    assert fmt is not None
    if fmt == "fp8":
        grid_rows, grid_cols = -(-rows // workload.fp8_block[0]), -(-cols // workload.fp8_block[1])
        per_expert = _chunk(rows, parts, index) * cols + 4 * _chunk(grid_rows, parts, index) * grid_cols
    else:  # values and scales [E, out, in / group, ...]: split on ``out``, C in GPT-OSS's [E, in, out] layout
        out, inner = (cols, rows) if shape.transposed_experts else (rows, cols)
        group, scale_dtype, _ = GROUPS[fmt]
        per_expert = _chunk(out, parts, index) * (inner // 2 + inner // group * scale_dtype.itemsize)
    return experts // layout.degree * per_expert


def state_bytes(shape: ModelShape, layout: Layout, workload: Workload, rank: int = 0) -> tuple[int, int, int]:
    """``(params, grads, optimizer)`` bytes on ``rank``: exact for the strategy's sharding and AdamW
    (frozen parameters have no gradient or state; frozen expert weights kept in ``frozen_experts``)."""
    params = grads = tensors = 0
    for p in trained(shape, workload).params:
        if not p.trainable and workload.frozen_experts and p.name.endswith(EXPERT_WEIGHTS):
            params += _frozen_bytes(p, shape, layout, workload, rank)
            continue
        held = local_numel(p, layout, rank) * workload.param_bytes
        params += held
        if p.trainable:
            grads, tensors = grads + held, tensors + 1
    return params, grads, 2 * grads + _STEP_BYTES * tensors


def rows_per_rank(shape: ModelShape, layout: Layout, workload: Workload, case: str) -> int:
    """Rows ``M`` one rank's experts receive in one MoE layer: ``"expected"``, ``"worst"``
    (dropless), or the capacity's static count when ``workload.capacity_factor`` is set."""
    t, k, e = workload.tokens, shape.top_k, shape.num_experts
    if workload.capacity_factor is not None:
        return e * max(1, math.ceil((t * k / e) * workload.capacity_factor))
    if case == "worst":
        return layout.degree * t * min(k, e // layout.degree)
    return t * k


def _norm(width: int, input_bytes: int) -> int:
    # HF RMSNorm keeps x in fp32 (a copy when x is bf16) and the normalised x cast back to x's dtype.
    return width * (_FP32 + (2 if input_bytes == 2 else _FP32))


def _inputs(width: int, consumers: int, workload: Workload) -> int:
    # Each projection saves its input; under autocast each casts the fp32 input to bf16 on its own.
    if workload.precision == "bf16-mixed":
        return width * 2 * consumers
    return width * workload.compute_bytes


def layer_activation_bytes(shape: ModelShape, workload: Workload, rows: int, moe: bool) -> int:
    """Bytes one decoder layer saves for its backward with ``rows`` expert rows (no checkpointing)."""
    t, h, b = workload.tokens, shape.hidden, workload.compute_bytes
    residual = workload.param_bytes if workload.precision != "bf16-mixed" else _FP32
    a = shape.attention
    attention = _norm(h, residual) + _inputs(h, a.linear_inputs, workload)
    attention += (a.q + a.k + a.v + 2 * a.o) * b + _FP32 * a.heads  # SDPA's q, k, v, out, lse; o_proj's input
    attention += sum(_norm(w, b) + w * b for w in a.norm_widths)
    per_token = attention + _norm(h, residual)
    if not moe:
        return t * (per_token + _inputs(h, 2, workload) + 4 * shape.dense_width * b)
    per_token += _FP32 * h + 3 * _FP32 * shape.num_experts  # fp32 router input; logits, scores
    if shape.shared_width:
        per_token += _inputs(h, 2, workload) + 4 * shape.shared_width * b
    # grouped_mlp keeps x and h = x W1 (2F); the SwiGLU output a (F) is kept only under autograd
    # (autocast, GPT-OSS's clamped SwiGLU); the combine keeps the expert outputs y, one per (token, k).
    keeps_a = workload.precision == "bf16-mixed" or shape.expert_biases
    per_row = (h + (3 if keeps_a else 2) * shape.expert_width) * b
    return t * per_token + rows * per_row + t * shape.top_k * h * b


def _units(shape: ModelShape, layout: Layout, workload: Workload) -> tuple[int, int, int, int]:
    """Bytes FSDP2 gathers (compute dtype): the root and output head (held from forward to backward),
    one decoder layer's dense parameters, one layer's local experts when FSDP2 wraps them (not the
    frozen weights kept in ``frozen_experts``: buffers); and one layer's trainable share of those."""
    gather = workload.compute_bytes
    head = 0 if shape.tied_embeddings else shape.vocab * shape.hidden
    root = shape.vocab * shape.hidden + shape.hidden + head
    params = trained(shape, workload).params
    kept = [p for p in params if p.expert and not (workload.frozen_experts and not p.trainable)]
    dense = sum(p.numel for p in params if not p.expert)
    per_layer_dense = (dense - root) // shape.layers
    experts = sum(p.numel for p in kept) // (shape.moe_layers * layout.degree) if layout.experts_sharded else 0
    trainable = sum(p.numel for p in params if p.trainable)
    per_layer_trainable = per_layer_dense + experts if not workload.lora_rank else trainable // shape.layers
    return root * gather, per_layer_dense * gather, experts * gather, per_layer_trainable * gather


def exchange_bytes(shape: ModelShape, layout: Layout, workload: Workload, rows: int) -> int:
    """One MoE layer's all-to-all buffers on a rank: the ``T K`` rows it sends and the ``M`` it
    receives (``0`` at degree 1: the local dispatch only permutes)."""
    if layout.degree == 1:
        return 0
    return (workload.tokens * shape.top_k + rows) * shape.hidden * workload.compute_bytes


def rank_memory(shape: ModelShape, layout: Layout, workload: Workload, rank: int = 0) -> RankMemory:
    """The memory of ``rank`` (see the module docstring) for one training step."""
    params, grads, optimizer = state_bytes(shape, layout, workload, rank)
    rows = rows_per_rank(shape, layout, workload, "expected")
    expected = _peak(shape, layout, workload, rank, rows)
    worst = _peak(shape, layout, workload, rank, rows_per_rank(shape, layout, workload, "worst"))
    static = params + optimizer
    return RankMemory(
        params=params,
        grads=grads,
        optimizer=optimizer,
        activations=expected[1],
        activations_worst=worst[1],
        exchange=exchange_bytes(shape, layout, workload, rows),
        gathered=expected[2],
        total=static + expected[0],
        total_worst=static + worst[0],
        peak_phase=expected[3],
    )


def _peak(shape: ModelShape, layout: Layout, workload: Workload, rank: int, rows: int) -> tuple[int, int, int, str]:
    """``(bytes above params + optimizer at the peak, activations then, FSDP2 gathered bytes then,
    phase)`` for ``rows`` expert rows per MoE layer."""
    t, h, v, b = workload.tokens, shape.hidden, shape.vocab, workload.compute_bytes
    _, grads, _ = state_bytes(shape, layout, workload, rank)
    ac = workload.activation_checkpointing
    residual = workload.param_bytes if workload.precision != "bf16-mixed" else _FP32
    moe_every = [i >= shape.layers - shape.moe_layers for i in range(shape.layers)]  # MoE layers last
    # Per MoE layer: the bf16 expert weights cast from fp32 and saved for backward, when FSDP2 does not
    # wrap the experts (``R x edp = 1``) under ``bf16-mixed`` (``GroupedExperts.compute_dtype``). Kept
    # in ``frozen_experts``, one layer's weights are dequantized in its forward and in its backward only.
    local_experts = rank_params(shape, layout, rank).experts // shape.moe_layers
    no_copies = layout.experts_sharded or workload.precision != "bf16-mixed" or workload.frozen_experts
    copies = 0 if no_copies else 2 * local_experts
    dequantized = b * local_experts if workload.frozen_experts else 0
    if workload.frozen_experts and layout.edp > 1:  # a weight's split bytes gathered, then reassembled
        frozen = [p for p in trained(shape, workload).params if not p.trainable and p.name.endswith(EXPERT_WEIGHTS)]
        dequantized += 2 * max(_frozen_bytes(p, shape, layout, workload, None) for p in frozen)
    full = [layer_activation_bytes(shape, workload, rows, moe) + (copies if moe else 0) for moe in moe_every]
    kept = exchange_bytes(shape, layout, workload, rows) if ac == "keep_all_to_all" else 0
    saved = [t * h * residual + (kept if moe else 0) for moe in moe_every] if ac else full
    root, layer_dense, layer_experts, layer_trainable = _units(shape, layout, workload)
    final = _norm(h, residual) + _inputs(h, 1, workload)
    # The loss: logits (compute dtype), their fp32 copy under bf16, log_softmax's fp32 output.
    logits_forward = t * v * (b + (_FP32 if b == 2 else 0) + _FP32)
    forward = grads + root + sum(saved) + t * final + logits_forward
    phases = {"forward (loss)": (forward, sum(saved) + t * final + logits_forward, root)}
    # Backward, layer by layer from the last: earlier layers' saved activations, this layer's full
    # ones, the gradients made so far, FSDP2's gathered parameters (this layer and the prefetched
    # one) and unsharded gradients (with their fp32 reduce-scatter copy), the GEMMs' temporaries.
    heads = [p for p in trained(shape, workload).params if p.trainable and ("embed" in p.name or "lm_head" in p.name)]
    head_grads = sum(local_numel(p, layout, rank) for p in heads) * workload.param_bytes
    per_layer_grads = (grads - head_grads) // shape.layers
    gathered = 2 * (layer_dense + layer_experts) + root
    unsharded_grads = layer_trainable * (1 + (2 if b == 2 else 1))
    temps = rows * (6 * shape.expert_width + h) * b + t * h * _FP32 + dequantized
    for i in range(shape.layers - 1, -1, -1):
        done = (shape.layers - i) * per_layer_grads + head_grads
        acts = sum(saved[:i]) + full[i]
        phases[f"backward (layer {i})"] = (root + acts + done + gathered + unsharded_grads + temps, acts, gathered)
    phases["optimizer step"] = (grads, 0, 0)
    phase = max(phases, key=lambda name: phases[name][0])
    return (*phases[phase], phase)
