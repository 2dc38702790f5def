"""Qwen3-MoE (``Qwen3MoeSparseMoeBlock``): softmax -> top-k -> renormalise if ``norm_topk_prob``,
fused SwiGLU experts, no shared expert. Dense layers (``mlp_only_layers``, ``decoder_sparse_step``)
are ``Qwen3MoeMLP`` and stay. On disk: ``mlp.experts.E.{gate_proj,up_proj,down_proj}.weight``.
"""

from lightning_ep.models.registry import MoEFamily, register

QWEN3_MOE = register(
    MoEFamily(
        name="qwen3_moe",
        model_types=("qwen3_moe",),
        block_classes=("Qwen3MoeSparseMoeBlock",),
        normalize_weights="norm_topk_prob",
    )
)
