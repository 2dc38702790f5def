"""``python -m lightning_ep.plan --config CONFIG --gpus N [...]``: the memory and step time of every
layout of ``N`` GPUs for a Hugging Face MoE config, as a table or as JSON lines (``--json``)."""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence

from lightning_ep.moe.experts.frozen import FORMATS
from lightning_ep.plan.layouts import valid_layouts
from lightning_ep.plan.memory import PRECISIONS, Workload
from lightning_ep.plan.model import model_shape
from lightning_ep.plan.planner import MEMORY_MARGIN, plan_layouts
from lightning_ep.plan.report import header, table
from lightning_ep.plan.time import Hardware

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})
HARDWARE = {"h200": Hardware.h200, "h100": Hardware.h100}


class ArgumentError(ValueError):
    """A bad command-line value: the message names the argument, its value and the fix."""


def parse_size(text: str) -> int:
    """Bytes in ``"141GiB"``, ``"80GB"``, ``"1.5TiB"`` or a plain number of bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _UNITS:
        raise ArgumentError(f"--gpu-memory={text!r}: pass a size such as 141GiB, 80GB or 150000000000.")
    return int(float(match.group(1)) * _UNITS[unit])


def _checkpointing(text: str) -> bool | str:
    lowered = text.lower()
    value = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}.get(lowered, lowered)
    if value not in (True, False, "keep_all_to_all"):
        raise ArgumentError(f"--activation-checkpointing={text!r}: pass true, false or keep_all_to_all.")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lightning_ep.plan", description=__doc__)
    p.add_argument("--config", required=True, help="a Hugging Face config.json, or a folder holding one")
    p.add_argument("--gpus", type=int, required=True, help="world size")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--degree", type=int, default=None, help="only this expert-parallel degree")
    p.add_argument("--replicate", type=int, default=None, help="only this replicate (HSDP) degree")
    p.add_argument("--precision", default="bf16-mixed", choices=PRECISIONS)
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per GPU per step")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--activation-checkpointing", default="false", help="false, true or keep_all_to_all")
    p.add_argument("--capacity-factor", type=float, default=None)
    p.add_argument("--lora-rank", type=int, default=0, help="0: a full fine-tune; r: LoRA adapters of rank r only")
    p.add_argument("--frozen-experts", default=None, choices=list(FORMATS), help="with --lora-rank: their format")
    p.add_argument("--hardware", default="h200", choices=sorted(HARDWARE))
    p.add_argument("--gpu-memory", default=None, help="device memory, e.g. 141GiB (default: the hardware's)")
    p.add_argument("--margin", type=float, default=MEMORY_MARGIN, help="share of device memory kept free")
    p.add_argument("--markdown", action="store_true", help="print a Markdown table")
    p.add_argument("--json", action="store_true", help="one JSON object per layout, one per line")
    return p


def _check(args: argparse.Namespace) -> None:
    for name in ("gpus", "gpus_per_node", "micro_batch", "seq"):
        value = getattr(args, name)
        if value < 1:
            raise ArgumentError(f"--{name.replace('_', '-')}={value}: pass an int >= 1.")
    for name in ("degree", "replicate"):
        value = getattr(args, name)
        if value is not None and (value < 1 or args.gpus % value):
            divisors = [d for d in range(1, args.gpus + 1) if args.gpus % d == 0]
            raise ArgumentError(f"--{name}={value}: pass a divisor of --gpus={args.gpus}: one of {divisors}.")
    if not 0.0 <= args.margin < 1.0:
        raise ArgumentError(f"--margin={args.margin}: pass a share in [0, 1), e.g. {MEMORY_MARGIN}.")
    if args.capacity_factor is not None and not args.capacity_factor > 0:
        raise ArgumentError(f"--capacity-factor={args.capacity_factor}: pass a number > 0, or leave it out (dropless).")
    if args.lora_rank < 0:
        raise ArgumentError(f"--lora-rank={args.lora_rank}: pass 0 (a full fine-tune) or a rank >= 1.")
    if args.frozen_experts is not None and not args.lora_rank:
        raise ArgumentError(
            f"--frozen-experts={args.frozen_experts}: the experts are frozen under LoRA; pass --lora-rank too."
        )


def run(argv: Sequence[str] | None = None) -> int:
    """The command; returns its exit code (2 for a bad argument, with the message on stderr)."""
    args = parser().parse_args(argv)
    try:
        _check(args)
        hardware = HARDWARE[args.hardware]()
        memory = parse_size(args.gpu_memory) if args.gpu_memory is not None else hardware.memory_bytes
        workload = Workload(
            micro_batch=args.micro_batch,
            seq=args.seq,
            precision=args.precision,
            capacity_factor=args.capacity_factor,
            activation_checkpointing=_checkpointing(args.activation_checkpointing),  # type: ignore[arg-type]
            lora_rank=args.lora_rank,
            frozen_experts=args.frozen_experts,
        )
        try:
            shape = model_shape(args.config)
        except ValueError as error:
            raise ArgumentError(f"--config={args.config!r}: {error}") from None
        plans = plan_layouts(
            shape,
            args.gpus,
            workload,
            hardware,
            gpus_per_node=args.gpus_per_node,
            memory_bytes=memory,
            margin=args.margin,
            degree=args.degree,
            replicate_degree=args.replicate,
        )
        if not plans:
            valid = sorted({layout.degree for layout in valid_layouts(args.gpus, shape.num_experts)})
            raise ArgumentError(
                f"--degree={args.degree} --replicate={args.replicate}: no valid layout of {args.gpus} GPUs for "
                f"{shape.num_experts} experts; choose a degree in {valid} and a replicate degree that divides "
                "--gpus / degree."
            )
    except ArgumentError as error:
        print(f"python -m lightning_ep.plan: error: {error}", file=sys.stderr)
        return 2
    if args.json:
        for plan in plans:
            print(json.dumps(plan.as_dict()))
    else:
        print(header(plans[0]))
        print(table(plans, markdown=args.markdown))
    return 0


def main() -> None:
    sys.exit(run())


if __name__ == "__main__":
    main()
