"""Shared pieces of the benchmarks: shapes, timers, the ceilings measured in the same run, FLOP
counts, and the table written to ``RESULTS.md``.

Importable without CUDA (timers fall back to the host clock on the CPU, so every script can be
smoke-tested with gloo on a laptop); the numbers that matter come from CUDA events on a GPU.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

RESULTS = Path(__file__).with_name("RESULTS.md")


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
    # GPT-OSS-20B's sizes (24 layers, 32 experts of width 2880, top-4, 201k vocabulary) as a
    # MixtralConfig: its parameter and FLOP counts, not its biases, clamped SwiGLU or attention sinks.
    "gpt_oss_20b": Shape("gpt_oss_20b", 2880, 2880, 32, 4, 64, 8, 64, layers=24, vocab=201088),
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
    from lightning_ep.moe.experts.grouped import GROUPED_MM

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


def add_record_args(parser: Any) -> None:
    """``--record`` and ``--results``, which every script passes to ``report``."""
    parser.add_argument("--record", action="store_true", help="append the table to --results")
    parser.add_argument("--results", default=None, help="markdown file to append to (default benchmarks/RESULTS.md)")


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
