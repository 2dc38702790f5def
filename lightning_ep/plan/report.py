"""The planner's tables: one row per layout, memory per GPU by kind, fit, step time, tokens/s, MFU."""

from __future__ import annotations

from lightning_ep.plan.planner import Plan

_GIB = 2**30
COLUMNS = (
    "degree",
    "replicate",
    "params/GPU",
    "params GiB",
    "grads GiB",
    "AdamW GiB",
    "activations GiB",
    "gathered GiB",
    "worst GiB",
    "peak GiB",
    "fits",
    "a2a MB/layer",
    "a2a share",
    "step s",
    "tok/s/GPU",
    "MFU",
)


def row(plan: Plan) -> list[str]:
    m, t = plan.memory, plan.time
    cross = " (across nodes)" if t.all_to_all_crosses_nodes else ""
    gib = [
        f"{b / _GIB:.1f}" for b in (m.params, m.grads, m.optimizer, m.activations, m.gathered, m.total_worst, m.total)
    ]
    return [
        str(plan.layout.degree),
        str(plan.layout.replicate_degree),
        f"{plan.params_per_rank / 1e9:.2f} B",
        *gib,
        "yes" if plan.fits else "no",
        f"{t.all_to_all_bytes / 1e6:.0f}{cross}",
        f"{t.all_to_all_share:.0%}",
        f"{t.step_s:.3f}",
        f"{plan.tokens_per_s:,.0f}",
        f"{plan.mfu:.0%}",
    ]


def header(plan: Plan) -> str:
    """One line of what every row shares."""
    s, w, hw = plan.shape, plan.workload, plan.hardware
    limit = "no limit" if plan.memory_limit is None else f"{plan.memory_limit / _GIB:.1f} GiB usable per GPU"
    return (
        f"{s.model_type}: {s.total_params / 1e9:.2f} B parameters ({s.expert_params / 1e9:.2f} B in experts, "
        f"{s.active_params / 1e9:.2f} B active), {s.num_experts} experts top-{s.top_k}, {s.layers} layers; "
        f"{plan.layout.world} x {hw.name} ({plan.layout.gpus_per_node} per node), {limit}; "
        f"micro_batch {w.micro_batch} x seq {w.seq}, {w.precision}, activation_checkpointing="
        f"{w.activation_checkpointing!r}, capacity_factor={w.capacity_factor}"
        + (f"; LoRA rank {w.lora_rank}, frozen experts in {w.frozen_experts or w.precision}" if w.lora_rank else "")
    )


def table(plans: list[Plan], markdown: bool = False) -> str:
    """The rows of ``plans`` as aligned text (or a Markdown table)."""
    rows = [list(COLUMNS)] + [row(p) for p in plans]
    if markdown:
        lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(COLUMNS)]
        lines += ["| " + " | ".join(r) + " |" for r in rows[1:]]
        return "\n".join(lines)
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(cell.rjust(widths[i]) for i, cell in enumerate(r)) for r in rows)


def summary(plan: Plan) -> str:
    """One line for the strategy's setup message."""
    m = plan.memory
    return (
        f"degree={plan.layout.degree}, replicate_degree={plan.layout.replicate_degree}: "
        f"{plan.params_per_rank / 1e9:.2f} B parameters per GPU, peak {m.total / _GIB:.1f} GiB "
        f"(params {m.params / _GIB:.1f}, grads {m.grads / _GIB:.1f}, AdamW {m.optimizer / _GIB:.1f}, "
        f"activations {m.activations / _GIB:.1f}) of "
        + ("no limit" if plan.memory_limit is None else f"{plan.memory_limit / _GIB:.1f} GiB usable")
        + f", step about {plan.time.step_s:.3f} s"
    )
