"""Shared pieces of the benchmarks: shapes, timers, the ceilings measured in the same run, FLOP
counts, and the table written to ``RESULTS.md``.

Importable without CUDA (timers fall back to the host clock on the CPU, so every script can be
smoke-tested with gloo on a laptop); the numbers that matter come from CUDA events on a GPU.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import shlex
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_ep.moe import GroupedExperts, combine, dispatch, dispatch_ep, experts, swiglu
from lightning_ep.parallel import compile as compiling
from lightning_ep.parallel import fsdp

RESULTS = Path(__file__).with_name("RESULTS.md")
VARIANTS = (
    "fast",
    "unfused-swiglu",
    "unfused-combine",
    "sync-counts",
    "atomic-bwd",
    "grouped-experts",
    "root-head",
    "eager-loss",
    "dedup",
    "wide-sort-keys",
    "unfused-copy-sum",
    "unfolded-scale",
    "session5",
    "reference",
    "serial-shared",
)


@dataclass(frozen=True)
class Shape:
    """Model shapes of one benchmark family (a MixtralConfig's fields)."""

    name: str
    hidden: int
    inter: int  # expert width I
    experts: int
    top_k: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    vocab: int = 32000
    shared_inter: int = 0  # width of a gated shared expert (Qwen2-MoE style); 0: none


SHAPES = {
    # Mixtral 8x7B layer shapes.
    "coarse": Shape("coarse", 4096, 14336, 8, 2, 32, 8, 128, layers=2),
    # Qwen3-30B-A3B-like fine-grained experts, as a MixtralConfig.
    "fine": Shape("fine", 2048, 768, 128, 8, 32, 4, 128, layers=4),
    # Qwen1.5-MoE-A2.7B-like: 64 routed experts (60 there) of width 1408, top-4, and a gated
    # shared expert of width 5632 (bench_layer only).
    "shared": Shape("shared", 2048, 1408, 64, 4, 16, 16, 128, layers=4, shared_inter=5632),
    # CPU smoke tests only (tiny-shared routes top-4 of 8: the dedup variant has copies to save).
    "tiny": Shape("tiny", 64, 32, 8, 2, 4, 2, 16, layers=2, vocab=128),
    "tiny-shared": Shape("tiny-shared", 64, 32, 8, 4, 4, 2, 16, layers=2, vocab=128, shared_inter=48),
}


# ---------------------------------------------------------------- processes


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", 0))


def world() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", 1))


def log(*args: Any) -> None:
    """Print on rank 0 only, flushed."""
    if rank() == 0:
        print(*args, flush=True)


def command_line() -> str:
    """The command as typed, with the ``torchrun`` prefix when launched by it."""
    argv = " ".join(shlex.quote(a) for a in sys.argv)
    nproc = os.environ.get("LOCAL_WORLD_SIZE")
    prefix = f"torchrun --nproc-per-node {nproc} " if nproc else "python "
    return prefix + argv


def versions() -> dict[str, str]:
    info = {"torch": torch.__version__, "python": platform.python_version()}
    for name in ("transformers", "lightning"):
        try:
            module = __import__(name)
            info[name] = module.__version__
        except ImportError:
            info[name] = "absent"
    return info


def device_name() -> str:
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        return f"{count} x {torch.cuda.get_device_name(0)}"
    return f"CPU ({platform.processor() or platform.machine()})"


# ---------------------------------------------------------------- variants: the replaced hot-path code


def _bincount_sort(expert_ids_TK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    flat = expert_ids_TK.reshape(-1)
    return torch.argsort(flat, stable=True), torch.bincount(flat, minlength=num_experts)


def _bincount_ids(expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    return torch.bincount(expert_ids.reshape(-1), minlength=num_experts)


def _index_select_permute(x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    return x.index_select(0, index)


def _index_select_gather(
    x_TH: torch.Tensor, order_N: torch.Tensor, top_k: int, inverse_N: torch.Tensor | None = None
) -> torch.Tensor:
    return x_TH.index_select(0, torch.div(order_N, top_k, rounding_mode="floor"))


def _bmm_unsort(
    y_NH: torch.Tensor, inverse_N: torch.Tensor, order_N: torch.Tensor, weights_TK: torch.Tensor
) -> torch.Tensor:
    num_tokens, top_k = weights_TK.shape
    y_TKH = y_NH.index_select(0, inverse_N).view(num_tokens, top_k, -1)
    return torch.bmm(weights_TK.to(y_TKH.dtype).unsqueeze(1), y_TKH).squeeze(1)


def _sum_copies_by_gather(x_NH: torch.Tensor, inverse_N: torch.Tensor, top_k: int) -> torch.Tensor:
    return x_NH.index_select(0, inverse_N).view(-1, top_k, x_NH.shape[1]).sum(dim=1)


@contextlib.contextmanager
def variant(name: str) -> Iterator[None]:
    """Swap replaced implementations back in for the duration (benchmark only):

    - ``unfused-swiglu``: ``silu(gate) * up`` under autograd instead of the Triton kernel;
    - ``unfused-combine``: the combine's torch fallback instead of the Triton kernel;
    - ``sync-counts``: counts per expert by ``torch.bincount`` (reads the maximum back to the host);
    - ``atomic-bwd``: permutations and the combine by ``index_select`` + ``bmm`` under plain
      autograd (zero-fill + scatter-add backward, outer-product GEMM);
    - ``grouped-experts``: the grouped GEMM even where the experts would pick one cuBLAS GEMM per
      expert (``GroupedExperts.per_expert_min_gflop = None``);
    - ``root-head``: the output projection stays in the root's FSDP2 unit (``shard_model``), not
      in one of its own;
    - ``eager-loss``: ``compile_layers`` / ``+compile`` leave the loss function eager;
    - ``dedup``: nothing patched here; ``bench_layer`` sets the all-to-all dispatcher's ``dedup``
      (``MoEConfig.token_dedup``; ``bench_step`` has the row option ``+dedup`` for it);
    - ``wide-sort-keys``: expert ids sorted as int64 keys (8 radix passes on CUDA), not narrowed;
    - ``unfused-copy-sum``: the dispatch's backward sums a token's K gradient copies by a gather
      into ``[T, K, H]`` and a sum, not the one-pass kernel (``combine.sum_copies``);
    - ``unfolded-scale``: the grouped experts under plain autograd, the gradient scale applied by
      two passes over ``[N, H]`` gradients (``with_grad_scale``), not folded (``grouped_mlp``);
    - ``session5``: the last three together (the hot path as Session 5 left it);
    - ``reference``: all of the above (the code before these changes);
    - ``serial-shared``: nothing patched here; ``bench_layer`` sets the layer's
      ``overlap_shared = False`` (shared experts after the dispatch exchange, not during it).
    """
    patches: dict[str, Any] = {}
    if name in ("unfused-swiglu", "reference"):
        patches |= {"fused_swiglu_available": lambda h: False}
    if name in ("unfused-combine", "reference"):
        patches |= {"fused_combine_available": lambda y: False}
    if name in ("sync-counts", "reference"):
        patches |= {"sort_by_expert": _bincount_sort, "count_ids": _bincount_ids}
    if name in ("atomic-bwd", "reference"):
        patches |= {
            "permute_rows": _index_select_permute,
            "gather_rows": _index_select_gather,
            "weighted_unsort": _bmm_unsort,
        }
    if name in ("grouped-experts", "reference"):
        patches |= {"per_expert_min_gflop": None}
    if name in ("root-head", "reference"):
        patches |= {"output_head": lambda model: None}
    if name in ("eager-loss", "reference"):
        patches |= {"compile_loss": lambda model, **kwargs: False}
    if name in ("wide-sort-keys", "session5", "reference"):
        patches |= {"narrow_keys": lambda keys, bound: keys}
    if name in ("unfused-copy-sum", "session5", "reference"):
        patches |= {"sum_copies": _sum_copies_by_gather}
    if name in ("unfolded-scale", "session5", "reference"):
        patches |= {"fold_grad_scale": lambda *args: False}
    modules = (combine, dispatch, dispatch_ep, experts, swiglu, GroupedExperts, fsdp, compiling)
    saved = [(m, k, getattr(m, k)) for m in modules for k in patches if k in vars(m)]
    for module, key, _ in saved:
        setattr(module, key, patches[key])
    try:
        yield
    finally:
        for module, key, value in saved:
            setattr(module, key, value)


# ---------------------------------------------------------------- timing


def stamp(device: torch.device) -> Any:
    """A point in the device's stream: a recorded CUDA event, or the host clock on the CPU."""
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def elapsed_ms(start: Any, end: Any) -> float:
    """Milliseconds between two stamps (synchronises on ``end`` when it is a CUDA event)."""
    if isinstance(start, float):
        return (end - start) * 1e3
    end.synchronize()
    return float(start.elapsed_time(end))


class Timer:
    """Elapsed device time between ``start()`` and ``stop()``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._t0: Any = None
        self._t1: Any = None

    def start(self) -> None:
        self._t0 = stamp(self.device)

    def stop(self) -> None:
        self._t1 = stamp(self.device)

    def ms(self) -> float:
        return elapsed_ms(self._t0, self._t1)


def time_ms(fn: Callable[[], Any], device: torch.device, *, warmup: int = 3, iters: int = 10) -> float:
    """Median milliseconds of ``fn()`` over ``iters`` runs, each timed on its own."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        timer = Timer(device)
        timer.start()
        fn()
        timer.stop()
        samples.append(timer.ms())
    return statistics.median(samples)


def count_host_syncs(fn: Callable[[], Any]) -> int | None:
    """Device-to-host synchronisations that ``fn()`` makes (CUDA only; ``None`` elsewhere).

    Uses ``torch.cuda.set_sync_debug_mode("warn")``: every synchronising CUDA call
    (``.item()``, ``.tolist()``, ``torch.bincount``'s maximum, a blocking copy) emits one warning.
    The first run under the mode in a process reports one sync that never recurs (H200, torch
    2.11), so ``fn()`` runs once under the mode before the counted run.
    """
    if not torch.cuda.is_available():
        return None
    _syncs_of(fn)
    return _syncs_of(fn)


def _syncs_of(fn: Callable[[], Any]) -> int:
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return sum("synchroniz" in str(w.message) for w in caught)


# ---------------------------------------------------------------- ceilings measured in the same run


def dense_gemm_tflops(device: torch.device, n: int = 8192) -> float:
    """bf16 ``n x n x n`` matrix product rate on random data (fp32 on the CPU): the MFU reference."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    n = n if device.type == "cuda" else 256
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    ms = time_ms(lambda: a @ b, device, warmup=5, iters=20)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def grouped_gemm_fwd_bwd_ms(
    counts_L: Sequence[int], hidden: int, inter: int, device: torch.device, dtype: torch.dtype
) -> float:
    """Forward + backward of the two expert GEMMs alone (``[M, H] x [L, H, 2I]`` then
    ``[M, I] x [L, I, H]``), with these rows per expert: ``18 * M * H * I`` FLOPs."""
    from lightning_ep.moe.experts import GROUPED_MM

    L, M = len(counts_L), int(sum(counts_L))
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(M, hidden, device=device, dtype=dtype, generator=g).requires_grad_(True)
    a = torch.randn(M, inter, device=device, dtype=dtype, generator=g).requires_grad_(True)
    w1 = (torch.randn(L, 2 * inter, hidden, device=device, dtype=dtype, generator=g) * 0.02).requires_grad_(True)
    w2 = (torch.randn(L, hidden, inter, device=device, dtype=dtype, generator=g) * 0.02).requires_grad_(True)
    offs = torch.cumsum(torch.tensor(counts_L, device=device), 0).to(torch.int32)
    g1 = torch.randn(M, 2 * inter, device=device, dtype=dtype, generator=g)
    g2 = torch.randn(M, hidden, device=device, dtype=dtype, generator=g)

    def step() -> None:
        if GROUPED_MM is not None and device.type == "cuda":
            h = GROUPED_MM(x, w1.transpose(-2, -1), offs=offs)
            y = GROUPED_MM(a, w2.transpose(-2, -1), offs=offs)
        else:  # a per-expert loop on the CPU smoke test
            h = torch.cat([xi @ w1[e].t() for e, xi in enumerate(torch.split(x, list(counts_L)))])
            y = torch.cat([ai @ w2[e].t() for e, ai in enumerate(torch.split(a, list(counts_L)))])
        torch.autograd.backward([h, y], [g1, g2])
        for t in (x, a, w1, w2):
            t.grad = None

    return time_ms(step, device, warmup=3, iters=10)


def all_to_all_ms(rows: int, hidden: int, device: torch.device, dtype: torch.dtype) -> float:
    """One ``all_to_all_single`` of ``rows x hidden`` elements per rank, equal splits."""
    if world() == 1:
        return 0.0
    x = torch.randn(rows - rows % world(), hidden, device=device, dtype=dtype)
    out = torch.empty_like(x)
    return time_ms(lambda: dist.all_to_all_single(out, x), device, warmup=3, iters=10)


# ---------------------------------------------------------------- FLOPs


def active_params_per_token(shape: Shape) -> int:
    """Parameters a token multiplies with: attention projections, router, ``K`` experts, lm_head."""
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    attention = h * q + 2 * h * kv + q * h
    router = h * shape.experts
    experts = shape.top_k * 3 * h * shape.inter
    return shape.layers * (attention + router + experts) + h * shape.vocab


def model_flops_per_token(shape: Shape, seq: int) -> float:
    """Training FLOPs per token (forward + backward), the formula every MFU here uses:

    ``6 * active_params_per_token + 6 * layers * seq * heads * head_dim``

    The first term is the matrix products (2 FLOPs per multiply-add forward, twice that backward);
    the second is causal attention: ``Q K^T`` and ``A V`` cost ``2 * seq * d`` each per token
    forward without the mask, halved by causality, times 3 for forward + backward. The embedding
    lookup, norms, softmax and the router's own softmax are not counted.
    """
    return 6 * active_params_per_token(shape) + 6 * shape.layers * seq * shape.heads * shape.head_dim


# ---------------------------------------------------------------- tables


def markdown_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "(no rows)\n"
    columns: list[str] = []
    for row in rows:
        columns += [c for c in row if c not in columns]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row.get(c, "")) for c in columns) + " |")
    return "\n".join(lines) + "\n"


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:,.0f}"
    return str(value)


def report(title: str, table: str, notes: str, record: bool, results: str | None) -> None:
    """Print ``table`` (rank 0) and, with ``record``, append it to ``results`` (default RESULTS.md)."""
    log("\n" + table)
    if record:
        write_results(title, table, notes, Path(results) if results else None)


def write_results(title: str, table: str, notes: str = "", path: Path | None = None) -> None:
    """Append one dated section (hardware, versions, the exact command, the table) to RESULTS.md."""
    if rank() != 0:
        return
    path = path or RESULTS
    info = versions()
    header = (
        f"\n## {title}\n\n"
        f"- date: {datetime.date.today().isoformat()}\n"
        f"- hardware: {device_name()}\n"
        f"- versions: torch {info['torch']}, transformers {info['transformers']}, "
        f"lightning {info['lightning']}, python {info['python']}\n"
        f"- command: `{command_line()}`\n\n"
    )
    with path.open("a") as f:
        f.write(header + table + ("\n" + notes + "\n" if notes else ""))
