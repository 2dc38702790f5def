"""The routed experts alone, forward + backward: the grouped GEMM against one cuBLAS GEMM per expert.

For each expert size (hidden x width), number of local experts and mean rows per expert, times
``GroupedExperts`` with ``use_grouped_mm=True`` and ``False`` (``grad_scale`` 0.5, as under expert
parallelism of degree 2) on the same rows and counts, and prints which path ``use_grouped_mm=None``
picks for them (``per_expert_min_gflop``, given host counts). One process::

    python benchmarks/bench_experts.py --record
"""

from __future__ import annotations

import argparse
import itertools
from typing import Any

import torch
import torch.nn.functional as F
from _common import add_record_args, dense_gemm_tflops, log, markdown_table, report, time_ms
from torch import nn

from lightning_ep.moe import GroupedExperts

# (hidden, expert width): Mixtral 8x7B, Qwen1.5-MoE-A2.7B's routed experts, Qwen3-30B-A3B.
SIZES = {"coarse": (4096, 14336), "shared": (2048, 1408), "fine": (2048, 768), "tiny": (64, 32)}


def measure(hidden: int, inter: int, experts: int, rows: int, device: torch.device, args: Any) -> dict[str, Any]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.randint(0, experts, (experts * rows,), generator=g), minlength=experts).tolist()
    w1 = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.02).to(device, dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) * 0.02).to(device, dtype)
    x = torch.randn(experts * rows, hidden, generator=g).to(device, dtype).requires_grad_(True)
    upstream = torch.randn(experts * rows, hidden, generator=g).to(device, dtype)
    counts_L = torch.tensor(counts, device=device)
    times = {}
    for label, grouped in (("grouped ms", True), ("per expert ms", False)):
        module = GroupedExperts(nn.Parameter(w1), nn.Parameter(w2), F.silu, use_grouped_mm=grouped)
        module.grad_scale = 0.5
        times[label] = time_ms(
            lambda m=module: m(x, counts_L, counts).backward(upstream), device, warmup=args.warmup, iters=args.iters
        )
    auto = GroupedExperts(nn.Parameter(w1), nn.Parameter(w2), F.silu)
    return {
        "H": hidden,
        "I": inter,
        "experts": experts,
        "rows/expert": rows,
        "first GEMM GFLOP": 2 * rows * 2 * inter * hidden / 1e9,
        **times,
        "per expert / grouped": times["per expert ms"] / times["grouped ms"],
        "None picks": "per expert" if auto.prefers_per_expert(x, counts, w1) else "grouped",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["coarse", "shared", "fine"], choices=sorted(SIZES))
    parser.add_argument("--experts", nargs="+", type=int, default=[4, 16], help="local experts")
    parser.add_argument("--rows", nargs="+", type=int, default=[512, 1024, 2048, 4096], help="mean rows per expert")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    add_record_args(parser)
    args = parser.parse_args()

    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    dense = dense_gemm_tflops(device)
    log(f"dense GEMM: {dense:.0f} TFLOP/s on {device}")
    rows = []
    for size, experts, per_expert in itertools.product(args.sizes, args.experts, args.rows):
        hidden, inter = SIZES[size]
        rows.append(measure(hidden, inter, experts, per_expert, device, args))
        log(rows[-1])
        if device.type == "cuda":
            torch.cuda.empty_cache()
    notes = (
        f"bf16 on CUDA (fp32 on the CPU), `grad_scale` 0.5, random counts around the mean, median of "
        f"{args.iters} after {args.warmup} warm-ups; dense bf16 GEMM {dense:.0f} TFLOP/s. `None picks`: the "
        "path of `use_grouped_mm=None` with host counts (`GroupedExperts.per_expert_min_gflop`; always grouped "
        "off CUDA)."
    )
    title = "bench_experts: routed experts, grouped GEMM vs per expert"
    report(title, markdown_table(rows), notes, args.record, args.results)


if __name__ == "__main__":
    main()
