"""FP8 GEMMs for trainable experts (``ExpertParallelStrategy(expert_gemms="fp8")``).

Legend: N routed rows (sorted by expert), P padded rows, H hidden size, I expert width, F = 2I,
L experts held here.

The grouped SwiGLU MLP's six GEMMs (two forward, two input gradients, two weight gradients) run on
the GPU's FP8 tensor cores through torchao's ``_to_fp8_rowwise_then_scaled_grouped_mm`` (its MoE
training kernels; ``torch._scaled_grouped_mm`` underneath): every operand is cast to e4m3 with a
dynamic power-of-two scale per row of the contraction (per expert for the weight gradients), each
GEMM accumulates in fp32 and writes bf16. The master weights stay as they are (fp32 under
``bf16-mixed``, bf16 under ``bf16-true``); their gradients come back in their dtype.

The scaled grouped GEMM needs each expert's rows in a multiple of 16. ``padded_rows`` places every
expert's block at a multiple of 16 in a zeroed buffer of about ``N + 16 L`` rows (a static size: no
host sync, CUDA graphs capture it); the MLP runs on that buffer and the outputs are read back, each
move a gather one way and a scatter the other (distinct rows: no atomics). Cost: one copy of the rows
in and one of the outputs out per direction, and up to 15 zero rows per expert of GEMM work. The
weights enter in bf16 (cast from fp32 masters by ``kernels.cast``), so torchao's casts to FP8 read two
bytes per element, and their bf16 gradients are widened by the cast's kernel.

What it changes in the math: each GEMM's operands carry e4m3's rounding (3 mantissa bits, a relative
error of at most 2^-4 per element) instead of bf16's 2^-9; the accumulation is fp32 in both. Its
effect on training is what ``benchmarks/bench_precision.py``'s ``bf16-mixed+fp8gemm`` row measures.
What it costs beside the GEMMs: every operand cast to FP8 with its scales (four tensors in the
forward, eight in the backward, the weights among them), and the row moves above.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

#: Rows per expert block that the FP8 grouped GEMM needs.
ALIGN = 16
#: The lowest CUDA compute capability whose FP8 grouped GEMM torch ships (Hopper).
MIN_CAPABILITY = (9, 0)


def _torchao_grouped_mm() -> Callable[..., torch.Tensor] | None:
    try:
        from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm
    except Exception:  # absent, or built for another torch
        return None
    return _to_fp8_rowwise_then_scaled_grouped_mm


def fp8_gemms_blocker(device: torch.device) -> str | None:
    """Why FP8 expert GEMMs cannot run on ``device`` (``None``: they can)."""
    if device.type != "cuda":
        return (
            f"a CUDA GPU of compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or later (this is {device.type})"
        )
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        return (
            f"a GPU of compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or later for torch's FP8 "
            f"grouped GEMM ({name} is {capability[0]}.{capability[1]})"
        )
    if _torchao_grouped_mm() is None:
        return "torchao's MoE training kernels (pip install torchao; torchao.prototype.moe_training did not import)"
    return None


def padded_rows(offsets_L: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Where each row goes in a buffer whose expert blocks start at multiples of ``ALIGN``.

    ``offsets_L``: int32 inclusive prefix sums of the rows per expert (at most ``rows``; rows past the
    last are a static plan's padding). Returns ``(target_N, offsets_P, P)``: for each row of ``x_NH``
    its buffer row, all distinct (rows past the last offset go, in order, after the last block,
    outside every expert's rows); the buffer's int32 offsets, every block a multiple of ``ALIGN`` rows;
    and the buffer's static size ``P``, ``rows`` rounded up to ``ALIGN`` plus ``ALIGN`` per expert (the
    rows of the weight-gradient GEMM, whose operands are read column by column, must be 16-byte
    aligned). On the device, no host sync.
    """
    device, experts = offsets_L.device, offsets_L.shape[0]
    ends = offsets_L.long()
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    padded = (counts + ALIGN - 1) // ALIGN * ALIGN
    padded_ends = torch.cumsum(padded, dim=0)
    shift = (padded_ends - padded) - (ends - counts)  # how far each expert's block moves
    r = torch.arange(rows, device=device)
    expert_N = torch.searchsorted(ends, r, right=True)
    past = padded_ends[-1] - ends[-1]  # rows past the last offset keep their order after the last block
    target_N = r + torch.where(expert_N < experts, shift[expert_N.clamp(max=experts - 1)], past)
    size = -(-rows // ALIGN) * ALIGN + ALIGN * experts
    return target_N, padded_ends.to(torch.int32), size


class _Scatter(torch.autograd.Function):
    """``out[index[i]] = x[i]`` into ``size`` zero rows (``index`` distinct); backward a gather."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, index: torch.Tensor, size: int) -> torch.Tensor:
        ctx.save_for_backward(index)
        return x.new_zeros(size, *x.shape[1:]).index_copy_(0, index, x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        (index,) = ctx.saved_tensors
        return grad.index_select(0, index), None, None


class _Gather(torch.autograd.Function):
    """``x[index]`` (``index`` distinct); backward a scatter into zeros, no atomics."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.rows = x.shape[0]
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        (index,) = ctx.saved_tensors
        return grad.new_zeros(ctx.rows, *grad.shape[1:]).index_copy_(0, index, grad), None


def fp8_grouped_mlp(
    x_NH: torch.Tensor,
    w1_LFH: torch.Tensor,
    w2_LHI: torch.Tensor,
    *,
    offsets_L: torch.Tensor,
    act_fn: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """``y_NH = act(x_NH @ w1[e].T)`` gated ``@ w2[e].T`` per expert ``e``, every GEMM in FP8 (see the
    module docstring), differentiable in ``x_NH``, ``w1_LFH`` and ``w2_LHI`` under plain autograd.
    ``x_NH`` and the weights (``[L, 2I, H]``, ``[L, H, I]``) in bf16, rows sorted by expert; rows past
    the last offset come out unspecified, as the grouped GEMMs leave them. Needs
    ``fp8_gemms_blocker(x_NH.device) is None``."""
    from lightning_ep.moe.kernels.swiglu import swiglu

    grouped_mm = _torchao_grouped_mm()
    assert grouped_mm is not None, "fp8_grouped_mlp needs torchao (fp8_gemms_blocker)"
    target_N, offsets_P, size = padded_rows(offsets_L, x_NH.shape[0])
    x_PH = _Scatter.apply(x_NH, target_N, size)  # zero rows inside the blocks: no weight gradient from them

    def gemm(a: torch.Tensor, w_LOK: torch.Tensor) -> torch.Tensor:
        # torchao takes the right operand as [L, K, O] column-major per expert: w's own transpose.
        return grouped_mm(a, w_LOK.transpose(-2, -1), offsets_P, out_dtype=torch.bfloat16,
                          pad_token_groups_for_grouped_mm=False)  # fmt: skip

    with torch.autocast(x_NH.device.type, enabled=False):
        h_PF = gemm(x_PH, w1_LFH)
        y_PH = gemm(swiglu(h_PF, act_fn, offsets_P[-1:]), w2_LHI)
    return _Gather.apply(y_PH, target_N)


def use_fp8_gemms(model: torch.nn.Module) -> int:
    """Run the grouped GEMMs of every ``GroupedExperts`` of ``model`` in FP8; returns how many modules.
    Refuses, naming the module, experts without such a path (LoRA adapters, GPT-OSS's interleaved GLU),
    a forced per-expert loop, and widths the FP8 GEMM cannot take (multiples of 16)."""
    from lightning_ep.moe.experts.grouped import GroupedExperts, RoutedExperts

    experts = [(name, m) for name, m in model.named_modules() if isinstance(m, RoutedExperts)]
    if not experts:
        raise ValueError(
            f"expert_gemms='fp8': the {type(model).__name__} holds no routed experts of lightning_ep; it runs "
            "lightning_ep.transform's experts (MoEConfig(smp_moe=True))."
        )
    for name, module in experts:
        if type(module) is not GroupedExperts:
            raise ValueError(
                f"expert_gemms='fp8' runs the grouped GEMMs of SwiGLU experts in FP8, but {name} is a "
                f"{type(module).__name__}, which has no FP8 path (LoRA adapters train through the frozen_experts "
                "formats instead; GPT-OSS's experts keep bf16); drop expert_gemms."
            )
        if module.use_grouped_mm is False:
            raise ValueError(
                f"expert_gemms='fp8' runs grouped GEMMs, but {name} has use_grouped_mm=False; drop one of them."
            )
        widths = (*module.gate_up_proj.shape[1:], module.down_proj.shape[-1])
        if any(w % ALIGN for w in widths):
            raise ValueError(
                f"expert_gemms='fp8': the FP8 grouped GEMM takes widths that are multiples of {ALIGN}, but {name}'s "
                f"weights are {tuple(module.gate_up_proj.shape)} and {tuple(module.down_proj.shape)}; "
                "drop expert_gemms."
            )
    for _, module in experts:
        module.fp8_gemms = True
    return len(experts)
