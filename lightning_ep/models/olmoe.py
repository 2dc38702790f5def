"""OLMoE (``OlmoeSparseMoeBlock``): softmax -> top-k -> renormalise if ``norm_topk_prob`` (off in
OLMoE's own config), fused SwiGLU experts, no shared expert. On disk:
``mlp.experts.E.{gate_proj,up_proj,down_proj}.weight``.
"""

from lightning_ep.models.registry import MoEFamily, register

OLMOE = register(
    MoEFamily(
        name="olmoe",
        model_types=("olmoe",),
        block_classes=("OlmoeSparseMoeBlock",),
        normalize_weights="norm_topk_prob",
    )
)
