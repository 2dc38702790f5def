"""The planner against one H200: predicted and measured peak memory and step time at degree 1.

For the benchmark shapes of ``bench_step.py`` ("fine": H2048 F768 E128 K8, 4 layers; "coarse":
Mixtral 8x7B layers, 2 layers; vocab 32000), in ``bf16-true`` and ``bf16-mixed``, with and without
activation checkpointing, this script trains a few steps through the Lightning Trainer (the
``ep:a2a+eager`` row of ``bench_step.run_row``: ``ExpertParallelStrategy(degree=1)`` with every
execution choice off, the path the planner models; torch's fused AdamW) and prints, per run,
``lightning_ep.plan``'s peak (``RankMemory.total``) beside ``torch.cuda.max_memory_allocated`` over
the timed steps, and its step time beside the measured one. Targets: peak within 10%, step time
within 20%.

    python benchmarks/bench_plan.py --out DIR                 # one GPU; writes DIR/bench_plan.md and .json
    python benchmarks/bench_plan.py --out DIR --dry-run       # the predictions only (runs on a CPU)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from _common import SHAPES, device_name, log, markdown_table, versions
from bench_step import hf_config

from lightning_ep.plan import Hardware, Layout, Workload, model_shape, rank_memory, step_time

BENCH_SHAPES = ("fine", "coarse")
PRECISIONS = ("bf16-true", "bf16-mixed")
CHECKPOINTING = (False, True)
MEMORY_TOLERANCE = 0.10
TIME_TOLERANCE = 0.20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for bench_plan.md and bench_plan.json")
    parser.add_argument("--shapes", nargs="+", default=list(BENCH_SHAPES), choices=sorted(SHAPES))
    parser.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=list(PRECISIONS))
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=2, help="sequences per step")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--hardware", default="h200", choices=["h200", "h100"])
    parser.add_argument("--dry-run", action="store_true", help="print the predictions only; train nothing")
    args = parser.parse_args(argv)
    for name in ("seq", "batch", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}={getattr(args, name)}: pass an int >= 1.")
    # What bench_step.run_row reads besides these.
    args.balancing, args.row_budget, args.trace, args.profile = "none", 1.25, None, False
    args.lr, args.optimizer = 1e-5, "fused"
    return args


def predictions(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One record per (shape, precision, checkpointing): the plan's peak bytes and step seconds."""
    hardware = Hardware.h200() if args.hardware == "h200" else Hardware.h100()
    layout = Layout(world=1, degree=1)
    records = []
    for shape_name in args.shapes:
        shape = model_shape(hf_config(SHAPES[shape_name], args.seq))
        for precision in args.precisions:
            for ac in CHECKPOINTING:
                workload = Workload(
                    micro_batch=args.batch, seq=args.seq, precision=precision, activation_checkpointing=ac
                )
                memory = rank_memory(shape, layout, workload)
                records.append(
                    {
                        "shape": shape_name,
                        "precision": precision,
                        "activation_checkpointing": ac,
                        "predicted_peak_bytes": memory.total,
                        "predicted_phase": memory.peak_phase,
                        "predicted_step_s": step_time(shape, layout, workload, hardware).step_s,
                    }
                )
    return records


def measure(record: dict[str, Any], args: argparse.Namespace, device: torch.device) -> None:
    """Train the record's configuration (``bench_step.run_row``) and add what was measured."""
    from bench_step import run_row

    run_args = argparse.Namespace(**vars(args))
    run_args.precision = record["precision"]
    shape = SHAPES[record["shape"]]
    row = "ep:a2a+ac+eager" if record["activation_checkpointing"] else "ep:a2a+eager"
    result = run_row(row, shape, run_args, device, None)
    record["measured_peak_bytes"] = int(result["peak"])
    record["measured_step_s"] = result["seconds"] / args.steps
    record["peak_error"] = record["predicted_peak_bytes"] / record["measured_peak_bytes"] - 1
    record["step_error"] = record["predicted_step_s"] / record["measured_step_s"] - 1


def table(records: list[dict[str, Any]]) -> str:
    rows = []
    for r in records:
        row = {
            "shape": r["shape"],
            "precision": r["precision"],
            "AC": "yes" if r["activation_checkpointing"] else "no",
            "predicted peak GiB": r["predicted_peak_bytes"] / 2**30,
            "predicted step s": r["predicted_step_s"],
        }
        if "measured_peak_bytes" in r:
            row["measured peak GiB"] = r["measured_peak_bytes"] / 2**30
            row["peak error %"] = 100 * r["peak_error"]
            row["measured step s"] = r["measured_step_s"]
            row["step error %"] = 100 * r["step_error"]
            ok = abs(r["peak_error"]) <= MEMORY_TOLERANCE and abs(r["step_error"]) <= TIME_TOLERANCE
            row["within 10% / 20%"] = "yes" if ok else "no"
        rows.append(row)
    return markdown_table(rows)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records = predictions(args)
    if not args.dry_run:
        if not torch.cuda.is_available():
            print(
                "bench_plan.py: no CUDA device; run on one GPU, or pass --dry-run for the predictions.", file=sys.stderr
            )
            return 2
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        for record in records:
            log(f"--- {record['shape']} {record['precision']} AC={record['activation_checkpointing']}")
            measure(record, args, device)
    text = table(records)
    header = (
        f"bench_plan: {device_name()}, versions {versions()}, seq {args.seq}, batch {args.batch}, "
        f"{args.steps} timed steps after {args.warmup} warm-ups\n\n"
    )
    print(header + text)
    (out / "bench_plan.md").write_text(header + text)
    (out / "bench_plan.json").write_text(json.dumps(records, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
