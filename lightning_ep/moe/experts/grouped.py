"""SwiGLU experts on 3-D weights in the Hugging Face layout, run as one grouped GEMM.

Legend: N routed rows (sorted by expert), H hidden size, I expert width, E experts, L experts held
here (``E / degree`` under expert parallelism, whose DTensor weights are multiplied by local shard).

Weights: ``gate_up_proj [E, 2I, H]`` (gate rows first, then up rows) and ``down_proj [E, H, I]``, so
expert ``e`` computes ``down_proj[e] @ (act(gate_e x) * up_e x)``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch
from torch import nn

from lightning_ep.moe.experts.fp8 import fp8_grouped_mlp
from lightning_ep.moe.experts.frozen import FrozenExpertWeight, recomputed_in_backward
from lightning_ep.moe.experts.grad_scale import with_grad_scale
from lightning_ep.moe.experts.mlp import GROUPED_MM, grouped_mlp, grouped_mlp_forward
from lightning_ep.moe.experts.segments import CountsOnHost, segment_linear
from lightning_ep.moe.kernels.cast import cast_for_compute
from lightning_ep.moe.kernels.swiglu import swiglu

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch built without distributed
    DTensor = None  # type: ignore[assignment,misc]


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (differentiably), or ``p`` itself."""
    return p.to_local() if DTensor is not None and isinstance(p, DTensor) else p


def fold_grad_scale(x_NH: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether ``GroupedExperts`` runs ``grouped_mlp``: rows in the GEMMs' ``dtype`` (the weights are cast
    inside), no autocast to another dtype (whose casts that function's backward would not replay)."""
    device = x_NH.device.type
    autocast_other = torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) != dtype
    return x_NH.dtype == dtype and not autocast_other


def compute_weights(weights: Sequence[torch.Tensor], dtype: torch.dtype | None) -> list[torch.Tensor]:
    """The local shards of ``weights``, cast (differentiably) to ``dtype`` unless it is ``None``; the
    gradients are widened back by ``cast_for_compute``'s kernel on CUDA."""
    local = [local_tensor(w) for w in weights]
    return local if dtype is None else [cast_for_compute(w, dtype) for w in local]


#: The row dtypes ``grouped_mm`` takes, by device type.
_GROUPED_MM_DTYPES = {"cuda": (torch.bfloat16, torch.float16), "cpu": (torch.float32, torch.bfloat16, torch.float16)}


def grouped_mm_supported(x: torch.Tensor, *weights: torch.Tensor, dtype: torch.dtype | None = None) -> bool:
    """Whether ``grouped_mm`` runs for these operands: dtype and device supported, rows 16-byte aligned
    (``dtype``: the weights' dtype in the GEMMs, when they are cast to it; ``None``: their own)."""
    dtypes = _GROUPED_MM_DTYPES.get(x.device.type, ()) if GROUPED_MM is not None else ()
    if dtypes and torch.compiler.is_compiling():
        dtypes = (torch.bfloat16,)  # what the operator's meta function takes (torch 2.11-2.13)
    if x.dtype not in dtypes or any((dtype or w.dtype) != x.dtype for w in weights):
        return False
    align = 16 // x.element_size()
    return all(dim % align == 0 for w in weights for dim in w.shape[1:])


class RoutedExperts(nn.Module):
    """What every routed-experts module shares: the 3-D ``gate_up_proj`` whose dim 0 is the global
    expert count, ``use_grouped_mm``, ``grad_scale`` and ``compute_dtype`` (see ``GroupedExperts``),
    and ``run``, which picks the grouped GEMM or the per-expert loop."""

    gate_up_proj: nn.Parameter
    #: As transformers' experts modules declare it: tools that find routed experts by it find these.
    has_gate = True

    #: Whether the weights are ``[E, in, out]`` (GPT-OSS) rather than ``[E, out, in]``.
    transposed_weights = False

    #: Whether ``run`` hands the grouped and per-expert functions the local weights uncast, to cast
    #: to ``compute_dtype`` themselves (``GroupedExperts``); otherwise they get the cast weights.
    casts_in_gemms = False

    #: Whether the grouped path runs its GEMMs in FP8 (``experts.fp8``; ``use_fp8_gemms`` sets it on
    #: ``GroupedExperts``, the only experts that have such a path).
    fp8_gemms = False

    def __init__(self, use_grouped_mm: bool | None) -> None:
        super().__init__()
        self.use_grouped_mm = use_grouped_mm
        self.grad_scale = 1.0
        self.compute_dtype: torch.dtype | None = None
        #: Whether a grouped forward may leave its backward to per-expert GEMMs (``counts_for_backward``);
        #: ``MoELayer`` clears it under CUDA graphs, whose replays cannot read counts on the host.
        self.host_counts_in_backward = True

    @property
    def num_experts(self) -> int:
        """Global number of experts (the first dim of the global weight shape)."""
        return self.gate_up_proj.shape[0]

    @num_experts.setter
    def num_experts(self, value: int) -> None:
        # transformers' own expert parallelism sets this on the experts it shards.
        raise RuntimeError(
            f"something set num_experts={value} on lightning_ep's {type(self).__name__}: transformers' own expert "
            "parallelism (DistributedConfig(ep_size=...)) is being applied to experts that lightning_ep.transform "
            "replaced, and the two cannot be combined. Load the model without DistributedConfig(ep_size=...) and let "
            "lightning_ep.transform(model, mesh=...) or ExpertParallelStrategy split the experts."
        )

    #: Size of an average expert's first GEMM (GFLOP: 2 x mean rows x that weight's elements) from
    #: which ``use_grouped_mm=None`` picks the per-expert GEMMs (``prefers_per_expert``); ``None``: never.
    per_expert_min_gflop: float | None = None

    def run(
        self,
        x_NH: torch.Tensor,
        counts_L: torch.Tensor,
        params: Sequence[torch.Tensor | FrozenExpertWeight],
        gemm_weights: tuple[int, int],
        grouped: Callable[..., torch.Tensor],
        loop: Callable[..., torch.Tensor],
        counts_host: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """``grouped(x_NH, counts_L, weights, grad_scale)`` or ``loop(x_NH, counts, weights, grad_scale)``
        on the local shards of ``params`` (cast to ``compute_dtype`` unless ``casts_in_gemms``); both
        multiply every weight's gradient by ``grad_scale``. ``gemm_weights``: the positions in ``params``
        of the two GEMM matrices. ``counts_host``: ``counts_L`` on the host, else the loop reads them (one sync).
        A ``FrozenExpertWeight`` in ``params`` is dequantized into the GEMMs' dtype for this call and again
        for the backward (``recomputed_in_backward``)."""
        frozen = {k: p for k, p in enumerate(params) if isinstance(p, FrozenExpertWeight)}
        dtype = self.compute_dtype or x_NH.dtype
        weights = [p.dequantize(dtype) if isinstance(p, FrozenExpertWeight) else p for p in params]
        if not frozen:
            return self._run(x_NH, counts_L, weights, gemm_weights, grouped, loop, counts_host)
        recompute = [partial(p.dequantize, dtype) for p in frozen.values()]
        with recomputed_in_backward([weights[k] for k in frozen], recompute):
            return self._run(x_NH, counts_L, weights, gemm_weights, grouped, loop, counts_host)

    def _run(
        self,
        x_NH: torch.Tensor,
        counts_L: torch.Tensor,
        params: Sequence[torch.Tensor],
        gemm_weights: tuple[int, int],
        grouped: Callable[..., torch.Tensor],
        loop: Callable[..., torch.Tensor],
        counts_host: Sequence[int] | None,
    ) -> torch.Tensor:
        weights = compute_weights(params, None if self.casts_in_gemms else self.compute_dtype)
        i, j = gemm_weights
        if counts_L.shape[0] != weights[i].shape[0]:
            raise RuntimeError(
                f"got token counts for {counts_L.shape[0]} experts, but {weights[i].shape[0]} are held here."
            )
        dtype = self.compute_dtype if self.casts_in_gemms else None
        supported = grouped_mm_supported(x_NH, weights[i], weights[j], dtype=dtype)
        if self.use_grouped_mm and not supported:
            raise RuntimeError(
                f"use_grouped_mm=True but grouped_mm cannot run for dtype {x_NH.dtype} on {x_NH.device.type} "
                f"with weights {tuple(weights[i].shape)}; use_grouped_mm=None falls back to a loop."
            )
        grouped_ok = supported and self.use_grouped_mm is not False
        if self.fp8_gemms and not (grouped_ok and x_NH.dtype == torch.bfloat16 and self.grouped_mm_runs(x_NH, weights)):
            raise RuntimeError(
                f"expert_gemms='fp8' runs {type(self).__name__}'s grouped GEMMs on bf16 rows, which cannot run for "
                f"{x_NH.dtype} rows and weights {[tuple(w.shape) for w in weights]} on {x_NH.device.type}: train in "
                "bf16-mixed or bf16-true, or drop expert_gemms."
            )
        if grouped_ok and not self.grouped_mm_runs(x_NH, weights):
            if self.use_grouped_mm:
                raise RuntimeError(
                    f"use_grouped_mm=True but grouped_mm cannot run for {type(self).__name__}'s operands "
                    f"({[tuple(w.shape) for w in weights]}, {x_NH.dtype}): rows must be 16-byte aligned; "
                    "use_grouped_mm=None falls back to a loop."
                )
            grouped_ok = False
        if grouped_ok and not self.prefers_per_expert(x_NH, counts_host, weights[i]):
            return grouped(x_NH, counts_L, weights, self.grad_scale)
        if torch.compiler.is_compiling() and counts_host is None:
            cast = compute_weights(weights, self.compute_dtype) if self.casts_in_gemms else weights
            return with_grad_scale(lambda x, *w: self.masked_forward(x, counts_L, list(w)), x_NH, cast, self.grad_scale)
        counts = list(counts_host) if counts_host is not None else counts_L.tolist()
        rows = sum(counts)
        if len(counts) != weights[i].shape[0] or rows > x_NH.shape[0]:
            raise RuntimeError(
                f"counts_host {counts} must give the rows of each of the {weights[i].shape[0]} local experts, "
                f"summing to at most the {x_NH.shape[0]} rows passed."
            )
        if rows == x_NH.shape[0]:
            return loop(x_NH, counts, weights, self.grad_scale)
        # A padded dispatch (symmetric memory with a row budget): the padding rows come out as zeros.
        y_NH = loop(x_NH[:rows], counts, weights, self.grad_scale)
        return torch.cat([y_NH, y_NH.new_zeros((x_NH.shape[0] - rows, *y_NH.shape[1:]))])

    def grouped_mm_runs(self, x_NH: torch.Tensor, weights: Sequence[torch.Tensor]) -> bool:
        """Whether ``grouped_mm`` runs for operands beyond the two GEMM weights ``run`` checks (a
        subclass with more GEMMs, as ``LoRAGroupedExperts``, checks its own)."""
        return True

    def expert(self, x_nH: torch.Tensor, e: int, weights: list[torch.Tensor]) -> torch.Tensor:
        """Local expert ``e`` on rows ``x_nH`` (``weights``: the local, cast parameters)."""
        raise NotImplementedError

    def masked_forward(self, x_NH: torch.Tensor, counts_L: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
        """The experts for a traced graph without host counts, in a dtype whose ``grouped_mm`` cannot be
        traced (fp32): every local expert runs on every row, each row keeps its own expert's output and
        padding rows come out zero. ``L`` times the grouped GEMM's arithmetic, no data-dependent shape."""
        ends_L = torch.cumsum(counts_L.to(device=x_NH.device), dim=0)
        rows_N = torch.arange(x_NH.shape[0], device=x_NH.device, dtype=ends_L.dtype)
        expert_N = torch.searchsorted(ends_L, rows_N, right=True)  # L for padding rows: no expert
        y_NH = None
        for e in range(counts_L.shape[0]):
            y_e = torch.where((expert_N == e)[:, None], self.expert(x_NH, e, weights), 0.0)
            y_NH = y_e if y_NH is None else y_NH + y_e
        assert y_NH is not None
        return y_NH

    def prefers_per_expert(self, x_NH: torch.Tensor, counts_host: Sequence[int] | None, w_first: torch.Tensor) -> bool:
        """Whether ``use_grouped_mm=None`` picks the per-expert GEMMs for these rows (``w_first``: the
        local weights of the first GEMM, ``[L, ...]``)."""
        return counts_host is not None and self._large_for(x_NH, w_first)

    def counts_for_backward(
        self, x_NH: torch.Tensor, counts_L: torch.Tensor, w_first: torch.Tensor
    ) -> CountsOnHost | None:
        """The counts queued to the host for per-expert GEMMs in the backward of a grouped forward where
        ``prefers_per_expert`` would pick them; not traced nor under CUDA graph capture (stale counts)."""
        if not self.host_counts_in_backward or not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return None
        if not self._large_for(x_NH, w_first) or (x_NH.is_cuda and torch.cuda.is_current_stream_capturing()):
            return None
        return CountsOnHost(counts_L)

    def _large_for(self, x_NH: torch.Tensor, w_first: torch.Tensor) -> bool:
        """Whether an average expert's first GEMM on these rows reaches ``per_expert_min_gflop``."""
        minimum = self.per_expert_min_gflop
        if self.fp8_gemms or self.use_grouped_mm is not None or minimum is None or not x_NH.is_cuda:
            return False
        mean_rows = x_NH.shape[0] / max(w_first.shape[0], 1)
        return 2 * mean_rows * w_first[0].numel() / 1e9 >= minimum


class GroupedExperts(RoutedExperts):
    """The routed experts of one MoE layer. Owns ``gate_up_proj`` and ``down_proj`` (the very same
    ``Parameter`` objects as the Hugging Face experts module it replaces).

    Args:
        gate_up_proj: ``[E, 2I, H]``; ``down_proj``: ``[E, H, I]``.
        act_fn: the activation applied to the gate half (SiLU for Mixtral).
        use_grouped_mm: ``None`` picks ``grouped_mm`` whenever it runs for the operands, ``False``
            forces the per-expert loop, ``True`` requires ``grouped_mm`` (error if it cannot run).

    ``grad_scale`` multiplies the weights' gradients: ``1 / d`` under expert parallelism of degree
    ``d``, whose ``d`` ranks' tokens reach an expert while data parallelism averages over ``W / d``
    ranks only, so each expert gradient ends up divided by the world size ``W``, like a dense one's.

    ``compute_dtype``, when set, is the matmuls' dtype (``shard_model`` sets FSDP2's ``param_dtype``
    when it leaves the experts out of FSDP2); the gradients come back in the parameters' dtype, fp32
    ones accumulated in fp32 (``lightning_ep.moe.experts.mlp``).

    The grouped path is one autograd function (``experts.mlp``) that folds ``grad_scale`` into its
    SwiGLU backward (under autocast to another dtype than the rows', plain autograd and
    ``with_grad_scale``). The per-expert path (``use_grouped_mm=False``, or ``None`` on CUDA with host
    counts and an average expert's first GEMM of at least ``per_expert_min_gflop``) runs one cuBLAS
    GEMM per expert, with the gradient scale folded into the weight-gradient GEMMs: faster than the
    grouped GEMM on large experts, slower on narrow ones (``benchmarks/bench_experts.py``). Without host
    counts, such experts run grouped GEMMs forward and per-expert ones backward (``counts_for_backward``).
    """

    per_expert_min_gflop = 64.0
    casts_in_gemms = True

    def __init__(
        self,
        gate_up_proj: nn.Parameter,
        down_proj: nn.Parameter,
        act_fn: Callable[[torch.Tensor], torch.Tensor],
        *,
        use_grouped_mm: bool | None = None,
    ) -> None:
        super().__init__(use_grouped_mm)
        if gate_up_proj.ndim != 3 or down_proj.ndim != 3:
            raise ValueError(
                f"expert weights must be 3-D, got gate_up_proj {tuple(gate_up_proj.shape)} and "
                f"down_proj {tuple(down_proj.shape)}."
            )
        num_experts, two_i, hidden = gate_up_proj.shape
        if two_i % 2:
            raise ValueError(
                f"gate_up_proj {tuple(gate_up_proj.shape)} must stack gate and up rows: its dim 1 must be even."
            )
        if down_proj.shape != (num_experts, hidden, two_i // 2):
            raise ValueError(
                f"expert weights do not match: gate_up_proj {tuple(gate_up_proj.shape)} needs down_proj "
                f"{(num_experts, hidden, two_i // 2)}, got {tuple(down_proj.shape)}."
            )
        self.gate_up_proj = gate_up_proj
        self.down_proj = down_proj
        self.act_fn = act_fn

    def expert(self, x_nH: torch.Tensor, e: int, weights: list[torch.Tensor]) -> torch.Tensor:
        return swiglu(x_nH @ weights[0][e].t(), self.act_fn) @ weights[1][e].t()

    def forward(
        self, x_NH: torch.Tensor, counts_L: torch.Tensor, counts_host: Sequence[int] | None = None
    ) -> torch.Tensor:
        """Run each local expert on its block of rows of ``x_NH`` (sorted by local expert) -> ``[N, H]``,
        in the order of ``x_NH``. ``counts_L``: rows per local expert (int, on any device), summing to
        ``N`` or less (the rows past them are padding, whose outputs are never to be read);
        ``counts_host``: the same counts as host integers, when the caller has them."""
        act_fn, dtype = self.act_fn, self.compute_dtype

        def grouped(x: torch.Tensor, counts: torch.Tensor, weights: list[torch.Tensor], scale: float) -> torch.Tensor:
            offsets_L = torch.cumsum(counts.to(device=x.device), dim=0).to(torch.int32)
            if self.fp8_gemms:  # bf16 weights into the FP8 casts (experts.fp8)
                fp8_mlp = partial(fp8_grouped_mlp, offsets_L=offsets_L, act_fn=act_fn)
                return with_grad_scale(fp8_mlp, x, compute_weights(weights, dtype or torch.bfloat16), scale)
            later = self.counts_for_backward(x, counts, weights[0])
            if fold_grad_scale(x, dtype or weights[0].dtype):
                return grouped_mlp(x, offsets_L, weights[0], weights[1], act_fn, scale, dtype, later)

            def mlp(x: torch.Tensor, w1_LFH: torch.Tensor, w2_LHI: torch.Tensor) -> torch.Tensor:
                return grouped_mlp_forward(x, offsets_L, w1_LFH, w2_LHI, act_fn)[1]

            return with_grad_scale(mlp, x, compute_weights(weights, dtype), scale)

        def loop(x: torch.Tensor, counts: list[int], weights: list[torch.Tensor], scale: float) -> torch.Tensor:
            h_NF = segment_linear(x, weights[0], counts, scale, dtype)
            return segment_linear(swiglu(h_NF, act_fn), weights[1], counts, scale, dtype)

        return self.run(x_NH, counts_L, [self.gate_up_proj, self.down_proj], (0, 1), grouped, loop, counts_host)
