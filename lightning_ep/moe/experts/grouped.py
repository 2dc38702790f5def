"""SwiGLU experts on 3-D weights in the Hugging Face layout, run as one grouped GEMM.

Legend: N routed rows (sorted by expert), H hidden size, I expert width, L experts held here
(all experts on one process, ``E / degree`` under expert parallelism).

Weights: ``gate_up_proj [L, 2I, H]`` (gate rows first, then up rows) and ``down_proj [L, H, I]``,
so expert ``e`` computes ``down_proj[e] @ (act(gate_e x) * up_e x)``. Under expert parallelism the
weights are DTensors sharded on the expert dim; the local shard is what this module multiplies.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

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
    if DTensor is not None and isinstance(p, DTensor):
        return p.to_local()
    return p


def fold_grad_scale(x_NH: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether ``GroupedExperts`` runs its grouped GEMMs as one autograd function with the gradient
    scale folded in (``grouped_mlp``): rows in the GEMMs' ``dtype`` (the weights are cast to it inside),
    and no autocast to another dtype (whose casts that function's backward would not replay)."""
    device = x_NH.device.type
    autocast_other = torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) != dtype
    return x_NH.dtype == dtype and not autocast_other


def compute_weights(weights: Sequence[torch.Tensor], dtype: torch.dtype | None) -> list[torch.Tensor]:
    """The local shards of ``weights``, cast (differentiably) to ``dtype`` unless it is ``None``; the
    gradients are widened back by ``cast_for_compute``'s kernel on CUDA."""
    local = [local_tensor(w) for w in weights]
    if dtype is None:
        return local
    return [cast_for_compute(w, dtype) for w in local]


def use_grouped(
    x_NH: torch.Tensor,
    counts_L: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    requested: bool | None,
    dtype: torch.dtype | None = None,
) -> bool:
    """Whether an experts module runs ``grouped_mm`` (``requested``: its ``use_grouped_mm``; ``dtype``:
    the GEMMs' dtype when the weights are cast to it); checks that the counts match the local experts
    and that a forced ``grouped_mm`` can run."""
    if counts_L.shape[0] != w1.shape[0]:
        raise RuntimeError(f"got token counts for {counts_L.shape[0]} experts, but {w1.shape[0]} are held here.")
    grouped = grouped_mm_supported(x_NH, w1, w2, dtype=dtype)
    if requested and not grouped:
        raise RuntimeError(
            f"use_grouped_mm=True but grouped_mm cannot run for dtype {x_NH.dtype} on {x_NH.device.type} "
            f"with weights {tuple(w1.shape)}; use_grouped_mm=None falls back to a loop."
        )
    return grouped and requested is not False


def grouped_mm_supported(x: torch.Tensor, *weights: torch.Tensor, dtype: torch.dtype | None = None) -> bool:
    """Whether ``grouped_mm`` runs for these operands: dtype and device supported, rows 16-byte aligned
    (``dtype``: the weights' dtype in the GEMMs, when they are cast to it; ``None``: their own)."""
    if GROUPED_MM is None:
        return False
    if x.device.type == "cuda":
        dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)
    elif x.device.type == "cpu":
        dtypes = (torch.float32, torch.bfloat16, torch.float16)
    else:
        return False
    if torch.compiler.is_compiling():
        dtypes = (torch.bfloat16,)  # what the operator's meta function takes (torch 2.11-2.13)
    if x.dtype not in dtypes or any((dtype or w.dtype) != x.dtype for w in weights):
        return False
    align = 16 // x.element_size()
    return all(dim % align == 0 for w in weights for dim in w.shape[1:])


class RoutedExperts(nn.Module):
    """What every routed-experts module shares: the 3-D ``gate_up_proj`` whose dim 0 is the global
    expert count, ``use_grouped_mm``, ``grad_scale`` and ``compute_dtype`` (see ``GroupedExperts``),
    and ``run``, which casts the local weight shards, picks the grouped GEMM or the per-expert loop
    and applies the gradient scale."""

    gate_up_proj: nn.Parameter
    #: As transformers' experts modules declare it (their weights hold a gate): tools that find a
    #: model's routed experts by it find these.
    has_gate = True

    #: Whether ``run`` hands the grouped and per-expert functions the local weights uncast, for
    #: them to cast to ``compute_dtype`` themselves (``GroupedExperts``: its GEMMs then write the
    #: weights' gradients in the weights' own dtype); otherwise they get the cast weights.
    casts_in_gemms = False

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
    #: which ``use_grouped_mm=None`` runs one cuBLAS GEMM per expert instead of the grouped GEMM, on
    #: CUDA and when the dispatcher already read the counts to the host (no extra sync). ``None``:
    #: never. Set by subclasses that have a measured per-expert path.
    per_expert_min_gflop: float | None = None

    def run(
        self,
        x_NH: torch.Tensor,
        counts_L: torch.Tensor,
        params: Sequence[torch.Tensor],
        gemm_weights: tuple[int, int],
        grouped: Callable[..., torch.Tensor],
        loop: Callable[..., torch.Tensor],
        counts_host: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """``grouped(x_NH, counts_L, weights, grad_scale)`` or ``loop(x_NH, counts, weights, grad_scale)``
        on the local shards of ``params`` (cast to ``compute_dtype`` unless ``casts_in_gemms``); both
        multiply every weight's gradient by ``grad_scale`` (``with_grad_scale`` does it for any
        function). ``gemm_weights``: the positions in ``params`` of the two matrices the GEMMs
        multiply by. ``counts_host``: ``counts_L`` as host integers when the caller already has them;
        otherwise the loop reads them (one sync)."""
        local = [local_tensor(w) for w in params]
        weights = local if self.casts_in_gemms else compute_weights(local, self.compute_dtype)
        i, j = gemm_weights
        dtype = self.compute_dtype if self.casts_in_gemms else None
        grouped_ok = use_grouped(x_NH, counts_L, weights[i], weights[j], self.use_grouped_mm, dtype)
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
        """The experts without host counts and without ``grouped_mm``, for a traced graph
        (``torch.compile``, ``torch.export``) in a dtype whose ``grouped_mm`` cannot be traced (fp32:
        the operator's meta function takes bf16 only): every local expert runs on every row and each
        row keeps its own expert's output; rows past the counts (padding) come out zero. ``L`` times
        the arithmetic of the grouped GEMM, no data-dependent shape."""
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
        """For a grouped forward without host counts: the counts queued to the host for a backward
        of per-expert GEMMs where ``prefers_per_expert`` would pick them, else ``None``. Not in a
        traced graph, nor while a CUDA graph is captured (its replays would read stale counts)."""
        if not self.host_counts_in_backward or not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return None
        if not self._large_for(x_NH, w_first) or (x_NH.is_cuda and torch.cuda.is_current_stream_capturing()):
            return None
        return CountsOnHost(counts_L)

    def _large_for(self, x_NH: torch.Tensor, w_first: torch.Tensor) -> bool:
        """Whether an average expert's first GEMM on these rows reaches ``per_expert_min_gflop`` (CUDA,
        ``use_grouped_mm=None``)."""
        minimum = self.per_expert_min_gflop
        if self.use_grouped_mm is not None or minimum is None or not x_NH.is_cuda:
            return False
        mean_rows = x_NH.shape[0] / max(w_first.shape[0], 1)
        return 2 * mean_rows * w_first[0].numel() / 1e9 >= minimum


class GroupedExperts(RoutedExperts):
    """The routed experts of one MoE layer. Owns ``gate_up_proj`` and ``down_proj`` (the very same
    ``Parameter`` objects as the Hugging Face experts module it replaces).

    Args:
        gate_up_proj: ``[E, 2I, H]``.
        down_proj: ``[E, H, I]``.
        act_fn: the activation applied to the gate half (SiLU for Mixtral).
        use_grouped_mm: ``None`` picks ``grouped_mm`` whenever it runs for the operands, ``False``
            forces the per-expert loop, ``True`` requires ``grouped_mm`` (error if it cannot run).

    ``grad_scale`` multiplies the weights' gradients (see ``with_grad_scale``). Under expert
    parallelism of degree ``d`` it is ``1 / d``: tokens of all ``d`` ranks of the group reach an
    expert, and data parallelism over the remaining ``W / d`` ranks averages by ``W / d`` only, so
    each expert gradient ends up divided by the world size ``W``, exactly like a dense parameter's.

    ``compute_dtype``, when set, is the dtype the weights are cast to for the matmuls (their
    gradients flow back in the parameters' dtype). ``shard_model`` sets it to FSDP2's
    ``param_dtype`` when it leaves the experts out of FSDP2 (no expert-data-parallel ranks). The
    GEMM functions cast the weights themselves (``casts_in_gemms``) and keep the cast for backward;
    fp32 master weights' gradients are written in fp32 by the grouped weight-gradient kernel on
    CUDA (``kernels.grouped_wgrad``) or by the per-expert GEMMs, and widened from the grouped GEMM's
    bf16 elsewhere.

    The grouped path runs as one autograd function (``lightning_ep.moe.experts.mlp``) that folds
    ``grad_scale`` into its SwiGLU backward and recomputes the SwiGLU output there instead of
    keeping it; under autocast to another dtype than the rows' it runs under plain autograd with
    ``with_grad_scale``.

    The per-expert path (``use_grouped_mm=False``, or ``None`` on CUDA with host counts and an
    average expert's first GEMM of at least ``per_expert_min_gflop``) runs one cuBLAS GEMM per
    expert and GEMM, written in place, with the gradient scale folded into the weight-gradient
    GEMMs. On an H200 it beats the grouped GEMM on large experts whatever the rows (Mixtral's
    4096 x 14336) and loses, by up to several times, on narrow ones (width 768 or 1408), hence the
    threshold on an average expert's GEMM size; measured with ``benchmarks/bench_experts.py``
    (``docs/performance.md``, "Expert GEMMs"). Where such experts get no host counts in the forward
    (one process, or the padded all-to-all), the forward runs the grouped GEMMs without a sync and
    the backward runs per expert on the counts copied to the host meanwhile (``counts_for_backward``).
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
        """Run each local expert on its contiguous block of rows.

        Args:
            x_NH: rows sorted by local expert.
            counts_L: rows per local expert (int, on any device), summing to ``N`` or less (the rows
                past them are padding: their outputs are never to be read).
            counts_host: the same counts as host integers, when the caller has them.
        Returns:
            ``[N, H]`` expert outputs, in the order of ``x_NH``.
        """
        act_fn, dtype = self.act_fn, self.compute_dtype

        def grouped(x: torch.Tensor, counts: torch.Tensor, weights: list[torch.Tensor], scale: float) -> torch.Tensor:
            later = self.counts_for_backward(x, counts, weights[0])
            return _grouped_forward(x, counts, weights[0], weights[1], act_fn, scale, dtype, later)

        def loop(x: torch.Tensor, counts: list[int], weights: list[torch.Tensor], scale: float) -> torch.Tensor:
            return _per_expert_forward(x, counts, weights[0], weights[1], act_fn, scale, dtype)

        return self.run(x_NH, counts_L, [self.gate_up_proj, self.down_proj], (0, 1), grouped, loop, counts_host)


def _grouped_forward(
    x_NH: torch.Tensor,
    counts_L: torch.Tensor,
    w1_LFH: torch.Tensor,
    w2_LHI: torch.Tensor,
    act_fn: Callable[[torch.Tensor], torch.Tensor],
    grad_scale: float,
    compute_dtype: torch.dtype | None,
    backward_counts: CountsOnHost | None,
) -> torch.Tensor:
    assert GROUPED_MM is not None
    offsets_L = torch.cumsum(counts_L.to(device=x_NH.device), dim=0).to(torch.int32)
    dtype = compute_dtype or w1_LFH.dtype
    if fold_grad_scale(x_NH, dtype):
        return grouped_mlp(x_NH, offsets_L, w1_LFH, w2_LHI, act_fn, grad_scale, dtype, backward_counts)

    def mlp(x_NH: torch.Tensor, w1_LFH: torch.Tensor, w2_LHI: torch.Tensor) -> torch.Tensor:
        return grouped_mlp_forward(x_NH, offsets_L, w1_LFH, w2_LHI, act_fn)[1]

    return with_grad_scale(mlp, x_NH, compute_weights([w1_LFH, w2_LHI], compute_dtype), grad_scale)


def _per_expert_forward(
    x_NH: torch.Tensor,
    counts: list[int],
    w1_LFH: torch.Tensor,
    w2_LHI: torch.Tensor,
    act_fn: Callable[[torch.Tensor], torch.Tensor],
    grad_scale: float,
    compute_dtype: torch.dtype | None,
) -> torch.Tensor:
    h_NF = segment_linear(x_NH, w1_LFH, counts, grad_scale, compute_dtype)
    return segment_linear(swiglu(h_NF, act_fn), w2_LHI, counts, grad_scale, compute_dtype)
