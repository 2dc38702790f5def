"""Step time of one rank from GEMM rates, memory bandwidth and link bandwidths (an estimate).

The model, per step and rank (``T`` tokens, ``d`` the degree, ``b`` bytes per activation element):

- expert GEMMs: ``6 x expert FLOPs`` at the grouped-GEMM rate, which falls with the expert width
  ``F`` as ``rate x F / (F + EXPERT_WIDTH_KNEE)`` (fewer rows per expert, smaller tiles);
- dense GEMMs (attention projections, shared experts, dense MLPs, output head) at the dense rate,
  attention's ``Q K^T`` and ``A V`` at ``ATTENTION_EFFICIENCY`` of it;
- memory-bound passes at HBM bandwidth: ``PASSES_PER_ROW`` passes over each layer's ``T K x H``
  expert rows (permutes, SwiGLU, combine), ``PASSES_PER_TOKEN`` over ``T x H`` (norms, residuals,
  RoPE), the loss over ``T x V``, and AdamW streaming parameters, gradients and both states;
- the all-to-all, not overlapped with compute: ``all_to_all_bytes`` per MoE layer at NVLink
  bandwidth within a node and the network's for the peers on other nodes, plus ``A2A_LATENCY_S`` per
  call (again in the recomputation of ``activation_checkpointing=True``, not of ``"keep_all_to_all"``);
- activation checkpointing recomputes each layer's forward: compute, passes and host a third more;
- under LoRA (``Workload.lora_rank``) the frozen weights get no gradient: ``4 x`` FLOPs instead of
  ``6 x`` (forward and input gradients; the adapters' are not counted), AdamW streams the adapters
  only, and frozen experts kept in ``frozen_experts`` are dequantized in each forward and backward
  (one fused kernel: the stored bytes read, the compute dtype written);
- FSDP2's all-gathers and reduce-scatters and HSDP's all-reduce, overlapped with compute: only what
  exceeds the compute time shows; frozen experts kept in ``frozen_experts``, split over the
  expert-data-parallel ranks, are gathered inside each forward and backward, not overlapped;
- a host floor of ``HOST_S_PER_STEP`` plus ``HOST_S_PER_LAYER`` per decoder layer (an eager step
  launches hundreds of kernels per layer).

The constants were set so that the two degree-1 steps recorded in ``benchmarks/RESULTS.md`` (one
H200, bf16-true, 8,192 tokens: the "coarse" shape at 0.112 s, GPU-bound, and the "fine" one at
0.076 s, host-bound) come out within 10%; ``benchmarks/bench_plan.py`` re-checks them. The
``Hardware`` defaults are stated with their sources there.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from lightning_ep.moe.experts.frozen import BYTES_PER_ELEMENT
from lightning_ep.plan.layouts import Layout
from lightning_ep.plan.memory import Workload, rank_params, rows_per_rank, state_bytes
from lightning_ep.plan.model import ModelShape

EXPERT_WIDTH_KNEE = 512
ATTENTION_EFFICIENCY = 0.6
PASSES_PER_ROW = 12
PASSES_PER_TOKEN = 40
A2A_LATENCY_S = 50e-6
HOST_S_PER_STEP = 15e-3
HOST_S_PER_LAYER = 15e-3


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """One GPU kind and its node.

    Attributes:
        memory_bytes: device memory (``torch.cuda.get_device_properties().total_memory``).
        dense_tflops: sustained bf16 dense GEMM rate; peak_tflops: the datasheet's dense bf16 peak
            (MFU is quoted against it, as Megatron-Core does).
        grouped_tflops: grouped GEMM rate (forward + backward) at wide experts inside a training step.
        hbm_gbps: HBM bandwidth reached by streaming kernels (GB/s).
        nvlink_gbps, network_gbps: all-to-all bandwidth per GPU inside a node and across nodes (GB/s,
            each direction); allgather_gbps: FSDP2's collectives' bus bandwidth inside a node.
    """

    name: str
    memory_bytes: int
    dense_tflops: float
    peak_tflops: float
    grouped_tflops: float
    hbm_gbps: float
    nvlink_gbps: float
    network_gbps: float
    allgather_gbps: float

    @classmethod
    def h200(cls) -> Hardware:
        """H200 SXM (141 GB HBM3e, 143,771 MiB usable): the dense GEMM rate measured on one H200, the
        grouped rate that the coarse benchmark step reaches (``benchmarks/RESULTS.md``), the
        all-to-all rate measured between two H200s at 16-64 MiB; 989 TFLOP/s datasheet peak; 8 x
        400 Gb/s InfiniBand per node at 80% of line rate."""
        return cls(
            name="H200",
            memory_bytes=143_771 * 2**20,
            dense_tflops=780.0,
            peak_tflops=989.0,
            grouped_tflops=430.0,
            hbm_gbps=3_800.0,
            nvlink_gbps=150.0,
            network_gbps=40.0,
            allgather_gbps=350.0,
        )

    @classmethod
    def h100(cls) -> Hardware:
        """H100 SXM (80 GB HBM3, 81,559 MiB usable): the same chip and links as the H200, HBM at
        3.35 TB/s (streaming kernels reach about 80% of it)."""
        return replace(cls.h200(), name="H100", memory_bytes=81_559 * 2**20, hbm_gbps=2_700.0)


@dataclass(frozen=True, kw_only=True)
class StepTime:
    """Seconds of one step on one rank, by part; ``all_to_all_bytes`` is per MoE layer and step."""

    compute_s: float
    memory_s: float
    all_to_all_s: float
    fsdp_exposed_s: float
    host_s: float
    all_to_all_bytes: int
    all_to_all_crosses_nodes: bool

    @property
    def step_s(self) -> float:
        return max(self.compute_s + self.memory_s, self.host_s) + self.all_to_all_s + self.fsdp_exposed_s

    @property
    def all_to_all_share(self) -> float:
        return self.all_to_all_s / self.step_s


def all_to_all_bytes(shape: ModelShape, layout: Layout, workload: Workload) -> int:
    """Bytes one rank sends to other ranks in one MoE layer per step (dispatch and combine, forward
    and backward), expected case: ``4 T K H b (d - 1) / d``."""
    sent = workload.tokens * shape.top_k * shape.hidden * workload.compute_bytes
    return 4 * sent * (layout.degree - 1) // layout.degree


def _a2a_seconds(nbytes: int, layout: Layout, hw: Hardware) -> float:
    if layout.degree == 1:
        return 0.0
    d, node = layout.degree, layout.gpus_per_node
    on_node = min(d, node) - 1  # peers on this node; the rest are across the network
    off_node = d - 1 - on_node
    per_peer = nbytes / (d - 1)
    link = max(per_peer * on_node / (hw.nvlink_gbps * 1e9), per_peer * off_node / (hw.network_gbps * 1e9))
    return link + 4 * A2A_LATENCY_S


def _collective_seconds(nbytes: float, group: int, layout: Layout, hw: Hardware, stride: int = 1) -> float:
    """A ring all-gather or reduce-scatter of ``nbytes`` (the full size) over ``group`` ranks
    ``stride`` apart (the ``edp`` ranks of an expert are ``degree`` apart)."""
    if group == 1:
        return 0.0
    rate = hw.allgather_gbps if group * stride <= layout.gpus_per_node else hw.network_gbps
    return nbytes * (group - 1) / group / (rate * 1e9)


def step_time(shape: ModelShape, layout: Layout, workload: Workload, hw: Hardware) -> StepTime:
    """The estimated step time of one rank (see the module docstring)."""
    t, h, b, k = workload.tokens, shape.hidden, workload.compute_bytes, shape.top_k
    expert_active = shape.expert_params * k // shape.num_experts
    dense_active = shape.active_params - expert_active
    rows = rows_per_rank(shape, layout, workload, "expected")
    fp32_slowdown = 4.0 if workload.precision == "32-true" else 1.0
    gemm_passes = 4.0 if workload.lora_rank else 6.0  # 2 forward, 2 input gradients, 2 weight gradients
    expert_rate = hw.grouped_tflops * shape.expert_width / (shape.expert_width + EXPERT_WIDTH_KNEE)
    expert_s = gemm_passes * (expert_active * rows / k) / (expert_rate * 1e12)
    a = shape.attention
    attention_flops = 3.0 * shape.layers * workload.seq * a.heads * (a.qk_head_dim + a.v_head_dim) * t
    dense_s = gemm_passes * dense_active * t / (hw.dense_tflops * 1e12)
    dense_s += attention_flops / (ATTENTION_EFFICIENCY * hw.dense_tflops * 1e12)
    # each layer's forward again
    recompute = (gemm_passes + 2.0) / gemm_passes if workload.activation_checkpointing else 1.0
    compute = (expert_s + dense_s) * fp32_slowdown * recompute
    streamed = float(shape.moe_layers * PASSES_PER_ROW * rows * h * b + shape.layers * PASSES_PER_TOKEN * t * h * b)
    streamed *= recompute
    streamed += 6 * t * shape.vocab * 4  # logits, their fp32 copy, log_softmax and its gradient
    local = rank_params(shape, layout).total
    _, grads, _ = state_bytes(shape, layout, workload)
    streamed += grads * 7  # AdamW reads p, g, m, v and writes p, m, v of what trains
    quantized = rank_params(shape, layout).experts if workload.frozen_experts else 0
    if workload.precision == "bf16-mixed":  # fp32 weights cast to bf16 for forward and again for backward
        streamed += 2 * (local - quantized) * (4 + 2)
    if workload.frozen_experts:
        moved = BYTES_PER_ELEMENT[workload.frozen_experts] + workload.compute_bytes
        streamed += (2 + (workload.activation_checkpointing is not False)) * quantized * moved
    a2a_bytes = all_to_all_bytes(shape, layout, workload)
    a2a = shape.moe_layers * _a2a_seconds(a2a_bytes, layout, hw)
    dense_full, expert_full = shape.dense_params, shape.expert_params // layout.degree
    fsdp = 2 * _collective_seconds(dense_full * b, layout.shard, layout, hw)  # forward, backward
    fsdp += _collective_seconds(dense_full * 4, layout.shard, layout, hw)  # fp32 reduce-scatter
    frozen_gather = 0.0
    if workload.frozen_experts:  # split over edp: gathered inside each (re)computation, not overlapped
        stored = expert_full * BYTES_PER_ELEMENT[workload.frozen_experts]
        passes = 2 + (workload.activation_checkpointing is not False)
        frozen_gather = passes * _collective_seconds(stored, layout.edp, layout, hw, layout.degree)
    elif layout.experts_sharded:
        fsdp += 2 * _collective_seconds(expert_full * b, layout.edp, layout, hw, layout.degree)
        if not workload.lora_rank:  # frozen parameters have no gradient to reduce
            fsdp += _collective_seconds(expert_full * 4, layout.edp, layout, hw, layout.degree)
    if layout.replicate_degree > 1:  # HSDP: all-reduce of each rank's fp32 gradient shard across replicas
        rate = hw.network_gbps if layout.world > layout.gpus_per_node else hw.allgather_gbps
        fsdp += 2 * local * 4 * (layout.replicate_degree - 1) / layout.replicate_degree / (rate * 1e9)
    return StepTime(
        compute_s=compute,
        memory_s=streamed / (hw.hbm_gbps * 1e9),
        all_to_all_s=a2a * recompute if workload.activation_checkpointing is True else a2a,
        fsdp_exposed_s=max(0.0, fsdp - compute) + frozen_gather,
        host_s=HOST_S_PER_STEP + HOST_S_PER_LAYER * shape.layers * recompute,
        all_to_all_bytes=a2a_bytes,
        all_to_all_crosses_nodes=layout.spans_nodes(layout.degree),
    )
