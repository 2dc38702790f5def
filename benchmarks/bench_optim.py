"""The optimizer step over the expert weights one rank holds: torch's AdamW against
``lightning_ep.optim.AdamW``.

For each shape and expert-parallel degree, bf16 parameters shaped as the rank's local experts of
every layer (``[E / degree, 2I, H]`` and ``[E / degree, H, I]`` per layer), random gradients; times
one ``optimizer.step()`` of torch's fused AdamW, torch's foreach AdamW and this library's (CUDA
events, median), and says whether this library's parameters and moments after three steps equal
torch's fused ones bit for bit. Memory moved per step: 14 bytes per bf16 parameter (parameter,
gradient and both moments read; parameter and moments written; 28 in fp32, ``--dtype fp32``, the
master weights of ``bf16-mixed``). ``--blocks`` adds a row of this library's kernel per block size
(elements per program). One process::

    python benchmarks/bench_optim.py --record
    python benchmarks/bench_optim.py --shapes coarse --degrees 1 --dtype fp32 --blocks 512 1024 2048 4096
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
from _common import SHAPES, add_record_args, log, markdown_table, report, time_ms
from torch import nn

from lightning_ep import optim
from lightning_ep.optim import AdamW

OPTIMIZERS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "torch fused": lambda ps: torch.optim.AdamW(ps, lr=1e-5, fused=True),
    "torch foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-5, foreach=True),
    "lightning_ep": lambda ps: AdamW(ps, lr=1e-5),
}


def expert_params(shape_name: str, degree: int, device: torch.device, dtype: torch.dtype) -> list[nn.Parameter]:
    shape = SHAPES[shape_name]
    local = shape.experts // degree
    g = torch.Generator(device=device).manual_seed(0)
    params = []
    for _ in range(shape.layers):
        for dims in ((local, 2 * shape.inter, shape.hidden), (local, shape.hidden, shape.inter)):
            p = nn.Parameter((torch.randn(dims, generator=g, device=device) * 0.02).to(dtype))
            p.grad = (torch.randn(dims, generator=g, device=device) * 1e-3).to(dtype)
            params.append(p)
    return params


def same_bits(shape_name: str, degree: int, device: torch.device, dtype: torch.dtype) -> bool:
    runs = []
    for name in ("torch fused", "lightning_ep"):
        params = expert_params(shape_name, degree, device, dtype)
        optimizer = OPTIMIZERS[name](params)
        for _ in range(3):
            optimizer.step()
        runs.append([t for p in params for t in (p, optimizer.state[p]["exp_avg"], optimizer.state[p]["exp_avg_sq"])])
        del params, optimizer
    return all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


def measure(shape_name: str, degree: int, device: torch.device, args: Any) -> list[dict[str, Any]]:
    dtype = torch.bfloat16 if device.type == "cuda" and args.dtype == "bf16" else torch.float32
    runs = [(name, make, None) for name, make in OPTIMIZERS.items()]
    runs += [(f"lightning_ep, block {b}", OPTIMIZERS["lightning_ep"], b) for b in args.blocks]
    rows = []
    for name, make, block in runs:
        params = expert_params(shape_name, degree, device, dtype)
        count = sum(p.numel() for p in params)
        optimizer = make(params)
        default_block = optim._BLOCK
        optim._BLOCK = block or default_block
        try:
            ms = time_ms(optimizer.step, device, warmup=args.warmup, iters=args.iters)
        finally:
            optim._BLOCK = default_block
        moved = count * (7 * torch.finfo(dtype).bits // 8)
        rows.append(
            {
                "shape": shape_name,
                "degree": degree,
                "params (M)": count / 1e6,
                "optimizer": name,
                "step ms": ms,
                "GB/s": moved / ms / 1e6,
            }
        )
        del params, optimizer
        if device.type == "cuda":
            torch.cuda.empty_cache()
    fused = rows[0]["step ms"]
    bits = {"torch fused": "reference", "torch foreach": "-"}
    bits["lightning_ep"] = "yes" if same_bits(shape_name, degree, device, dtype) else "NO"
    for row in rows:
        row["vs torch fused"] = fused / row["step ms"]
        row["same bits as torch fused"] = bits.get(row["optimizer"], "-")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["fine", "coarse"], choices=sorted(SHAPES))
    parser.add_argument("--degrees", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="parameters' dtype on CUDA")
    parser.add_argument("--blocks", nargs="*", type=int, default=[], help="also time the kernel at these blocks")
    add_record_args(parser)
    args = parser.parse_args()

    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    rows = []
    for shape_name in args.shapes:
        for degree in args.degrees:
            rows += measure(shape_name, degree, device, args)
            log(rows[-3 - len(args.blocks) :])
    notes = (
        f"{args.dtype} on CUDA (fp32 on the CPU, where every tensor takes torch's fused kernel), the expert weights of "
        f"every layer of the shape, one rank's share at each degree; median of {args.iters} steps after "
        f"{args.warmup} warm-ups. GB/s: 14 bytes per bf16 parameter (28 in fp32) over the step's time. "
        "`same bits`: parameters and both moments after three steps, against torch's fused AdamW."
    )
    report("bench_optim: AdamW over one rank's expert weights", markdown_table(rows), notes, args.record, args.results)


if __name__ == "__main__":
    main()
