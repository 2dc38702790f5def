"""The planner's tables of ``docs/scaling.md``: for each model and world size, every degree with
the smallest replicate degree that fits (replicate 1 where none does); then LoRA with the frozen
experts in bf16, FP8 and MXFP4: the fewest H100s or H200s of one node that hold each model.

    python benchmarks/plan_tables.py > tables.md
"""

from __future__ import annotations

from pathlib import Path

from lightning_ep.plan import Hardware, Workload, model_shape, plan_layouts
from lightning_ep.plan.report import header, table

CONFIGS = Path(__file__).resolve().parents[1] / "lightning_ep" / "plan" / "configs"
MODELS = ("mixtral-8x7b", "mixtral-8x22b", "qwen3-30b-a3b", "deepseek-v3")
WORLDS = (8, 64, 512)
WORKLOAD = Workload(micro_batch=2, seq=4096, precision="bf16-mixed", activation_checkpointing=True)
#: LoRA of rank 16 (attention and both expert weights), one sequence of 4,096 per GPU, bf16-true.
LORA = {"micro_batch": 1, "seq": 4096, "precision": "bf16-true", "activation_checkpointing": True, "lora_rank": 16}


def main() -> None:
    hardware = Hardware.h200()
    for name in MODELS:
        shape = model_shape(CONFIGS / f"{name}.json")
        print(f"### {name}\n")
        for world in WORLDS:
            plans = plan_layouts(shape, world, WORKLOAD, hardware, memory_bytes=hardware.memory_bytes)
            chosen = []
            for degree in sorted({p.layout.degree for p in plans}):
                same = [p for p in plans if p.layout.degree == degree]
                chosen.append(next((p for p in same if p.fits), same[0]))
            print(f"{world} GPUs. {header(chosen[0]).split('; ', 1)[1]}\n")
            print(table(chosen, markdown=True) + "\n")
            fitting = [p for p in plans if p.fits]
            if fitting:
                fast = min(fitting, key=lambda p: p.time.step_s)
                t = fast.time
                print(
                    f"Fastest layout that fits: degree={fast.layout.degree}, replicate_degree="
                    f"{fast.layout.replicate_degree}: {t.step_s:.3f} s per step, {fast.tokens_per_s:,.0f} tok/s/GPU, "
                    f"MFU {fast.mfu:.0%}, all-to-all {t.all_to_all_share:.0%} of the step"
                    + (
                        " (across nodes)"
                        if t.all_to_all_crosses_nodes
                        else " (inside a node)"
                        if t.all_to_all_s
                        else ""
                    )
                    + ".\n"
                )
    lora_table()


def lora_table() -> None:
    """For each model, frozen-expert format and card: the fewest GPUs of one node (1, 2, 4 or 8) on
    which some layout fits, with that layout's peak memory and tokens/s per GPU."""
    print("### LoRA on one node\n")
    print("| model | frozen experts | H100s (peak GiB, tok/s/GPU) | H200s (peak GiB, tok/s/GPU) |")
    print("|---|---|---|---|")
    for name in MODELS:
        shape = model_shape(CONFIGS / f"{name}.json")
        for fmt in (None, "fp8", "mxfp4", "nf4"):
            workload = Workload(**LORA, frozen_experts=fmt)  # type: ignore[arg-type]
            cells = []
            for hardware in (Hardware.h100(), Hardware.h200()):
                cell = "more than 8"
                for world in (1, 2, 4, 8):
                    plans = plan_layouts(
                        shape, world, workload, hardware, gpus_per_node=world, memory_bytes=hardware.memory_bytes
                    )
                    fitting = [p for p in plans if p.fits]
                    if fitting:
                        best = min(fitting, key=lambda p: p.time.step_s)
                        peak = best.memory.total / 2**30
                        cell = f"{world} at degree {best.layout.degree} ({peak:.1f}, {best.tokens_per_s:,.0f})"
                        break
                cells.append(cell)
            print(f"| {name} | {fmt or 'bf16'} | {cells[0]} | {cells[1]} |")
    print()


if __name__ == "__main__":
    main()
