"""How much of a bf16 weight each frozen-expert format keeps (``ExpertParallelStrategy(frozen_experts=...)``).

Each format quantizes a ``1024 x 1024`` bf16 weight as ``FrozenExpertWeight`` does on load (FP8 in
blocks of 128 x 128, MXFP4 and NF4 in groups along the input features), and the table gives the
relative error of the dequantized weight, ``||dequantized - w|| / ||w||``, with the bytes an element
takes, for three weight distributions: normal, normal with a log-normal scale per output row, and
Student-t with 4 degrees of freedom (heavier tails). Deterministic (seed 0), CPU only::

    python benchmarks/bench_quant_error.py --record
"""

from __future__ import annotations

import argparse

import torch
from _common import add_record_args, markdown_table, report

from lightning_ep.moe.experts.frozen import BYTES_PER_ELEMENT, FORMATS, FrozenExpertWeight


def weights(size: int) -> dict[str, torch.Tensor]:
    """The distributions, std about 0.02 as initialised Hugging Face weights are, rounded to bf16."""
    g = torch.Generator().manual_seed(0)
    normal = torch.randn(size, size, generator=g) * 0.02
    row_scales = torch.exp(torch.randn(size, 1, generator=g) * 0.5)
    student = torch.distributions.StudentT(4.0).sample((size, size)) * 0.02
    drawn = {"normal": normal, "normal, row scales": normal * row_scales, "Student-t (4)": student}
    return {name: w.to(torch.bfloat16).float() for name, w in drawn.items()}


def relative_error(fmt: str, w: torch.Tensor) -> float:
    frozen = FrozenExpertWeight(fmt, w[None])  # type: ignore[arg-type]
    return float((frozen.dequantize(torch.float32)[0] - w).norm() / w.norm())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=1024, help="rows and columns of the weight (a multiple of 128)")
    add_record_args(parser)
    args = parser.parse_args()
    drawn = weights(args.size)
    rows = [
        {"format": fmt, "bytes an element": f"{BYTES_PER_ELEMENT[fmt]:.4f}"}
        | {name: f"{relative_error(fmt, w):.4f}" for name, w in drawn.items()}
        for fmt in FORMATS
    ]
    report(
        "Frozen-expert formats: the relative error of a quantized bf16 weight",
        markdown_table(rows),
        "Relative error ||dequantized - w|| / ||w|| of one bf16 weight, seed 0.",
        args.record,
        args.results,
    )


if __name__ == "__main__":
    main()
