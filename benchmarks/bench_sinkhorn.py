"""Sinkhorn balancing of router logits, alone: this library's one-launch kernel
(``lightning_ep.moe.kernels.sinkhorn``) against the torch iterations of ``router.sinkhorn_log``.

For each ``T x E`` (tokens x experts, fp32 logits), the milliseconds of one call averaged over
back-to-back calls between two CUDA events (what a step pays when its host runs ahead), and the
largest difference between the two results. On the CPU only the torch iterations run (a smoke test
of the script). One process::

    python benchmarks/bench_sinkhorn.py --record
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch
from _common import add_record_args, log, markdown_table, report

from lightning_ep.moe.routing import router


def per_call_ms(fn: Callable[[], Any], device: torch.device, calls: int) -> float:
    """Milliseconds per call of ``fn`` over ``calls`` back-to-back calls, after one warm-up call."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / calls
    began = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - began) * 1e3 / calls


def torch_iterations(logits: torch.Tensor, iterations: int) -> torch.Tensor:
    """``router.sinkhorn_log`` with the fused kernel switched off (its torch iterations)."""
    fused = router.fused_sinkhorn_available
    router.fused_sinkhorn_available = lambda x: False
    try:
        return router.sinkhorn_log(logits, iterations)
    finally:
        router.fused_sinkhorn_available = fused


def measure(tokens: int, experts: int, device: torch.device, args: Any) -> dict[str, Any]:
    logits = torch.randn(tokens, experts, device=device, generator=torch.Generator(device).manual_seed(0)) * 3
    reference = torch_iterations(logits, args.iterations)
    row: dict[str, Any] = {"T x E": f"{tokens} x {experts}", "iterations": args.iterations}
    row["torch ms"] = per_call_ms(lambda: torch_iterations(logits, args.iterations), device, args.calls)
    if router.fused_sinkhorn_available(logits):
        row["kernel ms"] = per_call_ms(lambda: router.sinkhorn_log(logits, args.iterations), device, args.calls)
        row["torch / kernel"] = row["torch ms"] / row["kernel ms"]
        row["max |diff|"] = (router.sinkhorn_log(logits, args.iterations) - reference).abs().max().item()
    else:
        row["kernel ms"] = "-"  # CPU, or no Triton
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--sizes", nargs="+", default=["8192x128", "8192x8", "16384x128", "4096x64", "65536x64", "8192x60"],
        help="T x E, written TxE",
    )  # fmt: skip
    parser.add_argument("--iterations", type=int, default=30, help="MoEConfig.sinkhorn_iterations")
    parser.add_argument("--calls", type=int, default=50)
    add_record_args(parser)
    args = parser.parse_args()

    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    rows = []
    for size in args.sizes:
        tokens, experts = (int(n) for n in size.split("x"))
        rows.append(measure(tokens, experts, device, args))
        log(rows[-1])
    notes = (
        f"fp32 logits (randn x 3), {args.iterations} iterations; ms per call over {args.calls} back-to-back "
        "calls after one warm-up (CUDA events); `max |diff|` between the kernel's and the torch iterations' "
        "log-scores."
    )
    report("bench_sinkhorn: Sinkhorn balancing alone", markdown_table(rows), notes, args.record, args.results)


if __name__ == "__main__":
    main()
