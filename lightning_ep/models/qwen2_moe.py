"""Qwen2-MoE (``Qwen2MoeSparseMoeBlock``): softmax -> top-k -> renormalise if ``norm_topk_prob``,
fused SwiGLU experts ``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]``, and one dense
``shared_expert`` on every token, scaled by ``sigmoid(shared_expert_gate(x))``.

Dense layers (``mlp_only_layers``, or layers off the ``decoder_sparse_step`` stride) are
``Qwen2MoeMLP`` modules and stay as they are. On disk (transformers' ``qwen2_moe`` conversion,
which ``models.hf_io`` follows): ``mlp.experts.E.{gate_proj,up_proj,down_proj}.weight``.
"""

from lightning_ep.models.registry import MoEFamily, register

QWEN2_MOE = register(
    MoEFamily(
        name="qwen2_moe",
        model_types=("qwen2_moe",),
        block_classes=("Qwen2MoeSparseMoeBlock",),
        normalize_weights="norm_topk_prob",
        shared_experts="shared_expert",
        shared_experts_gate="shared_expert_gate",
    )
)
