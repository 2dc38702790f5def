"""DeepSeek-V3 (``DeepseekV3MoE``) and GLM-4-MoE (``Glm4MoeMoE``), which route alike.

Router: ``sigmoid`` scores; selection adds ``gate.e_score_correction_bias`` (a buffer, never
trained by transformers) and is group-limited (``topk_group`` of ``n_group`` groups); the combine
weights are the unbiased scores, renormalised if ``norm_topk_prob``, times
``routed_scaling_factor``. With ``MoEConfig(moe_load_balancing="balanced")`` that very buffer is
the auxiliary-loss-free bias this library updates (same tensor, same state-dict key).
Experts: fused SwiGLU; ``shared_experts`` (one dense MLP) is added on every token. The first
``first_k_dense_replace`` layers are dense ``*MLP`` modules and stay. On disk:
``mlp.experts.E.{gate_proj,up_proj,down_proj}.weight``.
"""

from lightning_ep.models.registry import MoEFamily, register

DEEPSEEK_V3 = register(
    MoEFamily(
        name="deepseek_v3",
        model_types=("deepseek_v3", "glm4_moe"),
        block_classes=("DeepseekV3MoE", "Glm4MoeMoE"),
        score_correction_bias="gate.e_score_correction_bias",
        scoring="sigmoid",
        normalize_weights="norm_topk_prob",
        n_group="n_group",
        topk_group="topk_group",
        routed_scaling_factor="routed_scaling_factor",
        shared_experts="shared_experts",
    )
)
